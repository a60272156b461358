/*
 * quant_avx512.h — the quantized formats' two loops written with AVX-512 intrinsics, 16 elements
 * at a time, for adamw_loops.h's AVX-512 instantiation. The compiler's own vectorisation of the
 * inline code (codes.h, adamw_math.h) widened the codes in two steps, extracted halves and
 * spilled masks: 0.83 + 0.50 ns an element for the two loops on a 2-core Zen 5 VM, against 0.18
 * for the unquantized update. The arithmetic is the inline code's own, in its order, except
 * where another sequence gives the same bits for every input it is used on (the decode by one
 * multiply, the maxima without the finite filter, the non-finite lanes found on y, each says
 * why), so the results stay equal to the reference bit for bit (tests/c/test_optim.c, at -O3,
 * with the fallbacks those need); the tails (fewer than 16 elements) run the inline code itself.
 * On a 2-core Zen 4 VM (AVX-512 as two 256-bit halves) these loops took 0.44 + 0.45 ns an
 * element, against 0.58 + 0.64 before those changes (benchmarks/optim_q8_ab.c for the step).
 *
 * Macros rather than functions: the shift counts must be immediates.
 */
#ifndef LLMMEM_OPTIM_QUANT_AVX512_H
#define LLMMEM_OPTIM_QUANT_AVX512_H

#include <immintrin.h>

/* llmmem_q_decode_mag of the 16 codes c (epi32) */
#define Q512_DECODE_MAG(c, M, B)                                                                                     \
  _mm512_mask_blend_ps(_mm512_cmplt_epu32_mask((c), _mm512_set1_epi32(1 << (M))),                                    \
                       _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32((c), 23 - (M)),                        \
                                                            _mm512_set1_epi32((int)((uint32_t)(127 - (B)) << 23)))), \
                       _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(llmmem_q_pow2(1 - (B) - (M)))))

/* llmmem_q_decode_signed */
#define Q512_DECODE_SIGNED(c, scale, MAG, M, B)                                                             \
  _mm512_mask_blend_ps(                                                                                     \
      _mm512_cmpeq_epi32_mask((c), _mm512_set1_epi32(1 << (MAG))),                                          \
      _mm512_castsi512_ps(_mm512_or_si512(                                                                  \
          _mm512_castps_si512(_mm512_mul_ps(                                                                \
              Q512_DECODE_MAG(_mm512_and_si512((c), _mm512_set1_epi32((1 << (MAG)) - 1)), M, B), (scale))), \
          _mm512_slli_epi32(_mm512_and_si512((c), _mm512_set1_epi32(1 << (MAG))), 31 - (MAG)))),            \
      _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)))

/* llmmem_q_decode_unsigned (the all-ones code is +inf) */
#define Q512_DECODE_UNSIGNED(c, scale, BITS, M, B)                                         \
  _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask((c), _mm512_set1_epi32((1 << (BITS)) - 1)), \
                       _mm512_mul_ps(Q512_DECODE_MAG(c, M, B), (scale)),                   \
                       _mm512_castsi512_ps(_mm512_set1_epi32(0x7f800000)))

/* The decode in one multiply. A magnitude code c shifted so that its e and f fields sit in a
 * float's exponent and mantissa fields (c << (23 - M)) reads, as a float, its value times
 * 2^(B-127) exactly: e > 0 gives (1 + f/2^M) * 2^(e-127), and e = 0 an fp32 subnormal
 * f * 2^(-126-M), which holds f exactly. Times K = scale * 2^(127-B) (exact: a power of two
 * times scale) that is value * scale rounded once: llmmem_q_decode_mag(c, M, B) * scale, the
 * reference's product (its decode is exact too). So it equals the reference when K is finite, the
 * subnormal inputs are read as they are (MXCSR's DAZ bit clear) and products round to nearest
 * (MXCSR's rounding control 0: under a directed mode an overflowing K becomes FLT_MAX, and a
 * negative product rounds the other way from the reference's positive one); the update checks
 * these once a block (q512_mul_decode_ok) and otherwise decodes as above. 6 and 5 operations fewer a moment
 * than the blend of two paths (8-bit step: see the commit for the times). */
