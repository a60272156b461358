/*
 * head_cuda_stub.c — the CUDA entry points of the LM head's passes in a CPU-only build: each
 * checks its arguments like the real one, then says CUDA was not built. Compiled only when head.cu
 * is not.
 */
#include <llmmem/head.h>

#include "head_internal.h"
#include "internal.h"

#define NOT_BUILT_MSG "llmmem was built without CUDA (LLMMEM_CUDA=0 or no nvcc found)"

LLMMEM_API llmmem_status_t llmmem_head_stats_cuda(const llmmem_head_chunk_t *chunk, float *row_max, float *row_sum,
                                                  float *row_target, float *row_zsum, uint8_t *row_has_target,
                                                  int32_t *bad_labels, int device, void *stream) {
  (void)row_max, (void)row_sum, (void)row_target, (void)row_zsum, (void)row_has_target, (void)bad_labels, (void)device,
      (void)stream;
  LLMMEM_TRY(_llmmem_head_check("llmmem_head_stats_cuda", chunk, 0));
  return LLMMEM_FAIL(LLMMEM_ERR_NOT_BUILT, "llmmem_head_stats_cuda: " NOT_BUILT_MSG);
}

LLMMEM_API llmmem_status_t llmmem_head_grad_cuda(const llmmem_head_chunk_t *chunk, const float *row_lse,
                                                 const float *row_scale, int device, void *stream) {
  (void)row_lse, (void)row_scale, (void)device, (void)stream;
  LLMMEM_TRY(_llmmem_head_check("llmmem_head_grad_cuda", chunk, 0));
  return LLMMEM_FAIL(LLMMEM_ERR_NOT_BUILT, "llmmem_head_grad_cuda: " NOT_BUILT_MSG);
}
