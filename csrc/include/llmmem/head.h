/*
 * head.h — the C ABI of llmmem's LM head loss: the per-chunk passes over a block of logits that a
 * fused linear + cross-entropy runs between its matmuls (which go through torch: BLAS, cuBLAS).
 *
 * A chunk is `rows` x `vocab` logits (row-major, `ld` elements from one row to the next) of one
 * vocabulary shard [vocab_start, vocab_start + vocab) of a vocabulary of `vocab_total` entries
 * (vocab_start = 0 and vocab = vocab_total when unsharded). Row i's label is labels[i], a global
 * vocabulary index, or ignore_index.
 *
 *   z      = softcap > 0 ? softcap * tanh(l / softcap) : l         (Gemma 2's final softcapping)
 *   lse    = log(sum_j exp(z_j))                                   (over the whole vocabulary)
 *   loss   = (1 - eps) * (lse - z_label) + eps * (lse - sum_j z_j / vocab_total)
 *            (F.cross_entropy with label_smoothing=eps; 0 for an ignored row)
 *   dl_j   = (exp(z_j - lse) - (1 - eps) [j == label] - eps / vocab_total) * dz_j/dl_j * scale_i
 *            with dz/dl = 1 - (z / softcap)^2 (1 without softcap); 0 for an ignored row.
 *
 * Pass 1, llmmem_head_stats, reads the chunk and writes per row: its shard's largest z, the sum of
 * exp(z - that largest), the label's z (0 where the label is not in the shard or is ignored) and
 * the sum of z. Shards combine their rows' statistics (max, then rescaled sums: one small
 * all-reduce); lse = max + log(sum). Pass 2, llmmem_head_grad, overwrites the chunk with dl.
 * Sums are taken in fp32 over blocks of the row and in double across blocks.
 *
 * Logits are fp32, fp16 or bf16 (read and written in that dtype, computed in fp32). Plain C11,
 * no Python and no PyTorch.
 */
#ifndef LLMMEM_HEAD_H
#define LLMMEM_HEAD_H

#include <llmmem/llmmem.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types of the logits (the same codes as llmmem_optim_dtype_t). */
typedef enum llmmem_head_dtype_e {
  LLMMEM_HEAD_F32 = 0,
  LLMMEM_HEAD_F16 = 1,
  LLMMEM_HEAD_BF16 = 2,
  LLMMEM_HEAD_DTYPE_COUNT_ = 3
} llmmem_head_dtype_t;

typedef struct llmmem_head_chunk_s {
  void *logits;          /* rows x vocab elements of `dtype`, row i at logits + i * ld */
  const int64_t *labels; /* rows global labels (host memory for the CPU calls, device memory for CUDA) */
  int64_t rows;          /* >= 0 */
  int64_t vocab;         /* this shard's size, >= 1 */
  int64_t ld;            /* elements from one row to the next, >= vocab */
  int64_t vocab_start;   /* this shard's first global index, >= 0 */
  int64_t vocab_total;   /* the whole vocabulary, >= vocab_start + vocab */
  int64_t ignore_index;  /* a label equal to it is ignored; any other must be in [0, vocab_total) */
  float label_smoothing; /* in [0, 1] */
  float softcap;         /* 0: none; else > 0 */
  int32_t dtype;         /* llmmem_head_dtype_t */
} llmmem_head_chunk_t;

/* Checks a chunk description (also that every label is ignore_index or in [0, vocab_total): an
 * index error names the row). The CPU entry points call it; the CUDA ones check all but the
 * labels (device memory), which their kernels clamp-and-flag instead. */
LLMMEM_API llmmem_status_t llmmem_head_check(const llmmem_head_chunk_t *chunk);

/*
 * Pass 1 on the CPU (threads over rows; 0 = as many as the CPUs this process may use and the size
 * warrants). Each out array has `rows` floats: row_max, row_sum (of exp(z - row_max)),
 * row_target (z of the label, 0 when it is not in this shard or the row is ignored), row_zsum.
 * A row of this shard holds its label or not: row_has_target (may be NULL) gets 1 or 0.
 */
LLMMEM_API llmmem_status_t llmmem_head_stats(const llmmem_head_chunk_t *chunk, float *row_max, float *row_sum,
                                             float *row_target, float *row_zsum, uint8_t *row_has_target,
                                             int num_threads);

/* Pass 2 on the CPU, in place: logits become dl (see above); row_lse and row_scale have `rows`
 * floats (row_scale: the upstream gradient of the row's loss, e.g. 1 / tokens for a mean). */
LLMMEM_API llmmem_status_t llmmem_head_grad(const llmmem_head_chunk_t *chunk, const float *row_lse,
                                            const float *row_scale, int num_threads);

/* The plain scalar references of both passes: the oracles of the tests. */
LLMMEM_API llmmem_status_t llmmem_head_stats_ref(const llmmem_head_chunk_t *chunk, float *row_max, float *row_sum,
                                                 float *row_target, float *row_zsum, uint8_t *row_has_target);
LLMMEM_API llmmem_status_t llmmem_head_grad_ref(const llmmem_head_chunk_t *chunk, const float *row_lse,
                                                const float *row_scale);

/*
 * CUDA versions: every pointer is device memory on `device` (labels, the out arrays, row_lse,
 * row_scale included); queued on `stream` (a cudaStream_t; 0 = the legacy default stream), no
 * host synchronisation. A label outside [0, vocab_total) that is not ignore_index is counted in
 * *bad_labels (device memory, one int32, may be NULL) and its row treated as ignored: the caller
 * checks the count when it next synchronises. Without a CUDA build: LLMMEM_ERR_NOT_BUILT.
 */
LLMMEM_API llmmem_status_t llmmem_head_stats_cuda(const llmmem_head_chunk_t *chunk, float *row_max, float *row_sum,
                                                  float *row_target, float *row_zsum, uint8_t *row_has_target,
                                                  int32_t *bad_labels, int device, void *stream);
LLMMEM_API llmmem_status_t llmmem_head_grad_cuda(const llmmem_head_chunk_t *chunk, const float *row_lse,
                                                 const float *row_scale, int device, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* LLMMEM_HEAD_H */
