/*
 * adamw_cpu.c — the CPU multi-tensor AdamW step (llmmem_optim_adamw_step): every tensor of the
 * list in one call, split into pieces that threads claim in order, each piece run by the vector
 * loops of adamw_loops.h for the best instruction set this CPU has.
 *
 * The call first checks everything (nothing is written on an error), then, on the calling thread,
 * increments each tensor's step and computes its scalars; the pieces only read those. A piece is
 * PIECE elements of one tensor (a multiple of any block size, so a block never spans two), or a
 * whole smaller tensor; threads claim pieces with one atomic add each, so a list of thousands of
 * small tensors costs one spread of threads, and one large tensor is shared by all of them.
 *
 * What it does not do: strided tensors, or allocate more than the piece table (16 bytes a tensor)
 * and the per-tensor scalars.
 */
#include <math.h>
#include <stdlib.h>

#include "cpu_isa.h"
#include "cpu_threads.h"
#include "half.h"
#include "internal.h"
#include "optim_internal.h"

#define PIECE ((int64_t)1 << 15) /* elements a thread claims at a time (a multiple of every block size) */
#define TILE  ((int64_t)512)     /* elements the unquantized formats update per loop: their buffers stay in L1 */
/* A second thread pays for itself from about this many elements in all (starting one costs tens
 * of microseconds; a thread streams about 1 M elements a millisecond). */
#define MIN_ELEMENTS_PER_THREAD ((int64_t)1 << 18)

typedef struct piece_job_s piece_job_t;
typedef void (*piece_fn)(const piece_job_t *, size_t, int64_t, int64_t);

struct piece_job_s {
  const llmmem_optim_tensor_t *tensors;
  const llmmem_optim_adamw_config_t *cfg;
  const llmmem_adamw_scalars_t *scalars; /* per tensor */
  const float *steps;                    /* per tensor: the step count after the increment */
  const int64_t *first_piece;            /* per tensor, and one past the last: a prefix sum */
  size_t count;
  int64_t pieces;
  int64_t next; /* the next unclaimed piece (atomic) */
  piece_fn run; /* the loops of the chosen instruction set */
};

#define LOOP_SUFFIX _generic
#define LOOP_TARGET
#define LOOP_F16C   0
#define LOOP_AVX512 0
#include "adamw_loops.h"
#undef LOOP_SUFFIX
#undef LOOP_TARGET
#undef LOOP_F16C
#undef LOOP_AVX512

#if LLMMEM_HAVE_X86_DISPATCH
#define LOOP_SUFFIX _avx2
#define LOOP_TARGET __attribute__((target("avx2,f16c")))
#define LOOP_F16C   1
#define LOOP_AVX512 0
#include "adamw_loops.h"
#undef LOOP_SUFFIX
#undef LOOP_TARGET
#undef LOOP_F16C
#undef LOOP_AVX512

#include "quant_avx512.h"

#define LOOP_SUFFIX _avx512
#if defined(__clang__)
#define LOOP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c")))
#else
#define LOOP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c,prefer-vector-width=512")))
#endif
#define LOOP_F16C   1
#define LOOP_AVX512 1
#include "adamw_loops.h"
#undef LOOP_SUFFIX
#undef LOOP_TARGET
#undef LOOP_F16C
#undef LOOP_AVX512
#endif

/* -1: pick by CPU; else the ISA level the tests force (see _llmmem_optim_force_isa). */
static int forced_isa = -1;

/* Test hook (not exported): 0 = plain C, 1 = AVX2+F16C, 2 = AVX-512, -1 = automatic; levels the
 * CPU lacks fall back to the best it has. Returns the level that will run. */
int _llmmem_optim_force_isa(int isa);
int _llmmem_optim_force_isa(int isa) {
  forced_isa = isa;
  return _llmmem_cpu_isa_pick(isa);
}

static piece_fn pick_piece_fn(void) {
  int isa = _llmmem_cpu_isa_pick(forced_isa);
#if LLMMEM_HAVE_X86_DISPATCH
  if (isa == LLMMEM_ISA_AVX512) return run_piece_avx512;
  if (isa == LLMMEM_ISA_AVX2) return run_piece_avx2;
#endif
  (void)isa;
  return run_piece_generic;
}

/* Claims pieces until none is left. */
static void work(void *arg) {
  piece_job_t *job = arg;
  size_t ti = 0;
  for (;;) {
    int64_t k = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
    if (k >= job->pieces) return;
    while (job->first_piece[ti + 1] <= k) ti++; /* claims only grow: the tensor index only moves on */
    const int64_t lo = (k - job->first_piece[ti]) * PIECE;
    const int64_t n = job->tensors[ti].numel - lo;
    job->run(job, ti, lo, lo + (n < PIECE ? n : PIECE));
  }
}

LLMMEM_API llmmem_status_t llmmem_optim_adamw_step(const llmmem_optim_tensor_t *tensors, size_t count,
                                                   const llmmem_optim_adamw_config_t *cfg, int num_threads) {
  int64_t total;
  LLMMEM_TRY(_llmmem_optim_check_step("llmmem_optim_adamw_step", tensors, count, cfg, &total));
  LLMMEM_CHECK_ARG(num_threads >= 0, "llmmem_optim_adamw_step: num_threads must be >= 0, got %d", num_threads);
  if (count == 0) return LLMMEM_OK;
  if (count > (SIZE_MAX - 1) / (sizeof(int64_t) + sizeof(float) + sizeof(llmmem_adamw_scalars_t)))
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_optim_adamw_step: too many tensors (%zu)", count);
  int64_t *first_piece = malloc((count + 1) * sizeof *first_piece);
  float *steps = malloc(count * sizeof *steps);
  llmmem_adamw_scalars_t *scalars = malloc(count * sizeof *scalars);
  if (!first_piece || !steps || !scalars) {
    free(first_piece), free(steps), free(scalars);
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_optim_adamw_step: no memory for %zu tensors' scalars", count);
  }
  /* from here on nothing fails: the steps move on together with the update */
  first_piece[0] = 0;
  for (size_t i = 0; i < count; i++) {
    steps[i] = *tensors[i].step + 1.0f;
    *tensors[i].step = steps[i];
    _llmmem_adamw_scalars(cfg, steps[i], &scalars[i]);
    first_piece[i + 1] = first_piece[i] + (tensors[i].numel + PIECE - 1) / PIECE;
  }
  piece_job_t job = {tensors, cfg, scalars, steps, first_piece, count, first_piece[count], 0, pick_piece_fn()};
  size_t nt = num_threads > 0 ? (size_t)num_threads : (size_t)_llmmem_online_cpus();
  const int64_t by_size = total / MIN_ELEMENTS_PER_THREAD;
  if ((int64_t)nt > by_size) nt = by_size > 1 ? (size_t)by_size : 1;
  if ((int64_t)nt > job.pieces) nt = (size_t)job.pieces;
  if (nt <= 1)
    work(&job);
  else
    _llmmem_cpu_parallel(work, &job, nt);
  free(first_piece), free(steps), free(scalars);
  return LLMMEM_OK;
}
