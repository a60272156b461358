/*
 * adamw_check.c — what every AdamW entry point checks before it writes anything (the config and
 * the tensor list), and the per-tensor scalars of the update, shared by the reference, the CPU
 * step and the CUDA launcher.
 */
#include <math.h>
#include <stdlib.h>

#include "internal.h"
#include "optim_internal.h"

static size_t dtype_size(int32_t dtype) {
  switch (dtype) {
    case LLMMEM_OPTIM_F32: return 4;
    case LLMMEM_OPTIM_F16:
    case LLMMEM_OPTIM_BF16: return 2;
    default: return 0;
  }
}

LLMMEM_API llmmem_status_t llmmem_optim_adamw_config_check(const llmmem_optim_adamw_config_t *cfg) {
  LLMMEM_CHECK_ARG(cfg != NULL, "llmmem_optim_adamw: cfg must not be NULL");
  /* written as !(x >= 0) so that NaN is refused too */
  LLMMEM_CHECK_ARG(!(cfg->lr < 0) && isfinite(cfg->lr), "llmmem_optim_adamw: lr must be a finite number >= 0, got %g",
                   cfg->lr);
  LLMMEM_CHECK_ARG(cfg->beta1 >= 0 && cfg->beta1 < 1, "llmmem_optim_adamw: beta1 must be in [0, 1), got %g",
                   cfg->beta1);
  LLMMEM_CHECK_ARG(cfg->beta2 >= 0 && cfg->beta2 < 1, "llmmem_optim_adamw: beta2 must be in [0, 1), got %g",
                   cfg->beta2);
  LLMMEM_CHECK_ARG(cfg->eps >= 0 && isfinite(cfg->eps), "llmmem_optim_adamw: eps must be a finite number >= 0, got %g",
                   cfg->eps);
  LLMMEM_CHECK_ARG(cfg->weight_decay >= 0 && isfinite(cfg->weight_decay),
                   "llmmem_optim_adamw: weight_decay must be a finite number >= 0, got %g", cfg->weight_decay);
  LLMMEM_CHECK_ARG(cfg->decoupled == 0 || cfg->decoupled == 1, "llmmem_optim_adamw: decoupled must be 0 or 1");
  LLMMEM_CHECK_ARG(cfg->maximize == 0 || cfg->maximize == 1, "llmmem_optim_adamw: maximize must be 0 or 1");
  LLMMEM_CHECK_ARG(cfg->stochastic_rounding == 0 || cfg->stochastic_rounding == 1,
                   "llmmem_optim_adamw: stochastic_rounding must be 0 or 1");
  LLMMEM_CHECK_ARG(cfg->state >= 0 && cfg->state < LLMMEM_OPTIM_STATE_COUNT_,
                   "llmmem_optim_adamw: state %d is not a state format (0=f32 1=bf16 2=q8 3=q4)", (int)cfg->state);
  if (cfg->state == LLMMEM_OPTIM_STATE_Q8 || cfg->state == LLMMEM_OPTIM_STATE_Q4)
    LLMMEM_CHECK_ARG(cfg->block_size >= LLMMEM_OPTIM_MIN_BLOCK && cfg->block_size <= LLMMEM_OPTIM_MAX_BLOCK &&
                         (cfg->block_size & (cfg->block_size - 1)) == 0,
                     "llmmem_optim_adamw: block_size must be a power of two in [%d, %d], got %d",
                     LLMMEM_OPTIM_MIN_BLOCK, LLMMEM_OPTIM_MAX_BLOCK, (int)cfg->block_size);
  return LLMMEM_OK;
}

LLMMEM_API llmmem_status_t llmmem_optim_state_bytes(int32_t state, int64_t numel, int32_t block_size, size_t *bytes,
                                                    int64_t *scales) {
  LLMMEM_CHECK_ARG(bytes != NULL && scales != NULL, "llmmem_optim_state_bytes: bytes and scales must not be NULL");
  LLMMEM_CHECK_ARG(numel >= 0, "llmmem_optim_state_bytes: numel is negative (%lld)", (long long)numel);
  llmmem_optim_adamw_config_t cfg = {.beta2 = 0.5, .state = state, .block_size = block_size};
  LLMMEM_TRY(llmmem_optim_adamw_config_check(&cfg));
  LLMMEM_CHECK_ARG((uint64_t)numel <= SIZE_MAX / 4, "llmmem_optim_state_bytes: numel %lld is too large",
                   (long long)numel);
  switch (state) {
    case LLMMEM_OPTIM_STATE_F32: *bytes = (size_t)numel * 4, *scales = 0; break;
    case LLMMEM_OPTIM_STATE_BF16: *bytes = (size_t)numel * 2, *scales = 0; break;
    case LLMMEM_OPTIM_STATE_Q8: *bytes = (size_t)numel, *scales = (numel + block_size - 1) / block_size; break;
    default: *bytes = ((size_t)numel + 1) / 2, *scales = (numel + block_size - 1) / block_size; break;
  }
  return LLMMEM_OK;
}

