/*
 * adamw.cu — the CUDA multi-tensor AdamW step (llmmem_optim_adamw_step_cuda): the same update,
 * state formats, codes and random bits as the C reference (adamw_ref.c), bit for bit: the
 * arithmetic is the shared inline code of adamw_math.h and codes.h, and nothing is fused (this
 * file is compiled with -fmad=false; division and sqrt are IEEE, nvcc's default).
 *
 * Launch: every tensor is cut into pieces of kPiece elements (a multiple of every block size); a
 * table of up to kMaxTensors tensors (addresses, sizes, their scalars, first piece) travels in the
 * kernel's parameters (CUDA 12.1+ allows 32 KB of them: 160 tensors; older toolkits 4 KB: 28), so
 * a launch needs no host-to-device copy. (A launch can be captured, but the scalars it carries are
 * the host's at capture: the Python layer refuses a step inside a capture.) One thread block
 * takes one piece and finds its tensor by binary search in the table. The step counters live in host memory (as torch keeps them): they
 * are incremented, and the scalars computed, here on the host before the launch.
 *
 * Unquantized formats: each thread updates elements of the piece independently. Quantized: the
 * block's threads take one quantization block at a time (several at once when blocks are smaller
 * than the thread block): decode, update (weights written), then the block maximum by a shuffle
 * and shared-memory reduction, the scale, and the codes (4-bit pairs joined by a shuffle).
 *
 * The table is a __grid_constant__ parameter: the kernels take references into it, which would
 * otherwise make every thread copy the whole table into local memory.
 *
 * What it does not do: strided tensors (the Python layer makes them contiguous first).
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <llmmem/optim.h>

#include "cuda_check.h"
#include "cuda_device_guard.h"
#include "internal.h"
#include "optim_internal.h"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kPiece = 4096;    // elements a thread block takes at a time (>= LLMMEM_OPTIM_MAX_BLOCK)
constexpr int kMaxBlocks = 1 << 16; // blocks stride over pieces beyond this

// Bytes of kernel parameters the toolkit compiles: 32764 from CUDA 12.1 (Volta and newer; the
// driver must be 12.1's too, else the launch fails and the known-answer check falls back), 4096
// before. (Defined from outside only to compile the small table with a new toolkit.)
#ifndef LLMMEM_OPTIM_CUDA_PARAM_BYTES
#if CUDART_VERSION >= 12010
#define LLMMEM_OPTIM_CUDA_PARAM_BYTES 32764
#else
#define LLMMEM_OPTIM_CUDA_PARAM_BYTES 4096
#endif
#endif

struct TensorArg {
  void *param;
  const void *grad;
  float *master;
  void *m, *v;
  float *ms, *vs;
  int64_t numel;
  uint64_t seed;
  llmmem_adamw_scalars_t s;
  float step;
  uint32_t key_param, key_moments; /* the random-bit keys of index range 0 (upper half 0) */
  int32_t param_dtype, grad_dtype;
};

// as many tensors as fit the parameter space with the table's other fields (24 bytes)
constexpr int kMaxTensors = (LLMMEM_OPTIM_CUDA_PARAM_BYTES - 24) / (sizeof(TensorArg) + sizeof(int64_t)) < 160
                                ? (int)((LLMMEM_OPTIM_CUDA_PARAM_BYTES - 24) / (sizeof(TensorArg) + sizeof(int64_t)))
                                : 160;

struct Table {
  TensorArg t[kMaxTensors];
  int64_t piece_start[kMaxTensors + 1]; // prefix sums of pieces
  int32_t n;
  int32_t state, block, stochastic;
};
static_assert(sizeof(Table) <= LLMMEM_OPTIM_CUDA_PARAM_BYTES, "the table must fit the kernel parameter space");

__device__ float load_as_float(const void *p, int32_t dtype, int64_t i) {
  if (dtype == LLMMEM_OPTIM_F32) return static_cast<const float *>(p)[i];
  const uint16_t h = static_cast<const uint16_t *>(p)[i];
  if (dtype == LLMMEM_OPTIM_BF16) return llmmem_bf16_value(h);
  return __half2float(__ushort_as_half(h));
}

__device__ uint32_t key_of(const TensorArg &a, uint32_t stream, int64_t i, uint32_t key0) {
  const uint32_t hi = (uint32_t)((uint64_t)i >> 32);
  return hi == 0 ? key0 : llmmem_sr_key(a.seed, a.step, stream, hi);
}

__device__ uint32_t random_bits(const TensorArg &a, uint32_t stream, int64_t i) {
  const uint32_t key = key_of(a, stream, i, stream == LLMMEM_SR_PARAM ? a.key_param : a.key_moments);
  return llmmem_sr_mix((uint32_t)i ^ key);
}

