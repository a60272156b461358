/*
 * unscale_cpu.c — the CPU multi-tensor unscale + non-finite check (llmmem_scaler_unscale_check)
 * and its plain reference (llmmem_scaler_unscale_check_ref).
 *
 * All gradients of a call are one list that the threads claim in order, several small tensors
 * or a slice of a large one at a time (the machinery of unscale_pipe.c, here with the whole list
 * published at once), so a list of 4000 tiny tensors costs one spread of threads, not 4000. Each
 * element is read and written once. The threads are the process's OpenMP team when it has a
 * usable one (torch's; omp_team.c says when it is not used, e.g. in a child forked after llmmem
 * was loaded), else threads created per call and joined before returning. Without a usable thread
 * the work runs on the calling thread.
 *
 * What it does not do: strided tensors (ranges must be contiguous), or any allocation besides
 * the pipe (its address set: about 16 bytes per tensor) and thread stacks, and only with more
 * than one thread; when the pipe cannot be allocated everything runs on the calling thread.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <llmmem/amp.h>

#include "half.h"
#include "internal.h"
#include "scaler_internal.h"

#include "cpu_isa.h"

/* Below this many bytes per thread a second thread costs more than it saves: starting it takes
 * tens of microseconds, and it reads from a cold cache what the calling thread may have in its
 * own (on a 2-core VM one thread won up to 4 MiB in all, two from 6 MiB). */
#define MIN_BYTES_PER_THREAD ((size_t)3 << 20)

/* ---------------------------------------------------------------- loops, per instruction set */

/* The loops ask for memory STREAM_AHEAD bytes in front of where they work, STREAM_BLOCK bytes at a
 * time (see _llmmem_scaler_run_span for why). */
#define STREAM_AHEAD ((size_t)4096)
#define STREAM_BLOCK ((size_t)256)

static inline void prefetch_lines(const char *p, size_t bytes, int write) {
  for (size_t off = 0; off < bytes; off += 64) {
    if (write)
      __builtin_prefetch(p + off, 1, 3);
    else
      __builtin_prefetch(p + off, 0, 3);
  }
}

#define LOOP_SUFFIX _generic
#define LOOP_TARGET
#define LOOP_F16C 0
#include "unscale_loops.h"
#undef LOOP_SUFFIX
#undef LOOP_TARGET
#undef LOOP_F16C

#if LLMMEM_HAVE_X86_DISPATCH
#define LOOP_SUFFIX _avx2
#define LOOP_TARGET __attribute__((target("avx2,f16c")))
#define LOOP_F16C   1
#include "unscale_loops.h"
#undef LOOP_SUFFIX
#undef LOOP_TARGET
#undef LOOP_F16C

/* 64-byte vectors: worth it where the core can keep two 512-bit loads in flight per cycle. */
#define LOOP_SUFFIX _avx512
#if defined(__clang__) /* clang's target attribute has no prefer-vector-width; it picks widths itself */
#define LOOP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c")))
#else
#define LOOP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c,prefer-vector-width=512")))
#endif
#define LOOP_F16C 1
#include "unscale_loops.h"
#undef LOOP_SUFFIX
#undef LOOP_TARGET
#undef LOOP_F16C
#endif

/* -1: pick by CPU; else the ISA level the tests force (see _llmmem_scaler_force_isa). */
static int forced_isa = -1;

int _llmmem_scaler_force_isa(int isa) {
  forced_isa = isa;
  return _llmmem_cpu_isa_pick(isa);
}

_llmmem_scaler_range_fn _llmmem_scaler_pick_range_fn(void) {
  int isa = _llmmem_cpu_isa_pick(forced_isa);
#if LLMMEM_HAVE_X86_DISPATCH
  if (isa == 2) return run_range_avx512;
  if (isa == 1) return run_range_avx2;
#endif
  (void)isa;
  return run_range_generic;
}

/* ---------------------------------------------------------------- shared argument checks */

