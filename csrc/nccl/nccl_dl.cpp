// Native NCCL, loaded with dlopen at run time.
//
// Why dlopen instead of linking: the extension must build where no NCCL headers or libraries
// exist (CI has nvcc but no nccl.h; the registry only ships the nvidia-nccl-cu12/13 wheels), and
// at run time it must use whichever libnccl the environment provides (the wheel torch brought, or
// the system's). So we declare the handful of prototypes we call ourselves, from NCCL's
// documented C API (stable since NCCL 2.0; ncclCommGetAsyncError since 2.4, ncclCommAbort since
// 2.4), resolve them with dlsym, and check ncclGetVersion >= 2.4 at load.
//
// Symbols (nccl.h):
//   ncclResult_t ncclGetVersion(int* version);
//   const char*  ncclGetErrorString(ncclResult_t result);
//   ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);            // 128 opaque bytes
//   ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
//   ncclResult_t ncclCommAbort(ncclComm_t comm);
//   ncclResult_t ncclCommDestroy(ncclComm_t comm);
//   ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError);
//   ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t t, int peer, ncclComm_t, cudaStream_t);
//   ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t t, int peer, ncclComm_t, cudaStream_t);
//   ncclResult_t ncclGroupStart(); ncclResult_t ncclGroupEnd();
// We always move bytes (ncclUint8 == 1 in ncclDataType_t).
#if defined(AWEX_FAST_WITH_CUDA)

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>
#include <string>
#include <vector>

#include "common.h"
#include "cuda_util.h"

namespace py = pybind11;

