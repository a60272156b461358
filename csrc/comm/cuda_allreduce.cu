/*
 * cuda_allreduce.cu — one-shot all-reduce between the GPUs (or processes) of one node over CUDA IPC.
 *
 * Each rank owns one device buffer: [flags, 4 KiB][data slot 0][data slot 1], shared with its
 * peers through cudaIpcGetMemHandle / cudaIpcOpenMemHandle. A call copies the input into this
 * rank's slot (epoch & 1), then one kernel: per block, thread t signals "arrived at epoch e" in
 * peer t's flags (st.release.sys) and waits for peer t's signal in its own flags
 * (ld.acquire.sys), then every thread sums element i of all slots in fp32, in rank order 0..n-1
 * (the same order as llmmem_comm_sum_ref, so every rank gets the same bits), and writes `out`.
 *
 * Slots alternate by epoch: a block of this rank reaches epoch e only after the same block of
 * every peer reached e-1, i.e. after each peer's kernel e-2 finished, so slot (e & 1) is free.
 * This needs the same grid on every rank (it depends only on count) and calls ordered on one
 * stream per rank. Waits are bounded by %globaltimer: a peer that never arrives sets an error
 * word that llmmem_cuda_ar_check reports, instead of hanging the GPU forever.
 *
 * What this file does not do: two-shot / multimem variants and large messages (NCCL is faster
 * there; llmmem/parallel/collectives.py routes them to torch.distributed).
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <string.h>

#include <new>

#include <llmmem/comm.h>

#include "cuda_check.h"

#define AR_MAX_WORLD 8
#define AR_MAX_BLOCKS 32
#define AR_THREADS 512
#define AR_FLAG_BYTES 4096 /* AR_MAX_BLOCKS * AR_MAX_WORLD uint32 flags, padded */

static_assert(AR_MAX_BLOCKS * AR_MAX_WORLD * sizeof(uint32_t) <= AR_FLAG_BYTES, "flag area too small");
static_assert(sizeof(cudaIpcMemHandle_t) == LLMMEM_CUDA_IPC_HANDLE_BYTES, "IPC handle size changed");

struct llmmem_cuda_ar_s {
  int device, rank, world;
  size_t max_bytes;
  double timeout_s;
  char *local;                  /* this rank's buffer */
  char *peers[AR_MAX_WORLD];    /* every rank's buffer as mapped here (peers[rank] == local) */
  int *error;                   /* device word: 1 when a kernel gave up waiting */
  uint32_t epoch;
  int connected;
};

struct PeerPtrs {
  char *p[AR_MAX_WORLD];
};

__device__ __forceinline__ void st_release_sys(uint32_t *addr, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t *addr) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T>
__global__ void one_shot_all_reduce_kernel(PeerPtrs ptrs, int rank, int world, size_t count, size_t slot_off,
                                           uint32_t epoch, uint64_t timeout_ns, int *error, T *out) {
  if (threadIdx.x < world) {
    int peer = threadIdx.x;
    uint32_t *to_peer = reinterpret_cast<uint32_t *>(ptrs.p[peer]) + blockIdx.x * AR_MAX_WORLD + rank;
    st_release_sys(to_peer, epoch);
    const uint32_t *from_peer = reinterpret_cast<const uint32_t *>(ptrs.p[rank]) + blockIdx.x * AR_MAX_WORLD + peer;
    uint64_t start = global_ns();
    while ((int32_t)(ld_acquire_sys(from_peer) - epoch) < 0) {
      if (global_ns() - start > timeout_ns) {
        atomicExch(error, 1);
        break;
      }
    }
  }
  __syncthreads();
  if (*(volatile int *)error) return; /* a peer is missing: its slot may hold stale data */
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
    float acc = to_f32(reinterpret_cast<const T *>(ptrs.p[0] + slot_off)[i]);
    for (int q = 1; q < world; q++) acc += to_f32(reinterpret_cast<const T *>(ptrs.p[q] + slot_off)[i]);
    out[i] = from_f32<T>(acc);
  }
}

/* Runs `body` with `device` current, restoring the caller's device afterwards. */
#define WITH_DEVICE(dev, body)                        \
  do {                                                \
    int prev_ = -1;                                   \
    LLMMEM_CUDA_TRY(cudaGetDevice(&prev_));           \
    if (prev_ != (dev)) LLMMEM_CUDA_TRY(cudaSetDevice(dev)); \
    llmmem_status_t st_ = (body);                     \
    if (prev_ != (dev)) (void)cudaSetDevice(prev_);   \
    return st_;                                       \
  } while (0)