/* The random bits that round sqrt(v) of element i into a code (llmmem_sr_code_bits). */
__device__ uint32_t code_bits(const TensorArg &a, int64_t i) {
  return llmmem_sr_code_bits((uint32_t)i, key_of(a, LLMMEM_SR_MOMENTS, i, a.key_moments));
}

__device__ void store_weight(const TensorArg &a, int stochastic, int64_t i, float w) {
  if (a.master) {
    a.master[i] = w;
    uint16_t *p = static_cast<uint16_t *>(a.param);
    p[i] = a.param_dtype == LLMMEM_OPTIM_BF16 ? llmmem_bf16_nearest(w) : __half_as_ushort(__float2half_rn(w));
  } else if (a.param_dtype == LLMMEM_OPTIM_F32) {
    static_cast<float *>(a.param)[i] = w;
  } else {
    uint16_t *p = static_cast<uint16_t *>(a.param);
    p[i] = stochastic ? llmmem_bf16_stochastic(w, random_bits(a, LLMMEM_SR_PARAM, i)) : llmmem_bf16_nearest(w);
  }
}

__device__ float load_weight(const TensorArg &a, int64_t i) {
  return a.master ? a.master[i] : load_as_float(a.param, a.param_dtype, i);
}

__device__ int find_tensor(const Table &tab, int64_t piece) {
  int lo = 0, hi = tab.n - 1;
  while (lo < hi) { // the last tensor whose first piece is <= piece
    int mid = (lo + hi + 1) / 2;
    if (tab.piece_start[mid] <= piece)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// ---- unquantized formats -------------------------------------------------------------------

template <int State>
__global__ void __launch_bounds__(kThreads) step_plain(const __grid_constant__ Table tab) {
  const int64_t pieces = tab.piece_start[tab.n];
  for (int64_t piece = blockIdx.x; piece < pieces; piece += gridDim.x) {
    const TensorArg &a = tab.t[find_tensor(tab, piece)];
    const int64_t lo = (piece - tab.piece_start[&a - tab.t]) * kPiece;
    const int64_t hi = lo + kPiece < a.numel ? lo + kPiece : a.numel;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
      float w = load_weight(a, i), g = load_as_float(a.grad, a.grad_dtype, i), m, v;
      if (State == LLMMEM_OPTIM_STATE_F32) {
        m = static_cast<float *>(a.m)[i];
        v = static_cast<float *>(a.v)[i];
      } else {
        m = llmmem_bf16_value(static_cast<uint16_t *>(a.m)[i]);
        v = llmmem_bf16_value(static_cast<uint16_t *>(a.v)[i]);
      }
      (void)llmmem_adamw_elem(&a.s, g, &w, &m, &v);
      if (State == LLMMEM_OPTIM_STATE_F32) {
        static_cast<float *>(a.m)[i] = m;
        static_cast<float *>(a.v)[i] = v;
      } else {
        const uint32_t r = random_bits(a, LLMMEM_SR_MOMENTS, i); /* low half for m, high half for v */
        static_cast<uint16_t *>(a.m)[i] = llmmem_bf16_stochastic(m, r);
        static_cast<uint16_t *>(a.v)[i] = llmmem_bf16_stochastic(v, r >> 16);
      }
      store_weight(a, tab.stochastic, i, w);
    }
  }
}

// ---- quantized formats ---------------------------------------------------------------------

template <int Bits>
__device__ uint32_t code_at(const void *codes, int64_t i) {
  const uint8_t *b = static_cast<const uint8_t *>(codes);
  return Bits == 8 ? b[i] : (uint32_t)(b[i >> 1] >> ((i & 1) * 4)) & 0xfu;
}

// The largest finite magnitude across the `group` threads that share a quantization block
// (a power of two from 32 to kThreads, aligned): by its bits, as the CPU loops take it.
__device__ float group_absmax(float x, int group, uint32_t *shared) {
  uint32_t a = llmmem_q_bits(x) & 0x7fffffffu;
  a = a < 0x7f800000u ? a : 0u;
  for (int off = 16; off > 0; off >>= 1) a = max(a, __shfl_xor_sync(0xffffffffu, a, off));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (group > 32) {
    __syncthreads(); // the previous use of `shared` is done
    if (lane == 0) shared[warp] = a;
    __syncthreads();
    const int first = (threadIdx.x / group) * (group / 32);
    a = 0;
    for (int w = 0; w < group / 32; w++) a = max(a, shared[first + w]);
  }
  return llmmem_q_float(a);
}

template <int State>
__global__ void __launch_bounds__(kThreads) step_quantized(const __grid_constant__ Table tab) {
  constexpr int Bits = State == LLMMEM_OPTIM_STATE_Q8 ? 8 : 4;
  constexpr int32_t CM = State == LLMMEM_OPTIM_STATE_Q8 ? LLMMEM_OPTIM_CODE_M8 : LLMMEM_OPTIM_CODE_M4;
  constexpr int32_t CR = State == LLMMEM_OPTIM_STATE_Q8 ? LLMMEM_OPTIM_CODE_R8 : LLMMEM_OPTIM_CODE_R4;
  constexpr int MMag = State == LLMMEM_OPTIM_STATE_Q8 ? LLMMEM_Q_M8_MAG : LLMMEM_Q_M4_MAG;
  constexpr int MM = State == LLMMEM_OPTIM_STATE_Q8 ? LLMMEM_Q_M8_M : LLMMEM_Q_M4_M;
  constexpr int MB = State == LLMMEM_OPTIM_STATE_Q8 ? LLMMEM_Q_M8_B : LLMMEM_Q_M4_B;
  constexpr int RM = State == LLMMEM_OPTIM_STATE_Q8 ? LLMMEM_Q_R8_M : LLMMEM_Q_R4_M;
  constexpr int RB = State == LLMMEM_OPTIM_STATE_Q8 ? LLMMEM_Q_R8_B : LLMMEM_Q_R4_B;
  __shared__ uint32_t shared[kThreads / 32];
  const int block = tab.block;
  const int group = block < kThreads ? block : kThreads; // threads per quantization block
  const int per = block / group;                         // elements per thread and block
  const float top_m = llmmem_q_max_value(CM), top_r = llmmem_q_max_value(CR);
  const int64_t pieces = tab.piece_start[tab.n];
  for (int64_t piece = blockIdx.x; piece < pieces; piece += gridDim.x) {
    const int ti = find_tensor(tab, piece);
    const TensorArg &a = tab.t[ti];
    const int64_t lo = (piece - tab.piece_start[ti]) * kPiece;
    const int64_t hi = lo + kPiece < a.numel ? lo + kPiece : a.numel;
    // the thread block takes kThreads / group quantization blocks of the piece at a time
    for (int64_t qb = lo + (threadIdx.x / group) * block; qb < lo + kPiece;
         qb += (int64_t)(kThreads / group) * block) {
      const int64_t qidx = qb / block;
      const bool live = qb < hi; // every thread of a group takes part in the reductions below
      float mv[LLMMEM_OPTIM_MAX_BLOCK / kThreads], rv[LLMMEM_OPTIM_MAX_BLOCK / kThreads];
      float amax_m = 0.0f, amax_r = 0.0f;
      for (int k = 0; k < per; k++) {
        const int64_t i = qb + (int64_t)k * group + threadIdx.x % group;
        mv[k] = rv[k] = 0.0f;
        if (!live || i >= hi) continue;
        float m = llmmem_q_decode_signed(code_at<Bits>(a.m, i), a.ms[qidx], MMag, MM, MB);
        float r = llmmem_q_decode_unsigned(code_at<Bits>(a.v, i), a.vs[qidx], Bits, RM, RB);
        float v = r * r;
        float w = load_weight(a, i), g = load_as_float(a.grad, a.grad_dtype, i);
        rv[k] = llmmem_adamw_elem(&a.s, g, &w, &m, &v);
        mv[k] = m;
        store_weight(a, tab.stochastic, i, w);
        amax_m = fmaxf(amax_m, llmmem_q_bits(fabsf(m)) < 0x7f800000u ? fabsf(m) : 0.0f);
        amax_r = fmaxf(amax_r, llmmem_q_bits(fabsf(rv[k])) < 0x7f800000u ? fabsf(rv[k]) : 0.0f);
      }
      amax_m = group_absmax(amax_m, group, shared);
      amax_r = group_absmax(amax_r, group, shared);
      float scale_m, inv_m, scale_r, inv_r;
      llmmem_q_block_scale(amax_m, top_m, &scale_m, &inv_m);
      llmmem_q_block_scale(amax_r, top_r, &scale_r, &inv_r);
      if (live && threadIdx.x % group == 0) {
        a.ms[qidx] = scale_m;
        a.vs[qidx] = scale_r;
      }
      for (int k = 0; k < per; k++) {
        const int64_t i = qb + (int64_t)k * group + threadIdx.x % group;
        uint32_t cm = llmmem_q_encode_signed(mv[k], inv_m, MMag, MM, MB);
        uint32_t cr = 0;
        if (live && i < hi) cr = llmmem_q_encode_unsigned_sr(rv[k], inv_r, Bits, RM, RB, code_bits(a, i));
        if (Bits == 8) {
          if (live && i < hi) {
            static_cast<uint8_t *>(a.m)[i] = (uint8_t)cm;
            static_cast<uint8_t *>(a.v)[i] = (uint8_t)cr;
          }
        } else {
          // element i + 1 sits on the next lane (groups are whole warps, elements consecutive)
          const uint32_t cm_next = __shfl_down_sync(0xffffffffu, cm, 1);
          const uint32_t cr_next = __shfl_down_sync(0xffffffffu, cr, 1);
          if (live && i < hi && (i & 1) == 0) {
            const bool pair = i + 1 < hi;
            static_cast<uint8_t *>(a.m)[i >> 1] = (uint8_t)(cm | (pair ? cm_next << 4 : 0u));
            static_cast<uint8_t *>(a.v)[i >> 1] = (uint8_t)(cr | (pair ? cr_next << 4 : 0u));
          }
        }
      }
    }
  }
}

llmmem_status_t launch(const Table &tab, cudaStream_t stream) {
  const int64_t pieces = tab.piece_start[tab.n];
  if (pieces == 0) return LLMMEM_OK;
  const unsigned grid = (unsigned)(pieces < kMaxBlocks ? pieces : kMaxBlocks);
  switch (tab.state) {
    case LLMMEM_OPTIM_STATE_F32: step_plain<LLMMEM_OPTIM_STATE_F32><<<grid, kThreads, 0, stream>>>(tab); break;
    case LLMMEM_OPTIM_STATE_BF16: step_plain<LLMMEM_OPTIM_STATE_BF16><<<grid, kThreads, 0, stream>>>(tab); break;
    case LLMMEM_OPTIM_STATE_Q8: step_quantized<LLMMEM_OPTIM_STATE_Q8><<<grid, kThreads, 0, stream>>>(tab); break;
    default: step_quantized<LLMMEM_OPTIM_STATE_Q4><<<grid, kThreads, 0, stream>>>(tab); break;
  }
  LLMMEM_CUDA_TRY(cudaGetLastError()); /* a launch that could not be queued */
  return LLMMEM_OK;
}

} // namespace