static inline __attribute__((target("avx512f"))) int q512_mul_decode_ok(float km, float kr) {
  /* +0 or positive finite (on the bits): a negative K would put the sign in the product, which the
   * reference ORs in after it; DAZ (0x40) and a rounding mode other than nearest (0x6000) clear */
  return llmmem_q_bits(km) < 0x7f800000u && llmmem_q_bits(kr) < 0x7f800000u && !(_mm_getcsr() & 0x6040u);
}

/* The bits of a signed code (sign above a MAG-bit magnitude) as the float whose magnitude times K
 * decodes it (see above), with the code's sign as its sign: sign-extended from the code's top bit
 * (an 8-bit code is loaded sign-extended already), shifted, and the bits between the sign and the
 * magnitude cleared. The NaN code (a negative zero) becomes -0.0f: its bits 0x80000000. */
#define Q512_SIGNED_BITS(c, MAG, M)                                                                             \
  _mm512_and_si512((MAG) == 7 ? _mm512_slli_epi32((c), 23 - (M))                                                \
                              : _mm512_srai_epi32(_mm512_slli_epi32((c), 31 - (MAG)), 31 - (MAG) - (23 - (M))), \
                   _mm512_set1_epi32((int)(0x80000000u | (((1u << (MAG)) - 1u) << (23 - (M))))))

/* llmmem_q_decode_signed by one multiply: c as loaded (sign-extended for MAG 7), k = K */
#define Q512_DECODE_SIGNED_MUL(c, k, MAG, M)                                                                       \
  __extension__({                                                                                                  \
    const __m512i b_ = Q512_SIGNED_BITS(c, MAG, M);                                                                \
    _mm512_mask_mul_ps(_mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)),                                         \
                       _mm512_cmpneq_epi32_mask(b_, _mm512_set1_epi32((int)0x80000000u)), _mm512_castsi512_ps(b_), \
                       (k));                                                                                       \
  })

/* llmmem_q_decode_unsigned by one multiply (the all-ones code is +inf) */
#define Q512_DECODE_UNSIGNED_MUL(c, k, BITS, M)                                           \
  _mm512_mask_mul_ps(_mm512_castsi512_ps(_mm512_set1_epi32(0x7f800000)),                  \
                     _mm512_cmpneq_epi32_mask((c), _mm512_set1_epi32((1 << (BITS)) - 1)), \
                     _mm512_castsi512_ps(_mm512_slli_epi32((c), 23 - (M))), (k))

/* llmmem_sr_mix of 16 lanes */
static inline __attribute__((target("avx512f,avx512bw,avx512vl"))) __m512i q512_mix(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x7feb352du));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846ca68bu));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* The subnormal range of an 8-bit code (y < 2^(1-B)) holds only what is below 2^-14 of its
 * block's largest, zeros chiefly: most 16-lane groups have none, so with GATE the encoders below
 * compute it only when some lane needs it, and blend it into those lanes (8-bit step: 6% less
 * time). A 4-bit code's range starts at 1/6 of the largest: nearly every group needs it, and the
 * 4-bit encoders compute it always (GATE 0). */
#define Q512_SUBNORMAL(y, B) _mm512_cmp_ps_mask((y), _mm512_set1_ps(llmmem_q_pow2(1 - (B))), _CMP_LT_OQ)

