/*
 * test_optim.c — the optimizer core: the quantization codes (every code read back, rounding to
 * the nearest code, NaN, the zero floor), blockwise quantization, stochastic rounding (unbiased,
 * reproducible), the vector step against the plain reference bit for bit (every state format,
 * parameter and gradient dtype, instruction set, thread count, size around the tiles, blocks
 * and pieces, NaN/inf gradients, several steps), and misuse: each a status code and nothing
 * written.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <llmmem/optim.h>

#include "half.h"
#include "internal.h"
#include "testhelper.h"

int _llmmem_optim_force_isa(int isa); /* adamw_cpu.c test hook */

static float uniform(unsigned long long *rng) { return (float)((double)(th_rand(rng) >> 11) / 9007199254740992.0); }

/* A value spread over many binades, as moments and gradients are. */
static float wide(unsigned long long *rng) {
  float mag = powf(2.0f, -24.0f + 24.0f * uniform(rng));
  return (th_rand(rng) & 1) ? mag : -mag;
}

/* ---------------------------------------------------------------- codes */

static int is_r(int32_t code) { return code == LLMMEM_OPTIM_CODE_R8 || code == LLMMEM_OPTIM_CODE_R4; }

static void test_codes(void) {
  for (int32_t code = 0; code < LLMMEM_OPTIM_CODE_COUNT_; code++) {
    TEST(code == 0   ? "codes: M8 values"
         : code == 1 ? "codes: R8 values"
         : code == 2 ? "codes: M4 values"
                     : "codes: R4 values") {
      float values[256];
      size_t n = 0;
      CHECK_OK(llmmem_optim_code_values(code, values, &n));
      CHECK(n == (code < 2 ? 256u : 16u));
      const size_t nan_code = is_r(code) ? n - 1 : n / 2;
      CHECK(is_r(code) ? isinf(values[nan_code]) && values[nan_code] > 0 : isnan(values[nan_code]));
      CHECK(values[0] == 0.0f && !signbit(values[0]));
      /* magnitudes strictly increase with the code (signed: within each half) */
      const size_t mags = is_r(code) ? n - 1 : n / 2;
      for (size_t c = 1; c < mags; c++) CHECK(values[c] > values[c - 1]);
      if (!is_r(code))
        for (size_t c = 1; c < mags; c++) CHECK(values[n / 2 + c] == -values[c]);
      /* every code survives a round trip: quantize its own value in a block whose largest is the top code */
      float x[256];
      uint8_t codes[256];
      float scale;
      for (size_t c = 0; c < mags; c++) x[c] = values[c];
      CHECK_OK(llmmem_optim_quantize(x, (int64_t)mags, code, 256, codes, &scale));
      CHECK(scale == 1.0f);
      float back[256];
      CHECK_OK(llmmem_optim_dequantize(codes, &scale, (int64_t)mags, code, 256, back));
      for (size_t c = 0; c < mags; c++) CHECK(back[c] == values[c]);
    }
  }
  TEST("codes: quantization picks the nearest code") {
    unsigned long long rng = 7;
    for (int32_t code = 0; code < LLMMEM_OPTIM_CODE_COUNT_; code++) {
      float values[256];
      size_t n;
      CHECK_OK(llmmem_optim_code_values(code, values, &n));
      const size_t mags = is_r(code) ? n - 1 : n / 2;
      const float top = values[mags - 1];
      for (int trial = 0; trial < 2000; trial++) {
        /* a block of two: its largest (top) and a random value below it */
        float x[2] = {top, top * uniform(&rng) * (trial & 1 ? 1.0f : powf(2.0f, -10.0f * uniform(&rng)))};
        if (!is_r(code) && (trial & 2)) x[1] = -x[1];
        uint8_t c[2];
        float scale;
        CHECK_OK(llmmem_optim_quantize(x, 2, code, 32, c, &scale));
        float back[2];
        CHECK_OK(llmmem_optim_dequantize(c, &scale, 2, code, 32, back));
        float err = fabsf(back[1] - x[1]);
        for (size_t k = 0; k < n; k++) {
          if (isnan(values[k])) continue;
          if (is_r(code) && x[1] > 0 && values[k] == 0) continue; /* the zero floor */
          CHECK(err <= fabsf(values[k] - x[1]));
        }
      }
    }
  }
  TEST("codes: non-finite values read back as NaN (m) or +inf (r), a positive r never as 0") {
    for (int32_t code = 0; code < LLMMEM_OPTIM_CODE_COUNT_; code++) {
      float x[4] = {1.0f, NAN, INFINITY, 1e-30f};
      if (!is_r(code)) x[2] = -INFINITY;
      uint8_t c[4];
      float scale, back[4];
      CHECK_OK(llmmem_optim_quantize(x, 4, code, 32, c, &scale));
      CHECK_OK(llmmem_optim_dequantize(c, &scale, 4, code, 32, back));
      CHECK(back[0] == 1.0f &&
            (is_r(code) ? isinf(back[1]) && isinf(back[2]) && back[1] > 0 : isnan(back[1]) && isnan(back[2])));
      if (is_r(code))
        CHECK(back[3] > 0.0f);
      else
        CHECK(back[3] == 0.0f);
    }
  }
  TEST("codes: relative error of the 8-bit codes over 16 binades") {
    unsigned long long rng = 11;
    enum { N = 4096 };
    static float x[N], back[N];
    static uint8_t c[N];
    float scales[N / 256];
    for (int32_t code = 0; code < 2; code++) {
      for (int i = 0; i < N; i++) x[i] = fabsf(wide(&rng)) * (code == 0 && (i & 1) ? -1.0f : 1.0f);
      for (int b = 0; b < N / 256; b++) x[b * 256] = 1.0f; /* each block's largest: 2^0, the values reach 2^-24 */
      CHECK_OK(llmmem_optim_quantize(x, N, code, 256, c, scales));
      CHECK_OK(llmmem_optim_dequantize(c, scales, N, code, 256, back));
      const double bound = code == 0 ? 1.0 / 15 : 1.0 / 32; /* half a step of 3 or 4 mantissa bits */
      for (int i = 0; i < N; i++)
        if (fabsf(x[i]) >= 0x1p-14f) CHECK(fabs((double)back[i] - x[i]) <= bound * fabs((double)x[i]) * 1.0001);
    }
  }
  TEST("codes: a block of zeros, a tiny block, odd 4-bit tails") {
    float x[33] = {0}, back[33], scale[2];
    uint8_t c[33];
    CHECK_OK(llmmem_optim_quantize(x, 33, LLMMEM_OPTIM_CODE_M4, 32, c, scale));
    CHECK(scale[0] == 0.0f && scale[1] == 0.0f);
    for (int i = 0; i < 33; i++) x[i] = 1e-38f;
    CHECK_OK(llmmem_optim_quantize(x, 33, LLMMEM_OPTIM_CODE_R8, 32, c, scale));
    CHECK_OK(llmmem_optim_dequantize(c, scale, 33, LLMMEM_OPTIM_CODE_R8, 32, back));
    for (int i = 0; i < 33; i++) CHECK(back[i] == 0.0f); /* below 2^-120: stored as zeros */
    x[32] = 0.5f;
    CHECK_OK(llmmem_optim_quantize(x, 33, LLMMEM_OPTIM_CODE_R4, 32, c, scale));
    CHECK(c[16] == (c[16] & 0x0f)); /* the last byte's unused high nibble is 0 */
    CHECK_OK(llmmem_optim_dequantize(c, scale, 33, LLMMEM_OPTIM_CODE_R4, 32, back));
    CHECK(back[32] == 0.5f);
  }
  TEST("codes: misuse") {
    float x[4] = {1, 2, 3, -1}, s;
    uint8_t c[4];
    size_t n;
    CHECK_STATUS(llmmem_optim_code_values(9, x, &n), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_optim_quantize(x, 4, LLMMEM_OPTIM_CODE_R8, 32, c, &s), LLMMEM_ERR_INVALID); /* negative r */
    CHECK_STATUS(llmmem_optim_quantize(x, 4, LLMMEM_OPTIM_CODE_M8, 48, c, &s), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_optim_quantize(x, 4, LLMMEM_OPTIM_CODE_M8, 16, c, &s), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_optim_quantize(NULL, 4, LLMMEM_OPTIM_CODE_M8, 32, c, &s), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_optim_quantize(x, -1, LLMMEM_OPTIM_CODE_M8, 32, c, &s), LLMMEM_ERR_INVALID);
    CHECK_OK(llmmem_optim_quantize(NULL, 0, LLMMEM_OPTIM_CODE_M8, 32, NULL, NULL));
  }
}