/* A region of memory a step writes, for the overlap check. */
typedef struct {
  uintptr_t lo, hi;
  size_t tensor;
  const char *what;
} region_t;

static int by_start(const void *a, const void *b) {
  uintptr_t x = ((const region_t *)a)->lo, y = ((const region_t *)b)->lo;
  return x < y ? -1 : x > y;
}

/* Debug builds: no two written buffers of the list may share a byte (a parameter listed twice, a
 * moment that aliases a weight). O(k log k) in the buffers, with an allocation: too slow to run
 * on every step of a release build, where the Python layer's tensors cannot overlap. */
static llmmem_status_t check_overlap(const char *fn, const llmmem_optim_tensor_t *tensors, size_t count,
                                     const llmmem_optim_adamw_config_t *cfg) {
  if (count > SIZE_MAX / (7 * sizeof(region_t))) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "%s: too many tensors", fn);
  region_t *r = malloc((count ? count : 1) * 7 * sizeof *r);
  if (!r) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "%s: no memory for the overlap check", fn);
  size_t k = 0;
  for (size_t i = 0; i < count; i++) {
    const llmmem_optim_tensor_t *t = &tensors[i];
    size_t m_bytes = 0;
    int64_t n_scales = 0;
    (void)llmmem_optim_state_bytes(cfg->state, t->numel, cfg->block_size, &m_bytes, &n_scales);
    const struct {
      const void *p;
      size_t bytes;
      const char *what;
    } bufs[] = {{t->param, (size_t)t->numel * dtype_size(t->param_dtype), "param"},
                {t->master, t->master ? (size_t)t->numel * 4 : 0, "master"},
                {t->exp_avg, m_bytes, "exp_avg"},
                {t->exp_avg_sq, m_bytes, "exp_avg_sq"},
                {t->exp_avg_scale, n_scales ? (size_t)n_scales * 4 : 0, "exp_avg_scale"},
                {t->exp_avg_sq_scale, n_scales ? (size_t)n_scales * 4 : 0, "exp_avg_sq_scale"},
                {t->step, 4, "step"}};
    for (size_t b = 0; b < sizeof bufs / sizeof bufs[0]; b++) {
      if (!bufs[b].p || !bufs[b].bytes) continue;
      r[k++] = (region_t){(uintptr_t)bufs[b].p, (uintptr_t)bufs[b].p + bufs[b].bytes, i, bufs[b].what};
    }
  }
  qsort(r, k, sizeof *r, by_start);
  llmmem_status_t st = LLMMEM_OK;
  for (size_t j = 1; j < k; j++) {
    if (r[j].lo < r[j - 1].hi) {
      st = LLMMEM_FAIL(LLMMEM_ERR_INVALID, "%s: tensors[%zu].%s overlaps tensors[%zu].%s", fn, r[j].tensor, r[j].what,
                       r[j - 1].tensor, r[j - 1].what);
      break;
    }
  }
  free(r);
  return st;
}

static int aligned(const void *p, size_t to) { return ((uintptr_t)p % to) == 0; }