LLMMEM_API size_t llmmem_scaler_dtype_size(int32_t dtype) {
  switch (dtype) {
    case LLMMEM_SCALER_F32: return 4;
    case LLMMEM_SCALER_F16: return 2;
    case LLMMEM_SCALER_BF16: return 2;
    case LLMMEM_SCALER_F64: return 8;
    default: return 0;
  }
}

LLMMEM_API llmmem_status_t llmmem_scaler_inv_scale(float scale, float *inv_scale) {
  LLMMEM_CHECK_ARG(inv_scale != NULL, "llmmem_scaler_inv_scale: inv_scale must not be NULL");
  /* torch: scale.double().reciprocal().float(), because an fp32 division can be imprecise. */
  *inv_scale = (float)(1.0 / (double)scale);
  return LLMMEM_OK;
}

/* The multiplier: 1 (check only) without a scale, the scale's fp64 reciprocal, or the given inverse. */
llmmem_status_t _llmmem_scaler_resolve_inv(const float *scale, int scale_is_inverse, float *inv) {
  *inv = 1.0f;
  if (!scale) return LLMMEM_OK;
  if (scale_is_inverse) {
    *inv = *scale;
    return LLMMEM_OK;
  }
  return llmmem_scaler_inv_scale(*scale, inv);
}

llmmem_status_t _llmmem_scaler_check_tensors(const char *fn, const llmmem_scaler_tensor_t *tensors, size_t count,
                                             const float *found_inf, const uint8_t *tensor_flags, size_t n_flags,
                                             size_t *total_bytes) {
  LLMMEM_CHECK_ARG(tensors != NULL || count == 0, "%s: tensors is NULL but count is %zu", fn, count);
  LLMMEM_CHECK_ARG(found_inf != NULL, "%s: found_inf must not be NULL", fn);
  size_t total = 0;
  for (size_t i = 0; i < count; i++) {
    const llmmem_scaler_tensor_t *t = &tensors[i];
    size_t es = llmmem_scaler_dtype_size(t->dtype);
    LLMMEM_CHECK_ARG(es != 0, "%s: tensors[%zu].dtype %d is not a gradient dtype (0=f32 1=f16 2=bf16 3=f64)", fn, i,
                     (int)t->dtype);
    LLMMEM_CHECK_ARG(t->numel >= 0, "%s: tensors[%zu].numel is negative (%lld)", fn, i, (long long)t->numel);
    LLMMEM_CHECK_ARG(t->data != NULL || t->numel == 0, "%s: tensors[%zu].data is NULL with numel %lld", fn, i,
                     (long long)t->numel);
    LLMMEM_CHECK_ARG((uint64_t)t->numel <= (SIZE_MAX - total) / es, "%s: tensors[%zu] makes the total size overflow",
                     fn, i);
    LLMMEM_CHECK_ARG(((uintptr_t)t->data % es) == 0, "%s: tensors[%zu].data is not aligned to its %zu-byte elements",
                     fn, i, es);
    if (tensor_flags != NULL)
      LLMMEM_CHECK_ARG(t->flag >= 0 && (size_t)t->flag < n_flags,
                       "%s: tensors[%zu].flag %d is outside tensor_flags (n_flags %zu)", fn, i, (int)t->flag, n_flags);
    total += (size_t)t->numel * es;
  }
  *total_bytes = total;
  return LLMMEM_OK;
}

/* ---------------------------------------------------------------- reference */

