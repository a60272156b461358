/*
 * scaler_cuda_stub.c — the CUDA entry points of the scaler in a CPU-only build: each checks its
 * arguments like the real one, then says CUDA was not built. Compiled only when scaler.cu is not.
 */
#include <llmmem/amp.h>

#include "internal.h"

#define NOT_BUILT_MSG "llmmem was built without CUDA (LLMMEM_CUDA=0 or no nvcc found); use a CPU GradScaler"

LLMMEM_API llmmem_status_t llmmem_scaler_unscale_check_cuda(const llmmem_scaler_tensor_t *tensors, size_t count,
                                                            const float *scale, int scale_is_inverse, float *found_inf,
                                                            uint8_t *tensor_flags, size_t n_flags, int device,
                                                            void *stream) {
  (void)tensors, (void)count, (void)scale, (void)scale_is_inverse, (void)found_inf, (void)tensor_flags, (void)n_flags,
      (void)device, (void)stream;
  return LLMMEM_FAIL(LLMMEM_ERR_NOT_BUILT, "llmmem_scaler_unscale_check_cuda: " NOT_BUILT_MSG);
}

LLMMEM_API llmmem_status_t llmmem_scaler_update_cuda(float *scale, int32_t *growth_tracker,
                                                     int32_t *hysteresis_tracker, int64_t *stats,
                                                     const float *const *found_infs, size_t n_found,
                                                     const llmmem_scaler_config_t *cfg, int device, void *stream) {
  (void)scale, (void)growth_tracker, (void)hysteresis_tracker, (void)stats, (void)found_infs, (void)n_found, (void)cfg,
      (void)device, (void)stream;
  return LLMMEM_FAIL(LLMMEM_ERR_NOT_BUILT, "llmmem_scaler_update_cuda: " NOT_BUILT_MSG);
}
