/*
 * scaler.cu — CUDA kernels of the loss scaler: multi-tensor unscale + non-finite check, and the
 * one-thread scale update. Same semantics as the CPU path (unscale_cpu.c, update_rule.h), which
 * is their test oracle.
 *
 * Multi-tensor launch: every gradient is cut into chunks of kChunk elements; a table of up to
 * LLMMEM_SCALER_CUDA_MAX_TENSORS tensors (pointer, size, first chunk, flag slot) travels in the
 * kernel's parameters (CUDA 12.1+ allows 32 KB of them), so one launch covers a whole dtype
 * group with no host-to-device copy and nothing that breaks CUDA-graph capture. Blocks stride
 * over chunks and find their tensor by binary search in the table. The inverse scale is computed
 * on the device from the scale tensor ((float)(1.0 / (double)scale), as torch), so nothing is
 * read back: nothing here synchronises with the host.
 *
 * What it does not do: strided tensors (the Python layer makes them contiguous first).
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <llmmem/amp.h>

#include "cuda_check.h"
#include "cuda_device_guard.h"
#include "scaler_internal.h"
#include "update_rule.h"

namespace {

constexpr int kBlock = 512;       // threads per block
constexpr int64_t kChunk = 65536; // elements per chunk (one block's unit of work)
constexpr int kMaxTensors = LLMMEM_SCALER_CUDA_MAX_TENSORS;
constexpr int kMaxBlocks = 4096; // blocks stride over chunks beyond this

// The kernel's tensor table: 8 + 8 + 4 + 4 bytes per tensor, ~24 KB for 1024 tensors.
struct TensorTable {
  void *ptr[kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t chunk_start[kMaxTensors + 1]; // prefix sums of chunk counts; chunk_start[n] = total chunks
  int32_t flag[kMaxTensors];
  int32_t n;
};
static_assert(sizeof(TensorTable) < 32764, "kernel parameters are limited to 32764 bytes");

// Per dtype: the math type and the conversions (round to nearest even, as the CPU path).
template <typename T>
struct Elem;
template <>
struct Elem<float> {
  using Math = float;
  __device__ static float load(float v) { return v; }
  __device__ static float store(float v) { return v; }
};
template <>
struct Elem<double> {
  using Math = double;
  __device__ static double load(double v) { return v; }
  __device__ static double store(double v) { return v; }
};
template <>
struct Elem<__half> {
  using Math = float;
  __device__ static float load(__half v) { return __half2float(v); }
  __device__ static __half store(float v) { return __float2half_rn(v); }
};
template <>
struct Elem<__nv_bfloat16> {
  using Math = float;
  __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

template <typename T>
__device__ __forceinline__ bool process(T *p, float inv, bool write) {
  using E = Elem<T>;
  typename E::Math v = E::load(*p);
  bool bad = !isfinite(v);
  if (write) *p = E::store(v * static_cast<typename E::Math>(inv));
  return bad;
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    unscale_check_kernel(const __grid_constant__ TensorTable tab, const float *scale, int scale_is_inverse,
                         float *found_inf, uint8_t *flags) {
  float inv = 1.0f;
  if (scale) inv = scale_is_inverse ? *scale : (float)(1.0 / (double)*scale);
  const bool write = inv != 1.0f; // torch leaves values as they are when inv_scale == 1
  const int32_t total = tab.chunk_start[tab.n];
  for (int32_t c = blockIdx.x; c < total; c += gridDim.x) {
    // the tensor owning chunk c: the last t with chunk_start[t] <= c (uniform across the block)
    int lo = 0, hi = tab.n - 1;
    while (lo < hi) {
      int mid = (lo + hi + 1) >> 1;
      if (tab.chunk_start[mid] <= c)
        lo = mid;
      else
        hi = mid - 1;
    }
    const int t = lo;
    const int64_t off = (int64_t)(c - tab.chunk_start[t]) * kChunk;
    const int64_t rem = tab.numel[t] - off;
    const int64_t len = rem < kChunk ? rem : kChunk;
    T *base = static_cast<T *>(tab.ptr[t]) + off;
    bool bad = false;
    constexpr int kVec = 16 / sizeof(T); // elements per 16-byte access
    if ((reinterpret_cast<uintptr_t>(base) & 15) == 0) {
      const int64_t nvec = len / kVec;
      for (int64_t i = threadIdx.x; i < nvec; i += kBlock) {
        // one 16-byte load and store per step; the union keeps the elements in registers
        union {
          uint4 raw;
          T e[kVec];
        } pack;
        pack.raw = reinterpret_cast<const uint4 *>(base)[i];
#pragma unroll
        for (int k = 0; k < kVec; k++) bad |= process(&pack.e[k], inv, write);
        if (write) reinterpret_cast<uint4 *>(base)[i] = pack.raw;
      }
      for (int64_t i = nvec * kVec + threadIdx.x; i < len; i += kBlock) bad |= process(&base[i], inv, write);
    } else {
      for (int64_t i = threadIdx.x; i < len; i += kBlock) bad |= process(&base[i], inv, write);
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) {
      *found_inf = 1.0f; // racing writers all store the same value
      if (flags) flags[tab.flag[t]] = 1;
    }
  }
}

template <typename T>
llmmem_status_t launch(const TensorTable &tab, const float *scale, int scale_is_inverse, float *found_inf,
                       uint8_t *flags, cudaStream_t stream) {
  int32_t total = tab.chunk_start[tab.n];
  if (total == 0) return LLMMEM_OK;
  int grid = total < kMaxBlocks ? total : kMaxBlocks;
  unscale_check_kernel<T><<<grid, kBlock, 0, stream>>>(tab, scale, scale_is_inverse, found_inf, flags);
  LLMMEM_CUDA_TRY(cudaGetLastError());
  return LLMMEM_OK;
}

llmmem_status_t launch_dtype(int32_t dtype, const TensorTable &tab, const float *scale, int inv, float *found,
                             uint8_t *flags, cudaStream_t stream) {
  switch (dtype) {
    case LLMMEM_SCALER_F32: return launch<float>(tab, scale, inv, found, flags, stream);
    case LLMMEM_SCALER_F64: return launch<double>(tab, scale, inv, found, flags, stream);
    case LLMMEM_SCALER_F16: return launch<__half>(tab, scale, inv, found, flags, stream);
    default: return launch<__nv_bfloat16>(tab, scale, inv, found, flags, stream);
  }
}

struct FoundList {
  const float *ptr[LLMMEM_SCALER_CUDA_MAX_FOUND];
  int n;
};

__global__ void update_kernel(float *scale, int32_t *growth, int32_t *hyst, int64_t *stats, FoundList found,
                              double growth_factor, double backoff_factor, int64_t growth_interval, int32_t hysteresis,
                              float min_scale, int on_growth) {
  int any = 0;
  for (int i = 0; i < found.n; i++) any |= *found.ptr[i] != 0.0f;
  llmmem_scaler_apply_rule(scale, growth, hyst, stats, any, growth_factor, backoff_factor, growth_interval, hysteresis,
                           min_scale, on_growth);
}

} // namespace

extern "C" LLMMEM_API llmmem_status_t llmmem_scaler_unscale_check_cuda(const llmmem_scaler_tensor_t *tensors,
                                                                       size_t count, const float *scale,
                                                                       int scale_is_inverse, float *found_inf,
                                                                       uint8_t *tensor_flags, size_t n_flags,
                                                                       int device, void *stream) {
  size_t total_bytes = 0;
  LLMMEM_TRY(_llmmem_scaler_check_tensors("llmmem_scaler_unscale_check_cuda", tensors, count, found_inf, tensor_flags,
                                          n_flags, &total_bytes));
  LLMMEM_CHECK_ARG(device >= 0, "llmmem_scaler_unscale_check_cuda: device must be >= 0, got %d", device);
  if (count == 0 || total_bytes == 0) return LLMMEM_OK;
  llmmem_cuda::device_guard guard(device); // restores the caller's device on every return below
  LLMMEM_CUDA_TRY(guard.err);
  // 24 KB: kept off the caller's stack; one per thread so concurrent callers do not share it.
  static thread_local TensorTable tab;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  for (int32_t dtype = 0; dtype < LLMMEM_SCALER_DTYPE_COUNT_; dtype++) {
    tab.n = 0;
    tab.chunk_start[0] = 0;
    for (size_t i = 0; i < count; i++) {
      const llmmem_scaler_tensor_t &t = tensors[i];
      if (t.dtype != dtype || t.numel == 0) continue;
      int64_t chunks = (t.numel + kChunk - 1) / kChunk;
      LLMMEM_CHECK_ARG(chunks < (int64_t)1 << 30, "llmmem_scaler_unscale_check_cuda: tensors[%zu] is too large", i);
      if (tab.n == kMaxTensors || (int64_t)tab.chunk_start[tab.n] + chunks >= INT32_MAX) {
        LLMMEM_TRY(launch_dtype(dtype, tab, scale, scale_is_inverse, found_inf, tensor_flags, s));
        tab.n = 0;
        tab.chunk_start[0] = 0;
      }
      tab.ptr[tab.n] = t.data;
      tab.numel[tab.n] = t.numel;
      tab.flag[tab.n] = tensor_flags ? t.flag : 0;
      tab.chunk_start[tab.n + 1] = tab.chunk_start[tab.n] + (int32_t)chunks;
      tab.n++;
    }
    if (tab.n) LLMMEM_TRY(launch_dtype(dtype, tab, scale, scale_is_inverse, found_inf, tensor_flags, s));
  }
  return LLMMEM_OK;
}

extern "C" LLMMEM_API llmmem_status_t llmmem_scaler_update_cuda(float *scale, int32_t *growth_tracker,
                                                                int32_t *hysteresis_tracker, int64_t *stats,
                                                                const float *const *found_infs, size_t n_found,
                                                                const llmmem_scaler_config_t *cfg, int device,
                                                                void *stream) {
  LLMMEM_TRY(llmmem_scaler_config_check(cfg));
  LLMMEM_CHECK_ARG(scale != NULL && growth_tracker != NULL,
                   "llmmem_scaler_update_cuda: scale and growth_tracker "
                   "must not be NULL");
  LLMMEM_CHECK_ARG(hysteresis_tracker != NULL || cfg->hysteresis == 1,
                   "llmmem_scaler_update_cuda: hysteresis_tracker is required when hysteresis is %d",
                   (int)cfg->hysteresis);
  LLMMEM_CHECK_ARG(n_found >= 1 && n_found <= LLMMEM_SCALER_CUDA_MAX_FOUND && found_infs != NULL,
                   "llmmem_scaler_update_cuda: 1..%d found_inf flags are needed, got %zu",
                   LLMMEM_SCALER_CUDA_MAX_FOUND, n_found);
  LLMMEM_CHECK_ARG(device >= 0, "llmmem_scaler_update_cuda: device must be >= 0, got %d", device);
  FoundList found;
  found.n = (int)n_found;
  for (size_t i = 0; i < n_found; i++) {
    LLMMEM_CHECK_ARG(found_infs[i] != NULL, "llmmem_scaler_update_cuda: found_infs[%zu] is NULL", i);
    found.ptr[i] = found_infs[i];
  }
  llmmem_cuda::device_guard guard(device); // restores the caller's device on return
  LLMMEM_CUDA_TRY(guard.err);
  update_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(
      scale, growth_tracker, hysteresis_tracker, stats, found, cfg->growth_factor, cfg->backoff_factor,
      cfg->growth_interval, cfg->hysteresis, cfg->min_scale, cfg->hysteresis_on_growth);
  LLMMEM_CUDA_TRY(cudaGetLastError());
  return LLMMEM_OK;
}