namespace awex::comm {
namespace {

using ncclResult_t = int;
using ncclComm_t = void*;
struct ncclUniqueId {
  char internal[128];
};
constexpr int kNcclUint8 = 1;
constexpr int kNcclInProgress = 7;  // ncclInProgress (non-blocking communicators)

struct Nccl {
  void* handle = nullptr;
  std::string path;
  int version = 0;
  ncclResult_t (*GetVersion)(int*) = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*CommAbort)(ncclComm_t) = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  ncclResult_t (*Send)(const void*, size_t, int, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*Recv)(void*, size_t, int, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;
};

Nccl g_nccl;
std::mutex g_load_mutex;

template <typename F>
void resolve(F& fn, const char* name) {
  fn = reinterpret_cast<F>(dlsym(g_nccl.handle, name));
  AWEX_CHECK_RT(fn != nullptr, "NCCL library ", g_nccl.path, " lacks symbol ", name);
}

#define AWEX_NCCL_CHECK(expr)                                                                 \
  do {                                                                                        \
    ncclResult_t r__ = (expr);                                                                \
    AWEX_CHECK_RT(r__ == 0, "NCCL call ", #expr, " failed: ", g_nccl.GetErrorString(r__)); \
  } while (0)

// Loads the first library of `candidates` that opens (Python builds the list: the nvidia-nccl
// wheel's lib directory first, then the bare soname for the system search path).
py::dict load(const std::vector<std::string>& candidates) {
  std::lock_guard<std::mutex> lock(g_load_mutex);
  if (g_nccl.handle == nullptr) {
    std::string errors;
    for (const auto& path : candidates) {
      void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (h != nullptr) {
        g_nccl.handle = h;
        g_nccl.path = path;
        break;
      }
      const char* err = dlerror();
      errors += "\n  " + path + ": " + (err ? err : "unknown error");
    }
    AWEX_CHECK_RT(g_nccl.handle != nullptr, "could not load NCCL; tried:", errors,
                  "\ninstall nvidia-nccl-cu12 or nvidia-nccl-cu13, or put libnccl.so.2 on the "
                  "library path");
    // A library that opened but is unusable (a symbol missing, too old) must not stay half
    // loaded: `handle` doubles as "loaded", so a second load() would otherwise report success
    // and later calls would jump through null function pointers.
    try {
      resolve(g_nccl.GetVersion, "ncclGetVersion");
      resolve(g_nccl.GetErrorString, "ncclGetErrorString");
      resolve(g_nccl.GetUniqueId, "ncclGetUniqueId");
      resolve(g_nccl.CommInitRank, "ncclCommInitRank");
      resolve(g_nccl.CommAbort, "ncclCommAbort");
      resolve(g_nccl.CommDestroy, "ncclCommDestroy");
      resolve(g_nccl.CommGetAsyncError, "ncclCommGetAsyncError");
      resolve(g_nccl.Send, "ncclSend");
      resolve(g_nccl.Recv, "ncclRecv");
      resolve(g_nccl.GroupStart, "ncclGroupStart");
      resolve(g_nccl.GroupEnd, "ncclGroupEnd");
      AWEX_NCCL_CHECK(g_nccl.GetVersion(&g_nccl.version));
      // NCCL_VERSION(X,Y,Z) in nccl.h: X*1000 + Y*100 + Z up to 2.8, X*10000 + Y*100 + Z after.
      const int v = g_nccl.version;
      const bool ok = v >= 20400 || (v >= 2400 && v < 10000);
      AWEX_CHECK_RT(ok, "NCCL ", v, " at ", g_nccl.path, " is too old: awex_fast needs 2.4 or newer");
    } catch (...) {
      dlclose(g_nccl.handle);
      g_nccl = Nccl{};
      throw;
    }
  }
  py::dict info;
  info["path"] = g_nccl.path;
  info["version"] = g_nccl.version;
  return info;
}

void require_loaded() { AWEX_CHECK_RT(g_nccl.handle != nullptr, "NCCL not loaded: call load() first"); }

py::bytes unique_id() {
  require_loaded();
  ncclUniqueId id;
  AWEX_NCCL_CHECK(g_nccl.GetUniqueId(&id));
  return py::bytes(id.internal, sizeof(id.internal));
}

// A communicator with its own non-blocking CUDA stream; every op is queued there and completion
// is observed through events, so waits can time out and abort instead of hanging.
class Comm {
 public:
  Comm(const std::string& id_bytes, int nranks, int rank, int device) : device_(device) {
    require_loaded();
    AWEX_CHECK_ARG(id_bytes.size() == sizeof(ncclUniqueId), "NCCL unique id must be ",
                   sizeof(ncclUniqueId), " bytes, got ", id_bytes.size());
    ncclUniqueId id;
    memcpy(id.internal, id_bytes.data(), sizeof(id.internal));
    DeviceGuard guard(device_);  // ncclCommInitRank binds the communicator to the current device
    AWEX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    py::gil_scoped_release release;
    const ncclResult_t r = g_nccl.CommInitRank(&comm_, nranks, id, rank);
    if (r != 0) {  // a throwing constructor runs no destructor: free the stream here
      cudaStreamDestroy(stream_);
      stream_ = nullptr;
      comm_ = nullptr;
    }
    AWEX_CHECK_RT(r == 0, "ncclCommInitRank (rank ", rank, " of ", nranks, ", device ", device_,
                  ") failed: ", g_nccl.GetErrorString(r));
  }
  ~Comm() {
    try {
      close(false);
    } catch (...) {
    }
    // The stream outlives close(): post() runs without the GIL, so an abort from another thread
    // may land while a post is still using stream_; the bound method keeps this object alive
    // until that post returns, so the destructor is the first safe point to destroy it.
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Queue sends/receives as one NCCL group after the producer stream's work so far.
  // ops: (is_send, ptr, nbytes, peer). Returns an event handle recorded after the group.
  uintptr_t post(const std::vector<std::tuple<bool, uintptr_t, int64_t, int>>& ops,
                 uintptr_t producer_stream) {
    AWEX_CHECK_RT(comm_ != nullptr, "NCCL communicator was closed or aborted");
    DeviceGuard guard(device_);
    // ncclGroupEnd of a blocking communicator can wait on the peer (the first operation with a
    // peer connects to it), so never hold the GIL here: other threads of this process (HTTP
    // servers, a rank driven by another thread, whoever would abort) must keep running.
    py::gil_scoped_release release;
    cudaEvent_t ready;
    AWEX_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    AWEX_CUDA_CHECK(cudaEventRecord(ready, reinterpret_cast<cudaStream_t>(producer_stream)));
    AWEX_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready, 0));
    AWEX_CUDA_CHECK(cudaEventDestroy(ready));
    AWEX_NCCL_CHECK(g_nccl.GroupStart());
    for (const auto& [is_send, ptr, nbytes, peer] : ops) {
      if (is_send)
        AWEX_NCCL_CHECK(g_nccl.Send(reinterpret_cast<const void*>(ptr), static_cast<size_t>(nbytes),
                                    kNcclUint8, peer, comm_, stream_));
      else
        AWEX_NCCL_CHECK(g_nccl.Recv(reinterpret_cast<void*>(ptr), static_cast<size_t>(nbytes),
                                    kNcclUint8, peer, comm_, stream_));
    }
    AWEX_NCCL_CHECK(g_nccl.GroupEnd());
    cudaEvent_t done;
    AWEX_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    AWEX_CUDA_CHECK(cudaEventRecord(done, stream_));
    return reinterpret_cast<uintptr_t>(done);
  }

  // 1: done (event destroyed), 0: still running; raises on an asynchronous NCCL error.
  int query(uintptr_t event) {
    auto ev = reinterpret_cast<cudaEvent_t>(event);
    // ncclCommAbort cancels queued operations, yet their completion events still fire: after an
    // abort, "done" no longer means "the bytes moved", so never report success.
    AWEX_CHECK_RT(!aborted_, "NCCL communicator was aborted; the operation may not have completed");
    const cudaError_t st = cudaEventQuery(ev);
    if (st == cudaSuccess) {
      AWEX_CUDA_CHECK(cudaEventDestroy(ev));
      return 1;
    }
    // Not done, and after close/abort the communicator handle is gone: say so rather than pass
    // nullptr to ncclCommGetAsyncError (a misleading "invalid argument").
    AWEX_CHECK_RT(comm_ != nullptr, "NCCL communicator was closed or aborted");
    AWEX_CHECK_RT(st == cudaErrorNotReady, "CUDA error while waiting for NCCL: ", cudaGetErrorString(st));
    ncclResult_t async_err = 0;
    AWEX_NCCL_CHECK(g_nccl.CommGetAsyncError(comm_, &async_err));
    AWEX_CHECK_RT(async_err == 0 || async_err == kNcclInProgress,
                  "NCCL asynchronous error: ", g_nccl.GetErrorString(async_err));
    return 0;
  }

  // Make the caller's stream wait for everything queued so far (receives landed).
  void join(uintptr_t consumer_stream) {
    AWEX_CHECK_RT(comm_ != nullptr, "NCCL communicator was closed or aborted");
    DeviceGuard guard(device_);
    cudaEvent_t ev;
    AWEX_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    AWEX_CUDA_CHECK(cudaEventRecord(ev, stream_));
    AWEX_CUDA_CHECK(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(consumer_stream), ev, 0));
    AWEX_CUDA_CHECK(cudaEventDestroy(ev));
  }