/* out = llmmem_q_encode_mag of y (>= 0): to nearest, ties to even; at most max_mag */
#define Q512_ENCODE_MAG(out, y, M, B, max_mag, GATE)                                                                 \
  do {                                                                                                               \
    const __m512i t_ =                                                                                               \
        _mm512_sub_epi32(_mm512_castps_si512(y), _mm512_set1_epi32((int)((uint32_t)(127 - (B)) << 23)));             \
    __m512i c_ =                                                                                                     \
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(t_, _mm512_set1_epi32((1 << (22 - (M))) - 1)),           \
                                           _mm512_and_si512(_mm512_srli_epi32(t_, 23 - (M)), _mm512_set1_epi32(1))), \
                          23 - (M));                                                                                 \
    const __mmask16 sub_ = Q512_SUBNORMAL(y, B);                                                                     \
    if (!(GATE) || sub_)                                                                                             \
      c_ = _mm512_mask_sub_epi32(                                                                                    \
          c_, sub_,                                                                                                  \
          _mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps((y), _mm512_set1_ps(llmmem_q_pow2((B)-1 + (M)))),          \
                                            _mm512_set1_ps(12582912.0f))),                                           \
          _mm512_set1_epi32(0x4b400000));                                                                            \
    (out) = _mm512_min_epu32(c_, _mm512_set1_epi32((int)(max_mag)));                                                 \
  } while (0)

/* out = llmmem_q_encode_mag_sr of y (>= 0) with the random bits rnd */
#define Q512_ENCODE_MAG_SR(out, y, M, B, max_mag, rnd, GATE)                                                        \
  do {                                                                                                              \
    const __m512i t_ =                                                                                              \
        _mm512_sub_epi32(_mm512_castps_si512(y), _mm512_set1_epi32((int)((uint32_t)(127 - (B)) << 23)));            \
    __m512i c_ = _mm512_srli_epi32(_mm512_add_epi32(t_, _mm512_srli_epi32((rnd), 9 + (M))), 23 - (M));              \
    const __mmask16 sub_ = Q512_SUBNORMAL(y, B);                                                                    \
    if (!(GATE) || sub_)                                                                                            \
      c_ = _mm512_mask_cvttps_epi32(                                                                                \
          c_, sub_,                                                                                                 \
          _mm512_add_ps(_mm512_mul_ps((y), _mm512_set1_ps(llmmem_q_pow2((B)-1 + (M)))),                             \
                        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32((rnd), 8)), _mm512_set1_ps(0x1p-24f)))); \
    (out) = _mm512_min_epu32(c_, _mm512_set1_epi32((int)(max_mag)));                                                \
  } while (0)

/* The maxima of a block's moments are kept on the bits, as the reference keeps them: |m| as
 * unsigned, r (never negative: v = r*r*beta2 + (c2*g)*g >= +0, so sqrt(v) is +0, positive or NaN)
 * as signed, which leaves out a NaN with its sign bit set. Infinities and NaNs are not left out in
 * the loop (2 operations fewer for each moment); a block whose maximum is one of them, rare, takes
 * its finite maxima again here, from the values stored. */
static inline void q512_finite_max(const float *restrict mo, const float *restrict ro, int64_t n, uint32_t *am,
                                   uint32_t *ar) {
  uint32_t a_max = 0, b_max = 0;
  for (int64_t k = 0; k < n; k++) {
    uint32_t a = llmmem_q_bits(mo[k]) & 0x7fffffffu, b = llmmem_q_bits(ro[k]) & 0x7fffffffu;
    a &= 0u - (uint32_t)(a < 0x7f800000u);
    b &= 0u - (uint32_t)(b < 0x7f800000u);
    a_max = a > a_max ? a : a_max;
    b_max = b > b_max ? b : b_max;
  }
  *am = a_max;
  *ar = b_max;
}

/* One pass of the update over [0, n & ~15) with the decode DECODE_MR (which sets m and r from the
 * codes at i); the body of Q512_UPDATE_FN. */
