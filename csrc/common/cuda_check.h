/*
 * cuda_check.h — turn a failing CUDA runtime call into a recorded llmmem status (never exits).
 * Only for .cu files and C files compiled with the CUDA headers.
 */
#ifndef LLMMEM_CUDA_CHECK_H
#define LLMMEM_CUDA_CHECK_H

#include <cuda_runtime_api.h>

#include "internal.h"

/* Driver missing or too old, or no GPU: the caller can fall back or report, not a crash. */
static inline int _llmmem_cuda_is_no_device(cudaError_t err) {
  return err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver || err == cudaErrorInitializationError;
}

#define LLMMEM_CUDA_TRY(expr)                                                                                  \
  do {                                                                                                         \
    cudaError_t llmmem_cuda_err_ = (expr);                                                                     \
    if (llmmem_cuda_err_ != cudaSuccess) {                                                                     \
      (void)cudaGetLastError(); /* clear the sticky-free error so later calls proceed */                       \
      return LLMMEM_FAIL(_llmmem_cuda_is_no_device(llmmem_cuda_err_) ? LLMMEM_ERR_NO_DEVICE : LLMMEM_ERR_CUDA, \
                         "%s failed: %s (%s)", #expr, cudaGetErrorString(llmmem_cuda_err_),                    \
                         cudaGetErrorName(llmmem_cuda_err_));                                                  \
    }                                                                                                          \
  } while (0)

#endif /* LLMMEM_CUDA_CHECK_H */