/* ---------------------------------------------------------------- stochastic rounding */

static void test_rounding(void) {
  TEST("stochastic rounding: unbiased, within one bf16 step, reproducible") {
    enum { N = 1 << 16 };
    static float x[N];
    static uint16_t a[N], b[N];
    const float v = 1.0f + 0x1p-9f; /* a quarter of the way from 1 to the next bf16 (1 + 2^-7) */
    for (int i = 0; i < N; i++) x[i] = v;
    CHECK_OK(llmmem_optim_round_bf16(x, N, 42, 3.0f, 0, a));
    double sum = 0;
    int ups = 0;
    for (int i = 0; i < N; i++) {
      float r = llmmem_bf16_to_f32(a[i]);
      CHECK(r == 1.0f || r == 1.0f + 0x1p-7f);
      ups += r != 1.0f;
      sum += r;
    }
    CHECK(fabs((double)ups / N - 0.25) < 0.01); /* 0.25 +- 4.6 sigma */
    CHECK(fabs(sum / N - v) < 1e-4);
    CHECK_OK(llmmem_optim_round_bf16(x, N, 42, 3.0f, 0, b));
    CHECK(memcmp(a, b, sizeof a) == 0);
    CHECK_OK(llmmem_optim_round_bf16(x, N, 42, 4.0f, 0, b)); /* another step: other bits */
    CHECK(memcmp(a, b, sizeof a) != 0);
    CHECK_OK(llmmem_optim_round_bf16(x, N, 43, 3.0f, 0, b)); /* another tensor: other bits */
    CHECK(memcmp(a, b, sizeof a) != 0);
    CHECK_OK(llmmem_optim_round_bf16(x + 100, 10, 42, 3.0f, 100, b)); /* an element's bits follow its index */
    CHECK(memcmp(a + 100, b, 10 * sizeof *b) == 0);
    float special[4] = {NAN, INFINITY, -INFINITY, 3.0e38f};
    uint16_t o[4];
    CHECK_OK(llmmem_optim_round_bf16(special, 4, 1, 1.0f, 0, o));
    CHECK(o[0] == 0x7fc0 && o[1] == 0x7f80 && o[2] == 0xff80);
    CHECK(isfinite(llmmem_bf16_to_f32(o[3])) || isinf(llmmem_bf16_to_f32(o[3])));
  }
}

