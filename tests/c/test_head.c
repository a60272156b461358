/*
 * test_head.c — the LM head's passes: the vector passes against the plain reference (every dtype,
 * instruction set, thread count, row lengths around the block, softcap, label smoothing, ignored
 * rows, vocabulary shards, NaN logits), the polynomial exp against libm, and misuse (each a status
 * code, nothing read past its end).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <llmmem/head.h>

#include "half.h"
#include "testhelper.h"
#include "../../csrc/head/head_math.h"

int _llmmem_head_force_isa(int isa); /* head_cpu.c test hook */

static float uniform(unsigned long long *rng) { return (float)((double)(th_rand(rng) >> 11) / 9007199254740992.0); }

static int close_rel(float a, float b, float rel, float abs_tol) {
  if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
  return fabsf(a - b) <= abs_tol + rel * fabsf(b);
}

static void fill(void *buf, int32_t dtype, int64_t n, unsigned long long *rng, float spread) {
  for (int64_t i = 0; i < n; i++) {
    float v = (uniform(rng) * 2.0f - 1.0f) * spread;
    if (dtype == LLMMEM_HEAD_F32)
      ((float *)buf)[i] = v;
    else if (dtype == LLMMEM_HEAD_BF16)
      ((uint16_t *)buf)[i] = llmmem_f32_to_bf16(v);
    else
      ((uint16_t *)buf)[i] = llmmem_f32_to_f16(v);
  }
}

static float get(const void *buf, int32_t dtype, int64_t i) {
  if (dtype == LLMMEM_HEAD_F32) return ((const float *)buf)[i];
  if (dtype == LLMMEM_HEAD_BF16) return llmmem_bf16_to_f32(((const uint16_t *)buf)[i]);
  return llmmem_f16_to_f32(((const uint16_t *)buf)[i]);
}

/* Both passes, vector against reference, on one chunk description; 1 when they agree. */
static int passes_agree(int64_t rows, int64_t vocab, int32_t dtype, float smoothing, float softcap,
                        int64_t shard_start, int64_t total, int isa, int threads, unsigned long long *rng) {
  const size_t es = dtype == LLMMEM_HEAD_F32 ? 4 : 2;
  const int64_t ld = vocab + (rows > 1 ? 3 : 0); /* a padded row stride */
  void *a = malloc((size_t)(rows * ld) * es + 8), *b = malloc((size_t)(rows * ld) * es + 8);
  int64_t *labels = malloc((size_t)(rows ? rows : 1) * sizeof *labels);
  float *st[2][4];
  uint8_t *has[2];
  for (int k = 0; k < 2; k++) {
    for (int q = 0; q < 4; q++) st[k][q] = malloc((size_t)(rows ? rows : 1) * sizeof(float));
    has[k] = malloc((size_t)(rows ? rows : 1));
  }
  fill(a, dtype, rows * ld, rng, 8.0f);
  memcpy(b, a, (size_t)(rows * ld) * es);
  for (int64_t i = 0; i < rows; i++) {
    uint64_t r = th_rand(rng);
    labels[i] = r % 5 == 0 ? -100 : (int64_t)(r % (uint64_t)total); /* some ignored, some in other shards */
  }
  llmmem_head_chunk_t c = {a, labels, rows, vocab, ld, shard_start, total, -100, smoothing, softcap, dtype};
  llmmem_head_chunk_t d = c;
  d.logits = b;
  int ok = 1;
  (void)_llmmem_head_force_isa(isa);
  ok &= llmmem_head_stats_ref(&c, st[0][0], st[0][1], st[0][2], st[0][3], has[0]) == LLMMEM_OK;
  ok &= llmmem_head_stats(&d, st[1][0], st[1][1], st[1][2], st[1][3], has[1], threads) == LLMMEM_OK;
  for (int64_t i = 0; ok && i < rows; i++) {
    /* without softcap z is the logit itself: exact; with it, tanh by the polynomial exp: a few ulp */
    const float zrel = softcap > 0.0f ? 2e-6f : 0.0f;
    ok &= close_rel(st[1][0][i], st[0][0][i], zrel, 0.0f) && close_rel(st[1][2][i], st[0][2][i], zrel, 1e-6f);
    ok &= has[0][i] == has[1][i];
    ok &= close_rel(st[1][1][i], st[0][1][i], 1e-5f, 0.0f);
    ok &= close_rel(st[1][3][i], st[0][3][i], 1e-5f, 1e-3f);
  }
  float *lse = malloc((size_t)(rows ? rows : 1) * sizeof(float)),
        *scale = malloc((size_t)(rows ? rows : 1) * sizeof(float));
  for (int64_t i = 0; i < rows; i++) {
    lse[i] = st[0][0][i] + logf(st[0][1][i]) + 0.25f; /* as if other shards held more of the sum */
    scale[i] = 0.5f + uniform(rng);
  }
  ok &= llmmem_head_grad_ref(&c, lse, scale) == LLMMEM_OK;
  ok &= llmmem_head_grad(&d, lse, scale, threads) == LLMMEM_OK;
  const float rel = dtype == LLMMEM_HEAD_F32 ? 2e-5f : 1e-2f;
  for (int64_t i = 0; ok && i < rows; i++)
    for (int64_t j = 0; j < vocab; j++)
      ok &= close_rel(get(b, dtype, i * ld + j), get(a, dtype, i * ld + j), rel, 1e-8f);
  (void)_llmmem_head_force_isa(-1);
  free(a), free(b), free(labels), free(lse), free(scale);
  for (int k = 0; k < 2; k++) {
    for (int q = 0; q < 4; q++) free(st[k][q]);
    free(has[k]);
  }
  return ok;
}