llmmem_status_t _llmmem_optim_check_step(const char *fn, const llmmem_optim_tensor_t *tensors, size_t count,
                                         const llmmem_optim_adamw_config_t *cfg, int64_t *total_elements) {
  LLMMEM_TRY(llmmem_optim_adamw_config_check(cfg));
  LLMMEM_CHECK_ARG(tensors != NULL || count == 0, "%s: tensors is NULL but count is %zu", fn, count);
  const int quantized = cfg->state == LLMMEM_OPTIM_STATE_Q8 || cfg->state == LLMMEM_OPTIM_STATE_Q4;
  const size_t state_align = cfg->state == LLMMEM_OPTIM_STATE_F32 ? 4 : cfg->state == LLMMEM_OPTIM_STATE_BF16 ? 2 : 1;
  int64_t total = 0;
  for (size_t i = 0; i < count; i++) {
    const llmmem_optim_tensor_t *t = &tensors[i];
    size_t ps = dtype_size(t->param_dtype), gs = dtype_size(t->grad_dtype);
    LLMMEM_CHECK_ARG(ps != 0, "%s: tensors[%zu].param_dtype %d is not a dtype (0=f32 1=f16 2=bf16)", fn, i,
                     (int)t->param_dtype);
    LLMMEM_CHECK_ARG(gs != 0, "%s: tensors[%zu].grad_dtype %d is not a dtype (0=f32 1=f16 2=bf16)", fn, i,
                     (int)t->grad_dtype);
    LLMMEM_CHECK_ARG(t->numel >= 0, "%s: tensors[%zu].numel is negative (%lld)", fn, i, (long long)t->numel);
    LLMMEM_CHECK_ARG(t->step != NULL, "%s: tensors[%zu].step must not be NULL", fn, i);
    LLMMEM_CHECK_ARG(t->master == NULL || t->param_dtype != LLMMEM_OPTIM_F32,
                     "%s: tensors[%zu] has a master but fp32 parameters (a master is for bf16/fp16 ones)", fn, i);
    LLMMEM_CHECK_ARG(INT64_MAX - total >= t->numel, "%s: tensors[%zu] makes the total size overflow", fn, i);
    total += t->numel;
    if (t->numel == 0) continue; /* nothing is read or written (empty tensors may have NULL data) */
    LLMMEM_CHECK_ARG(t->param_dtype != LLMMEM_OPTIM_F16 || t->master != NULL,
                     "%s: tensors[%zu] is fp16 without a master: fp16 weights cannot take the update directly", fn, i);
    LLMMEM_CHECK_ARG(t->param && t->grad && t->exp_avg && t->exp_avg_sq,
                     "%s: tensors[%zu] has a NULL param, grad, exp_avg or exp_avg_sq with numel %lld", fn, i,
                     (long long)t->numel);
    LLMMEM_CHECK_ARG(!quantized || (t->exp_avg_scale && t->exp_avg_sq_scale),
                     "%s: tensors[%zu] needs exp_avg_scale and exp_avg_sq_scale in a quantized state", fn, i);
    LLMMEM_CHECK_ARG((uint64_t)t->numel <= SIZE_MAX / 4, "%s: tensors[%zu].numel %lld is too large", fn, i,
                     (long long)t->numel);
    LLMMEM_CHECK_ARG(aligned(t->param, ps) && aligned(t->grad, gs) && aligned(t->master, 4) &&
                         aligned(t->exp_avg, state_align) && aligned(t->exp_avg_sq, state_align) &&
                         aligned(t->exp_avg_scale, 4) && aligned(t->exp_avg_sq_scale, 4) && aligned(t->step, 4),
                     "%s: tensors[%zu] has a buffer not aligned to its elements", fn, i);
  }
  if (LLMMEM_DEBUG >= 2) LLMMEM_TRY(check_overlap(fn, tensors, count, cfg));
  *total_elements = total;
  return LLMMEM_OK;
}

void _llmmem_adamw_scalars(const llmmem_optim_adamw_config_t *cfg, float t, llmmem_adamw_scalars_t *s) {
  /* as torch/optim/adam.py computes them in Python (doubles), each rounded once into a float */
  const double lr = cfg->lr, wd = cfg->weight_decay;
  const double bc1 = 1.0 - pow(cfg->beta1, (double)t);
  const double bc2 = 1.0 - pow(cfg->beta2, (double)t);
  s->decay = cfg->decoupled && wd != 0 ? (float)(1.0 - lr * wd) : 1.0f;
  s->l2 = cfg->decoupled ? 0.0f : (float)wd;
  s->w1 = (float)(1.0 - cfg->beta1);
  s->one_m_w1 = 1.0f - s->w1;
  s->lerp_high = fabsf(s->w1) >= 0.5f;
  s->beta2 = (float)cfg->beta2;
  s->c2 = (float)(1.0 - cfg->beta2);
  s->bc2_sqrt = (float)pow(bc2, 0.5);
  s->eps = (float)cfg->eps;
  s->neg_step = (float)(-(lr / bc1));
  s->maximize = cfg->maximize;
}
