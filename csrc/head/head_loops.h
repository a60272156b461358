/*
 * head_loops.h — the LM head's per-row loops, written once and included by head_cpu.c for each
 * instruction set it dispatches to. A row is read in blocks of BLOCK elements widened into an
 * fp32 buffer (in L1), over which the loops are branch-free so that the compiler vectorises them.
 *
 * Include with LOOP_SUFFIX (name suffix) and LOOP_TARGET (an attribute or nothing) defined.
 */
#define LOOP_CAT2(a, b) a##b
#define LOOP_CAT(a, b)  LOOP_CAT2(a, b)
#define LOOP_NAME(name) LOOP_CAT(name, LOOP_SUFFIX)

/* z of elements [j0, j0 + n) of row i into buf. */
LOOP_TARGET static void LOOP_NAME(load_z)(const llmmem_head_chunk_t *c, int64_t i, int64_t j0, int64_t n,
                                          float *restrict buf) {
  const int64_t k = i * c->ld + j0;
  if (c->dtype == LLMMEM_HEAD_F32) {
    const float *restrict src = (const float *)c->logits + k;
    for (int64_t j = 0; j < n; j++) buf[j] = src[j];
  } else if (c->dtype == LLMMEM_HEAD_BF16) {
    const uint16_t *restrict src = (const uint16_t *)c->logits + k;
    for (int64_t j = 0; j < n; j++) buf[j] = llmmem_head_float((uint32_t)src[j] << 16);
  } else {
    const uint16_t *restrict src = (const uint16_t *)c->logits + k;
    for (int64_t j = 0; j < n; j++) buf[j] = llmmem_f16_to_f32(src[j]);
  }
  if (c->softcap > 0.0f) {
    const float cap = c->softcap, inv = 1.0f / c->softcap;
    for (int64_t j = 0; j < n; j++) buf[j] = llmmem_head_softcap(buf[j], cap, inv);
  }
}

/* Sums run in LANES partial sums (a vector's worth): one float sum in order would be a chain of
 * dependent adds, which the compiler keeps in order (it may not reassociate). */
#define LANES 16

/* The largest of buf[0..n) by an integer maximum over order-preserving bits (a float maximum
 * does not vectorise: NaN's ordering), and the sum of buf. */
LOOP_TARGET static void LOOP_NAME(max_sum)(const float *restrict buf, int64_t n, float *max_out, float *sum_out) {
  int32_t mx[LANES];
  float s[LANES];
  for (int k = 0; k < LANES; k++) mx[k] = INT32_MIN, s[k] = 0.0f;
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES) {
    for (int k = 0; k < LANES; k++) {
      int32_t b = (int32_t)llmmem_head_bits(buf[j + k]);
      b ^= (b >> 31) & 0x7fffffff; /* negative floats: reversed, so ints order as the floats */
      mx[k] = b > mx[k] ? b : mx[k];
      s[k] += buf[j + k];
    }
  }
  for (; j < n; j++) {
    int32_t b = (int32_t)llmmem_head_bits(buf[j]);
    b ^= (b >> 31) & 0x7fffffff;
    mx[0] = b > mx[0] ? b : mx[0];
    s[0] += buf[j];
  }
  int32_t m = mx[0];
  float t = 0.0f;
  for (int k = 0; k < LANES; k++) m = mx[k] > m ? mx[k] : m, t += s[k];
  m ^= (m >> 31) & 0x7fffffff;
  *max_out = llmmem_head_float((uint32_t)m);
  *sum_out = t;
}

LOOP_TARGET static float LOOP_NAME(sum_exp)(const float *restrict buf, int64_t n, float shift) {
  float s[LANES];
  for (int k = 0; k < LANES; k++) s[k] = 0.0f;
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int k = 0; k < LANES; k++) s[k] += llmmem_head_exp(buf[j + k] - shift);
  for (; j < n; j++) s[0] += llmmem_head_exp(buf[j] - shift);
  float t = 0.0f;
  for (int k = 0; k < LANES; k++) t += s[k];
  return t;
}

/* buf (z) becomes dl of the block (see head.h) without the label's own term. */
LOOP_TARGET static void LOOP_NAME(grad_block)(const llmmem_head_chunk_t *c, int64_t n, float *restrict buf, float lse,
                                              float uniform, float scale) {
  if (c->softcap > 0.0f) {
    const float inv = 1.0f / c->softcap;
    for (int64_t j = 0; j < n; j++) {
      float z = buf[j], q = z * inv;
      buf[j] = ((llmmem_head_exp(z - lse) - uniform) * (1.0f - q * q)) * scale;
    }
  } else {
    for (int64_t j = 0; j < n; j++) buf[j] = (llmmem_head_exp(buf[j] - lse) - uniform) * scale;
  }
}