static llmmem_status_t create_on_device(llmmem_cuda_ar_t *ar, void *handle_out) {
  size_t total = AR_FLAG_BYTES + 2 * ar->max_bytes;
  LLMMEM_CUDA_TRY(cudaMalloc((void **)&ar->local, total));
  LLMMEM_CUDA_TRY(cudaMemset(ar->local, 0, AR_FLAG_BYTES));
  LLMMEM_CUDA_TRY(cudaMalloc((void **)&ar->error, sizeof(int)));
  LLMMEM_CUDA_TRY(cudaMemset(ar->error, 0, sizeof(int)));
  cudaIpcMemHandle_t h;
  LLMMEM_CUDA_TRY(cudaIpcGetMemHandle(&h, ar->local));
  memcpy(handle_out, &h, sizeof h);
  LLMMEM_CUDA_TRY(cudaDeviceSynchronize());
  return LLMMEM_OK;
}

static void release(llmmem_cuda_ar_t *ar) {
  int prev = -1;
  if (cudaGetDevice(&prev) == cudaSuccess && prev != ar->device) (void)cudaSetDevice(ar->device);
  for (int q = 0; q < ar->world; q++)
    if (q != ar->rank && ar->peers[q]) (void)cudaIpcCloseMemHandle(ar->peers[q]);
  if (ar->local) (void)cudaFree(ar->local);
  if (ar->error) (void)cudaFree(ar->error);
  (void)cudaGetLastError();
  if (prev >= 0 && prev != ar->device) (void)cudaSetDevice(prev);
  delete ar;
}

extern "C" LLMMEM_API llmmem_status_t llmmem_cuda_ar_create(int device, int rank, int world_size, size_t max_bytes,
                                                            double timeout_s, llmmem_cuda_ar_t **out,
                                                            void *handle_out) {
  LLMMEM_CHECK_ARG(out != NULL && handle_out != NULL, "llmmem_cuda_ar_create: out and handle_out must not be NULL");
  *out = NULL;
  LLMMEM_CHECK_ARG(world_size >= 1 && world_size <= AR_MAX_WORLD,
                   "llmmem_cuda_ar_create: world_size must be in 1..%d, got %d", AR_MAX_WORLD, world_size);
  LLMMEM_CHECK_ARG(rank >= 0 && rank < world_size, "llmmem_cuda_ar_create: rank must be in 0..%d, got %d",
                   world_size - 1, rank);
  LLMMEM_CHECK_ARG(max_bytes > 0 && max_bytes % 256 == 0 && max_bytes <= ((size_t)1 << 31),
                   "llmmem_cuda_ar_create: max_bytes must be a positive multiple of 256 up to 2 GiB, got %zu",
                   max_bytes);
  LLMMEM_CHECK_ARG(timeout_s > 0, "llmmem_cuda_ar_create: timeout_s must be > 0, got %g", timeout_s);
  LLMMEM_CHECK_ARG(device >= 0, "llmmem_cuda_ar_create: device must be >= 0, got %d", device);
  llmmem_cuda_ar_t *ar = new (std::nothrow) llmmem_cuda_ar_t();
  if (!ar) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_cuda_ar_create: out of host memory");
  ar->device = device;
  ar->rank = rank;
  ar->world = world_size;
  ar->max_bytes = max_bytes;
  ar->timeout_s = timeout_s;
  int prev = -1;
  cudaError_t e = cudaGetDevice(&prev);
  if (e == cudaSuccess && prev != device) e = cudaSetDevice(device);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    delete ar;
    return LLMMEM_FAIL(_llmmem_cuda_is_no_device(e) ? LLMMEM_ERR_NO_DEVICE : LLMMEM_ERR_CUDA,
                       "llmmem_cuda_ar_create: cannot use device %d: %s", device, cudaGetErrorString(e));
  }
  llmmem_status_t st = create_on_device(ar, handle_out);
  if (prev >= 0 && prev != device) (void)cudaSetDevice(prev);
  if (st != LLMMEM_OK) {
    release(ar);
    return st;
  }
  ar->peers[rank] = ar->local;
  *out = ar;
  return LLMMEM_OK;
}

static llmmem_status_t connect_on_device(llmmem_cuda_ar_t *ar, const void *handles) {
  for (int q = 0; q < ar->world; q++) {
    if (q == ar->rank) continue;
    cudaIpcMemHandle_t h;
    memcpy(&h, (const char *)handles + (size_t)q * sizeof h, sizeof h);
    LLMMEM_CUDA_TRY(cudaIpcOpenMemHandle((void **)&ar->peers[q], h, cudaIpcMemLazyEnablePeerAccess));
  }
  ar->connected = 1;
  return LLMMEM_OK;
}