LLMMEM_API llmmem_status_t llmmem_scaler_unscale_check_ref(const llmmem_scaler_tensor_t *tensors, size_t count,
                                                           const float *scale, int scale_is_inverse, float *found_inf,
                                                           uint8_t *tensor_flags, size_t n_flags) {
  size_t total;
  LLMMEM_TRY(_llmmem_scaler_check_tensors("llmmem_scaler_unscale_check_ref", tensors, count, found_inf, tensor_flags,
                                          n_flags, &total));
  float inv = 1.0f;
  LLMMEM_TRY(_llmmem_scaler_resolve_inv(scale, scale_is_inverse, &inv));
  const int write = inv != 1.0f; /* torch leaves values untouched when inv_scale == 1 */
  for (size_t i = 0; i < count; i++) {
    const llmmem_scaler_tensor_t *t = &tensors[i];
    int bad = 0;
    for (int64_t k = 0; k < t->numel; k++) {
      switch (t->dtype) {
        case LLMMEM_SCALER_F32: {
          float *p = (float *)t->data + k;
          if (!isfinite(*p)) bad = 1;
          if (write) *p = *p * inv;
          break;
        }
        case LLMMEM_SCALER_F64: {
          double *p = (double *)t->data + k;
          if (!isfinite(*p)) bad = 1;
          if (write) *p = *p * (double)inv;
          break;
        }
        case LLMMEM_SCALER_BF16: {
          uint16_t *p = (uint16_t *)t->data + k;
          float v = llmmem_bf16_to_f32(*p);
          if (!isfinite(v)) bad = 1;
          if (write) *p = llmmem_f32_to_bf16(v * inv);
          break;
        }
        default: {
          uint16_t *p = (uint16_t *)t->data + k;
          float v = llmmem_f16_to_f32(*p);
          if (!isfinite(v)) bad = 1;
          if (write) *p = llmmem_f32_to_f16(v * inv);
          break;
        }
      }
    }
    if (bad) {
      *found_inf = 1.0f;
      if (tensor_flags) tensor_flags[t->flag] = 1;
    }
  }
  return LLMMEM_OK;
}

/* ---------------------------------------------------------------- threaded fast path */

/* Bytes of tensor i inside the span [from, to), and (in *lo) the element it starts at there. */
static size_t bytes_in_span(const llmmem_scaler_tensor_t *tensors, size_t i, _llmmem_scaler_pos_t from,
                            _llmmem_scaler_pos_t to, int64_t *lo) {
  *lo = i == from.tensor ? from.offset : 0;
  int64_t hi = i == to.tensor ? to.offset : tensors[i].numel;
  return hi > *lo ? (size_t)(hi - *lo) * llmmem_scaler_dtype_size(tensors[i].dtype) : 0;
}

/* Asks for the first STREAM_AHEAD bytes of tensor i's part of the span; returns that part's bytes. */
static size_t prefetch_head(const llmmem_scaler_tensor_t *tensors, size_t i, _llmmem_scaler_pos_t from,
                            _llmmem_scaler_pos_t to, int write) {
  int64_t lo;
  size_t bytes = bytes_in_span(tensors, i, from, to, &lo);
  if (!bytes) return 0; /* data may be NULL (numel 0): no address is formed from it, not even NULL + 0 */
  const char *p = (const char *)tensors[i].data + (size_t)lo * llmmem_scaler_dtype_size(tensors[i].dtype);
  prefetch_lines(p, bytes < STREAM_AHEAD ? bytes : STREAM_AHEAD, write);
  return bytes;
}

/* Runs the span asking for memory ahead of the loops. A core streams from memory at the rate of
 * the misses it keeps in flight, and on its own it keeps few where the stream breaks: at every
 * 4 KiB page (the hardware prefetcher stops there, and the next page starts with a TLB miss) and
 * at every tensor (small gradients lie scattered over the heap). So the loops ask for each
 * tensor's memory STREAM_AHEAD bytes before they reach it (the next page), and here each tensor's
 * first STREAM_AHEAD bytes are asked for before the tensors in front of it are done: at least one
 * tensor ahead, more while they are small. Lists of many small tensors gain most, large tensors
 * too (the page breaks): see benchmarks/README.md. */