/* ---------------------------------------------------------------- the step */

/* One tensor with all its buffers, in a state format and dtypes. */
typedef struct {
  llmmem_optim_tensor_t t;
  void *bufs[8];
  size_t sizes[8];
} owned_t;

static size_t dsize(int32_t d) { return d == LLMMEM_OPTIM_F32 ? 4 : 2; }

static void *buf(owned_t *o, int k, size_t bytes) {
  o->sizes[k] = bytes;
  o->bufs[k] = calloc(bytes ? bytes : 1, 1);
  return o->bufs[k];
}

static void store(void *p, int32_t dtype, int64_t i, float v) {
  if (dtype == LLMMEM_OPTIM_F32)
    ((float *)p)[i] = v;
  else if (dtype == LLMMEM_OPTIM_BF16)
    ((uint16_t *)p)[i] = llmmem_f32_to_bf16(v);
  else
    ((uint16_t *)p)[i] = llmmem_f32_to_f16(v);
}

/* The step count tensors start from (0: fresh state). */
static float first_step = 0.0f;

static owned_t make(int64_t n, int32_t pd, int32_t gd, int master, const llmmem_optim_adamw_config_t *cfg,
                    unsigned long long *rng) {
  owned_t o;
  memset(&o, 0, sizeof o);
  size_t mb;
  int64_t ns;
  (void)llmmem_optim_state_bytes(cfg->state, n, cfg->block_size, &mb, &ns);
  o.t.numel = n;
  o.t.param_dtype = pd;
  o.t.grad_dtype = gd;
  o.t.seed = th_rand(rng);
  o.t.param = buf(&o, 0, (size_t)n * dsize(pd));
  o.t.grad = buf(&o, 1, (size_t)n * dsize(gd));
  if (master) o.t.master = buf(&o, 2, (size_t)n * 4);
  o.t.exp_avg = buf(&o, 3, mb);
  o.t.exp_avg_sq = buf(&o, 4, mb);
  o.t.exp_avg_scale = buf(&o, 5, (size_t)ns * 4);
  o.t.exp_avg_sq_scale = buf(&o, 6, (size_t)ns * 4);
  o.t.step = buf(&o, 7, 4);
  *o.t.step = first_step;
  for (int64_t i = 0; i < n; i++) {
    float w = wide(rng) * 64.0f;
    store(o.t.param, pd, i, w);
    if (master) o.t.master[i] = w;
  }
  return o;
}

