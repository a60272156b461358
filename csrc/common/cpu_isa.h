/*
 * cpu_isa.h — which vector instruction set the CPU kernels may use, decided at run time.
 *
 * The kernels are compiled for several levels (function target attributes) and pick one per call,
 * so one binary runs everywhere and still uses AVX2/AVX-512 where the CPU has them. Tests force a
 * lower level to compare every variant against the portable C reference.
 */
#ifndef LLMMEM_CPU_ISA_H
#define LLMMEM_CPU_ISA_H

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LLMMEM_HAVE_X86_DISPATCH 1
#else
#define LLMMEM_HAVE_X86_DISPATCH 0
#endif

/* Vector levels, in increasing order. */
enum { LLMMEM_ISA_C = 0, LLMMEM_ISA_AVX2 = 1 /* with F16C */, LLMMEM_ISA_AVX512 = 2 /* F, BW, VL */ };

/* The best level this CPU runs (LLMMEM_ISA_C off x86-64). */
int _llmmem_cpu_best_isa(void);

/* The level to run: `forced` (a test's choice; -1 means automatic) capped at what the CPU has. */
static inline int _llmmem_cpu_isa_pick(int forced) {
  int best = _llmmem_cpu_best_isa();
  return forced < 0 || forced > best ? best : forced;
}

#endif /* LLMMEM_CPU_ISA_H */
