/*
 * half.h — exact scalar conversions between fp16/bf16 bit patterns and float, in portable C.
 *
 * Shared by the scaler (its reference kernel and the scalar tails of its vector kernels) and the
 * collectives (fp32-accumulated sums rounded once), so every CPU path rounds the same way: round-to-nearest-even, overflow to inf, subnormals kept (no flush to zero).
 * NaN results: fp16 keeps the sign and top payload bits and sets the quiet bit (what the x86
 * F16C instruction does); bf16 becomes 0x7fc0 (what torch's scalar conversion does; torch's own
 * vector path writes 0xffff instead, so NaN bit patterns are not part of any parity promise).
 * Not for CUDA: the .cu kernels use the cuda_fp16/cuda_bf16 intrinsics.
 */
#ifndef LLMMEM_HALF_H
#define LLMMEM_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t llmmem_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static inline float llmmem_f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline float llmmem_bf16_to_f32(uint16_t h) { return llmmem_f32_from_bits((uint32_t)h << 16); }

static inline uint16_t llmmem_f32_to_bf16(float f) {
  uint32_t u = llmmem_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  /* Round to nearest, ties to even: add 0x7fff plus the lowest kept bit, then truncate. */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float llmmem_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return llmmem_f32_from_bits(sign | 0x7f800000u | (mant << 13)); /* inf / NaN */
  if (exp == 0) {
    /* zero or subnormal: mant * 2^-24, exact in float */
    float v = (float)mant * 5.9604644775390625e-8f;
    return llmmem_f32_from_bits(sign | llmmem_f32_bits(v));
  }
  return llmmem_f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

static inline uint16_t llmmem_f32_to_f16(float f) {
  uint32_t u = llmmem_f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* quiet NaN */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf (and inf itself) */
  if (a < 0x38800000u) {
    /* result is subnormal or zero (|f| < 2^-14): round mant * 2^24 to an integer, ties to even */
    if (a < 0x33000000u) return sign;         /* below half of the smallest subnormal (2^-25): +-0 */
    uint32_t e = a >> 23;                     /* 102..112 */
    uint32_t m = (a & 0x7fffffu) | 0x800000u; /* 24-bit significand */
    uint32_t shift = 126u - e;                /* 14..24: bits dropped to land on 2^-24 units */
    uint32_t q = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
  }
  /* normal: rebias the exponent, then round the 13 dropped bits to nearest even */
  uint32_t r = a - 0x38000000u; /* exponent 127 -> 15 */
  r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
  return (uint16_t)(sign | r);
}

#endif /* LLMMEM_HALF_H */