extern "C" LLMMEM_API llmmem_status_t llmmem_optim_adamw_step_cuda(const llmmem_optim_tensor_t *tensors, size_t count,
                                                                   const llmmem_optim_adamw_config_t *cfg, int device,
                                                                   void *stream) {
  int64_t total;
  LLMMEM_TRY(_llmmem_optim_check_step("llmmem_optim_adamw_step_cuda", tensors, count, cfg, &total));
  LLMMEM_CHECK_ARG(device >= 0, "llmmem_optim_adamw_step_cuda: device must be >= 0, got %d", device);
  if (count == 0) return LLMMEM_OK;
  llmmem_cuda::device_guard guard(device); // restores the caller's device on every return below
  LLMMEM_CUDA_TRY(guard.err);
  // One launch per kMaxTensors tensors; each tensor's step moves on once its launch is queued, so
  // after a failed launch the steps say which tensors were updated.
  llmmem_status_t st = LLMMEM_OK;
  size_t at = 0;
  while (at < count && st == LLMMEM_OK) {
    // ~27 KB: kept off the caller's stack; one per thread so concurrent callers do not share it
    static thread_local Table local;
    local.n = 0;
    local.state = cfg->state;
    local.block = cfg->block_size;
    local.stochastic = cfg->stochastic_rounding;
    local.piece_start[0] = 0;
    size_t first = at;
    for (; at < count && local.n < kMaxTensors; at++) {
      const llmmem_optim_tensor_t *t = &tensors[at];
      TensorArg &a = local.t[local.n];
      a.param = t->param;
      a.grad = t->grad;
      a.master = t->master;
      a.m = t->exp_avg;
      a.v = t->exp_avg_sq;
      a.ms = t->exp_avg_scale;
      a.vs = t->exp_avg_sq_scale;
      a.numel = t->numel;
      a.seed = t->seed;
      a.step = *t->step + 1.0f;
      _llmmem_adamw_scalars(cfg, a.step, &a.s);
      a.key_param = llmmem_sr_key(t->seed, a.step, LLMMEM_SR_PARAM, 0);
      a.key_moments = llmmem_sr_key(t->seed, a.step, LLMMEM_SR_MOMENTS, 0);
      a.param_dtype = t->param_dtype;
      a.grad_dtype = t->grad_dtype;
      local.piece_start[local.n + 1] = local.piece_start[local.n] + (t->numel + kPiece - 1) / kPiece;
      local.n++;
    }
    st = launch(local, (cudaStream_t)stream);
    if (st == LLMMEM_OK)
      for (size_t k = first; k < at; k++) *tensors[k].step += 1.0f;
  }
  return st;
}
