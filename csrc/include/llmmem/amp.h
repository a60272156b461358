/*
 * amp.h — the C ABI of llmmem's dynamic loss scaler: a multi-tensor "unscale + non-finite
 * check" pass over gradients, and the scale update, on the CPU and (when built) on CUDA.
 *
 * The semantics are those of PyTorch's `_amp_foreach_non_finite_check_and_unscale_` and
 * `_amp_update_scale_`, so results are bitwise equal to torch's CPU path:
 *   inv_scale = (float)(1.0 / (double)scale)      (the reciprocal is taken in fp64, then rounded)
 *   per element v:  if !isfinite(v) -> found;  v = (float-or-double)v * inv_scale, rounded back to
 *   the gradient's dtype (fp16/bf16 compute in fp32, fp64 in fp64). Non-finite elements are
 *   multiplied too: nothing is skipped. When inv_scale == 1 nothing is written (a pure check).
 *
 * What this header does not do: allocate, own or track tensors. Callers hand over pointers to
 * contiguous element ranges; strided views are the caller's business (the Python layer copies).
 * Plain C11, no Python and no PyTorch.
 */
#ifndef LLMMEM_SCALER_H
#define LLMMEM_SCALER_H

#include <llmmem/llmmem.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Gradient element types. The values are part of the ABI (the Python layer maps torch dtypes). */
typedef enum llmmem_scaler_dtype_e {
  LLMMEM_SCALER_F32 = 0,
  LLMMEM_SCALER_F16 = 1,
  LLMMEM_SCALER_BF16 = 2,
  LLMMEM_SCALER_F64 = 3,
  LLMMEM_SCALER_DTYPE_COUNT_ = 4
} llmmem_scaler_dtype_t;

/* One gradient: `numel` contiguous elements of `dtype` starting at `data`. */
typedef struct llmmem_scaler_tensor_s {
  void *data;    /* first element; may be NULL only when numel == 0 */
  int64_t numel; /* elements, not bytes; >= 0 */
  int32_t dtype; /* an llmmem_scaler_dtype_t */
  int32_t flag;  /* index into tensor_flags this tensor reports to (several tensors may share one) */
} llmmem_scaler_tensor_t;

/* Bytes per element of `dtype`, 0 for an unknown code. */
LLMMEM_API size_t llmmem_scaler_dtype_size(int32_t dtype);

/* The inverse scale exactly as torch computes it: (float)(1.0 / (double)scale). */
LLMMEM_API llmmem_status_t llmmem_scaler_inv_scale(float scale, float *inv_scale);

/*
 * CPU multi-tensor unscale + non-finite check, one pass per gradient, spread over threads.
 *
 *   scale         pointer to the current scale, or NULL for a check only (inv_scale = 1, no writes)
 *   scale_is_inverse  0: *scale is the scale and inv_scale = (float)(1.0 / (double)*scale);
 *                 1: *scale already is the inverse (torch's _unscale_grads_ contract, used by subclasses)
 *   found_inf     set to 1.0f when any element of any tensor is inf or NaN; never cleared (the
 *                 caller zeroes it, as with torch)
 *   tensor_flags  NULL, or an array of n_flags bytes: flags[t.flag] is set to 1 when tensor t has a
 *                 non-finite element; never cleared. Every t.flag must be < n_flags.
 *   num_threads   0 = the CPUs this process may run on, and never more than those; small inputs
 *                 use fewer threads (spawning a thread costs more than checking a few hundred KB).
 * The call blocks until done. Tensors must not overlap, except that one tensor may be listed more
 * than once (its data pointer repeated): it is then processed once per listing, in order, as torch
 * does (the threads share the list up to the first repeated address; the rest runs in order on
 * the calling thread once they are done).
 */
LLMMEM_API llmmem_status_t llmmem_scaler_unscale_check(const llmmem_scaler_tensor_t *tensors, size_t count,
                                                       const float *scale, int scale_is_inverse, float *found_inf,
                                                       uint8_t *tensor_flags, size_t n_flags, int num_threads);

/*
 * The same CPU unscale + check over a tensor list that is still being written: worker threads
 * work on the tensors published so far while the caller describes the next ones. This overlaps
 * the caller's per-tensor cost of finding its tensors (for Python, reading thousands of gradient
 * attributes) with the memory traffic of the unscale. Results equal llmmem_scaler_unscale_check's.
 *
 *   start    tensors: the caller's array of `capacity` entries, filled in order; scale,
 *            scale_is_inverse, tensor_flags, n_flags as above; workers: at most this many threads
 *            besides the caller, started as the published bytes grow and never more than the
 *            online CPUs less one (0 = none: everything runs in finish).
 *   publish  tensors[0, count) are complete and checked here (as llmmem_scaler_unscale_check does;
 *            on an error nothing more is published); workers may start on them at once, so the
 *            caller must not change them afterwards. count never decreases; count <= capacity.
 *            A tensor whose data pointer was published before is not published, nor anything
 *            after it: its two listings could run at once. *published (if not NULL) is how many
 *            are published now; less than count means tensors[*published] repeats one.
 *   finish   the caller works too until every published tensor is done, then joins the workers,
 *            sets *found_inf to 1.0f if any element was inf/NaN, and frees the pipe. Must be called
 *            exactly once after a successful start, also when the caller gives up early: the work
 *            already published is always completed (it may have begun).
 */
typedef struct llmmem_scaler_pipe_s llmmem_scaler_pipe_t;
/* *uses_openmp = 1 when llmmem_scaler_unscale_check, called now from this thread on a list big
 * enough for more than one thread, would run them on the process's OpenMP team: an OpenMP runtime
 * with the GNU entry points is loaded (as torch's libgomp is), this thread is not inside an active
 * parallel region, the process is not a child forked after llmmem was loaded, and the runtime's
 * default team size is 2 or more. 0: on threads of llmmem's own. The pipe always uses its own. */
