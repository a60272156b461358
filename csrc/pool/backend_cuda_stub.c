/*
 * backend_cuda_stub.c — the CUDA backends of a CPU-only build: both say they were not built.
 * Compiled only when backend_cuda.cu is not.
 */
#include "pool_internal.h"

#define NOT_BUILT_MSG "llmmem was built without CUDA (LLMMEM_CUDA=0 or no nvcc found)"

llmmem_status_t _llmmem_pool_backend_pinned(llmmem_pool_backend_t *out) {
  (void)out;
  return LLMMEM_FAIL(LLMMEM_ERR_NOT_BUILT, "pinned host memory needs the CUDA runtime: " NOT_BUILT_MSG);
}

LLMMEM_API llmmem_status_t llmmem_pool_backend_cuda(int device, llmmem_pool_backend_t *out) {
  LLMMEM_CHECK_ARG(out != NULL, "llmmem_pool_backend_cuda: out must not be NULL");
  LLMMEM_CHECK_ARG(device >= 0, "llmmem_pool_backend_cuda: device must be >= 0, got %d", device);
  return LLMMEM_FAIL(LLMMEM_ERR_NOT_BUILT, "CUDA device memory: " NOT_BUILT_MSG);
}

LLMMEM_API llmmem_status_t llmmem_pool_backend_cuda_vmm(int device, llmmem_pool_backend_t *out) {
  LLMMEM_CHECK_ARG(out != NULL, "llmmem_pool_backend_cuda_vmm: out must not be NULL");
  LLMMEM_CHECK_ARG(device >= 0, "llmmem_pool_backend_cuda_vmm: device must be >= 0, got %d", device);
  return LLMMEM_FAIL(LLMMEM_ERR_NOT_BUILT, "CUDA device memory: " NOT_BUILT_MSG);
}
