/*
 * optim_internal.h — what the files of csrc/optim share (C and the CUDA launcher). Not part of
 * the ABI.
 */
#ifndef LLMMEM_OPTIM_INTERNAL_H
#define LLMMEM_OPTIM_INTERNAL_H

#include <llmmem/optim.h>

#include "adamw_math.h"

#ifdef __cplusplus
extern "C" {
#endif

/* adamw_check.c: checks a step's config and tensor list (`fn` names the entry point in the
 * detail). With LLMMEM_DEBUG >= 2 also that no two written buffers overlap. On success
 * *total_elements is the elements of all tensors together. */
llmmem_status_t _llmmem_optim_check_step(const char *fn, const llmmem_optim_tensor_t *tensors, size_t count,
                                         const llmmem_optim_adamw_config_t *cfg, int64_t *total_elements);

/* adamw_check.c: the scalars of one tensor's update at step t (the count after the increment). */
void _llmmem_adamw_scalars(const llmmem_optim_adamw_config_t *cfg, float t, llmmem_adamw_scalars_t *s);

/* quantize.c: which code each moment of `state` uses (the R code is of sqrt(v)), -1 for F32/BF16. */
int _llmmem_optim_code_of(int32_t state, int second_moment);
/* quantize.c: bits of a code (8 or 4). */
int _llmmem_optim_code_bits(int32_t code);

/* quantize.c: elements [0, n) of one block (n <= block size), read from x (fp32), quantized into
 * `codes` starting at element `first` of the tensor (even for 4-bit codes) and its scale in
 * *scale; the plain form the reference uses. `key` NULL: to nearest; else (R codes only) rounded
 * stochastically, element i with the bits llmmem_sr_code_bits((uint32_t)i, *key). */
void _llmmem_optim_quantize_block_ref(const float *x, int64_t n, int32_t code, void *codes, int64_t first,
                                      float *scale, const uint32_t *key);
/* quantize.c: the value of element `i` of a quantized tensor whose block scale is `scale`. */
float _llmmem_optim_dequantize_one(const void *codes, int64_t i, int32_t code, float scale);

#ifdef __cplusplus
}
#endif

#endif /* LLMMEM_OPTIM_INTERNAL_H */
