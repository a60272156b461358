/*
 * adamw_ref.c — the plain reference of the AdamW step (llmmem_optim_adamw_step_ref): one thread,
 * one element at a time, every format spelled out. It is the oracle of the vector step and of the
 * CUDA kernel, which must equal it bit for bit, and must stay obviously correct.
 */
#include <math.h>

#include "half.h"
#include "internal.h"
#include "optim_internal.h"

static float load(const void *p, int32_t dtype, int64_t i) {
  switch (dtype) {
    case LLMMEM_OPTIM_F32: return ((const float *)p)[i];
    case LLMMEM_OPTIM_BF16: return llmmem_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return llmmem_f16_to_f32(((const uint16_t *)p)[i]);
  }
}

/* The random bits of element i in one stream of this tensor's step. */
static uint32_t random_bits(const llmmem_optim_tensor_t *t, float step, uint32_t stream, int64_t i) {
  uint32_t key = llmmem_sr_key(t->seed, step, stream, (uint32_t)((uint64_t)i >> 32));
  return llmmem_sr_mix((uint32_t)i ^ key);
}

/* Writes the updated weight w of element i: into the master and the parameter rounded to
 * nearest, or into the parameter (fp32 as is; bf16 rounded stochastically or to nearest). */
static void store_weight(const llmmem_optim_tensor_t *t, const llmmem_optim_adamw_config_t *cfg, float step, int64_t i,
                         float w) {
  if (t->master) {
    t->master[i] = w;
    uint16_t *p = t->param;
    p[i] = t->param_dtype == LLMMEM_OPTIM_BF16 ? llmmem_f32_to_bf16(w) : llmmem_f32_to_f16(w);
  } else if (t->param_dtype == LLMMEM_OPTIM_F32) {
    ((float *)t->param)[i] = w;
  } else {
    uint16_t *p = t->param;
    p[i] = cfg->stochastic_rounding ? llmmem_bf16_stochastic(w, random_bits(t, step, LLMMEM_SR_PARAM, i))
                                    : llmmem_f32_to_bf16(w);
  }
}

static float load_weight(const llmmem_optim_tensor_t *t, int64_t i) {
  return t->master ? t->master[i] : load(t->param, t->param_dtype, i);
}

/* One element in an unquantized state: m and v read and written in their format. */
static void step_plain(const llmmem_optim_tensor_t *t, const llmmem_optim_adamw_config_t *cfg,
                       const llmmem_adamw_scalars_t *s, float step, int64_t i) {
  float w = load_weight(t, i), g = load(t->grad, t->grad_dtype, i), m, v;
  if (cfg->state == LLMMEM_OPTIM_STATE_F32) {
    m = ((float *)t->exp_avg)[i];
    v = ((float *)t->exp_avg_sq)[i];
  } else {
    m = llmmem_bf16_value(((uint16_t *)t->exp_avg)[i]);
    v = llmmem_bf16_value(((uint16_t *)t->exp_avg_sq)[i]);
  }
  (void)llmmem_adamw_elem(s, g, &w, &m, &v);
  if (cfg->state == LLMMEM_OPTIM_STATE_F32) {
    ((float *)t->exp_avg)[i] = m;
    ((float *)t->exp_avg_sq)[i] = v;
  } else {
    uint32_t r = random_bits(t, step, LLMMEM_SR_MOMENTS, i); /* low half for m, high half for v */
    ((uint16_t *)t->exp_avg)[i] = llmmem_bf16_stochastic(m, r);
    ((uint16_t *)t->exp_avg_sq)[i] = llmmem_bf16_stochastic(v, r >> 16);
  }
  store_weight(t, cfg, step, i, w);
}

/* One block of a quantized state: read every moment, update, then quantize the block anew. */
static void step_block(const llmmem_optim_tensor_t *t, const llmmem_optim_adamw_config_t *cfg,
                       const llmmem_adamw_scalars_t *s, float step, int64_t block) {
  float m_new[LLMMEM_OPTIM_MAX_BLOCK], r_new[LLMMEM_OPTIM_MAX_BLOCK];
  const int32_t cm = _llmmem_optim_code_of(cfg->state, 0), cr = _llmmem_optim_code_of(cfg->state, 1);
  const int64_t first = block * cfg->block_size;
  const int64_t n = t->numel - first < cfg->block_size ? t->numel - first : cfg->block_size;
  for (int64_t k = 0; k < n; k++) {
    const int64_t i = first + k;
    float m = _llmmem_optim_dequantize_one(t->exp_avg, i, cm, t->exp_avg_scale[block]);
    float r = _llmmem_optim_dequantize_one(t->exp_avg_sq, i, cr, t->exp_avg_sq_scale[block]);
    float v = r * r;
    float w = load_weight(t, i), g = load(t->grad, t->grad_dtype, i);
    r_new[k] = llmmem_adamw_elem(s, g, &w, &m, &v);
    m_new[k] = m;
    store_weight(t, cfg, step, i, w);
  }
  /* sqrt(v) rounded stochastically (see codes.h), with the moments' stream of random bits */
  const uint32_t key = llmmem_sr_key(t->seed, step, LLMMEM_SR_MOMENTS, (uint32_t)((uint64_t)first >> 32));
  _llmmem_optim_quantize_block_ref(m_new, n, cm, t->exp_avg, first, &t->exp_avg_scale[block], NULL);
  _llmmem_optim_quantize_block_ref(r_new, n, cr, t->exp_avg_sq, first, &t->exp_avg_sq_scale[block], &key);
}

LLMMEM_API llmmem_status_t llmmem_optim_adamw_step_ref(const llmmem_optim_tensor_t *tensors, size_t count,
                                                       const llmmem_optim_adamw_config_t *cfg) {
  int64_t total;
  LLMMEM_TRY(_llmmem_optim_check_step("llmmem_optim_adamw_step_ref", tensors, count, cfg, &total));
  const int quantized = cfg->state == LLMMEM_OPTIM_STATE_Q8 || cfg->state == LLMMEM_OPTIM_STATE_Q4;
  for (size_t ti = 0; ti < count; ti++) {
    const llmmem_optim_tensor_t *t = &tensors[ti];
    const float step = *t->step + 1.0f;
    *t->step = step;
    llmmem_adamw_scalars_t s;
    _llmmem_adamw_scalars(cfg, step, &s);
    if (quantized) {
      for (int64_t b = 0; b * cfg->block_size < t->numel; b++) step_block(t, cfg, &s, step, b);
    } else {
      for (int64_t i = 0; i < t->numel; i++) step_plain(t, cfg, &s, step, i);
    }
  }
  return LLMMEM_OK;
}
