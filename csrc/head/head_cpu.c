/*
 * head_cpu.c — the LM head's passes on the CPU (llmmem_head_stats, llmmem_head_grad): rows spread
 * over threads (each claims the next row), each row run by the vector loops of head_loops.h for
 * the best instruction set this CPU has. Agrees with head_ref.c to a few ulp (a polynomial exp).
 */
#include <math.h>
#include <stdint.h>

#include "cpu_isa.h"
#include "cpu_threads.h"
#include "half.h"
#include "head_internal.h"
#include "internal.h"

#define BLOCK 2048 /* elements of a row widened at a time: 8 KiB of fp32, in L1 */
/* A second thread pays for itself from about this many logits in all */
#define MIN_ELEMENTS_PER_THREAD ((int64_t)1 << 18)

#define LOOP_SUFFIX _generic
#define LOOP_TARGET
#include "head_loops.h"
#undef LOOP_SUFFIX
#undef LOOP_TARGET

#if LLMMEM_HAVE_X86_DISPATCH
#define LOOP_SUFFIX _avx2
#define LOOP_TARGET __attribute__((target("avx2,f16c")))
#include "head_loops.h"
#undef LOOP_SUFFIX
#undef LOOP_TARGET

#define LOOP_SUFFIX _avx512
#if defined(__clang__)
#define LOOP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c")))
#else
#define LOOP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c,prefer-vector-width=512")))
#endif
#include "head_loops.h"
#undef LOOP_SUFFIX
#undef LOOP_TARGET
#endif

static int forced_isa = -1;

/* Test hook (not exported): 0 = plain C, 1 = AVX2, 2 = AVX-512, -1 = automatic. */
int _llmmem_head_force_isa(int isa);
int _llmmem_head_force_isa(int isa) {
  forced_isa = isa;
  return _llmmem_cpu_isa_pick(isa);
}

typedef struct {
  const llmmem_head_chunk_t *c;
  float *a, *b, *d, *e; /* stats: max, sum, target, zsum; grad: lse (a), scale (b) */
  uint8_t *has;
  int isa, grad;
  int64_t next; /* the next unclaimed row (atomic) */
} job_t;

static void run_row(const job_t *j, int64_t i) {
#if LLMMEM_HAVE_X86_DISPATCH
  if (j->isa == LLMMEM_ISA_AVX512) {
    if (j->grad)
      grad_row_avx512(j->c, i, j->a, j->b);
    else
      stats_row_avx512(j->c, i, j->a, j->b, j->d, j->e, j->has);
    return;
  }
  if (j->isa == LLMMEM_ISA_AVX2) {
    if (j->grad)
      grad_row_avx2(j->c, i, j->a, j->b);
    else
      stats_row_avx2(j->c, i, j->a, j->b, j->d, j->e, j->has);
    return;
  }
#endif
  if (j->grad)
    grad_row_generic(j->c, i, j->a, j->b);
  else
    stats_row_generic(j->c, i, j->a, j->b, j->d, j->e, j->has);
}

static void work(void *arg) {
  job_t *j = arg;
  for (;;) {
    int64_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
    if (i >= j->c->rows) return;
    run_row(j, i);
  }
}

static void run(job_t *j, int num_threads) {
  size_t nt = num_threads > 0 ? (size_t)num_threads : (size_t)_llmmem_online_cpus();
  const int64_t by_size = j->c->rows * j->c->vocab / MIN_ELEMENTS_PER_THREAD;
  if ((int64_t)nt > by_size) nt = by_size > 1 ? (size_t)by_size : 1;
  if ((int64_t)nt > j->c->rows) nt = (size_t)j->c->rows;
  if (nt <= 1)
    work(j);
  else
    _llmmem_cpu_parallel(work, j, nt);
}

LLMMEM_API llmmem_status_t llmmem_head_stats(const llmmem_head_chunk_t *c, float *row_max, float *row_sum,
                                             float *row_target, float *row_zsum, uint8_t *row_has_target,
                                             int num_threads) {
  LLMMEM_TRY(_llmmem_head_check("llmmem_head_stats", c, 1));
  LLMMEM_CHECK_ARG(num_threads >= 0, "llmmem_head_stats: num_threads must be >= 0, got %d", num_threads);
  if (c->rows == 0) return LLMMEM_OK;
  LLMMEM_CHECK_ARG(row_max && row_sum && row_target && row_zsum,
                   "llmmem_head_stats: row_max, row_sum, row_target and row_zsum must not be NULL");
  job_t j = {c, row_max, row_sum, row_target, row_zsum, row_has_target, _llmmem_cpu_isa_pick(forced_isa), 0, 0};
  run(&j, num_threads);
  return LLMMEM_OK;
}

LLMMEM_API llmmem_status_t llmmem_head_grad(const llmmem_head_chunk_t *c, const float *row_lse, const float *row_scale,
                                            int num_threads) {
  LLMMEM_TRY(_llmmem_head_check("llmmem_head_grad", c, 1));
  LLMMEM_CHECK_ARG(num_threads >= 0, "llmmem_head_grad: num_threads must be >= 0, got %d", num_threads);
  if (c->rows == 0) return LLMMEM_OK;
  LLMMEM_CHECK_ARG(row_lse && row_scale, "llmmem_head_grad: row_lse and row_scale must not be NULL");
  job_t j = {c, (float *)row_lse, (float *)row_scale, NULL, NULL, NULL, _llmmem_cpu_isa_pick(forced_isa), 1, 0};
  run(&j, num_threads);
  return LLMMEM_OK;
}
