/*
 * head_math.h — the arithmetic of the LM head's passes shared by the vector loops and the CUDA
 * kernel: the dtype loads and stores, softcap, and an exp that the compiler vectorises (no libm
 * call, no branch). The plain reference (head_ref.c) uses libm instead: the passes agree with it
 * to a few ulp, not bit for bit. Not part of the ABI.
 */
#ifndef LLMMEM_HEAD_MATH_H
#define LLMMEM_HEAD_MATH_H

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define LLMMEM_HEAD_HD __host__ __device__ __forceinline__
#else
#define LLMMEM_HEAD_HD static inline
#endif

LLMMEM_HEAD_HD uint32_t llmmem_head_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

LLMMEM_HEAD_HD float llmmem_head_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

/* exp(x) for x <= 0 (the passes take exp of z - max and z - lse), within 2 ulp of the exact
 * value down to x = -87 (below it returns 0: those terms are below fp32's precision of any row
 * sum that holds a 1). x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial. */
LLMMEM_HEAD_HD float llmmem_head_exp(float x) {
  const int nan = x != x;
  x = nan ? 0.0f : x < -87.0f ? -87.0f : x; /* a NaN comes out again at the end, converted to no int */
  float n = x * 1.44269504088896341f;
  n = (n + 12582912.0f) - 12582912.0f; /* round to nearest */
  float r = x - n * 0.693359375f;      /* ln2 in two parts: the first exact in float */
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t e = (int32_t)n + 127;
  float scale = llmmem_head_float((uint32_t)(e < 1 ? 1 : e) << 23);
  float out = e < 1 ? 0.0f : p * scale;
  return nan ? llmmem_head_float(0x7fc00000u) : out;
}

/* softcap * tanh(l / softcap) for softcap > 0. tanh(a): for |a| < 0.625 an odd polynomial (Cephes'
 * tanhf: 1 - exp would cancel there), above it (1 - m) / (1 + m) with m = exp(-2|a|). */
LLMMEM_HEAD_HD float llmmem_head_softcap(float l, float softcap, float inv_softcap) {
  float a = l * inv_softcap;
  float abs_a = a < 0.0f ? -a : a;
  float z = a * a;
  float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z + 1.33314422036e-1f) * z -
                 3.33332819422e-1f) *
                    z * a +
                a;
  float m = llmmem_head_exp(-2.0f * abs_a);
  float t = (1.0f - m) / (1.0f + m);
  float large = a < 0.0f ? -t : t;
  return softcap * (abs_a < 0.625f ? small : large);
}

#endif /* LLMMEM_HEAD_MATH_H */
