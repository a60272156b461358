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
 * Messages of TWO_SHOT_MIN_BYTES and more use the two-shot kernel instead: rank r sums only part
 * r of every slot (reading the message about once instead of world times), writes it to `out` and
 * back into part r of its own slot; a second per-block barrier (flag set B); then it copies the
 * other parts from their owners' slots. Block b handles the same offsets inside every part on
 * every rank, so per-block barriers suffice, and the sum order is the same as one-shot's.
 *
 * What this file does not do: multimem (NVLS) variants and large messages (NCCL is faster there;
 * llmmem/parallel/collectives.py routes them to torch.distributed).
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
#define AR_FLAG_BYTES 4096 /* two sets (A, B) of AR_MAX_BLOCKS * AR_MAX_WORLD uint32 flags, padded */
#define AR_FLAGS_B_OFFSET 2048
#define TWO_SHOT_MIN_BYTES (256u * 1024u)

static_assert(AR_MAX_BLOCKS * AR_MAX_WORLD * sizeof(uint32_t) <= AR_FLAGS_B_OFFSET, "flag area too small");
static_assert(sizeof(cudaIpcMemHandle_t) == LLMMEM_CUDA_IPC_HANDLE_BYTES, "IPC handle size changed");

struct llmmem_cuda_ar_s {
  int device, rank, world;
  size_t max_bytes;
  double timeout_s;
  char *local;                  /* this rank's buffer */
  char *peers[AR_MAX_WORLD];    /* every rank's buffer as mapped here (peers[rank] == local) */
  int *error;                   /* device view of error_host: a kernel that gave up waiting sets it to 1 */
  volatile int *error_host;     /* mapped pinned host memory: read without synchronising, so a
                                   timed-out communicator fails the next call instead of silently
                                   computing on stale peer data */
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

/* Block-level barrier across ranks on flag set at byte offset `flags_off`: thread t tells peer t
 * "this block reached epoch" and waits for peer t's word. Returns false if a peer never came. */
__device__ __forceinline__ bool block_barrier(const PeerPtrs &ptrs, int rank, int world, size_t flags_off,
                                              uint32_t epoch, uint64_t timeout_ns, int *error) {
  __syncthreads();
  int failed = 0;
  if (threadIdx.x < world) {
    int peer = threadIdx.x;
    __threadfence_system(); /* this block's earlier writes (after the __syncthreads) before the flag */
    uint32_t *to_peer = reinterpret_cast<uint32_t *>(ptrs.p[peer] + flags_off) + blockIdx.x * AR_MAX_WORLD + rank;
    st_release_sys(to_peer, epoch);
    const uint32_t *from_peer =
        reinterpret_cast<const uint32_t *>(ptrs.p[rank] + flags_off) + blockIdx.x * AR_MAX_WORLD + peer;
    uint64_t start = global_ns();
    while ((int32_t)(ld_acquire_sys(from_peer) - epoch) < 0) {
      if (global_ns() - start > timeout_ns) {
        failed = 1;
        *(volatile int *)error = 1; /* a plain store: host memory need not support GPU atomics */
        __threadfence_system();
        break;
      }
    }
  }
  /* a peer is missing: its slot may hold stale data, so this block stops */
  return __syncthreads_or(failed) == 0;
}

template <typename T>
__global__ void one_shot_all_reduce_kernel(PeerPtrs ptrs, int rank, int world, size_t count, size_t slot_off,
                                           uint32_t epoch, uint64_t timeout_ns, int *error, T *out) {
  if (!block_barrier(ptrs, rank, world, 0, epoch, timeout_ns, error)) return;
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
    float acc = to_f32(reinterpret_cast<const T *>(ptrs.p[0] + slot_off)[i]);
    for (int q = 1; q < world; q++) acc += to_f32(reinterpret_cast<const T *>(ptrs.p[q] + slot_off)[i]);
    out[i] = from_f32<T>(acc);
  }
}

