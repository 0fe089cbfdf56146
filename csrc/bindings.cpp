// The only PYBIND11_MODULE: each subsystem registers its own bindings beside its code.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "copy/copy.h"

namespace py = pybind11;

namespace awex {
namespace copy {
void register_apis(py::module_& m);
}
namespace plan {
void register_apis(py::module_& m);
}
namespace comm {
void register_apis(py::module_& m);
void register_ipc_apis(py::module_& m);
}
namespace shm {
void register_apis(py::module_& m);
}
namespace quant {
void register_apis(py::module_& m);
}
}  // namespace awex

namespace {
py::dict build_info() {
  py::dict info;
  info["version"] = AWEX_FAST_VERSION;
#if defined(AWEX_FAST_WITH_CUDA)
  info["cuda"] = true;
#else
  info["cuda"] = false;
#endif
  info["cuda_version"] = AWEX_FAST_CUDA_VERSION;
  info["cuda_archs"] = AWEX_FAST_CUDA_ARCHS;
  info["compiler"] = AWEX_FAST_CXX_COMPILER;
  info["threads"] = awex::copy::num_threads();
  return info;
}
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "awex_fast native core (no libtorch: raw pointers, sizes, strides, streams)";
  m.def("build_info", &build_info, "How this extension was built.");
  awex::copy::register_apis(m);
  awex::plan::register_apis(m);
  awex::comm::register_apis(m);
  awex::comm::register_ipc_apis(m);
  awex::shm::register_apis(m);
  awex::quant::register_apis(m);
}
