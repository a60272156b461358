/*
 * adamw_math.h — the arithmetic of one AdamW element and of stochastic rounding, one inline
 * definition shared by the C reference, the vector loops and the CUDA kernel (see optim.h for
 * the formula and why nothing is fused). Not part of the ABI.
 */
#ifndef LLMMEM_OPTIM_ADAMW_MATH_H
#define LLMMEM_OPTIM_ADAMW_MATH_H

#include <stdint.h>
#if !defined(__CUDACC__)
#include <math.h>
#endif

#include "codes.h"

/* The scalars of one tensor's update, each computed in double and rounded once to float, as
 * Python computes torch's scalars and torch's kernels take them. */
typedef struct {
  float decay;    /* AdamW: 1 - lr * wd (1 when wd == 0: no multiply, as torch skips it) */
  float l2;       /* Adam: wd (0 when decoupled) */
  float w1;       /* 1 - beta1, the lerp weight */
  float one_m_w1; /* 1 - w1 in float: torch's lerp for weights >= 0.5 */
  float beta2;
  float c2; /* 1 - beta2 */
  float bc2_sqrt;
  float eps;
  float neg_step; /* -lr / (1 - beta1^t) */
  int lerp_high;  /* w1 >= 0.5: lerp computes g - (g - m) * (1 - w1) */
  int maximize;
} llmmem_adamw_scalars_t;

/* One element: p, m, v updated in place; g is the gradient as read. Returns sqrt(v) (the r that
 * the quantized formats store, and the numerator of the denominator). */
LLMMEM_HD float llmmem_adamw_elem(const llmmem_adamw_scalars_t *s, float g, float *p, float *m, float *v) {
  float pv = *p;
  g = s->maximize ? -g : g;
  pv = pv * s->decay;
  g = s->l2 != 0.0f ? g + s->l2 * pv : g; /* torch adds nothing without decay (0 * inf would be NaN) */
  float d1 = g - *m;
  float ml = *m + s->w1 * d1;
  float mh = g - d1 * s->one_m_w1;
  float mv = s->lerp_high ? mh : ml;
  float vv = *v * s->beta2 + (s->c2 * g) * g;
  float r = sqrtf(vv);
  float den = r / s->bc2_sqrt + s->eps;
  *p = pv + (s->neg_step * mv) / den;
  *m = mv;
  *v = vv;
  return r;
}

/* ---- stochastic rounding ------------------------------------------------------------------ */

/* A 32-bit mixing function (a bijection with good avalanche: "lowbias32", from Chris Wellons'
 * hash prospector): the random bits of element i are mix(i ^ key). */
LLMMEM_HD uint32_t llmmem_sr_mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

/* The random bits that round element idx (its index's low 32 bits) of sqrt(v) into a code: 16 of
 * them, in the top half (the low half is 0). One hash serves two elements: that of idx with its
 * bit 4 taken out, whose low half rounds the element with bit 4 clear and whose high half the
 * element 16 further on. So 16 vector lanes hash once for 32 elements (half the multiplies of a
 * hash an element: the AVX-512 8-bit step took 4% less time), and a pair shares no bits. 16 bits
 * resolve the probability of rounding up to 2^-16 of a code's step, as bf16 rounding's do. */
LLMMEM_HD uint32_t llmmem_sr_code_bits(uint32_t idx, uint32_t key) {
  uint32_t h = llmmem_sr_mix((((idx >> 5) << 4) | (idx & 15u)) ^ key);
  return (idx & 16u) ? h & 0xffff0000u : h << 16;
}

/* Streams of random bits, one per thing rounded. */
enum { LLMMEM_SR_PARAM = 0, LLMMEM_SR_MOMENTS = 1 };

/* The 32-bit key of (seed, step, stream) for elements whose index has `hi` as its upper 32 bits. */
LLMMEM_HD uint32_t llmmem_sr_key(uint64_t seed, float step, uint32_t stream, uint32_t hi) {
  uint32_t k = llmmem_sr_mix((uint32_t)seed ^ 0x9e3779b9u);
  k = llmmem_sr_mix(k ^ (uint32_t)(seed >> 32));
  k = llmmem_sr_mix(k ^ llmmem_q_bits(step));
  k = llmmem_sr_mix(k ^ (stream * 0x85ebca6bu));
  return llmmem_sr_mix(k ^ hi);
}

/* x rounded to a bf16 bit pattern: up with probability (the dropped bits) / 2^16, using the low
 * 16 bits of `rnd`. NaN becomes 0x7fc0; inf stays inf (adding below its mantissa keeps it). */
LLMMEM_HD uint16_t llmmem_bf16_stochastic(float x, uint32_t rnd) {
  uint32_t u = llmmem_q_bits(x);
  uint32_t r = (u + (rnd & 0xffffu)) >> 16;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : r);
}

/* x rounded to the nearest bf16, ties to even (as half.h, written here for the device too). */
LLMMEM_HD uint16_t llmmem_bf16_nearest(float x) {
  uint32_t u = llmmem_q_bits(x);
  uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : r);
}

LLMMEM_HD float llmmem_bf16_value(uint16_t h) { return llmmem_q_float((uint32_t)h << 16); }

#endif /* LLMMEM_OPTIM_ADAMW_MATH_H */
