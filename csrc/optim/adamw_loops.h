/*
 * adamw_loops.h — the CPU step's loops, written once and included by adamw_cpu.c for each
 * instruction set it dispatches to (plain C, AVX2+F16C+FMA-free, AVX-512). Every loop is
 * branch-free over arrays so that the compiler vectorises it, and every value goes through the
 * same inline arithmetic as the reference (adamw_math.h, codes.h), so all variants agree with it
 * bit for bit.
 *
 * A piece of a tensor runs in tiles (one quantization block, or TILE elements): the tile's
 * weights, gradients and moments are widened into fp32 buffers where they are not fp32 in
 * memory already, updated by one loop, then narrowed, rounded or quantized back. The buffers
 * stay in the L1/L2 cache, so memory is read and written once.
 *
 * Include with LOOP_SUFFIX (name suffix) and LOOP_TARGET (an attribute or nothing) defined,
 * LOOP_F16C defined to 1 when the F16C intrinsics may be used, and LOOP_AVX512 to 1 when the
 * AVX-512 loops of quant_avx512.h may be (included before).
 */
#define LOOP_CAT2(a, b) a##b
#define LOOP_CAT(a, b)  LOOP_CAT2(a, b)
#define LOOP_NAME(name) LOOP_CAT(name, LOOP_SUFFIX)

LOOP_TARGET static void LOOP_NAME(widen_bf16)(const uint16_t *restrict src, float *restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = llmmem_bf16_value(src[i]);
}

LOOP_TARGET static void LOOP_NAME(widen_f16)(const uint16_t *restrict src, float *restrict dst, int64_t n) {
  int64_t i = 0;
#if LOOP_F16C
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
  for (; i < n; i++) dst[i] = llmmem_f16_to_f32(src[i]);
}

LOOP_TARGET static void LOOP_NAME(widen)(const void *src, int32_t dtype, float *restrict dst, int64_t n) {
  if (dtype == LLMMEM_OPTIM_BF16)
    LOOP_NAME(widen_bf16)(src, dst, n);
  else
    LOOP_NAME(widen_f16)(src, dst, n);
}

LOOP_TARGET static void LOOP_NAME(narrow_bf16_nearest)(const float *restrict src, uint16_t *restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = llmmem_bf16_nearest(src[i]);
}

LOOP_TARGET static void LOOP_NAME(narrow_f16_nearest)(const float *restrict src, uint16_t *restrict dst, int64_t n) {
  int64_t i = 0;
#if LOOP_F16C
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i *)(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; i++) dst[i] = llmmem_f32_to_f16(src[i]);
}

/* src rounded stochastically into bf16, element k with the bits of index first + k. */
LOOP_TARGET static void LOOP_NAME(narrow_bf16_stochastic)(const float *restrict src, uint16_t *restrict dst, int64_t n,
                                                          uint32_t key, uint32_t first) {
  for (int64_t i = 0; i < n; i++) dst[i] = llmmem_bf16_stochastic(src[i], llmmem_sr_mix((first + (uint32_t)i) ^ key));
}

/* Both bf16 moments from one hash per element: its low half rounds m, its high half v. */
LOOP_TARGET static void LOOP_NAME(narrow_moments_bf16)(const float *restrict m, const float *restrict v,
                                                       uint16_t *restrict mo, uint16_t *restrict vo, int64_t n,
                                                       uint32_t key, uint32_t first) {
  for (int64_t i = 0; i < n; i++) {
    uint32_t r = llmmem_sr_mix((first + (uint32_t)i) ^ key);
    mo[i] = llmmem_bf16_stochastic(m[i], r);
    vo[i] = llmmem_bf16_stochastic(v[i], r >> 16);
  }
}

/* The update of n elements of the unquantized formats: p, m and v updated in place. */
LOOP_TARGET static void LOOP_NAME(update)(const llmmem_adamw_scalars_t *sp, float *restrict p, const float *restrict g,
                                          float *restrict m, float *restrict v, int64_t n) {
  const llmmem_adamw_scalars_t s = *sp;
  for (int64_t i = 0; i < n; i++) (void)llmmem_adamw_elem(&s, g[i], &p[i], &m[i], &v[i]);
}

