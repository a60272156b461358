/*
 * head.cu — the LM head's two passes over a chunk of logits on a GPU (llmmem_head_stats_cuda,
 * llmmem_head_grad_cuda): the arithmetic of the CPU loops (head_math.h's exp and softcap), one
 * thread block a row. Queued on the caller's stream; nothing waits on the host.
 *
 * Pass 1: every thread keeps an online (max, sum of exp relative to it) pair and a sum of z over
 * its strided elements (coalesced across a warp), then the block combines the pairs by shuffles
 * and shared memory. Pass 2 writes each element's gradient in place. Labels live in device
 * memory, so they cannot be checked before the launch: a label outside [0, vocab_total) that is
 * not ignore_index counts once in *bad_labels (pass 1) and its row is treated as ignored by both
 * passes.
 *
 * Compiled with -fmad=false like the other kernels: the same roundings as the CPU loops, which
 * agree with the reference (head_ref.c) to a few ulp.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>

#include "cuda_check.h"
#include "cuda_device_guard.h"
#include "head_internal.h"
#include "internal.h"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kMaxGrid = 1u << 20; // blocks stride over rows beyond this

struct Chunk {
  void *logits;
  const int64_t *labels;
  int64_t rows, vocab, ld, vocab_start, vocab_total, ignore_index;
  float eps, softcap, inv_softcap;
  int32_t dtype;
};

__device__ __forceinline__ float load_z(const Chunk &c, int64_t k) {
  float l;
  if (c.dtype == LLMMEM_HEAD_F32)
    l = static_cast<const float *>(c.logits)[k];
  else if (c.dtype == LLMMEM_HEAD_BF16)
    l = __bfloat162float(__ushort_as_bfloat16(static_cast<const unsigned short *>(c.logits)[k]));
  else
    l = __half2float(__ushort_as_half(static_cast<const unsigned short *>(c.logits)[k]));
  return c.softcap > 0.0f ? llmmem_head_softcap(l, c.softcap, c.inv_softcap) : l;
}

__device__ __forceinline__ void store(const Chunk &c, int64_t k, float v) {
  if (c.dtype == LLMMEM_HEAD_F32)
    static_cast<float *>(c.logits)[k] = v;
  else if (c.dtype == LLMMEM_HEAD_BF16)
    static_cast<unsigned short *>(c.logits)[k] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  else
    static_cast<unsigned short *>(c.logits)[k] = __half_as_ushort(__float2half_rn(v));
}

/* A row's label: its local index in the shard, or -1 (not in the shard); *ok = 0 for an ignored
 * or out-of-range label. */
__device__ __forceinline__ int64_t local_label(const Chunk &c, int64_t row, int *ok, int *bad) {
  const int64_t t = c.labels[row];
  const int ignored = t == c.ignore_index;
  *bad = !ignored && (t < 0 || t >= c.vocab_total);
  *ok = !ignored && !*bad;
  const int64_t local = t - c.vocab_start;
  return *ok && local >= 0 && local < c.vocab ? local : -1;
}

/* (m1, s1) and (m2, s2) as one pair relative to the larger maximum; an empty side (s = 0) adds
 * nothing, also when its maximum is -inf (-inf - -inf would be NaN). */
__device__ __forceinline__ void merge(float &m, float &s, float m2, float s2) {
  const float mx = m2 > m ? m2 : m;
  const float a = s == 0.0f ? 0.0f : s * llmmem_head_exp(m - mx);
  const float b = s2 == 0.0f ? 0.0f : s2 * llmmem_head_exp(m2 - mx);
  m = mx;
  s = a + b;
}

__global__ void stats_kernel(Chunk c, float *row_max, float *row_sum, float *row_target, float *row_zsum,
                             uint8_t *row_has_target, int32_t *bad_labels) {
  __shared__ float sh_m[kWarps], sh_s[kWarps], sh_z[kWarps];
  __shared__ int sh_nan[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t row = blockIdx.x; row < c.rows; row += gridDim.x) {
    const int64_t base = row * c.ld;
    float m = -INFINITY, s = 0.0f, zs = 0.0f;
    int nan = 0;
    for (int64_t j = threadIdx.x; j < c.vocab; j += kThreads) {
      const float z = load_z(c, base + j);
      nan |= z != z;
      zs += z;
      if (z > m) {
        s = s * llmmem_head_exp(m - z) + 1.0f; // s is 0 while m is -inf: no NaN from -inf - z
        m = z;
      } else if (z != -INFINITY) { // a -inf logit adds nothing (with m = -inf, z - m would be NaN)
        s += llmmem_head_exp(z - m);
      }
    }
    for (int off = 16; off > 0; off >>= 1) {
      const float m2 = __shfl_down_sync(0xffffffffu, m, off), s2 = __shfl_down_sync(0xffffffffu, s, off);
      zs += __shfl_down_sync(0xffffffffu, zs, off);
      nan |= __shfl_down_sync(0xffffffffu, nan, off);
      merge(m, s, m2, s2);
    }
    if (lane == 0) sh_m[warp] = m, sh_s[warp] = s, sh_z[warp] = zs, sh_nan[warp] = nan;
    __syncthreads();
    if (threadIdx.x == 0) {
      // the warps' partials in a fixed order, the z sum in double as the CPU's across blocks
      m = sh_m[0], s = sh_s[0], nan = sh_nan[0];
      double z = sh_z[0];
      for (int w = 1; w < kWarps; w++) merge(m, s, sh_m[w], sh_s[w]), z += sh_z[w], nan |= sh_nan[w];
      int ok, bad;
      const int64_t t = local_label(c, row, &ok, &bad);
      if (bad && bad_labels) atomicAdd(bad_labels, 1);
      row_max[row] = nan ? NAN : m;
      row_sum[row] = nan ? NAN : s;
      row_target[row] = t >= 0 ? load_z(c, base + t) : 0.0f;
      row_zsum[row] = (float)z;
      if (row_has_target) row_has_target[row] = (uint8_t)(t >= 0);
    }
    __syncthreads(); // the shared partials are reused by the next row
  }
}