LLMMEM_API llmmem_status_t llmmem_scaler_cpu_workers(int *uses_openmp);

LLMMEM_API llmmem_status_t llmmem_scaler_pipe_start(const llmmem_scaler_tensor_t *tensors, size_t capacity,
                                                    const float *scale, int scale_is_inverse, uint8_t *tensor_flags,
                                                    size_t n_flags, int workers, llmmem_scaler_pipe_t **out);
LLMMEM_API llmmem_status_t llmmem_scaler_pipe_publish(llmmem_scaler_pipe_t *pipe, size_t count, size_t *published);
LLMMEM_API llmmem_status_t llmmem_scaler_pipe_finish(llmmem_scaler_pipe_t *pipe, float *found_inf);

/* The plain scalar reference of the above (one thread, no vector code): the oracle of the tests. */
LLMMEM_API llmmem_status_t llmmem_scaler_unscale_check_ref(const llmmem_scaler_tensor_t *tensors, size_t count,
                                                           const float *scale, int scale_is_inverse, float *found_inf,
                                                           uint8_t *tensor_flags, size_t n_flags);

/* Scale-update rule. With hysteresis == 1 and min_scale == 0 it is torch's _amp_update_scale_. */
typedef struct llmmem_scaler_config_s {
  double growth_factor;         /* > 1 */
  double backoff_factor;        /* in (0, 1) */
  int64_t growth_interval;      /* >= 1: consecutive finite steps before the scale grows */
  int32_t hysteresis;           /* >= 1: back off only after this many consecutive non-finite steps */
  float min_scale;              /* >= 0; 0 = no floor. The scale never backs off below it. */
  int32_t hysteresis_on_growth; /* 0: any finite step refills the hysteresis budget ("consecutive",
                                   apex); 1: only a growth of the scale does (Megatron-LM, DeepSpeed's
                                   default). Last, so initialisers without it mean 0. */
} llmmem_scaler_config_t;

/* Counters kept next to the scale (int64 each), in this order. */
enum {
  LLMMEM_SCALER_STAT_UPDATES = 0,      /* update() calls that consumed found_inf */
  LLMMEM_SCALER_STAT_SKIPPED = 1,      /* of those, how many found inf/NaN (a skipped step) */
  LLMMEM_SCALER_STAT_LAST_SKIPPED = 2, /* 1 if the latest update found inf/NaN, else 0 */
  LLMMEM_SCALER_STAT_MIN_HITS = 3,     /* backoffs that were clamped to min_scale */
  LLMMEM_SCALER_STAT_COUNT = 4
};

/*
 * One scale update on host memory. found = any(found_infs[i][0] != 0).
 *   found:     hysteresis_tracker -= 1 (not below 0); growth_tracker = 0; if the hysteresis tracker
 *              reached 0: scale = (float)(scale * backoff_factor), raised to min_scale if below it.
 *   not found: hysteresis_tracker = hysteresis (unless cfg->hysteresis_on_growth); successful =
 *              growth_tracker + 1; if successful == growth_interval: scale = (float)(scale *
 *              growth_factor) if that is finite, tracker = 0, and with cfg->hysteresis_on_growth
 *              hysteresis_tracker = hysteresis; else growth_tracker = successful.
 * `hysteresis_tracker` and `stats` (LLMMEM_SCALER_STAT_COUNT int64) may be NULL when
 * cfg->hysteresis == 1 / when counters are not wanted.
 */
LLMMEM_API llmmem_status_t llmmem_scaler_update(float *scale, int32_t *growth_tracker, int32_t *hysteresis_tracker,
                                                int64_t *stats, const float *const *found_infs, size_t n_found,
                                                const llmmem_scaler_config_t *cfg);

/* Validates a config (the CUDA path calls this on the host before launching). */
LLMMEM_API llmmem_status_t llmmem_scaler_config_check(const llmmem_scaler_config_t *cfg);

/*
 * CUDA versions. All pointers are device pointers on `device`; `stream` is a cudaStream_t (0 = the
 * legacy default stream). Nothing synchronises with the host: the work is queued on `stream`.
 *
 * unscale_check_cuda: one launch per dtype group (more only past LLMMEM_SCALER_CUDA_MAX_TENSORS
 * tensors of one dtype); `tensors` itself is host memory, read before the call returns.
 * `scale` NULL = check only. found_inf / tensor_flags as for the CPU version.
 * Without a CUDA build these return LLMMEM_ERR_NOT_BUILT.
 */
#define LLMMEM_SCALER_CUDA_MAX_TENSORS 1024
#define LLMMEM_SCALER_CUDA_MAX_FOUND   16

LLMMEM_API llmmem_status_t llmmem_scaler_unscale_check_cuda(const llmmem_scaler_tensor_t *tensors, size_t count,
                                                            const float *scale, int scale_is_inverse, float *found_inf,
                                                            uint8_t *tensor_flags, size_t n_flags, int device,
                                                            void *stream);

/* Device-side update: one tiny kernel, same rule as llmmem_scaler_update. n_found <= LLMMEM_SCALER_CUDA_MAX_FOUND. */
LLMMEM_API llmmem_status_t llmmem_scaler_update_cuda(float *scale, int32_t *growth_tracker,
                                                     int32_t *hysteresis_tracker, int64_t *stats,
                                                     const float *const *found_infs, size_t n_found,
                                                     const llmmem_scaler_config_t *cfg, int device, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* LLMMEM_SCALER_H */