/* part q of a message of `count` elements split in `world` parts: [q*per, min((q+1)*per, count)) */
template <typename T>
__global__ void two_shot_all_reduce_kernel(PeerPtrs ptrs, int rank, int world, size_t count, size_t per,
                                           size_t slot_off, uint32_t epoch, uint64_t timeout_ns, int *error, T *out) {
  if (!block_barrier(ptrs, rank, world, 0, epoch, timeout_ns, error)) return;
  size_t stride = (size_t)gridDim.x * blockDim.x, first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  /* phase 1: reduce my part into out and into my slot (only I touch part `rank` of my slot) */
  size_t lo = (size_t)rank * per, hi = lo + per < count ? lo + per : count;
  T *mine = reinterpret_cast<T *>(ptrs.p[rank] + slot_off);
  for (size_t i = lo + first; i < hi; i += stride) {
    float acc = to_f32(reinterpret_cast<const T *>(ptrs.p[0] + slot_off)[i]);
    for (int q = 1; q < world; q++) acc += to_f32(reinterpret_cast<const T *>(ptrs.p[q] + slot_off)[i]);
    T v = from_f32<T>(acc);
    out[i] = v;
    mine[i] = v;
  }
  if (!block_barrier(ptrs, rank, world, AR_FLAGS_B_OFFSET, epoch, timeout_ns, error)) return;
  /* phase 2: the other parts, from the slots of the ranks that reduced them */
  for (int q = 0; q < world; q++) {
    if (q == rank) continue;
    size_t qlo = (size_t)q * per, qhi = qlo + per < count ? qlo + per : count;
    const T *theirs = reinterpret_cast<const T *>(ptrs.p[q] + slot_off);
    for (size_t i = qlo + first; i < qhi; i += stride) out[i] = theirs[i];
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
  int *host = NULL;
  LLMMEM_CUDA_TRY(cudaHostAlloc((void **)&host, sizeof(int), cudaHostAllocMapped));
  *host = 0;
  ar->error_host = host;
  LLMMEM_CUDA_TRY(cudaHostGetDevicePointer((void **)&ar->error, host, 0));
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
  if (ar->error_host) (void)cudaFreeHost((void *)ar->error_host);
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

static llmmem_status_t all_reduce_on_device(llmmem_cuda_ar_t *ar, const void *in, void *out, size_t count,
                                            llmmem_comm_dtype_t dtype, void *stream);

/* The kernel must run on the communicator's device whatever device the caller has current. */
extern "C" LLMMEM_API llmmem_status_t llmmem_cuda_ar_all_reduce(llmmem_cuda_ar_t *ar, const void *in, void *out,
                                                                size_t count, llmmem_comm_dtype_t dtype,
                                                                void *stream) {
  LLMMEM_CHECK_ARG(ar != NULL, "llmmem_cuda_ar_all_reduce: ar must not be NULL");
  WITH_DEVICE(ar->device, all_reduce_on_device(ar, in, out, count, dtype, stream));
}

static llmmem_status_t all_reduce_on_device(llmmem_cuda_ar_t *ar, const void *in, void *out, size_t count,
                                            llmmem_comm_dtype_t dtype, void *stream) {
  size_t es = llmmem_comm_dtype_size(dtype);
  LLMMEM_CHECK_ARG(es != 0, "llmmem_cuda_ar_all_reduce: unknown dtype %d", (int)dtype);
  LLMMEM_CHECK_ARG(count == 0 || (in != NULL && out != NULL), "llmmem_cuda_ar_all_reduce: in/out must not be NULL");
  LLMMEM_CHECK_ARG(count * es <= ar->max_bytes, "llmmem_cuda_ar_all_reduce: %zu bytes exceed the buffer (%zu bytes)",
                   count * es, ar->max_bytes);
  if (ar->world > 1 && !ar->connected)
    return LLMMEM_FAIL(LLMMEM_ERR_STATE, "llmmem_cuda_ar_all_reduce: call llmmem_cuda_ar_connect first");
  if (*ar->error_host)
    return LLMMEM_FAIL(LLMMEM_ERR_STATE, "llmmem cuda all_reduce: an earlier call on rank %d timed out waiting for a "
                                         "peer; the communicator is unusable", ar->rank);
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
  uint64_t timeout_ns = (uint64_t)(ar->timeout_s * 1e9);
  if (count * es >= TWO_SHOT_MIN_BYTES) {
    size_t per = (count + (size_t)ar->world - 1) / (size_t)ar->world;
    size_t want = (per + AR_THREADS - 1) / AR_THREADS;
    int blocks = want < AR_MAX_BLOCKS ? (int)want : AR_MAX_BLOCKS;
    switch (dtype) {
      case LLMMEM_COMM_F32:
        two_shot_all_reduce_kernel<float><<<blocks, AR_THREADS, 0, s>>>(ptrs, ar->rank, ar->world, count, per, slot_off,
                                                                         epoch, timeout_ns, ar->error, (float *)out);
        break;
      case LLMMEM_COMM_F16:
        two_shot_all_reduce_kernel<__half><<<blocks, AR_THREADS, 0, s>>>(
            ptrs, ar->rank, ar->world, count, per, slot_off, epoch, timeout_ns, ar->error, (__half *)out);
        break;
      default:
        two_shot_all_reduce_kernel<__nv_bfloat16><<<blocks, AR_THREADS, 0, s>>>(
            ptrs, ar->rank, ar->world, count, per, slot_off, epoch, timeout_ns, ar->error, (__nv_bfloat16 *)out);
        break;
    }
    LLMMEM_CUDA_TRY(cudaGetLastError());
    return LLMMEM_OK;
  }
  size_t want_blocks = (count + AR_THREADS - 1) / AR_THREADS;
  int blocks = want_blocks < AR_MAX_BLOCKS ? (int)want_blocks : AR_MAX_BLOCKS;
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
  if (*ar->error_host)
    return LLMMEM_FAIL(LLMMEM_ERR_STATE, "llmmem cuda all_reduce: rank %d timed out after %.3g s waiting for a peer "
                                         "(did every rank call the same collective?)", ar->rank, ar->timeout_s);
  return LLMMEM_OK;
}