/* ---- 4-bit codes, two per byte (element 2i in the low nibble) ---------------------------- */
/* Unpacked to one code a byte first, then decoded (and encoded, then packed) like 8-bit codes:
 * each loop then has one element width and vectorises. n is odd only at a tensor's end. */

LOOP_TARGET static void LOOP_NAME(unpack4)(const uint8_t *restrict c, uint8_t *restrict u, int64_t n) {
  for (int64_t j = 0; j < n / 2; j++) {
    u[2 * j] = c[j] & 0xfu;
    u[2 * j + 1] = c[j] >> 4;
  }
  if (n & 1) u[n - 1] = c[n / 2] & 0xfu;
}

LOOP_TARGET static void LOOP_NAME(pack4)(const uint8_t *restrict u, uint8_t *restrict c, int64_t n) {
  for (int64_t j = 0; j < n / 2; j++) c[j] = (uint8_t)(u[2 * j] | (u[2 * j + 1] << 4));
  if (n & 1) c[n / 2] = u[n - 1];
}

/* ---- quantized formats, fused ------------------------------------------------------------- */
/* One pass decodes both moments, updates and keeps the block's two maxima (on the bits, as
 * absmax does), a second encodes both: two loops over a block in L1 rather than seven. */

/* The AVX-512 instantiation runs the hand-vectorised loops of quant_avx512.h over all but the
 * last (n mod 16) elements; the others start at 0. */
#if LOOP_AVX512
#define LOOP_Q_HEAD_UPDATE(NAME) i = q512_##NAME(&s, p, g, mc, rc, ms, rs, mo, ro, n, &am, &ar);
#define LOOP_Q_HEAD_ENCODE(NAME) i = q512_##NAME(m, r, inv_m, inv_r, mc, rc, n, key, first);
#else
#define LOOP_Q_HEAD_UPDATE(NAME)
#define LOOP_Q_HEAD_ENCODE(NAME)
#endif

#define LOOP_UPDATE_Q(NAME, MMAG, MM, MB, RBITS, RM, RB)                                                      \
  LOOP_TARGET static void LOOP_NAME(NAME)(const llmmem_adamw_scalars_t *sp, float *restrict p,                \
                                          const float *restrict g, const uint8_t *restrict mc,                \
                                          const uint8_t *restrict rc, float ms, float rs, float *restrict mo, \
                                          float *restrict ro, int64_t n, float *amax_m, float *amax_r) {      \
    const llmmem_adamw_scalars_t s = *sp;                                                                     \
    uint32_t am = 0, ar = 0;                                                                                  \
    int64_t i = 0;                                                                                            \
    LOOP_Q_HEAD_UPDATE(NAME)                                                                                  \
    for (; i < n; i++) {                                                                                      \
      float m = llmmem_q_decode_signed(mc[i], ms, MMAG, MM, MB);                                              \
      float r = llmmem_q_decode_unsigned(rc[i], rs, RBITS, RM, RB);                                           \
      float v = r * r;                                                                                        \
      float rn = llmmem_adamw_elem(&s, g[i], &p[i], &m, &v);                                                  \
      mo[i] = m;                                                                                              \
      ro[i] = rn;                                                                                             \
      uint32_t a = llmmem_q_bits(m) & 0x7fffffffu, b = llmmem_q_bits(rn) & 0x7fffffffu;                       \
      a &= 0u - (uint32_t)(a < 0x7f800000u);                                                                  \
      b &= 0u - (uint32_t)(b < 0x7f800000u);                                                                  \
      am = a > am ? a : am;                                                                                   \
      ar = b > ar ? b : ar;                                                                                   \
    }                                                                                                         \
    *amax_m = llmmem_q_float(am);                                                                             \
    *amax_r = llmmem_q_float(ar);                                                                             \
  }

LOOP_UPDATE_Q(update_q8, LLMMEM_Q_M8_MAG, LLMMEM_Q_M8_M, LLMMEM_Q_M8_B, 8, LLMMEM_Q_R8_M, LLMMEM_Q_R8_B)
LOOP_UPDATE_Q(update_q4, LLMMEM_Q_M4_MAG, LLMMEM_Q_M4_M, LLMMEM_Q_M4_B, 4, LLMMEM_Q_R4_M, LLMMEM_Q_R4_B)