int _llmmem_scaler_run_span(const llmmem_scaler_tensor_t *tensors, _llmmem_scaler_pos_t from, _llmmem_scaler_pos_t to,
                            float inv, int write, uint8_t *flags, _llmmem_scaler_range_fn run) {
  int found = 0;
  const size_t end = to.offset > 0 ? to.tensor + 1 : to.tensor; /* tensors [from.tensor, end) take part */
  size_t next = from.tensor; /* the first tensor whose first bytes are not asked for yet */
  size_t gap = 0;            /* bytes of the tensors between the current one and `next` */
  for (size_t i = from.tensor; i < end; i++) {
    const llmmem_scaler_tensor_t *t = &tensors[i];
    int64_t lo;
    size_t bytes = bytes_in_span(tensors, i, from, to, &lo);
    if (next <= i) { /* the span's first tensor */
      (void)prefetch_head(tensors, i, from, to, write);
      next = i + 1;
      gap = 0;
    } else {
      gap -= bytes;
    }
    for (; next < end && gap < STREAM_AHEAD; next++) gap += prefetch_head(tensors, next, from, to, write);
    if (bytes && run(t, lo, (int64_t)(bytes / llmmem_scaler_dtype_size(t->dtype)), inv, write)) {
      found = 1;
      if (flags) __atomic_store_n(&flags[t->flag], (uint8_t)1, __ATOMIC_RELAXED);
    }
  }
  return found;
}

LLMMEM_API llmmem_status_t llmmem_scaler_unscale_check(const llmmem_scaler_tensor_t *tensors, size_t count,
                                                       const float *scale, int scale_is_inverse, float *found_inf,
                                                       uint8_t *tensor_flags, size_t n_flags, int num_threads) {
  size_t total;
  LLMMEM_TRY(_llmmem_scaler_check_tensors("llmmem_scaler_unscale_check", tensors, count, found_inf, tensor_flags,
                                          n_flags, &total));
  LLMMEM_CHECK_ARG(num_threads >= 0, "llmmem_scaler_unscale_check: num_threads must be >= 0, got %d", num_threads);
  if (count == 0 || total == 0) return LLMMEM_OK;
  float inv = 1.0f;
  LLMMEM_TRY(_llmmem_scaler_resolve_inv(scale, scale_is_inverse, &inv));

  /* never more threads than CPUs to run them: this is memory traffic, more would take turns */
  const size_t cpus = (size_t)_llmmem_online_cpus();
  size_t nt = num_threads > 0 && (size_t)num_threads < cpus ? (size_t)num_threads : cpus;
  size_t by_size = total / MIN_BYTES_PER_THREAD;
  if (nt > by_size) nt = by_size;
  if (nt < 1) nt = 1;

  /* The threads claim the list in order, piece by piece (unscale_pipe.c), rather than each taking a
   * fixed share of it. Fixed shares assume every byte costs the same, but the part of the list
   * still in cache (backward wrote it last) goes several times faster than the rest, and a thread
   * can lose its CPU for a while: one thread then waits for the other. Claimed in pieces, they
   * finish together. */
  /* The threads are the process's OpenMP team when it has one (torch's: see omp_team.c), else
   * threads the pipe starts. */
  size_t done = 0; /* tensors [0, done) went through the pipe */
  llmmem_scaler_pipe_t *pipe = NULL;
  const int team = nt > 1 && _llmmem_omp_team_usable();
  if (nt > 1 && llmmem_scaler_pipe_start(tensors, count, scale, scale_is_inverse, tensor_flags, n_flags,
                                         team ? 0 : (int)nt - 1, &pipe) == LLMMEM_OK) {
    _llmmem_scaler_pipe_publish_checked(pipe, count, &done);     /* the tensors were checked above */
    if (team) (void)_llmmem_scaler_pipe_drain_on_team(pipe, nt); /* not run: finish drains it here */
    LLMMEM_TRY(llmmem_scaler_pipe_finish(pipe, found_inf));
  }
  if (done < count) {
    /* On this thread, in order: the whole list (one thread, or no memory for the pipe), or what
     * follows tensor `done`, which repeats an earlier one's memory: the pipe took the list up to
     * it and has finished, so every listing is unscaled, one after the other. */
    _llmmem_scaler_pos_t from = {done, 0}, to = {count - 1, tensors[count - 1].numel};
    if (_llmmem_scaler_run_span(tensors, from, to, inv, inv != 1.0f, tensor_flags, _llmmem_scaler_pick_range_fn()))
      *found_inf = 1.0f;
  }
  return LLMMEM_OK;
}
