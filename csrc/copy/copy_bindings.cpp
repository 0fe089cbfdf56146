// Python face of csrc/copy: descriptors arrive as one C-contiguous int64 buffer [n, kDescWords].
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common.h"
#include "copy/checksum.h"
#include "copy/copy.h"

namespace py = pybind11;

namespace awex::copy {
namespace {

struct DescView {
  const int64_t* data;
  int64_t rows;
};

DescView desc_view(const py::buffer& desc, py::buffer_info& info) {
  info = desc.request();
  AWEX_CHECK_ARG(info.itemsize == 8 && (info.format == "q" || info.format == "l"),
                 "descriptors must be int64, got format '", info.format, "'");
  AWEX_CHECK_ARG(info.ndim == 2 && info.shape[1] == kDescWords, "descriptors must have shape [n, ",
                 kDescWords, "]");
  AWEX_CHECK_ARG(info.strides[1] == 8 && info.strides[0] == 8 * kDescWords,
                 "descriptors must be C-contiguous");
  return {static_cast<const int64_t*>(info.ptr), info.shape[0]};
}

void copy_boxes(const py::buffer& desc, int device, uintptr_t stream, bool streaming) {
  py::buffer_info info;
  const DescView v = desc_view(desc, info);
  py::gil_scoped_release release;
  if (device < 0) {
    copy_cpu(normalize(v.data, v.rows, /*max_unit=*/1), streaming);
    return;
  }
#if defined(AWEX_FAST_WITH_CUDA)
  copy_cuda(normalize(v.data, v.rows, /*max_unit=*/16), device, stream);
#else
  (void)stream;
  throw ArgumentError("a CUDA copy was asked for but awex_fast was built without CUDA "
                      "(AWEX_FAST_CUDA=OFF or no CUDA compiler at build time)");
#endif
}

// One contiguous byte range on the CPU, through the same pool and run copies as copy_boxes
// (the ipc transport's plain sends and receives use it).
void copy_bytes(uintptr_t dst, uintptr_t src, int64_t nbytes, bool streaming) {
  AWEX_CHECK_ARG(nbytes >= 0, "copy_bytes: negative byte count ", nbytes);
  if (nbytes == 0) return;
  AWEX_CHECK_ARG(dst != 0 && src != 0, "copy_bytes: null pointer");
  Box b{};
  b.src = reinterpret_cast<const char*>(src);
  b.dst = reinterpret_cast<char*>(dst);
  b.ndim = 1;
  b.src_kind = b.dst_kind = kRaw;
  b.src_size = b.dst_size = 1;
  b.shape[0] = b.numel = nbytes;
  b.src_stride[0] = b.dst_stride[0] = 1;
  py::gil_scoped_release release;
  copy_cpu({b}, streaming);
}

std::pair<int64_t, int64_t> dst_overlap(const py::buffer& desc) {
  py::buffer_info info;
  const DescView v = desc_view(desc, info);
  py::gil_scoped_release release;
  return find_dst_overlap(v.data, v.rows);
}

uint64_t checksum(uintptr_t ptr, int64_t nbytes, int device, uintptr_t stream) {
  py::gil_scoped_release release;
  if (device < 0) return checksum_cpu(reinterpret_cast<const void*>(ptr), nbytes);
#if defined(AWEX_FAST_WITH_CUDA)
  AWEX_CHECK_ARG(ptr % 8 == 0, "CUDA checksum needs an 8-byte aligned buffer");
  return checksum_cuda(reinterpret_cast<const void*>(ptr), nbytes, device, stream);
#else
  (void)stream;
  throw ArgumentError("a CUDA checksum was asked for but awex_fast was built without CUDA");
#endif
}

}  // namespace

void register_apis(py::module_& m) {
  auto sub = m.def_submodule("copy", "batched strided copy (see csrc/copy/copy.h)");
  sub.attr("DESC_WORDS") = kDescWords;
  sub.attr("MAX_DIMS") = kMaxDims;
  py::dict cast_dtypes;  // torch dtype name -> kind, for every dtype the copies cast among
  for (const CastDtype& c : kCastDtypes) cast_dtypes[c.name] = static_cast<int>(c.kind);
  sub.attr("CAST_DTYPES") = cast_dtypes;
  sub.def("copy_boxes", &copy_boxes, py::arg("desc"), py::arg("device") = -1,
          py::arg("stream") = 0, py::arg("streaming") = false,
          "Copy every box of an int64 [n, DESC_WORDS] descriptor array; device -1 is the CPU. "
          "streaming: the destinations are not read soon (CPU: non-temporal stores on long runs).");
  sub.def("copy_bytes", &copy_bytes, py::arg("dst"), py::arg("src"), py::arg("nbytes"),
          py::arg("streaming") = false,
          "Copy nbytes from address src to address dst on the CPU (ranges must not overlap).");
  sub.def("dst_overlap", &dst_overlap, py::arg("desc"),
          "First pair of descriptors whose destinations overlap, or (-1, -1).");
  sub.def("checksum", &checksum, py::arg("ptr"), py::arg("nbytes"), py::arg("device") = -1,
          py::arg("stream") = 0, "64-bit positional checksum of a byte range.");
  sub.def("set_num_threads", &set_num_threads, py::arg("n"));
  sub.def("num_threads", &num_threads);
}

}  // namespace awex::copy