/* specials: 1 = NaN and inf here and there; 2 = every third block of 256 scaled by 2^40, so that its
 * moments' scales pass 2^16 (the AVX-512 decode by one multiply then falls back: quant_avx512.h) */
static void fill_grads(owned_t *o, unsigned long long *rng, int specials) {
  for (int64_t i = 0; i < o->t.numel; i++) {
    float g = wide(rng) * (i % 97 == 3 ? 4096.0f : 1.0f); /* a few large ones, so blocks span binades */
    /* every other 4096 elements narrow (within a binade), so most 16-lane groups have no value in
     * a code's subnormal range, and zeros (in it) here and there: both ways of the vector encoders */
    if ((i >> 12) & 1) g = copysignf(0.5f + 0.5f * uniform(rng), g);
    if (i % 89 == 7) g = 0.0f;
    if (specials == 1 && i % 1031 == 5) g = (i / 1031) % 2 ? NAN : INFINITY;
    if (specials == 2 && (i >> 8) % 3 == 0) g *= 0x1p40f;
    store((void *)o->t.grad, o->t.grad_dtype, i, g);
  }
}

static owned_t clone(const owned_t *src) {
  owned_t o = *src;
  for (int k = 0; k < 8; k++) {
    if (!src->bufs[k]) continue;
    o.bufs[k] = malloc(src->sizes[k] ? src->sizes[k] : 1);
    memcpy(o.bufs[k], src->bufs[k], src->sizes[k]);
  }
  o.t.param = o.bufs[0];
  o.t.grad = o.bufs[1];
  o.t.master = o.bufs[2];
  o.t.exp_avg = o.bufs[3];
  o.t.exp_avg_sq = o.bufs[4];
  o.t.exp_avg_scale = o.bufs[5];
  o.t.exp_avg_sq_scale = o.bufs[6];
  o.t.step = o.bufs[7];
  return o;
}

static int same(const owned_t *a, const owned_t *b) {
  for (int k = 0; k < 8; k++)
    if (a->bufs[k] && memcmp(a->bufs[k], b->bufs[k], a->sizes[k]) != 0) return 0;
  return 1;
}

static void release(owned_t *o) {
  for (int k = 0; k < 8; k++) free(o->bufs[k]);
}

typedef struct {
  int32_t pd, gd, master;
} dtypes_t;

static const dtypes_t DTYPES[] = {
    {LLMMEM_OPTIM_F32, LLMMEM_OPTIM_F32, 0},  {LLMMEM_OPTIM_F32, LLMMEM_OPTIM_BF16, 0},
    {LLMMEM_OPTIM_F32, LLMMEM_OPTIM_F16, 0},  {LLMMEM_OPTIM_BF16, LLMMEM_OPTIM_BF16, 0},
    {LLMMEM_OPTIM_BF16, LLMMEM_OPTIM_F32, 0}, {LLMMEM_OPTIM_BF16, LLMMEM_OPTIM_BF16, 1},
    {LLMMEM_OPTIM_F16, LLMMEM_OPTIM_F16, 1},
};
#define N_DTYPES (sizeof DTYPES / sizeof DTYPES[0])

