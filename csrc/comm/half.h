/*
 * half.h — fp16 / bf16 <-> fp32 conversions used by the collectives (private, header-only).
 *
 * Widening is exact; narrowing rounds to nearest, ties to even, like PyTorch's own conversions,
 * so an fp32-accumulated sum rounded once here equals what torch would store. NaN stays NaN
 * (canonical quiet NaN with the sign kept), overflow becomes +-Inf.
 */
#ifndef LLMMEM_COMM_HALF_H
#define LLMMEM_COMM_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t llmmem_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static inline float llmmem_bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline float llmmem_bf16_to_f32(uint16_t h) { return llmmem_bits_f32((uint32_t)h << 16); }

static inline uint16_t llmmem_f32_to_bf16(float f) {
  uint32_t u = llmmem_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* NaN: keep it quiet */
  u += 0x7fffu + ((u >> 16) & 1u);                                             /* round to nearest even */
  return (uint16_t)(u >> 16);
}

static inline float llmmem_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    /* zero or subnormal: mant * 2^-24 is exact in fp32 */
    float v = (float)mant * 0x1p-24f;
    return llmmem_bits_f32(llmmem_f32_bits(v) | sign);
  }
  if (exp == 31) return llmmem_bits_f32(sign | 0x7f800000u | (mant << 13));
  return llmmem_bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

static inline uint16_t llmmem_f32_to_f16(float f) {
  const uint32_t f32_inf = 255u << 23, f16_max = (127u + 16u) << 23;
  const uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t x = llmmem_f32_bits(f);
  uint32_t sign = x & 0x80000000u;
  uint16_t o;
  x ^= sign;
  if (x >= f16_max) {
    o = x > f32_inf ? 0x7e00u : 0x7c00u; /* NaN -> quiet NaN; Inf or too large -> Inf */
  } else if (x < (113u << 23)) {
    /* result is subnormal or zero: let the fp32 adder do the rounding (RNE) at the right place */
    float v = llmmem_bits_f32(x) + llmmem_bits_f32(denorm_magic);
    o = (uint16_t)(llmmem_f32_bits(v) - denorm_magic);
  } else {
    uint32_t mant_odd = (x >> 13) & 1u;
    x += ((uint32_t)(15 - 127) << 23) + 0xfffu; /* rebias the exponent, round half up ... */
    x += mant_odd;                              /* ... then make ties go to even */
    o = (uint16_t)(x >> 13);
  }
  return (uint16_t)(o | (sign >> 16));
}

#endif /* LLMMEM_COMM_HALF_H */