__global__ void grad_kernel(Chunk c, const float *row_lse, const float *row_scale) {
  const float uniform = c.eps / (float)c.vocab_total;
  for (int64_t row = blockIdx.x; row < c.rows; row += gridDim.x) {
    const int64_t base = row * c.ld;
    int ok, bad;
    const int64_t t = local_label(c, row, &ok, &bad);
    const float lse = row_lse[row], scale = ok ? row_scale[row] : 0.0f;
    for (int64_t j = threadIdx.x; j < c.vocab; j += kThreads) {
      if (!ok) {
        store(c, base + j, 0.0f);
        continue;
      }
      const float z = load_z(c, base + j);
      const float q = c.softcap > 0.0f ? z * c.inv_softcap : 0.0f;
      const float d = c.softcap > 0.0f ? 1.0f - q * q : 1.0f;
      float g = ((llmmem_head_exp(z - lse) - uniform) * d) * scale;
      if (j == t) g -= ((1.0f - c.eps) * d) * scale; // the label's own term, as the CPU loop takes it
      store(c, base + j, g);
    }
  }
}

Chunk to_chunk(const llmmem_head_chunk_t *h) {
  Chunk c;
  c.logits = h->logits;
  c.labels = h->labels;
  c.rows = h->rows, c.vocab = h->vocab, c.ld = h->ld;
  c.vocab_start = h->vocab_start, c.vocab_total = h->vocab_total, c.ignore_index = h->ignore_index;
  c.eps = h->label_smoothing, c.softcap = h->softcap;
  c.inv_softcap = h->softcap > 0.0f ? 1.0f / h->softcap : 0.0f;
  c.dtype = h->dtype;
  return c;
}

unsigned grid_of(int64_t rows) { return (unsigned)(rows < (int64_t)kMaxGrid ? rows : kMaxGrid); }

} // namespace

extern "C" LLMMEM_API llmmem_status_t llmmem_head_stats_cuda(const llmmem_head_chunk_t *chunk, float *row_max,
                                                             float *row_sum, float *row_target, float *row_zsum,
                                                             uint8_t *row_has_target, int32_t *bad_labels, int device,
                                                             void *stream) {
  LLMMEM_TRY(_llmmem_head_check("llmmem_head_stats_cuda", chunk, 0));
  LLMMEM_CHECK_ARG(device >= 0, "llmmem_head_stats_cuda: device must be >= 0, got %d", device);
  if (chunk->rows == 0) return LLMMEM_OK;
  LLMMEM_CHECK_ARG(row_max && row_sum && row_target && row_zsum,
                   "llmmem_head_stats_cuda: row_max, row_sum, row_target and row_zsum must not be NULL");
  llmmem_cuda::device_guard guard(device);
  LLMMEM_CUDA_TRY(guard.err);
  stats_kernel<<<grid_of(chunk->rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      to_chunk(chunk), row_max, row_sum, row_target, row_zsum, row_has_target, bad_labels);
  LLMMEM_CUDA_TRY(cudaGetLastError());
  return LLMMEM_OK;
}

extern "C" LLMMEM_API llmmem_status_t llmmem_head_grad_cuda(const llmmem_head_chunk_t *chunk, const float *row_lse,
                                                            const float *row_scale, int device, void *stream) {
  LLMMEM_TRY(_llmmem_head_check("llmmem_head_grad_cuda", chunk, 0));
  LLMMEM_CHECK_ARG(device >= 0, "llmmem_head_grad_cuda: device must be >= 0, got %d", device);
  if (chunk->rows == 0) return LLMMEM_OK;
  LLMMEM_CHECK_ARG(row_lse && row_scale, "llmmem_head_grad_cuda: row_lse and row_scale must not be NULL");
  llmmem_cuda::device_guard guard(device);
  LLMMEM_CUDA_TRY(guard.err);
  grad_kernel<<<grid_of(chunk->rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(to_chunk(chunk), row_lse,
                                                                                        row_scale);
  LLMMEM_CUDA_TRY(cudaGetLastError());
  return LLMMEM_OK;
}