/* A list of tensors of the given sizes stepped `steps` times by the reference and by the vector
 * step (at an instruction set, a thread count); every buffer must agree bit for bit. */
static int vector_equals_ref(const int64_t *sizes, size_t count, const dtypes_t *d, llmmem_optim_adamw_config_t cfg,
                             int isa, int threads, int steps, int specials, unsigned long long *rng) {
  owned_t a[8], b[8];
  llmmem_optim_tensor_t ta[8], tb[8];
  for (size_t i = 0; i < count; i++) a[i] = make(sizes[i], d->pd, d->gd, d->master, &cfg, rng);
  for (size_t i = 0; i < count; i++) b[i] = clone(&a[i]);
  int ok = 1;
  (void)_llmmem_optim_force_isa(isa);
  for (int s = 0; s < steps && ok; s++) {
    for (size_t i = 0; i < count; i++) {
      fill_grads(&a[i], rng, specials);
      memcpy(b[i].bufs[1], a[i].bufs[1], a[i].sizes[1]);
      ta[i] = a[i].t;
      tb[i] = b[i].t;
    }
    cfg.lr *= 0.9; /* a schedule: the config may change every step */
    ok &= llmmem_optim_adamw_step_ref(ta, count, &cfg) == LLMMEM_OK;
    ok &= llmmem_optim_adamw_step(tb, count, &cfg, threads) == LLMMEM_OK;
    for (size_t i = 0; i < count; i++) ok &= same(&a[i], &b[i]);
  }
  (void)_llmmem_optim_force_isa(-1);
  for (size_t i = 0; i < count; i++) release(&a[i]), release(&b[i]);
  return ok;
}

static llmmem_optim_adamw_config_t base_cfg(int32_t state) {
  llmmem_optim_adamw_config_t c = {.lr = 1e-3,
                                   .beta1 = 0.9,
                                   .beta2 = 0.999,
                                   .eps = 1e-8,
                                   .weight_decay = 0.01,
                                   .decoupled = 1,
                                   .state = state,
                                   .block_size = 256,
                                   .stochastic_rounding = 1};
  return c;
}