/* buf into elements [j0, j0 + n) of row i, rounded to the dtype (to nearest even). */
LOOP_TARGET static void LOOP_NAME(store)(const llmmem_head_chunk_t *c, int64_t i, int64_t j0, int64_t n,
                                         const float *restrict buf) {
  const int64_t k = i * c->ld + j0;
  if (c->dtype == LLMMEM_HEAD_F32) {
    float *restrict dst = (float *)c->logits + k;
    for (int64_t j = 0; j < n; j++) dst[j] = buf[j];
  } else if (c->dtype == LLMMEM_HEAD_BF16) {
    uint16_t *restrict dst = (uint16_t *)c->logits + k;
    for (int64_t j = 0; j < n; j++) {
      uint32_t u = llmmem_head_bits(buf[j]);
      uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      dst[j] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : r);
    }
  } else {
    uint16_t *restrict dst = (uint16_t *)c->logits + k;
    for (int64_t j = 0; j < n; j++) dst[j] = llmmem_f32_to_f16(buf[j]);
  }
}

LOOP_TARGET static void LOOP_NAME(stats_row)(const llmmem_head_chunk_t *c, int64_t i, float *row_max, float *row_sum,
                                             float *row_target, float *row_zsum, uint8_t *row_has_target) {
  float buf[BLOCK];
  float mx = -INFINITY;
  double sum = 0.0, zsum = 0.0;
  for (int64_t j0 = 0; j0 < c->vocab; j0 += BLOCK) {
    const int64_t n = c->vocab - j0 < BLOCK ? c->vocab - j0 : BLOCK;
    LOOP_NAME(load_z)(c, i, j0, n, buf);
    float bmax, bz;
    LOOP_NAME(max_sum)(buf, n, &bmax, &bz);
    zsum += bz;
    if (bmax == -INFINITY) continue; /* a block of -inf logits (a masked part of the vocabulary) adds nothing */
    const float bsum = LOOP_NAME(sum_exp)(buf, n, bmax);
    /* the running sum, kept relative to the running maximum (as online softmax does) */
    if (bmax > mx) {
      sum = sum * exp((double)mx - (double)bmax) + bsum;
      mx = bmax;
    } else {
      sum += bsum * exp((double)bmax - (double)mx);
    }
    if (bmax != bmax) mx = bmax; /* a NaN logit: the row's statistics are NaN, as torch's */
  }
  const int64_t t = c->labels[i] - c->vocab_start;
  const int has = c->labels[i] != c->ignore_index && t >= 0 && t < c->vocab;
  float zt = 0.0f;
  if (has) {
    LOOP_NAME(load_z)(c, i, t, 1, buf);
    zt = buf[0];
  }
  row_max[i] = mx;
  row_sum[i] = (float)(mx != mx ? NAN : sum);
  row_target[i] = zt;
  row_zsum[i] = (float)zsum;
  if (row_has_target) row_has_target[i] = (uint8_t)has;
}

LOOP_TARGET static void LOOP_NAME(grad_row)(const llmmem_head_chunk_t *c, int64_t i, const float *row_lse,
                                            const float *row_scale) {
  float buf[BLOCK];
  const float eps = c->label_smoothing, uniform = eps / (float)c->vocab_total;
  const int ignored = c->labels[i] == c->ignore_index;
  const float lse = row_lse[i], scale = ignored ? 0.0f : row_scale[i];
  const int64_t t = ignored ? -1 : c->labels[i] - c->vocab_start;
  for (int64_t j0 = 0; j0 < c->vocab; j0 += BLOCK) {
    const int64_t n = c->vocab - j0 < BLOCK ? c->vocab - j0 : BLOCK;
    LOOP_NAME(load_z)(c, i, j0, n, buf);
    const int here = t >= j0 && t < j0 + n;
    const float zt = here ? buf[t - j0] : 0.0f;
    LOOP_NAME(grad_block)(c, n, buf, lse, uniform, scale);
    if (here) { /* the label's own term, on its element alone */
      const float q = c->softcap > 0.0f ? zt / c->softcap : 0.0f;
      buf[t - j0] -= ((1.0f - eps) * (1.0f - q * q)) * scale;
    }
    LOOP_NAME(store)(c, i, j0, n, buf);
  }
}

#undef LANES
#undef LOOP_CAT2
#undef LOOP_CAT
#undef LOOP_NAME
