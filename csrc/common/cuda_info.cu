/*
 * cuda_info.cu — run-time CUDA discovery for the CUDA build.
 *
 * Linked against the static CUDA runtime, so importing llmmem needs no libcudart on the
 * machine; with no driver these calls return LLMMEM_ERR_NO_DEVICE instead of failing to load.
 */
#include <cuda_runtime_api.h>

#include "cuda_check.h"

extern "C" int _llmmem_cuda_runtime_version_compiled(void) { return CUDART_VERSION; }

extern "C" LLMMEM_API llmmem_status_t llmmem_cuda_device_count(int *count) {
  LLMMEM_CHECK_ARG(count != NULL, "llmmem_cuda_device_count: count must not be NULL");
  *count = 0;
  int n = 0;
  LLMMEM_CUDA_TRY(cudaGetDeviceCount(&n));
  *count = n;
  return LLMMEM_OK;
}

extern "C" LLMMEM_API llmmem_status_t llmmem_cuda_driver_version(int *version) {
  LLMMEM_CHECK_ARG(version != NULL, "llmmem_cuda_driver_version: version must not be NULL");
  int v = 0;
  LLMMEM_CUDA_TRY(cudaDriverGetVersion(&v));
  *version = v;
  if (v == 0) return LLMMEM_FAIL(LLMMEM_ERR_NO_DEVICE, "no CUDA driver is installed");
  return LLMMEM_OK;
}
