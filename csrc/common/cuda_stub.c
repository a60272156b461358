/*
 * cuda_stub.c — the CUDA entry points of a CPU-only build: each says the capability is not built.
 * Compiled only when the CUDA part (cuda_info.cu) is not.
 */
#include "internal.h"

int _llmmem_cuda_runtime_version_compiled(void) { return 0; }

LLMMEM_API llmmem_status_t llmmem_cuda_device_count(int *count) {
  LLMMEM_CHECK_ARG(count != NULL, "llmmem_cuda_device_count: count must not be NULL");
  *count = 0;
  return LLMMEM_FAIL(LLMMEM_ERR_NOT_BUILT, "llmmem was built without CUDA (LLMMEM_CUDA=0 or no nvcc found)");
}

LLMMEM_API llmmem_status_t llmmem_cuda_driver_version(int *version) {
  LLMMEM_CHECK_ARG(version != NULL, "llmmem_cuda_driver_version: version must not be NULL");
  *version = 0;
  return LLMMEM_FAIL(LLMMEM_ERR_NOT_BUILT, "llmmem was built without CUDA (LLMMEM_CUDA=0 or no nvcc found)");
}
