/*
 * cuda_device_guard.h — makes a device current for a C++ scope (.cu files only).
 *
 * Callers (torch included) keep their own notion of the current device: a call of ours on cuda:1
 * must not leave their later work on cuda:1, so the previous device is restored on every return.
 */
#ifndef LLMMEM_CUDA_DEVICE_GUARD_H
#define LLMMEM_CUDA_DEVICE_GUARD_H

#include <cuda_runtime_api.h>

namespace llmmem_cuda {

/* Makes `device` current for the scope, restoring the previous one; err says whether it took. */
struct device_guard {
  int prev = -1;
  bool changed = false;
  cudaError_t err = cudaSuccess;
  explicit device_guard(int device) {
    err = cudaGetDevice(&prev);
    if (err == cudaSuccess && prev != device) {
      err = cudaSetDevice(device);
      changed = err == cudaSuccess;
    }
  }
  ~device_guard() {
    if (changed) (void)cudaSetDevice(prev);
  }
  device_guard(const device_guard &) = delete;
  device_guard &operator=(const device_guard &) = delete;
};

} // namespace llmmem_cuda

#endif /* LLMMEM_CUDA_DEVICE_GUARD_H */