/* Both moments' codes: m to nearest, sqrt(v) stochastically, element k with the bits of index
 * first + k (llmmem_sr_code_bits; first is a multiple of 32); one code a byte, 4-bit codes are
 * packed after. */
#define LOOP_ENCODE_Q(NAME, MMAG, MM, MB, RBITS, RM, RB)                                                              \
  LOOP_TARGET static void LOOP_NAME(NAME)(const float *restrict m, const float *restrict r, float inv_m, float inv_r, \
                                          uint8_t *restrict mc, uint8_t *restrict rc, int64_t n, uint32_t key,        \
                                          uint32_t first) {                                                           \
    int64_t i = 0;                                                                                                    \
    LOOP_Q_HEAD_ENCODE(NAME)                                                                                          \
    for (; i < n; i++) {                                                                                              \
      mc[i] = (uint8_t)llmmem_q_encode_signed(m[i], inv_m, MMAG, MM, MB);                                             \
      rc[i] = (uint8_t)llmmem_q_encode_unsigned_sr(r[i], inv_r, RBITS, RM, RB,                                        \
                                                   llmmem_sr_code_bits(first + (uint32_t)i, key));                    \
    }                                                                                                                 \
  }

LOOP_ENCODE_Q(encode_q8, LLMMEM_Q_M8_MAG, LLMMEM_Q_M8_M, LLMMEM_Q_M8_B, 8, LLMMEM_Q_R8_M, LLMMEM_Q_R8_B)
LOOP_ENCODE_Q(encode_q4, LLMMEM_Q_M4_MAG, LLMMEM_Q_M4_M, LLMMEM_Q_M4_B, 4, LLMMEM_Q_R4_M, LLMMEM_Q_R4_B)

/* ---- one piece of one tensor ------------------------------------------------------------- */