int main(void) {
  TEST("exp: the polynomial within 2 ulp of libm over [-87, 0]") {
    unsigned long long rng = 3;
    int ok = 1;
    for (int k = 0; k < 200000; k++) {
      float x = -87.0f * uniform(&rng);
      float a = llmmem_head_exp(x), b = (float)exp((double)x);
      ok &= fabsf(a - b) <= 2.5f * 1.1920929e-7f * b;
    }
    CHECK(ok);
    CHECK(llmmem_head_exp(0.0f) == 1.0f);
    CHECK(llmmem_head_exp(-200.0f) == 0.0f || llmmem_head_exp(-200.0f) < 1e-37f);
  }
  TEST("softcap: cap * tanh(l / cap) to a few ulp") {
    int ok = 1;
    for (float l = -200.0f; l <= 200.0f; l += 0.37f) {
      float a = llmmem_head_softcap(l, 30.0f, 1.0f / 30.0f), b = 30.0f * tanhf(l / 30.0f);
      ok &= fabsf(a - b) <= 1e-5f * 30.0f;
    }
    CHECK(ok);
  }
  TEST("passes: vector == reference over sizes, dtypes, instruction sets, options") {
    unsigned long long rng = 11;
    static const int64_t VOCABS[] = {1, 7, 2047, 2048, 2049, 5003};
    for (int isa = 0; isa <= 2; isa++)
      for (int32_t dtype = 0; dtype < LLMMEM_HEAD_DTYPE_COUNT_; dtype++)
        for (size_t v = 0; v < sizeof VOCABS / sizeof VOCABS[0]; v++) {
          const int64_t vocab = VOCABS[v];
          CHECK(passes_agree(9, vocab, dtype, 0.0f, 0.0f, 0, vocab, isa, 1 + (int)(v % 3), &rng));
          CHECK(passes_agree(5, vocab, dtype, 0.1f, 30.0f, 0, vocab, isa, 2, &rng));
          CHECK(passes_agree(4, vocab, dtype, 0.0f, 0.0f, vocab, 3 * vocab, isa, 1, &rng)); /* a middle shard */
        }
    CHECK(passes_agree(300, 5000, LLMMEM_HEAD_F32, 0.0f, 0.0f, 0, 5000, 2, 2, &rng)); /* threads over rows */
    CHECK(passes_agree(0, 10, LLMMEM_HEAD_F32, 0.0f, 0.0f, 0, 10, 2, 1, &rng));
  }
  TEST("passes: the loss and gradient of a hand-computed row") {
    float l[3] = {1.0f, 2.0f, 3.0f};
    int64_t label = 2;
    float mx, sum, zt, zs;
    uint8_t has;
    llmmem_head_chunk_t c = {l, &label, 1, 3, 3, 0, 3, -100, 0.0f, 0.0f, LLMMEM_HEAD_F32};
    CHECK_OK(llmmem_head_stats(&c, &mx, &sum, &zt, &zs, &has, 1));
    double e = exp(-2.0) + exp(-1.0) + 1.0;
    CHECK(mx == 3.0f && zt == 3.0f && zs == 6.0f && has == 1 && fabs(sum - e) < 1e-6);
    float lse = 3.0f + logf(sum), one = 1.0f;
    CHECK_OK(llmmem_head_grad(&c, &lse, &one, 1));
    CHECK(fabs(l[0] - exp(-2.0) / e) < 1e-6 && fabs(l[2] - (1.0 / e - 1.0)) < 1e-6);
  }
  TEST("passes: a NaN logit makes its row NaN, the others untouched") {
    float l[2 * 4] = {1, 2, NAN, 3, 1, 2, 3, 4};
    int64_t labels[2] = {0, 1};
    float mx[2], sum[2], zt[2], zs[2];
    llmmem_head_chunk_t c = {l, labels, 2, 4, 4, 0, 4, -100, 0.0f, 0.0f, LLMMEM_HEAD_F32};
    CHECK_OK(llmmem_head_stats(&c, mx, sum, zt, zs, NULL, 1));
    CHECK(isnan(mx[0] + sum[0]) && !isnan(mx[1]) && !isnan(sum[1]));
  }
  TEST("passes: -inf logits (a masked part of the vocabulary) add nothing, in whole blocks too") {
    enum { V = 5000 };
    static float l[V], r[V];
    int64_t label = 17;
    for (int j = 0; j < V; j++) l[j] = j < 2000 ? (float)(j % 13) * 0.25f : -INFINITY;
    l[5] = -INFINITY; /* one inside a finite block as well */
    memcpy(r, l, sizeof l);
    float a[4], b[4];
    llmmem_head_chunk_t c = {l, &label, 1, V, V, 0, V, -100, 0.0f, 0.0f, LLMMEM_HEAD_F32};
    llmmem_head_chunk_t d = c;
    d.logits = r;
    for (int isa = 0; isa <= 2; isa++) {
      (void)_llmmem_head_force_isa(isa);
      CHECK_OK(llmmem_head_stats(&c, a, a + 1, a + 2, a + 3, NULL, 1));
      CHECK_OK(llmmem_head_stats_ref(&d, b, b + 1, b + 2, b + 3, NULL));
      CHECK(isfinite(a[1]) && close_rel(a[0], b[0], 0.0f, 0.0f) && close_rel(a[1], b[1], 1e-5f, 0.0f));
    }
    (void)_llmmem_head_force_isa(-1);
  }
  TEST("misuse: a status, nothing read") {
    float l[4] = {0};
    int64_t bad = 7, ok_label = 1;
    float o[4];
    llmmem_head_chunk_t c = {l, &bad, 1, 4, 4, 0, 4, -100, 0.0f, 0.0f, LLMMEM_HEAD_F32};
    CHECK_STATUS(llmmem_head_stats(&c, o, o + 1, o + 2, o + 3, NULL, 1), LLMMEM_ERR_INVALID); /* label >= V */
    c.labels = &ok_label;
    llmmem_head_chunk_t d = c;
    d.label_smoothing = 1.5f;
    CHECK_STATUS(llmmem_head_check(&d), LLMMEM_ERR_INVALID);
    d = c, d.softcap = -1.0f;
    CHECK_STATUS(llmmem_head_check(&d), LLMMEM_ERR_INVALID);
    d = c, d.ld = 2;
    CHECK_STATUS(llmmem_head_check(&d), LLMMEM_ERR_INVALID);
    d = c, d.vocab_start = 2; /* the shard runs past the vocabulary */
    CHECK_STATUS(llmmem_head_check(&d), LLMMEM_ERR_INVALID);
    d = c, d.dtype = 9;
    CHECK_STATUS(llmmem_head_check(&d), LLMMEM_ERR_INVALID);
    d = c, d.logits = NULL;
    CHECK_STATUS(llmmem_head_check(&d), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_head_grad(&c, NULL, o, 1), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_head_stats(&c, o, o, o, o, NULL, -2), LLMMEM_ERR_INVALID);
    CHECK_OK(llmmem_head_check(&c));
    llmmem_status_t st = llmmem_head_stats_cuda(&c, o, o, o, o, NULL, NULL, 0, NULL);
    CHECK(st == LLMMEM_ERR_NOT_BUILT || st == LLMMEM_OK || st == LLMMEM_ERR_NO_DEVICE || st == LLMMEM_ERR_CUDA);
  }
  return TEST_SUMMARY();
}
