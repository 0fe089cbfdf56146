// Shared CUDA helpers of the native core (only included where AWEX_FAST_WITH_CUDA is defined):
// the checked-call macro every CUDA runtime call goes through, and a guard that makes one device
// current for a scope. The guard matters because this extension links cudart statically but
// shares the thread's current context with torch's cudart: a bare cudaSetDevice would silently
// move torch's current device, and a stream of device d used while device e is current fails
// with "invalid resource handle".
#pragma once

#include <cuda_runtime.h>

#include "common.h"

#define AWEX_CUDA_CHECK(expr)                                                                     \
  do {                                                                                            \
    cudaError_t e__ = (expr);                                                                     \
    AWEX_CHECK_RT(e__ == cudaSuccess, "CUDA call ", #expr, " failed: ", cudaGetErrorString(e__)); \
  } while (0)

namespace awex {

// Makes `device` current for the guard's lifetime and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    AWEX_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      const cudaError_t e = cudaSetDevice(device);
      AWEX_CHECK_RT(e == cudaSuccess, "cudaSetDevice(", device, ") failed: ", cudaGetErrorString(e));
    }
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }  // teardown: nothing sensible to do on failure
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace awex
