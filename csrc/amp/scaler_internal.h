/*
 * scaler_internal.h — what the files of csrc/scaler share (C and CUDA). Not part of the ABI.
 */
#ifndef LLMMEM_SCALER_INTERNAL_H
#define LLMMEM_SCALER_INTERNAL_H

#include <llmmem/amp.h>

#include "cpu_threads.h"

#ifdef __cplusplus
extern "C" {
#endif

/* unscale_cpu.c: checks the tensor list of `fn` (its name goes into the error detail); on success
 * *total_bytes is the bytes of all tensors together. Used by the CPU and the CUDA unscale. */
llmmem_status_t _llmmem_scaler_check_tensors(const char *fn, const llmmem_scaler_tensor_t *tensors, size_t count,
                                             const float *found_inf, const uint8_t *tensor_flags, size_t n_flags,
                                             size_t *total_bytes);

/* unscale_cpu.c: the unscale + check of elements [off, off + n) of one tensor, in the vector
 * loops this CPU runs best (or the level a test forced); nonzero when one of them is inf or NaN.
 * Writes x * inv when `write`. */
typedef int (*_llmmem_scaler_range_fn)(const llmmem_scaler_tensor_t *t, int64_t off, int64_t n, float inv, int write);
_llmmem_scaler_range_fn _llmmem_scaler_pick_range_fn(void);

/* A position in a tensor list: element `offset` of tensor `tensor`. */
typedef struct {
  size_t tensor;
  int64_t offset;
} _llmmem_scaler_pos_t;

/* unscale_cpu.c: runs `run` over the elements [from, to) of the list, in (tensor, element) order,
 * setting flags[t.flag] (relaxed atomic stores: two spans can meet in one tensor) for each tensor
 * that held inf/NaN; nonzero when one did. `to` may be (count, 0). */
int _llmmem_scaler_run_span(const llmmem_scaler_tensor_t *tensors, _llmmem_scaler_pos_t from, _llmmem_scaler_pos_t to,
                            float inv, int write, uint8_t *flags, _llmmem_scaler_range_fn run);

/* unscale_pipe.c: llmmem_scaler_pipe_publish without its argument checks, for a caller that has
 * checked the pipe's tensors [0, count) itself (llmmem_scaler_unscale_check) against the
 * tensor_flags and n_flags it started the pipe with; count >= what is published already. */
void _llmmem_scaler_pipe_publish_checked(llmmem_scaler_pipe_t *p, size_t count, size_t *published);

/* unscale_cpu.c: the multiplier: 1 (check only) without a scale, the scale's fp64 reciprocal, or
 * the given inverse. */
llmmem_status_t _llmmem_scaler_resolve_inv(const float *scale, int scale_is_inverse, float *inv);

/* unscale_pipe.c: drains a pipe (everything published, no workers of its own) on an OpenMP team,
 * at most `threads` of its threads taking part. 1 when it ran; 0 when no team was usable (finish
 * then drains it on the calling thread). */
int _llmmem_scaler_pipe_drain_on_team(llmmem_scaler_pipe_t *p, size_t threads);

/* unscale_cpu.c test hook (not exported): 0 = plain C, 1 = AVX2+F16C, 2 = AVX-512, -1 = automatic.
 * Levels the CPU lacks fall back to the best it has. Returns the level that will run. */
int _llmmem_scaler_force_isa(int isa);

#ifdef __cplusplus
}
#endif

#endif /* LLMMEM_SCALER_INTERNAL_H */
