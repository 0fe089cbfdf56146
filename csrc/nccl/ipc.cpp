// CUDA IPC for colocated weight sync: export a device allocation from one process, map it in
// another on the same node, close it again. Python side: awex_fast/sync/colocate.py.
//
// Why native and not torch's storage._share_cuda_(): the extension never links libtorch, and the
// handle must travel as bytes inside JSON (no pickled rebuild functions). Why the driver API for
// one call: a tensor of PyTorch's caching allocator lives inside a larger cudaMalloc segment,
// cudaIpcGetMemHandle names the whole segment, and only cuMemGetAddressRange tells where the
// segment starts (the importer maps the segment's base; the tensor sits at ptr - base). The
// driver symbol is resolved with dlopen("libcuda.so.1") at first use, so the extension still
// links only the static CUDA runtime.
//
// Symbols:
//   cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* devPtr);     // 64 bytes
//   cudaError_t cudaIpcOpenMemHandle(void** devPtr, cudaIpcMemHandle_t h, unsigned int flags);
//   cudaError_t cudaIpcCloseMemHandle(void* devPtr);
//   CUresult    cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);
// Limits: legacy IPC cannot export memory of cuMemCreate-based allocators (PyTorch's
// expandable_segments), and one process cannot open its own handles (use the pointer directly).
#if defined(AWEX_FAST_WITH_CUDA)

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "common.h"
#include "cuda_util.h"

namespace py = pybind11;

namespace awex::comm {
namespace {

using CUresult = int;
using CUdeviceptr = unsigned long long;
using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

#define AWEX_IPC_CUDA_CHECK(expr, ...)                                                              \
  do {                                                                                              \
    cudaError_t e__ = (expr);                                                                       \
    AWEX_CHECK_RT(e__ == cudaSuccess, "CUDA call ", #expr, " failed: ", cudaGetErrorString(e__), " ", \
                  __VA_ARGS__);                                                                     \
  } while (0)

GetAddressRange address_range_fn() {
  static std::once_flag once;
  static GetAddressRange fn = nullptr;
  static std::string error;
  std::call_once(once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* err = dlerror();
      error = std::string("dlopen(libcuda.so.1) failed: ") + (err ? err : "unknown error");
      return;
    }
    fn = reinterpret_cast<GetAddressRange>(dlsym(lib, "cuMemGetAddressRange_v2"));
    if (fn == nullptr) error = "libcuda.so.1 lacks cuMemGetAddressRange_v2";
  });
  AWEX_CHECK_RT(fn != nullptr, error);
  return fn;
}

std::string uuid_of(int device) {
  static std::mutex mutex;
  static std::map<int, std::string> cache;  // cudaGetDeviceProperties takes milliseconds
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  cudaDeviceProp prop;
  AWEX_IPC_CUDA_CHECK(cudaGetDeviceProperties(&prop, device), "(device ", device, ")");
  char out[33];
  for (int i = 0; i < 16; ++i)
    std::snprintf(out + 2 * i, 3, "%02x", static_cast<unsigned char>(prop.uuid.bytes[i]));
  return cache[device] = std::string(out, 32);
}

// {"handle": 64 bytes, "base", "size" (the allocation), "offset" (ptr - base), "uuid" (GPU)}
py::dict export_handle(uintptr_t ptr, int device) {
  AWEX_CHECK_ARG(ptr != 0, "export_handle: null device pointer");
  DeviceGuard guard(device);
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult r = address_range_fn()(&base, &size, static_cast<CUdeviceptr>(ptr));
  AWEX_CHECK_RT(r == 0, "cuMemGetAddressRange failed (CUresult ", r, ") for pointer ", ptr, " on device ", device,
                ": not device memory of this process?");
  cudaIpcMemHandle_t handle;
  AWEX_IPC_CUDA_CHECK(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base)), "(pointer ", ptr, ", device ",
                      device, "; legacy IPC cannot export memory of PyTorch's expandable_segments or "
                      "cudaMallocAsync allocator backends)");
  py::dict out;
  out["handle"] = py::bytes(reinterpret_cast<const char*>(&handle), sizeof(handle));
  out["base"] = static_cast<uintptr_t>(base);
  out["size"] = size;
  out["offset"] = static_cast<uintptr_t>(ptr - base);
  out["uuid"] = uuid_of(device);
  return out;
}

// Maps an exported allocation on `device` of this process; returns its base pointer here.
uintptr_t open_handle(const std::string& handle_bytes, int device) {
  AWEX_CHECK_ARG(handle_bytes.size() == sizeof(cudaIpcMemHandle_t), "open_handle: an IPC handle is ",
                 sizeof(cudaIpcMemHandle_t), " bytes, got ", handle_bytes.size());
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, handle_bytes.data(), sizeof(handle));
  void* ptr = nullptr;
  {
    py::gil_scoped_release release;  // opening maps memory and may take milliseconds
    DeviceGuard guard(device);
    AWEX_IPC_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess), "(device ", device,
                        "; is the exporter on this node and alive?)");
  }
  return reinterpret_cast<uintptr_t>(ptr);
}

void close_handle(uintptr_t ptr, int device) {
  DeviceGuard guard(device);
  AWEX_IPC_CUDA_CHECK(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)), "(pointer ", ptr, ")");
}

}  // namespace

void register_ipc_apis(py::module_& m) {
  auto sub = m.def_submodule("ipc", "CUDA IPC handles for colocated weight sync (csrc/nccl/ipc.cpp)");
  sub.def("available", [] { return true; });
  sub.def("export_handle", &export_handle, py::arg("ptr"), py::arg("device"),
          "IPC handle of the allocation holding device pointer `ptr`, with its base, size and ptr's offset.");
  sub.def("open_handle", &open_handle, py::arg("handle"), py::arg("device"),
          "Map an exported allocation on `device`; returns its base pointer in this process.");
  sub.def("close_handle", &close_handle, py::arg("ptr"), py::arg("device"), "Unmap what open_handle mapped.");
  sub.def("device_uuid", &uuid_of, py::arg("device"), "The GPU's UUID as 32 hex digits.");
}

}  // namespace awex::comm

#else  // no CUDA: the module exists and says why it cannot work

#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace awex::comm {
void register_ipc_apis(py::module_& m) {
  auto sub = m.def_submodule("ipc", "CUDA IPC needs the CUDA build of awex_fast");
  sub.def("available", [] { return false; });
  sub.def("export_handle", [](uintptr_t, int) -> py::dict {
    throw std::runtime_error("CUDA IPC needs awex_fast built with CUDA (AWEX_FAST_CUDA=ON)");
  });
}
}  // namespace awex::comm

#endif
