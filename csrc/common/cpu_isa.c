/*
 * cpu_isa.c — run-time detection of the CPU's vector instruction sets (see cpu_isa.h).
 */
#include "cpu_isa.h"

int _llmmem_cpu_best_isa(void) {
#if LLMMEM_HAVE_X86_DISPATCH
  __builtin_cpu_init();
#if defined(__clang__) /* older clang cannot query f16c; every AVX2 CPU has it (since Ivy Bridge) */
  int avx2 = __builtin_cpu_supports("avx2");
#else
  int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#endif
  int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
  return avx512 ? LLMMEM_ISA_AVX512 : avx2 ? LLMMEM_ISA_AVX2 : LLMMEM_ISA_C;
#else
  return LLMMEM_ISA_C;
#endif
}