/* Elements [lo, hi) of tensor t (lo a multiple of the tile: for quantized state, of the block). */
LOOP_TARGET static void LOOP_NAME(run_piece)(const piece_job_t *job, size_t ti, int64_t lo, int64_t hi) {
  const llmmem_optim_tensor_t *t = &job->tensors[ti];
  const llmmem_optim_adamw_config_t *cfg = job->cfg;
  const llmmem_adamw_scalars_t *s = &job->scalars[ti];
  const float step = job->steps[ti];
  const int32_t state = cfg->state;
  const int q8 = state == LLMMEM_OPTIM_STATE_Q8, q4 = state == LLMMEM_OPTIM_STATE_Q4;
  const int64_t tile = q8 || q4 ? cfg->block_size : TILE;
  const int direct_p = t->master != NULL || t->param_dtype == LLMMEM_OPTIM_F32;
  float pbuf[LLMMEM_OPTIM_MAX_BLOCK], gbuf[LLMMEM_OPTIM_MAX_BLOCK], mbuf[LLMMEM_OPTIM_MAX_BLOCK],
      vbuf[LLMMEM_OPTIM_MAX_BLOCK];
  uint8_t codes[LLMMEM_OPTIM_MAX_BLOCK], codes2[LLMMEM_OPTIM_MAX_BLOCK]; /* 4-bit codes, one a byte */
  for (int64_t a = lo; a < hi; a += tile) {
    const int64_t n = hi - a < tile ? hi - a : tile;
    const int64_t block = a / tile;
    /* the upper half of the index is the same across a tile: tiles are powers of two, aligned */
    const uint32_t hi32 = (uint32_t)((uint64_t)a >> 32), first = (uint32_t)a;

    float *p = t->master ? t->master + a : t->param_dtype == LLMMEM_OPTIM_F32 ? (float *)t->param + a : pbuf;
    if (!direct_p) LOOP_NAME(widen_bf16)((const uint16_t *)t->param + a, pbuf, n);
    const float *g = gbuf;
    if (t->grad_dtype == LLMMEM_OPTIM_F32)
      g = (const float *)t->grad + a;
    else
      LOOP_NAME(widen)((const uint16_t *)t->grad + a, t->grad_dtype, gbuf, n);

    float *m = mbuf, *v = vbuf;
    if (state == LLMMEM_OPTIM_STATE_F32) {
      m = (float *)t->exp_avg + a;
      v = (float *)t->exp_avg_sq + a;
    } else if (state == LLMMEM_OPTIM_STATE_BF16) {
      LOOP_NAME(widen_bf16)((const uint16_t *)t->exp_avg + a, mbuf, n);
      LOOP_NAME(widen_bf16)((const uint16_t *)t->exp_avg_sq + a, vbuf, n);
    }

    float amax_m = 0.0f, amax_r = 0.0f;
    if (q8) {
      LOOP_NAME(update_q8)
      (s, p, g, (const uint8_t *)t->exp_avg + a, (const uint8_t *)t->exp_avg_sq + a, t->exp_avg_scale[block],
       t->exp_avg_sq_scale[block], mbuf, vbuf, n, &amax_m, &amax_r);
    } else if (q4) {
      LOOP_NAME(unpack4)((const uint8_t *)t->exp_avg + a / 2, codes, n);
      LOOP_NAME(unpack4)((const uint8_t *)t->exp_avg_sq + a / 2, codes2, n);
      LOOP_NAME(update_q4)
      (s, p, g, codes, codes2, t->exp_avg_scale[block], t->exp_avg_sq_scale[block], mbuf, vbuf, n, &amax_m, &amax_r);
    } else {
      LOOP_NAME(update)(s, p, g, m, v, n);
    }

    if (t->master) {
      if (t->param_dtype == LLMMEM_OPTIM_BF16)
        LOOP_NAME(narrow_bf16_nearest)(p, (uint16_t *)t->param + a, n);
      else
        LOOP_NAME(narrow_f16_nearest)(p, (uint16_t *)t->param + a, n);
    } else if (!direct_p) {
      if (cfg->stochastic_rounding) LOOP_NAME(narrow_bf16_stochastic)
      (pbuf, (uint16_t *)t->param + a, n, llmmem_sr_key(t->seed, step, LLMMEM_SR_PARAM, hi32), first);
      else LOOP_NAME(narrow_bf16_nearest)(pbuf, (uint16_t *)t->param + a, n);
    }

    if (state == LLMMEM_OPTIM_STATE_BF16) {
      LOOP_NAME(narrow_moments_bf16)
      (mbuf, vbuf, (uint16_t *)t->exp_avg + a, (uint16_t *)t->exp_avg_sq + a, n,
       llmmem_sr_key(t->seed, step, LLMMEM_SR_MOMENTS, hi32), first);
    } else if (q8 || q4) {
      const int32_t cm = q8 ? LLMMEM_OPTIM_CODE_M8 : LLMMEM_OPTIM_CODE_M4;
      const int32_t cr = q8 ? LLMMEM_OPTIM_CODE_R8 : LLMMEM_OPTIM_CODE_R4;
      float inv_m, inv_r;
      const uint32_t rkey = llmmem_sr_key(t->seed, step, LLMMEM_SR_MOMENTS, hi32);
      llmmem_q_block_scale(amax_m, llmmem_q_max_value(cm), &t->exp_avg_scale[block], &inv_m);
      llmmem_q_block_scale(amax_r, llmmem_q_max_value(cr), &t->exp_avg_sq_scale[block], &inv_r);
      if (q8) {
        LOOP_NAME(encode_q8)
        (mbuf, vbuf, inv_m, inv_r, (uint8_t *)t->exp_avg + a, (uint8_t *)t->exp_avg_sq + a, n, rkey, first);
      } else {
        LOOP_NAME(encode_q4)(mbuf, vbuf, inv_m, inv_r, codes, codes2, n, rkey, first);
        LOOP_NAME(pack4)(codes, (uint8_t *)t->exp_avg + a / 2, n);
        LOOP_NAME(pack4)(codes2, (uint8_t *)t->exp_avg_sq + a / 2, n);
      }
    }
  }
}

#undef LOOP_Q_HEAD_UPDATE
#undef LOOP_Q_HEAD_ENCODE
#undef LOOP_CAT2
#undef LOOP_CAT
#undef LOOP_NAME
