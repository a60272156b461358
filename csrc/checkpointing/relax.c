/*
 * relax.c — the DP's inner loop (relax.h), compiled for several vector levels and picked at run time.
 */
#include "relax.h"

#include "cpu_isa.h"

#define STRETCH PLAN_RELAX_STRETCH

#define RELAX_BODY                                                                                 \
  {                                                                                                \
    /* index j = m - shift into a and b; bs = best shifted the same way (shift <= lo, so valid) */ \
    float *bs = best + shift;                                                                      \
    const int64_t jend = hi - shift;                                                               \
    for (int64_t j0 = lo - shift, j1; j0 < jend; j0 = j1) {                                        \
      const int64_t t = j0 / STRETCH;                                                              \
      float floor_v;                                                                               \
      j1 = (t + 1) * STRETCH;                                                                      \
      if (j1 <= jend) {                                                                            \
        floor_v = c + ca[t] + cb[t]; /* = c + a[j1 - 1] + b[j1 - 1] */                             \
      } else {                                                                                     \
        j1 = jend;                                                                                 \
        floor_v = c + a[j1 - 1] + b[j1 - 1];                                                       \
      }                                                                                            \
      if (!(floor_v < bs[j0])) continue; /* cannot improve any slot of the stretch */              \
      for (int64_t j = j0; j < j1; j++) {                                                          \
        const float v = c + a[j] + b[j];                                                           \
        bs[j] = v < bs[j] ? v : bs[j]; /* a min the compiler vectorises (no NaN here) */           \
      }                                                                                            \
    }                                                                                              \
  }

static void relax_c(float *restrict best, const float *restrict a, const float *restrict b, const float *ca,
                    const float *cb, float c, int64_t shift, int64_t lo, int64_t hi) RELAX_BODY
#if LLMMEM_HAVE_X86_DISPATCH
    __attribute__((target("avx2"))) static void relax_avx2(float *restrict best, const float *restrict a,
                                                           const float *restrict b, const float *ca, const float *cb,
                                                           float c, int64_t shift, int64_t lo, int64_t hi) RELAX_BODY

#if defined(__clang__)
    __attribute__((target("avx512f,avx512vl,avx2")))
#else
    __attribute__((target("avx512f,avx512vl,avx2,prefer-vector-width=512")))
#endif
    static void relax_avx512(float *restrict best, const float *restrict a, const float *restrict b, const float *ca,
                             const float *cb, float c, int64_t shift, int64_t lo, int64_t hi) RELAX_BODY
#endif

    plan_relax_fn plan_relax_pick(int forced) {
  const int isa = _llmmem_cpu_isa_pick(forced);
#if LLMMEM_HAVE_X86_DISPATCH
  if (isa == LLMMEM_ISA_AVX512) return relax_avx512;
  if (isa == LLMMEM_ISA_AVX2) return relax_avx2;
#endif
  (void)isa;
  return relax_c;
}