static void test_step_matches_ref(void) {
  static const char *names[] = {"step: vector == reference, fp32 state", "step: vector == reference, bf16 state",
                                "step: vector == reference, 8-bit state", "step: vector == reference, 4-bit state"};
  static const int64_t SIZES[][3] = {{0, 1, 7}, {31, 256, 257}, {1000, 513, 4095}, {40000, 3, 70001}};
  for (int32_t state = 0; state < LLMMEM_OPTIM_STATE_COUNT_; state++) {
    TEST(names[state]) {
      unsigned long long rng = 1000 + (unsigned long long)state;
      for (int isa = 0; isa <= 2; isa++) {
        for (size_t d = 0; d < N_DTYPES; d++) {
          for (size_t s = 0; s < sizeof SIZES / sizeof SIZES[0]; s++) {
            llmmem_optim_adamw_config_t cfg = base_cfg(state);
            int threads = 1 + (int)((s + d) % 3);
            CHECK(vector_equals_ref(SIZES[s], 3, &DTYPES[d], cfg, isa, threads, 3, 0, &rng));
          }
        }
      }
    }
  }
  TEST("step: vector == reference across options") {
    unsigned long long rng = 77;
    static const int64_t sizes[3] = {300, 5000, 33000};
    for (int32_t state = 0; state < LLMMEM_OPTIM_STATE_COUNT_; state++) {
      for (int variant = 0; variant < 6; variant++) {
        llmmem_optim_adamw_config_t cfg = base_cfg(state);
        if (variant == 0) cfg.decoupled = 0; /* Adam: L2 into the gradient */
        if (variant == 1) cfg.maximize = 1;
        if (variant == 2) cfg.beta1 = 0.3; /* lerp weight 0.7: torch's other lerp form */
        if (variant == 3) cfg.weight_decay = 0, cfg.eps = 0;
        if (variant == 4) cfg.block_size = state >= 2 ? 32 : 256, cfg.stochastic_rounding = 0;
        if (variant == 5) cfg.block_size = state >= 2 ? 4096 : 256, cfg.beta1 = 0;
        for (size_t d = 0; d < N_DTYPES; d += 3) CHECK(vector_equals_ref(sizes, 3, &DTYPES[d], cfg, 2, 2, 2, 0, &rng));
      }
    }
  }
  TEST("step: NaN and inf gradients spoil their own elements only, the same in both") {
    unsigned long long rng = 99;
    static const int64_t sizes[2] = {5000, 2100};
    for (int32_t state = 0; state < LLMMEM_OPTIM_STATE_COUNT_; state++)
      for (size_t d = 0; d < N_DTYPES; d += 2)
        CHECK(vector_equals_ref(sizes, 2, &DTYPES[d], base_cfg(state), 2, 2, 3, 1, &rng));
    /* and in the reference, only those elements became NaN */
    for (int32_t state = 0; state < LLMMEM_OPTIM_STATE_COUNT_; state++) {
      llmmem_optim_adamw_config_t cfg = base_cfg(state);
      owned_t o = make(3000, LLMMEM_OPTIM_F32, LLMMEM_OPTIM_F32, 0, &cfg, &rng);
      fill_grads(&o, &rng, 0);
      ((float *)o.bufs[1])[1000] = NAN;
      ((float *)o.bufs[1])[2000] = INFINITY;
      for (int s = 0; s < 3; s++) CHECK_OK(llmmem_optim_adamw_step_ref(&o.t, 1, &cfg));
      int bad = 0;
      for (int i = 0; i < 3000; i++) bad += !isfinite(((float *)o.t.param)[i]);
      CHECK(bad == 2 && isnan(((float *)o.t.param)[1000]) && isnan(((float *)o.t.param)[2000]));
      release(&o);
    }
  }
  TEST("step: vector == reference with moments above 2^16, late steps and denormals read as zero") {
    unsigned long long rng = 123;
    static const int64_t sizes[2] = {5000, 2100};
    for (int32_t state = 0; state < LLMMEM_OPTIM_STATE_COUNT_; state++)
      for (size_t d = 0; d < N_DTYPES; d += 2)
        CHECK(vector_equals_ref(sizes, 2, &DTYPES[d], base_cfg(state), 2, 2, 3, 2, &rng));
    /* from step 20000 on, sqrt(1 - 0.999^t) is 1.0f: the AVX-512 update leaves its division out */
    first_step = 20000.0f;
    for (int32_t state = 0; state < LLMMEM_OPTIM_STATE_COUNT_; state++)
      for (size_t d = 0; d < N_DTYPES; d += 2)
        CHECK(vector_equals_ref(sizes, 2, &DTYPES[d], base_cfg(state), 2, 2, 3, 0, &rng));
    /* and just before: sqrt(1 - 0.999^t) a little below 1.0f, where the division must stay */
    first_step = 10000.0f;
    for (int32_t state = LLMMEM_OPTIM_STATE_Q8; state <= LLMMEM_OPTIM_STATE_Q4; state++)
      CHECK(vector_equals_ref(sizes, 2, &DTYPES[0], base_cfg(state), 2, 2, 3, 0, &rng));
    first_step = 0.0f;
#if defined(__x86_64__) || defined(__i386__)
    /* MXCSR's DAZ bit (torch.set_flush_denormal(True) sets it): the vector decode reads codes as
     * fp32 subnormals and must then fall back; one thread, so that the setting is the one in force */
    const unsigned csr = __builtin_ia32_stmxcsr();
    __builtin_ia32_ldmxcsr(csr | 0x40u);
    for (int32_t state = LLMMEM_OPTIM_STATE_Q8; state <= LLMMEM_OPTIM_STATE_Q4; state++)
      CHECK(vector_equals_ref(sizes, 2, &DTYPES[0], base_cfg(state), 2, 1, 3, 0, &rng));
    __builtin_ia32_ldmxcsr(csr);
    /* MXCSR's rounding control away from nearest (fesetround; 0x2000 down, 0x4000 up, 0x6000 toward
     * zero): K = scale * 2^(127-B) no longer overflows to inf, and a negative product rounds the
     * other way from the reference's positive one */
    static const unsigned rc[3] = {0x2000u, 0x4000u, 0x6000u};
    for (int k = 0; k < 3; k++) {
      __builtin_ia32_ldmxcsr((csr & ~0x6000u) | rc[k]);
      for (int32_t state = LLMMEM_OPTIM_STATE_Q8; state <= LLMMEM_OPTIM_STATE_Q4; state++)
        for (int specials = 0; specials <= 2; specials += 2)
          CHECK(vector_equals_ref(sizes, 2, &DTYPES[0], base_cfg(state), 2, 1, 3, specials, &rng));
      __builtin_ia32_ldmxcsr(csr);
    }
#endif
  }
  TEST("step: the fp32 format is torch's single-tensor AdamW, operation for operation") {
    /* one element, three steps, against the formula of torch/optim/adam.py written out here */
    llmmem_optim_adamw_config_t cfg = base_cfg(LLMMEM_OPTIM_STATE_F32);
    float p = 0.5f, g[3] = {0.1f, -0.2f, 0.05f}, m = 0, v = 0, step = 0, want_p = 0.5f, want_m = 0, want_v = 0;
    for (int s = 0; s < 3; s++) {
      llmmem_optim_tensor_t t = {&p, &g[s], NULL, &m, &v, NULL, NULL, &step, 1, 0, 0, 0};
      CHECK_OK(llmmem_optim_adamw_step_ref(&t, 1, &cfg));
      double k = s + 1;
      want_p = want_p * (float)(1 - cfg.lr * cfg.weight_decay);
      want_m = want_m + (float)(1 - cfg.beta1) * (g[s] - want_m);
      want_v = want_v * (float)cfg.beta2 + ((float)(1 - cfg.beta2) * g[s]) * g[s];
      float den = sqrtf(want_v) / (float)pow(1 - pow(cfg.beta2, k), 0.5) + (float)cfg.eps;
      want_p = want_p + ((float)(-cfg.lr / (1 - pow(cfg.beta1, k))) * want_m) / den;
      CHECK(p == want_p && m == want_m && v == want_v && step == (float)k);
    }
  }
}