#define Q512_UPDATE_LOOP(DECODE_MR)                                                                       \
  for (; i + 16 <= n; i += 16) {                                                                          \
    __m512 m, r;                                                                                          \
    DECODE_MR;                                                                                            \
    __m512 v = _mm512_mul_ps(r, r);                                                                       \
    __m512 gv = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_loadu_ps(g + i)), flip)); \
    __m512 pv = _mm512_mul_ps(_mm512_loadu_ps(p + i), decay);                                             \
    if (with_l2) gv = _mm512_add_ps(gv, _mm512_mul_ps(l2, pv));                                           \
    __m512 d1 = _mm512_sub_ps(gv, m);                                                                     \
    m = high ? _mm512_sub_ps(gv, _mm512_mul_ps(d1, omw1)) : _mm512_add_ps(m, _mm512_mul_ps(w1, d1));      \
    v = _mm512_add_ps(_mm512_mul_ps(v, beta2), _mm512_mul_ps(_mm512_mul_ps(c2, gv), gv));                 \
    r = _mm512_sqrt_ps(v);                                                                                \
    __m512 den = _mm512_add_ps(unit_bc2 ? r : _mm512_div_ps(r, bc2), eps);                                \
    _mm512_storeu_ps(p + i, _mm512_add_ps(pv, _mm512_div_ps(_mm512_mul_ps(neg, m), den)));                \
    _mm512_storeu_ps(mo + i, m);                                                                          \
    _mm512_storeu_ps(ro + i, r);                                                                          \
    vam = _mm512_max_epu32(vam, _mm512_and_si512(_mm512_castps_si512(m), abs_mask));                      \
    var = _mm512_max_epi32(var, _mm512_castps_si512(r));                                                  \
  }

/* The vector part of adamw_loops.h's fused update of a quantized block: elements [0, n & ~15)
 * of update_q8/update_q4 (see there), their maxima's bits in *am, *ar; returns how many. */
#define Q512_UPDATE_FN(NAME, MMAG, MM, MB, RBITS, RM, RB)                                                              \
  static inline __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c"))) int64_t NAME(                           \
      const llmmem_adamw_scalars_t *s, float *restrict p, const float *restrict g, const uint8_t *restrict mc,         \
      const uint8_t *restrict rc, float ms, float rs, float *restrict mo, float *restrict ro, int64_t n,               \
      uint32_t *am, uint32_t *ar) {                                                                                    \
    const __m512 decay = _mm512_set1_ps(s->decay);                                                                     \
    const __m512 l2 = _mm512_set1_ps(s->l2), w1 = _mm512_set1_ps(s->w1), omw1 = _mm512_set1_ps(s->one_m_w1);           \
    const __m512 beta2 = _mm512_set1_ps(s->beta2), c2 = _mm512_set1_ps(s->c2), bc2 = _mm512_set1_ps(s->bc2_sqrt);      \
    const __m512 eps = _mm512_set1_ps(s->eps), neg = _mm512_set1_ps(s->neg_step);                                      \
    const __m512i flip = _mm512_set1_epi32(s->maximize ? (int)0x80000000u : 0),                                        \
                  abs_mask = _mm512_set1_epi32(0x7fffffff);                                                            \
    /* after some 17,000 steps at beta2 = 0.999, sqrt(1 - beta2^t) rounds to 1: r / 1 is r, bit for                  \
     * bit, and the division (a third of the divider's time here) can go */ \
    const int with_l2 = s->l2 != 0.0f, high = s->lerp_high, unit_bc2 = s->bc2_sqrt == 1.0f;                            \
    __m512i vam = _mm512_setzero_si512(), var = _mm512_setzero_si512();                                                \
    const float km = ms * llmmem_q_pow2(127 - (MB)), kr = rs * llmmem_q_pow2(127 - (RB));                              \
    int64_t i = 0;                                                                                                     \
    if (q512_mul_decode_ok(km, kr)) {                                                                                  \
      const __m512 vkm = _mm512_set1_ps(km), vkr = _mm512_set1_ps(kr);                                                 \
      Q512_UPDATE_LOOP({                                                                                               \
        const __m128i bm_ = _mm_loadu_si128((const __m128i *)(mc + i));                                                \
        m = Q512_DECODE_SIGNED_MUL((MMAG) == 7 ? _mm512_cvtepi8_epi32(bm_) : _mm512_cvtepu8_epi32(bm_), vkm, MMAG,     \
                                   MM);                                                                                \
        r = Q512_DECODE_UNSIGNED_MUL(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(rc + i))), vkr, RBITS,     \
                                     RM);                                                                              \
      })                                                                                                               \
    } else {                                                                                                           \
      const __m512 vms = _mm512_set1_ps(ms), vrs = _mm512_set1_ps(rs);                                                 \
      Q512_UPDATE_LOOP({                                                                                               \
        m = Q512_DECODE_SIGNED(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mc + i))), vms, MMAG, MM, MB);   \
        r = Q512_DECODE_UNSIGNED(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(rc + i))), vrs, RBITS, RM,     \
                                 RB);                                                                                  \
      })                                                                                                               \
    }                                                                                                                  \
    uint32_t am_ = (uint32_t)_mm512_reduce_max_epu32(vam), ar_ = (uint32_t)_mm512_reduce_max_epi32(var);               \
    if (am_ >= 0x7f800000u || ar_ >= 0x7f800000u) q512_finite_max(mo, ro, i, &am_, &ar_);                              \
    *am = am_;                                                                                                         \
    *ar = ar_;                                                                                                         \
    return i;                                                                                                          \
  }

