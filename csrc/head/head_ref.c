/*
 * head_ref.c — the plain references of the LM head's two passes (llmmem_head_stats_ref,
 * llmmem_head_grad_ref): one thread, one element at a time, libm's exp, tanh and log, sums in
 * double. The oracle of the vector passes and of the CUDA kernels, which agree with it to a few
 * ulp (their exp is a polynomial).
 */
#include <math.h>

#include "half.h"
#include "head_internal.h"
#include "internal.h"

static float load(const llmmem_head_chunk_t *c, int64_t i, int64_t j) {
  const int64_t k = i * c->ld + j;
  switch (c->dtype) {
    case LLMMEM_HEAD_F32: return ((const float *)c->logits)[k];
    case LLMMEM_HEAD_BF16: return llmmem_bf16_to_f32(((const uint16_t *)c->logits)[k]);
    default: return llmmem_f16_to_f32(((const uint16_t *)c->logits)[k]);
  }
}

static void store(const llmmem_head_chunk_t *c, int64_t i, int64_t j, float v) {
  const int64_t k = i * c->ld + j;
  switch (c->dtype) {
    case LLMMEM_HEAD_F32: ((float *)c->logits)[k] = v; break;
    case LLMMEM_HEAD_BF16: ((uint16_t *)c->logits)[k] = llmmem_f32_to_bf16(v); break;
    default: ((uint16_t *)c->logits)[k] = llmmem_f32_to_f16(v); break;
  }
}

static float capped(const llmmem_head_chunk_t *c, float l) {
  return c->softcap > 0.0f ? c->softcap * tanhf(l / c->softcap) : l;
}

LLMMEM_API llmmem_status_t llmmem_head_stats_ref(const llmmem_head_chunk_t *c, float *row_max, float *row_sum,
                                                 float *row_target, float *row_zsum, uint8_t *row_has_target) {
  LLMMEM_TRY(_llmmem_head_check("llmmem_head_stats_ref", c, 1));
  if (c->rows == 0) return LLMMEM_OK;
  LLMMEM_CHECK_ARG(row_max && row_sum && row_target && row_zsum,
                   "llmmem_head_stats_ref: row_max, row_sum, row_target and row_zsum must not be NULL");
  for (int64_t i = 0; i < c->rows; i++) {
    float mx = -INFINITY;
    double zsum = 0.0;
    for (int64_t j = 0; j < c->vocab; j++) {
      float z = capped(c, load(c, i, j));
      mx = z > mx ? z : mx;
      zsum += z;
    }
    double s = 0.0;
    for (int64_t j = 0; j < c->vocab; j++) s += exp((double)capped(c, load(c, i, j)) - (double)mx);
    const int64_t t = c->labels[i] - c->vocab_start;
    const int has = c->labels[i] != c->ignore_index && t >= 0 && t < c->vocab;
    row_max[i] = mx;
    row_sum[i] = (float)s;
    row_target[i] = has ? capped(c, load(c, i, t)) : 0.0f;
    row_zsum[i] = (float)zsum;
    if (row_has_target) row_has_target[i] = (uint8_t)has;
  }
  return LLMMEM_OK;
}

LLMMEM_API llmmem_status_t llmmem_head_grad_ref(const llmmem_head_chunk_t *c, const float *row_lse,
                                                const float *row_scale) {
  LLMMEM_TRY(_llmmem_head_check("llmmem_head_grad_ref", c, 1));
  if (c->rows == 0) return LLMMEM_OK;
  LLMMEM_CHECK_ARG(row_lse && row_scale, "llmmem_head_grad_ref: row_lse and row_scale must not be NULL");
  const float eps = c->label_smoothing, uniform = eps / (float)c->vocab_total;
  for (int64_t i = 0; i < c->rows; i++) {
    const int ignored = c->labels[i] == c->ignore_index;
    const int64_t t = c->labels[i] - c->vocab_start;
    for (int64_t j = 0; j < c->vocab; j++) {
      float l = load(c, i, j), z = capped(c, l);
      float g = (float)exp((double)z - (double)row_lse[i]) - uniform - (j == t ? 1.0f - eps : 0.0f);
      if (c->softcap > 0.0f) g *= 1.0f - (z / c->softcap) * (z / c->softcap);
      store(c, i, j, ignored ? 0.0f : g * row_scale[i]);
    }
  }
  return LLMMEM_OK;
}
