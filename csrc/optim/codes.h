/*
 * codes.h — the optimizer's quantization codes, one inline definition shared by the C reference,
 * the vector loops (which the compiler vectorises: no branches, no tables) and the CUDA kernel.
 *
 * A code is a small float ("minifloat") of E exponent bits and M mantissa bits, bias B, with
 * subnormals: magnitude code c = (e, f) reads f * 2^(1-B-M) when e = 0, else (2^M + f) * 2^(e-B-M).
 * A block's values are divided by its scale (largest finite magnitude / largest code value), so
 * the largest element lands on the largest code and the others keep a relative precision of
 * 2^-(M+1) down to 2^-(2^E - 1) of it: the property that makes a "dynamic" code better than a
 * linear one for Adam's moments, whose magnitudes in one block span orders of magnitude.
 *
 *   M8  signed   sign + E4 M3, B 15: 7.0 % worst relative error, 2^-17 of the block's largest;
 *                0x80 (a negative zero) is NaN.
 *   R8  unsigned E4 M4, B 15, on r = sqrt(v): 3.1 %, 2^-18; 0xff is +inf.
 *   M4  signed   sign + E2 M1, B 1: magnitudes 0, 1/12, 1/6, 1/4, 1/3, 1/2, 2/3 and 1 of the block's
 *                largest; 0x8 is NaN.
 *   R4  unsigned E2 M2, B 3: 0, 1/24 .. 7/24, 1/3, 5/12, 1/2, 7/12, 2/3, 5/6 and 1; 0xf is +inf.
 * m is rounded to nearest, ties to even. sqrt(v) is rounded stochastically by the step (to
 * nearest by a format conversion): its running average moves by 0.1% a step at beta2 = 0.999, far
 * below a code's step, and to nearest it could never decay (measured: an 8-bit teacher-student
 * run ended 5.1% above fp32 state with it rounded to nearest, 0.2% stochastically; rounding m
 * stochastically changed nothing at 8 bits and cost 1% at 4). An unsigned (R) value above zero
 * never becomes code 0: it takes code 1, so that a small r read back as 0 cannot turn
 * m / (r + eps) into m / eps.
 * Non-finite inputs become the NaN code (M) or the +inf code (R: a second moment that overflowed
 * stays +inf, as torch's does, so that the weight's updates are 0 rather than NaN; a NaN one
 * comes with a NaN first moment, which keeps the weight NaN as in torch).
 */
#ifndef LLMMEM_OPTIM_CODES_H
#define LLMMEM_OPTIM_CODES_H

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define LLMMEM_HD __host__ __device__ __forceinline__
#else
#define LLMMEM_HD static inline
#endif

LLMMEM_HD uint32_t llmmem_q_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

LLMMEM_HD float llmmem_q_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

/* 2^k as a float, for the constant exponents of the codes (k in [-126, 127]). */
LLMMEM_HD float llmmem_q_pow2(int k) { return llmmem_q_float((uint32_t)(k + 127) << 23); }

/* The magnitude code of y (finite, >= 0, at most a little above the largest code value) in a
 * code of M mantissa bits and bias B, rounded to nearest even; at most max_mag. */
LLMMEM_HD uint32_t llmmem_q_encode_mag(float y, int M, int B, uint32_t max_mag) {
  /* subnormal range (y < 2^(1-B)): the code is y in units of 2^(1-B-M), an integer <= 2^M; adding
   * 1.5 * 2^23 rounds it to nearest even and leaves it in the low mantissa bits */
  uint32_t sub = llmmem_q_bits(y * llmmem_q_pow2(B - 1 + M) + 12582912.0f) - 0x4b400000u;
  /* normal range: rebias the exponent so its field is e, then round the mantissa to M bits; a
   * carry out of the mantissa moves the exponent up, as it should */
  uint32_t t = llmmem_q_bits(y) - ((uint32_t)(127 - B) << 23);
  uint32_t norm = (t + ((1u << (22 - M)) - 1u) + ((t >> (23 - M)) & 1u)) >> (23 - M);
  uint32_t c = y < llmmem_q_pow2(1 - B) ? sub : norm;
  return c < max_mag ? c : max_mag;
}

/* The same code rounded stochastically: up with probability (the distance from the code below) /
 * (the step to the code above), using the random bits `rnd` from the top down (the step passes
 * 16, llmmem_sr_code_bits). Unbiased, so a running average stored in a few bits still moves by
 * amounts below half a step (see optim.h). */
LLMMEM_HD uint32_t llmmem_q_encode_mag_sr(float y, int M, int B, uint32_t max_mag, uint32_t rnd) {
  /* subnormal range: the code is floor(y in units of 2^(1-B-M) + a uniform [0, 1)); the sum is
   * below 2^(M+1), so float holds it to 2^-18 of a unit: exact for the 24 random bits' purpose */
  uint32_t sub = (uint32_t)(int32_t)(y * llmmem_q_pow2(B - 1 + M) + (float)(rnd >> 8) * 0x1p-24f);
  /* normal range: add random bits below the kept mantissa, then truncate */
  uint32_t t = llmmem_q_bits(y) - ((uint32_t)(127 - B) << 23);
  uint32_t norm = (t + (rnd >> (9 + M))) >> (23 - M);
  uint32_t c = y < llmmem_q_pow2(1 - B) ? sub : norm;
  return c < max_mag ? c : max_mag;
}

/* The value of magnitude code c (see above). */
LLMMEM_HD float llmmem_q_decode_mag(uint32_t c, int M, int B) {
  /* subnormal (e = 0): c itself is f */
  float sub = (float)c * llmmem_q_pow2(1 - B - M);
  /* normal: c shifted up puts e in the exponent field and f under it; the bias is added there */
  float norm = llmmem_q_float((c << (23 - M)) + ((uint32_t)(127 - B) << 23));
  return c < (1u << M) ? sub : norm;
}