/* Both codes of the 16 elements at j (the body of Q512_ENCODE_FN), sqrt(v) with the random bits
 * rnd. */
#define Q512_ENCODE16(j, rnd, MMAG, MM, MB, RBITS, RM, RB, GATE)                                                    \
  do {                                                                                                              \
    /* m: to nearest. y is not finite exactly where x is not (|x| is at most the block's finite                   \
     * maximum, and inv at most max_value over it, or 0), so one compare on y finds the lanes that                 \
     * take the NaN code; what the encoder makes of them before is overwritten */ \
    const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(m + (j)));                                                \
    __m512 y = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff))), vim);         \
    __mmask16 bad = _mm512_cmp_ps_mask(y, inf, _CMP_NLT_UQ);                                                        \
    __m512i mag;                                                                                                    \
    Q512_ENCODE_MAG(mag, y, MM, MB, (1u << (MMAG)) - 1u, GATE);                                                     \
    /* the sign bit over a magnitude above 0 (x's sign bit shifted down to bit MAG, with the                      \
     * exponent bits below it masked off), 0 for a magnitude of 0 */ \
    __m512i code =                                                                                                  \
        _mm512_maskz_ternarylogic_epi32(_mm512_test_epi32_mask(mag, mag), _mm512_srli_epi32(u, 31 - (MMAG)), mag,   \
                                        _mm512_set1_epi32(1 << (MMAG)), 0xec); /* (a & c) | b */                    \
    code = _mm512_mask_mov_epi32(code, bad, _mm512_set1_epi32(1 << (MMAG)));                                        \
    _mm_storeu_si128((__m128i *)(mc + (j)), _mm512_cvtepi32_epi8(code));                                            \
    /* sqrt(v): stochastically, with a positive value kept off code 0 (x > 0 as a float compare:                  \
     * false for NaN and -0, true for +inf, which is overwritten) */ \
    const __m512 x = _mm512_loadu_ps(r + (j));                                                                      \
    y = _mm512_mul_ps(x, vir);                                                                                      \
    bad = _mm512_cmp_ps_mask(y, inf, _CMP_NLT_UQ);                                                                  \
    Q512_ENCODE_MAG_SR(mag, y, RM, RB, (1u << (RBITS)) - 2u, (rnd), GATE);                                          \
    mag = _mm512_mask_max_epu32(mag, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ), mag,                   \
                                _mm512_set1_epi32(1));                                                              \
    code = _mm512_mask_mov_epi32(mag, bad, _mm512_set1_epi32((1 << (RBITS)) - 1));                                  \
    _mm_storeu_si128((__m128i *)(rc + (j)), _mm512_cvtepi32_epi8(code));                                            \
  } while (0)