  // abort=true: ncclCommAbort (pending ops are cancelled; for timeouts and dead peers).
  void close(bool abort) {
    if (comm_ == nullptr) return;
    ncclComm_t c = comm_;
    comm_ = nullptr;
    aborted_ = abort;
    py::gil_scoped_release release;
    // Results deliberately unchecked: this is teardown (and runs from the destructor), and an
    // abort after a failure is expected to report that failure again.
    if (abort) g_nccl.CommAbort(c);
    else g_nccl.CommDestroy(c);
  }

  uintptr_t stream() const { return reinterpret_cast<uintptr_t>(stream_); }

 private:
  int device_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool aborted_ = false;
};

}  // namespace

void register_apis(py::module_& m) {
  auto sub = m.def_submodule("nccl", "NCCL loaded with dlopen (see csrc/nccl/nccl_dl.cpp)");
  sub.def("load", &load, py::arg("candidates"));
  sub.def("unique_id", &unique_id);
  py::class_<Comm>(sub, "Comm")
      .def(py::init<const std::string&, int, int, int>(), py::arg("unique_id"), py::arg("nranks"),
           py::arg("rank"), py::arg("device"))
      .def("post", &Comm::post, py::arg("ops"), py::arg("producer_stream"))
      .def("query", &Comm::query, py::arg("event"))
      .def("join", &Comm::join, py::arg("consumer_stream"))
      .def("close", &Comm::close, py::arg("abort"))
      .def_property_readonly("stream", &Comm::stream);
}

}  // namespace awex::comm

#else  // no CUDA: the module still exists and says why it cannot load NCCL

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

namespace py = pybind11;

namespace awex::comm {
void register_apis(py::module_& m) {
  auto sub = m.def_submodule("nccl", "NCCL needs the CUDA build of awex_fast");
  sub.def("load", [](const std::vector<std::string>&) -> py::dict {
    throw std::runtime_error("native NCCL needs awex_fast built with CUDA (AWEX_FAST_CUDA=ON)");
  });
}
}  // namespace awex::comm

#endif