/* ---- the four codes: bits of the magnitude, mantissa bits, bias ---------------------------- */

#define LLMMEM_Q_M8_MAG 7
#define LLMMEM_Q_M8_M   3
#define LLMMEM_Q_M8_B   15
#define LLMMEM_Q_R8_M   4
#define LLMMEM_Q_R8_B   15
#define LLMMEM_Q_M4_MAG 3
#define LLMMEM_Q_M4_M   1
#define LLMMEM_Q_M4_B   1
#define LLMMEM_Q_R4_M   2
#define LLMMEM_Q_R4_B   3

/* Signed codes (first moment): sign bit above a magnitude of `mag` bits; the negative zero is NaN. */
LLMMEM_HD uint32_t llmmem_q_encode_signed(float x, float inv, int mag, int M, int B) {
  const uint32_t nan_code = 1u << mag, max_mag = nan_code - 1u;
  uint32_t u = llmmem_q_bits(x);
  float y = llmmem_q_float(u & 0x7fffffffu) * inv;
  /* y is inf or NaN exactly when x is not finite (|x| <= the block's finite maximum, inv <= 2^121) */
  int bad = (u & 0x7f800000u) == 0x7f800000u;
  uint32_t m = llmmem_q_encode_mag(bad ? 0.0f : y, M, B, max_mag);
  uint32_t code = m == 0 ? 0u : ((u >> 31) << mag) | m;
  return bad ? nan_code : code;
}

LLMMEM_HD float llmmem_q_decode_signed(uint32_t c, float scale, int mag, int M, int B) {
  const uint32_t nan_code = 1u << mag;
  float v = llmmem_q_decode_mag(c & (nan_code - 1u), M, B) * scale;
  uint32_t s = (c >> mag) & 1u;
  float out = llmmem_q_float(llmmem_q_bits(v) | (s << 31));
  return c == nan_code ? llmmem_q_float(0x7fc00000u) : out;
}

/* Unsigned codes (sqrt of the second moment, x >= 0 or NaN): the all-ones code is +inf, and a
 * positive x never rounds to 0. */
LLMMEM_HD uint32_t llmmem_q_encode_unsigned(float x, float inv, int bits, int M, int B) {
  const uint32_t nan_code = (1u << bits) - 1u;
  uint32_t u = llmmem_q_bits(x);
  int bad = (u & 0x7f800000u) == 0x7f800000u;
  float y = x * inv;
  uint32_t m = llmmem_q_encode_mag(bad ? 0.0f : y, M, B, nan_code - 1u);
  /* x > 0, on the bits (positive finite: [1, 0x7f7fffff]); integer arithmetic, so loops vectorise */
  uint32_t positive = (uint32_t)(u - 1u < 0x7f7fffffu);
  m = m > positive ? m : positive;
  return bad ? nan_code : m;
}

/* The unsigned code of x rounded stochastically with the random bits `rnd` (see
 * llmmem_q_encode_mag_sr): how the step stores sqrt(v). */
LLMMEM_HD uint32_t llmmem_q_encode_unsigned_sr(float x, float inv, int bits, int M, int B, uint32_t rnd) {
  const uint32_t nan_code = (1u << bits) - 1u;
  uint32_t u = llmmem_q_bits(x);
  int bad = (u & 0x7f800000u) == 0x7f800000u;
  float y = x * inv;
  uint32_t m = llmmem_q_encode_mag_sr(bad ? 0.0f : y, M, B, nan_code - 1u, rnd);
  uint32_t positive = (uint32_t)(u - 1u < 0x7f7fffffu);
  m = m > positive ? m : positive;
  return bad ? nan_code : m;
}

LLMMEM_HD float llmmem_q_decode_unsigned(uint32_t c, float scale, int bits, int M, int B) {
  const uint32_t nan_code = (1u << bits) - 1u;
  float v = llmmem_q_decode_mag(c, M, B) * scale;
  return c == nan_code ? llmmem_q_float(0x7f800000u) : v;
}

/* The largest value of each code (scale = block maximum / this). */
LLMMEM_HD float llmmem_q_max_value(int code) {
  switch (code) {
    case 0: return llmmem_q_decode_mag((1u << LLMMEM_Q_M8_MAG) - 1u, LLMMEM_Q_M8_M, LLMMEM_Q_M8_B);
    case 1: return llmmem_q_decode_mag(0xfeu, LLMMEM_Q_R8_M, LLMMEM_Q_R8_B);
    case 2: return llmmem_q_decode_mag((1u << LLMMEM_Q_M4_MAG) - 1u, LLMMEM_Q_M4_M, LLMMEM_Q_M4_B);
    default: return llmmem_q_decode_mag(0xeu, LLMMEM_Q_R4_M, LLMMEM_Q_R4_B);
  }
}

/* A block's scale and the multiplier its values are quantized with, from its largest finite
 * magnitude. A block whose largest magnitude is below 2^-120 (so tiny that its updates are
 * lost in any fp32 weight) is stored as zeros: the multiplier would overflow. */
#define LLMMEM_Q_MIN_ABSMAX 0x1p-120f
LLMMEM_HD void llmmem_q_block_scale(float absmax, float max_value, float *scale, float *inv) {
  int ok = absmax >= LLMMEM_Q_MIN_ABSMAX;
  *scale = ok ? absmax / max_value : 0.0f;
  *inv = ok ? max_value / absmax : 0.0f;
}

#endif /* LLMMEM_OPTIM_CODES_H */