/* llmmem_sr_code_bits of the 32 elements from index idx (a multiple of 32): one hash of 16 lanes,
 * its low halves for the first 16 elements, its high halves for the next 16 */
#define Q512_CODE_HASH(idx) \
  q512_mix(_mm512_xor_si512(_mm512_or_si512(_mm512_set1_epi32((int)(((idx) >> 5) << 4)), iota), vkey))
#define Q512_LOW_BITS(h)  _mm512_slli_epi32((h), 16)
#define Q512_HIGH_BITS(h) _mm512_and_si512((h), _mm512_set1_epi32((int)0xffff0000u))

/* The vector part of the fused encode of a quantized block: elements [0, n & ~15); returns how
 * many. first is a multiple of 32 (a block's start; blocks are at least 32 elements). 32 elements
 * a turn, so that one hash serves both halves without a branch (encode: 3% less time than a
 * hash every other turn of 16). */
#define Q512_ENCODE_FN(NAME, MMAG, MM, MB, RBITS, RM, RB, GATE)                                                \
  static inline __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c"))) int64_t NAME(                   \
      const float *restrict m, const float *restrict r, float inv_m, float inv_r, uint8_t *restrict mc,        \
      uint8_t *restrict rc, int64_t n, uint32_t key, uint32_t first) {                                         \
    const __m512 vim = _mm512_set1_ps(inv_m), vir = _mm512_set1_ps(inv_r);                                     \
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);              \
    const __m512i vkey = _mm512_set1_epi32((int)key);                                                          \
    const __m512 inf = _mm512_castsi512_ps(_mm512_set1_epi32(0x7f800000));                                     \
    int64_t i = 0;                                                                                             \
    for (; i + 32 <= n; i += 32) {                                                                             \
      const __m512i h = Q512_CODE_HASH(first + (uint32_t)i);                                                   \
      Q512_ENCODE16(i, Q512_LOW_BITS(h), MMAG, MM, MB, RBITS, RM, RB, GATE);                                   \
      Q512_ENCODE16(i + 16, Q512_HIGH_BITS(h), MMAG, MM, MB, RBITS, RM, RB, GATE);                             \
    }                                                                                                          \
    if (i + 16 <= n) {                                                                                         \
      Q512_ENCODE16(i, Q512_LOW_BITS(Q512_CODE_HASH(first + (uint32_t)i)), MMAG, MM, MB, RBITS, RM, RB, GATE); \
      i += 16;                                                                                                 \
    }                                                                                                          \
    return i;                                                                                                  \
  }

Q512_UPDATE_FN(q512_update_q8, LLMMEM_Q_M8_MAG, LLMMEM_Q_M8_M, LLMMEM_Q_M8_B, 8, LLMMEM_Q_R8_M, LLMMEM_Q_R8_B)
Q512_UPDATE_FN(q512_update_q4, LLMMEM_Q_M4_MAG, LLMMEM_Q_M4_M, LLMMEM_Q_M4_B, 4, LLMMEM_Q_R4_M, LLMMEM_Q_R4_B)
Q512_ENCODE_FN(q512_encode_q8, LLMMEM_Q_M8_MAG, LLMMEM_Q_M8_M, LLMMEM_Q_M8_B, 8, LLMMEM_Q_R8_M, LLMMEM_Q_R8_B, 1)
Q512_ENCODE_FN(q512_encode_q4, LLMMEM_Q_M4_MAG, LLMMEM_Q_M4_M, LLMMEM_Q_M4_B, 4, LLMMEM_Q_R4_M, LLMMEM_Q_R4_B, 0)

#endif /* LLMMEM_OPTIM_QUANT_AVX512_H */
