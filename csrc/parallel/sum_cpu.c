/*
 * sum_cpu.c — the fast CPU sum the shared-memory collectives use: the loops of sum_loops.h
 * compiled for plain C, AVX2+F16C and AVX-512, picked at run time by what the CPU has.
 *
 * Every variant gives the bits of the reference (sum_ref.c: fp32 accumulation in source order,
 * one rounding), which the tests check for each variant. Why it matters: in the two-shot
 * all-reduce the reduce step is the longest one for 256 KiB .. 1 MiB messages, and the plain
 * build (baseline x86-64, SSE2) reads and writes at about 2/3 of the speed of the AVX variants.
 * What it does not do: threads (one rank = one thread; the ranks are the parallelism).
 */
#include <stdint.h>
#include <string.h>

#include <llmmem/parallel.h>

#include "half.h"
#include "internal.h"
#include "shm_internal.h"

#include "cpu_isa.h"

enum { SUM_BLOCK = 512 }; /* elements per block: 2 KiB of fp32 accumulator, stays in L1 */

#define LOOP_SUFFIX _generic
#define LOOP_TARGET
#define LOOP_F16C 0
#include "sum_loops.h"
#undef LOOP_SUFFIX
#undef LOOP_TARGET
#undef LOOP_F16C

#if LLMMEM_HAVE_X86_DISPATCH
#define LOOP_SUFFIX _avx2
#define LOOP_TARGET __attribute__((target("avx2,f16c")))
#define LOOP_F16C   1
#include "sum_loops.h"
#undef LOOP_SUFFIX
#undef LOOP_TARGET
#undef LOOP_F16C

#define LOOP_SUFFIX _avx512
#if defined(__clang__) /* clang's target attribute has no prefer-vector-width */
#define LOOP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c")))
#else
#define LOOP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c,prefer-vector-width=512")))
#endif
#define LOOP_F16C 1
#include "sum_loops.h"
#undef LOOP_SUFFIX
#undef LOOP_TARGET
#undef LOOP_F16C
#endif

/* -1: pick by CPU; else the level the tests force (see _llmmem_comm_force_isa). */
static _Atomic int forced_isa = -1;

int _llmmem_comm_force_isa(int isa) {
  forced_isa = isa;
  return _llmmem_cpu_isa_pick(isa);
}

void _llmmem_comm_sum2(const void *const *srcs, int nsrc, void *out, void *out2, size_t count,
                       llmmem_comm_dtype_t dtype) {
  int isa = _llmmem_cpu_isa_pick(forced_isa);
#if LLMMEM_HAVE_X86_DISPATCH
  if (isa == 2) {
    sum_avx512(srcs, nsrc, out, out2, count, dtype);
    return;
  }
  if (isa == 1) {
    sum_avx2(srcs, nsrc, out, out2, count, dtype);
    return;
  }
#endif
  (void)isa;
  sum_generic(srcs, nsrc, out, out2, count, dtype);
}

void _llmmem_comm_sum(const void *const *srcs, int nsrc, void *out, size_t count, llmmem_comm_dtype_t dtype) {
  _llmmem_comm_sum2(srcs, nsrc, out, NULL, count, dtype);
}