extern "C" LLMMEM_API llmmem_status_t llmmem_cuda_ar_connect(llmmem_cuda_ar_t *ar, const void *handles) {
  LLMMEM_CHECK_ARG(ar != NULL && handles != NULL, "llmmem_cuda_ar_connect: ar and handles must not be NULL");
  LLMMEM_CHECK_ARG(!ar->connected, "llmmem_cuda_ar_connect: already connected");
  WITH_DEVICE(ar->device, connect_on_device(ar, handles));
}

extern "C" LLMMEM_API llmmem_status_t llmmem_cuda_ar_close(llmmem_cuda_ar_t *ar) {
  if (ar) release(ar);
  return LLMMEM_OK;
}

extern "C" LLMMEM_API llmmem_status_t llmmem_cuda_ar_all_reduce(llmmem_cuda_ar_t *ar, const void *in, void *out,
                                                                size_t count, llmmem_comm_dtype_t dtype,
                                                                void *stream) {
  LLMMEM_CHECK_ARG(ar != NULL, "llmmem_cuda_ar_all_reduce: ar must not be NULL");
  size_t es = llmmem_comm_dtype_size(dtype);
  LLMMEM_CHECK_ARG(es != 0, "llmmem_cuda_ar_all_reduce: unknown dtype %d", (int)dtype);
  LLMMEM_CHECK_ARG(count == 0 || (in != NULL && out != NULL), "llmmem_cuda_ar_all_reduce: in/out must not be NULL");
  LLMMEM_CHECK_ARG(count * es <= ar->max_bytes, "llmmem_cuda_ar_all_reduce: %zu bytes exceed the buffer (%zu bytes)",
                   count * es, ar->max_bytes);
  if (ar->world > 1 && !ar->connected)
    return LLMMEM_FAIL(LLMMEM_ERR_STATE, "llmmem_cuda_ar_all_reduce: call llmmem_cuda_ar_connect first");
  cudaStream_t s = (cudaStream_t)stream;
  if (count == 0) return LLMMEM_OK;
  if (ar->world == 1) {
    if (in != out) LLMMEM_CUDA_TRY(cudaMemcpyAsync(out, in, count * es, cudaMemcpyDeviceToDevice, s));
    return LLMMEM_OK;
  }
  uint32_t epoch = ++ar->epoch;
  size_t slot_off = AR_FLAG_BYTES + (size_t)(epoch & 1u) * ar->max_bytes;
  LLMMEM_CUDA_TRY(cudaMemcpyAsync(ar->local + slot_off, in, count * es, cudaMemcpyDeviceToDevice, s));
  PeerPtrs ptrs;
  memset(&ptrs, 0, sizeof ptrs);
  for (int q = 0; q < ar->world; q++) ptrs.p[q] = ar->peers[q];
  size_t want_blocks = (count + AR_THREADS - 1) / AR_THREADS;
  int blocks = want_blocks < AR_MAX_BLOCKS ? (int)want_blocks : AR_MAX_BLOCKS;
  uint64_t timeout_ns = (uint64_t)(ar->timeout_s * 1e9);
  switch (dtype) {
    case LLMMEM_COMM_F32:
      one_shot_all_reduce_kernel<float><<<blocks, AR_THREADS, 0, s>>>(ptrs, ar->rank, ar->world, count, slot_off,
                                                                       epoch, timeout_ns, ar->error, (float *)out);
      break;
    case LLMMEM_COMM_F16:
      one_shot_all_reduce_kernel<__half><<<blocks, AR_THREADS, 0, s>>>(ptrs, ar->rank, ar->world, count, slot_off,
                                                                        epoch, timeout_ns, ar->error, (__half *)out);
      break;
    default:
      one_shot_all_reduce_kernel<__nv_bfloat16><<<blocks, AR_THREADS, 0, s>>>(
          ptrs, ar->rank, ar->world, count, slot_off, epoch, timeout_ns, ar->error, (__nv_bfloat16 *)out);
      break;
  }
  LLMMEM_CUDA_TRY(cudaGetLastError());
  return LLMMEM_OK;
}

extern "C" LLMMEM_API llmmem_status_t llmmem_cuda_ar_check(llmmem_cuda_ar_t *ar, void *stream) {
  LLMMEM_CHECK_ARG(ar != NULL, "llmmem_cuda_ar_check: ar must not be NULL");
  LLMMEM_CUDA_TRY(cudaStreamSynchronize((cudaStream_t)stream));
  int err = 0;
  LLMMEM_CUDA_TRY(cudaMemcpy(&err, ar->error, sizeof err, cudaMemcpyDeviceToHost));
  if (err)
    return LLMMEM_FAIL(LLMMEM_ERR_STATE, "llmmem cuda all_reduce: rank %d timed out after %.3g s waiting for a peer "
                                         "(did every rank call the same collective?)", ar->rank, ar->timeout_s);
  return LLMMEM_OK;
}