static void test_misuse(void) {
  TEST("step: bad configs and tensors are refused before anything is written") {
    unsigned long long rng = 5;
    llmmem_optim_adamw_config_t cfg = base_cfg(LLMMEM_OPTIM_STATE_Q8);
    owned_t o = make(100, LLMMEM_OPTIM_F32, LLMMEM_OPTIM_F32, 0, &cfg, &rng);
    fill_grads(&o, &rng, 0);
    owned_t keep = clone(&o);
    llmmem_optim_tensor_t two[2] = {o.t, o.t};
    struct {
      llmmem_optim_adamw_config_t cfg;
    } bad[12];
    for (int i = 0; i < 12; i++) bad[i].cfg = cfg;
    bad[0].cfg.lr = -1;
    bad[1].cfg.lr = NAN;
    bad[2].cfg.beta1 = 1.0;
    bad[3].cfg.beta2 = -0.1;
    bad[4].cfg.eps = -1e-8;
    bad[5].cfg.weight_decay = -0.1;
    bad[6].cfg.block_size = 100;
    bad[7].cfg.block_size = 8192;
    bad[8].cfg.state = 7;
    bad[9].cfg.stochastic_rounding = 2;
    bad[10].cfg.beta2 = NAN;
    bad[11].cfg.maximize = -1;
    for (int i = 0; i < 12; i++) {
      CHECK_STATUS(llmmem_optim_adamw_step(&o.t, 1, &bad[i].cfg, 1), LLMMEM_ERR_INVALID);
      CHECK_STATUS(llmmem_optim_adamw_step_ref(&o.t, 1, &bad[i].cfg), LLMMEM_ERR_INVALID);
    }
    CHECK_STATUS(llmmem_optim_adamw_step(&o.t, 1, NULL, 1), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_optim_adamw_step(&o.t, 1, &cfg, -1), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_optim_adamw_step(NULL, 1, &cfg, 1), LLMMEM_ERR_INVALID);
    llmmem_optim_tensor_t t = o.t;
    t.param_dtype = 5;
    CHECK_OK(llmmem_optim_adamw_step(two, 1, &cfg, 1)); /* the good one alone works ... */
    CHECK(!same(&o, &keep));
    for (int k = 0; k < 8; k++)
      if (o.bufs[k]) memcpy(o.bufs[k], keep.bufs[k], keep.sizes[k]); /* (undone) */
    llmmem_optim_tensor_t list[2] = {o.t, t}; /* ... and a bad second one keeps it from changing */
    CHECK_STATUS(llmmem_optim_adamw_step(list, 2, &cfg, 1), LLMMEM_ERR_INVALID);
    t = o.t, t.grad = NULL, list[1] = t;
    CHECK_STATUS(llmmem_optim_adamw_step(list, 2, &cfg, 1), LLMMEM_ERR_INVALID);
    t = o.t, t.exp_avg_scale = NULL, list[1] = t;
    CHECK_STATUS(llmmem_optim_adamw_step(list, 2, &cfg, 1), LLMMEM_ERR_INVALID);
    t = o.t, t.step = NULL, list[1] = t;
    CHECK_STATUS(llmmem_optim_adamw_step(list, 2, &cfg, 1), LLMMEM_ERR_INVALID);
    t = o.t, t.numel = -3, list[1] = t;
    CHECK_STATUS(llmmem_optim_adamw_step(list, 2, &cfg, 1), LLMMEM_ERR_INVALID);
    t = o.t, t.param = (char *)t.param + 1, list[1] = t; /* misaligned */
    CHECK_STATUS(llmmem_optim_adamw_step(list, 2, &cfg, 1), LLMMEM_ERR_INVALID);
    t = o.t, t.param_dtype = LLMMEM_OPTIM_F16, list[1] = t; /* fp16 without a master */
    CHECK_STATUS(llmmem_optim_adamw_step(list, 2, &cfg, 1), LLMMEM_ERR_INVALID);
    t = o.t, t.master = (float *)o.bufs[0], list[1] = t; /* a master for fp32 weights */
    CHECK_STATUS(llmmem_optim_adamw_step(list, 2, &cfg, 1), LLMMEM_ERR_INVALID);
#if LLMMEM_DEBUG >= 2
    CHECK_STATUS(llmmem_optim_adamw_step(two, 2, &cfg, 1), LLMMEM_ERR_INVALID); /* listed twice: overlap */
#endif
    CHECK(same(&o, &keep));
    /* the CUDA entry point checks the same, then says it was not built (or runs) */
    CHECK_STATUS(llmmem_optim_adamw_step_cuda(&o.t, 1, &bad[0].cfg, 0, NULL), LLMMEM_ERR_INVALID);
    llmmem_status_t st = llmmem_optim_adamw_step_cuda(NULL, 0, &cfg, 0, NULL);
    CHECK(st == LLMMEM_ERR_NOT_BUILT || st == LLMMEM_OK);
    release(&o), release(&keep);
  }
  TEST("state bytes") {
    size_t b;
    int64_t s;
    CHECK_OK(llmmem_optim_state_bytes(LLMMEM_OPTIM_STATE_F32, 1000, 256, &b, &s));
    CHECK(b == 4000 && s == 0);
    CHECK_OK(llmmem_optim_state_bytes(LLMMEM_OPTIM_STATE_BF16, 1000, 256, &b, &s));
    CHECK(b == 2000 && s == 0);
    CHECK_OK(llmmem_optim_state_bytes(LLMMEM_OPTIM_STATE_Q8, 1000, 256, &b, &s));
    CHECK(b == 1000 && s == 4);
    CHECK_OK(llmmem_optim_state_bytes(LLMMEM_OPTIM_STATE_Q4, 1001, 128, &b, &s));
    CHECK(b == 501 && s == 8);
    CHECK_STATUS(llmmem_optim_state_bytes(LLMMEM_OPTIM_STATE_Q4, 10, 100, &b, &s), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_optim_state_bytes(LLMMEM_OPTIM_STATE_F32, -1, 256, &b, &s), LLMMEM_ERR_INVALID);
  }
}

int main(void) {
  test_codes();
  test_rounding();
  test_step_matches_ref();
  test_misuse();
  return TEST_SUMMARY();
}
