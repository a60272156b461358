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
 * stream per rank.
 *
 * Faults. Waits are bounded by %globaltimer. The first barrier also exchanges the ranks' call
 * descriptors (epoch, dtype, count; each rank writes its own into its peers' headers), so ranks
 * that disagree on size or dtype are detected. A block
 * that gives up (timeout, disagreement) writes an abort word into every rank's buffer (its own
 * too): every block of every rank polls those words while it waits, so the other blocks, the
 * peers and the kernels already queued behind stop at once instead of each waiting out its own
 * timeout. The first failure of a rank is recorded in mapped host memory (ar_error_t), which
 * llmmem_cuda_ar_check reports after synchronising and every later llmmem_cuda_ar_all_reduce
 * reports without synchronising (it refuses to launch). The elements a failed block was to write
 * are set to NaN, so a result used before the check is visibly wrong, not a partial sum.
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

#include <llmmem/parallel.h>

#include "cuda_check.h"
#include "cuda_device_guard.h"

using llmmem_cuda::device_guard;

#define AR_MAX_WORLD       8
#define AR_MAX_BLOCKS      32
#define AR_THREADS         512
#define AR_FLAG_BYTES      4096 /* the header of each rank's buffer: flag sets A and B, abort words, descriptors */
#define AR_FLAGS_B_OFFSET  2048
#define AR_ABORT_OFFSET    3072 /* uint32 abort[AR_MAX_WORLD]: abort[q] != 0: rank q failed (an ar_fail_t) */
#define AR_DESC_OFFSET     3136 /* ar_desc_t desc[AR_MAX_WORLD][2]: [q][e & 1] = rank q's call e, written by q */
#define TWO_SHOT_MIN_BYTES (256u * 1024u)

/* Why a kernel gave up (values of abort words and of ar_error_t.kind). */
enum ar_fail_t { AR_FAIL_NONE = 0, AR_FAIL_TIMEOUT = 1, AR_FAIL_PEER = 2, AR_FAIL_MISMATCH = 3 };

/* A rank's call, written by it into every peer's header (a posted write: no remote read on the
 * critical path); every rank checks the ones it received after the first barrier. */
struct ar_desc_t {
  uint32_t epoch;
  uint32_t dtype;
  uint64_t count;
};

/* What a kernel that gave up tells its host: mapped pinned memory, read without synchronising.
 * Written once per communicator (the first failing thread of this rank, decided by a CAS on this
 * rank's own abort word), `kind` last. */
struct ar_error_t {
  int kind; /* ar_fail_t */
  int peer; /* the rank waited for, disagreeing with us, or that failed first */
  uint32_t epoch, peer_epoch;
  uint32_t dtype, peer_dtype;
  uint64_t count, peer_count;
};

static_assert(AR_MAX_BLOCKS * AR_MAX_WORLD * sizeof(uint32_t) <= AR_FLAGS_B_OFFSET, "flag area too small");
static_assert(AR_FLAGS_B_OFFSET + AR_MAX_BLOCKS * AR_MAX_WORLD * sizeof(uint32_t) <= AR_ABORT_OFFSET,
              "flag set B overlaps the abort words");
static_assert(AR_ABORT_OFFSET + AR_MAX_WORLD * sizeof(uint32_t) <= AR_DESC_OFFSET, "abort words overlap");
static_assert(AR_DESC_OFFSET + AR_MAX_WORLD * 2 * sizeof(ar_desc_t) <= AR_FLAG_BYTES,
              "descriptors overflow the header");
static_assert(sizeof(cudaIpcMemHandle_t) == LLMMEM_CUDA_IPC_HANDLE_BYTES, "IPC handle size changed");

struct llmmem_cuda_ar_s {
  int device, rank, world;
  size_t max_bytes;
  double timeout_s;
  char *local;                     /* this rank's buffer */
  char *peers[AR_MAX_WORLD];       /* every rank's buffer as mapped here (peers[rank] == local) */
  ar_error_t *error;               /* device view of error_host */
  volatile ar_error_t *error_host; /* mapped pinned host memory: read without synchronising, so a
                                      failed communicator fails the next call instead of silently
                                      computing on stale peer data */
  uint32_t epoch;
  int connected;
};

struct PeerPtrs {
  char *p[AR_MAX_WORLD];
};

/* Everything one call's kernel needs, equal on every rank except `rank` (and the pointers). */
struct ArCall {
  PeerPtrs ptrs;
  int rank, world;
  uint32_t epoch, dtype;
  size_t count, per; /* per: elements of each part (two-shot) */
  size_t slot_off;
  uint64_t timeout_ns;
  ar_error_t *error;
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
template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ uint32_t *abort_words(const ArCall &c, int owner) {
  return reinterpret_cast<uint32_t *>(c.ptrs.p[owner] + AR_ABORT_OFFSET);
}

/* Where rank `from` puts the descriptor of its current call in rank `owner`'s header. */
__device__ __forceinline__ ar_desc_t *desc_slot(const ArCall &c, int owner, int from) {
  return reinterpret_cast<ar_desc_t *>(c.ptrs.p[owner] + AR_DESC_OFFSET) + (size_t)from * 2u + (c.epoch & 1u);
}

/* The first rank whose abort word is set in this rank's buffer (this rank included), or -1. */
__device__ int aborted_by(const ArCall &c) {
  const volatile uint32_t *ab = abort_words(c, c.rank);
  for (int q = 0; q < c.world; q++)
    if (ab[q] != AR_FAIL_NONE) return q;
  return -1;
}

/* Records that this rank gives up. The first failure of this rank (CAS on its own abort word,
 * which also stops its later kernels at once) fills the host's error record. A failure found
 * here (timeout, mismatch) is also written to every peer's abort word, so their kernels stop
 * waiting for us instead of each spinning to its own timeout. */
__device__ void give_up(const ArCall &c, ar_fail_t kind, int peer, const ar_desc_t *peer_desc) {
  if (atomicCAS(abort_words(c, c.rank) + c.rank, 0u, (uint32_t)kind) == 0u) {
    volatile ar_error_t *e = c.error;
    e->peer = peer;
    e->epoch = c.epoch;
    e->dtype = c.dtype;
    e->count = c.count;
    if (peer_desc) {
      e->peer_epoch = peer_desc->epoch;
      e->peer_dtype = peer_desc->dtype;
      e->peer_count = peer_desc->count;
    }
    __threadfence_system();
    e->kind = kind; /* a plain store: host memory need not support GPU atomics */
    __threadfence_system();
  }
  if (kind != AR_FAIL_PEER)
    for (int q = 0; q < c.world; q++)
      if (q != c.rank) st_release_sys(abort_words(c, q) + c.rank, (uint32_t)kind);
}

/* Block-level barrier across ranks on the flag set at byte offset `flags_off`: thread t tells
 * peer t "this block reached epoch" and waits for peer t's word. The first barrier of a call
 * (set A) also sends this rank's descriptor to each peer before the flag and checks the one each
 * peer sent after. Returns false, with the failure recorded, if a peer never came (timeout),
 * disagreed, or any rank failed already (abort words: looked at whenever the flag is not there
 * yet, then every 256 polls, so queued kernels stop at once). */
__device__ __forceinline__ bool block_barrier(const ArCall &c, size_t flags_off) {
  __syncthreads();
  int failed = 0;
  if (threadIdx.x < c.world) {
    int peer = threadIdx.x;
    if (flags_off == 0) { /* every block sends the same descriptor; the release below orders it */
      volatile ar_desc_t *to = desc_slot(c, peer, c.rank);
      to->epoch = c.epoch;
      to->dtype = c.dtype;
      to->count = c.count;
    }
    __threadfence_system(); /* this block's earlier writes (after the __syncthreads) before the flag */
    uint32_t *to_peer = reinterpret_cast<uint32_t *>(c.ptrs.p[peer] + flags_off) + blockIdx.x * AR_MAX_WORLD + c.rank;
    st_release_sys(to_peer, c.epoch);
    const uint32_t *from_peer =
        reinterpret_cast<const uint32_t *>(c.ptrs.p[c.rank] + flags_off) + blockIdx.x * AR_MAX_WORLD + peer;
    uint64_t start = 0;
    for (uint64_t it = 0;; it++) {
      if ((int32_t)(ld_acquire_sys(from_peer) - c.epoch) >= 0) break;
      if ((it & 255u) == 0) {
        int q = aborted_by(c);
        if (q >= 0) {
          failed = 1;
          give_up(c, AR_FAIL_PEER, q, NULL);
          break;
        }
        uint64_t now = global_ns();
        if (it == 0)
          start = now;
        else if (now - start > c.timeout_ns) {
          failed = 1;
          give_up(c, AR_FAIL_TIMEOUT, peer, NULL);
          break;
        }
      }
    }
    if (!failed && flags_off == 0 && peer != c.rank) {
      /* the peer wrote it before the flag we just acquired */
      const volatile ar_desc_t *d = desc_slot(c, c.rank, peer);
      ar_desc_t theirs;
      theirs.epoch = d->epoch;
      theirs.dtype = d->dtype;
      theirs.count = d->count;
      if (theirs.epoch != c.epoch || theirs.dtype != c.dtype || theirs.count != c.count) {
        failed = 1;
        give_up(c, AR_FAIL_MISMATCH, peer, &theirs);
      }
    }
  }
  return __syncthreads_or(failed) == 0;
}

/* A block that gave up sets the elements it was to write to NaN: a result used before the host
 * checks the error is visibly wrong, never a plausible partial sum. */
template <typename T>
__device__ void poison(const ArCall &c, T *out) {
  const T nan = from_f32<T>(__int_as_float(0x7fc00000));
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < c.count; i += (size_t)gridDim.x * blockDim.x)
    out[i] = nan;
}

template <typename T>
__global__ void one_shot_all_reduce_kernel(ArCall c, T *out) {
  if (!block_barrier(c, 0)) return poison(c, out);
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < c.count; i += stride) {
    float acc = to_f32(reinterpret_cast<const T *>(c.ptrs.p[0] + c.slot_off)[i]);
    for (int q = 1; q < c.world; q++) acc += to_f32(reinterpret_cast<const T *>(c.ptrs.p[q] + c.slot_off)[i]);
    out[i] = from_f32<T>(acc);
  }
}

/* part q of a message of `count` elements split in `world` parts: [q*per, min((q+1)*per, count)) */
template <typename T>
__global__ void two_shot_all_reduce_kernel(ArCall c, T *out) {
  if (!block_barrier(c, 0)) return poison(c, out);
  size_t stride = (size_t)gridDim.x * blockDim.x, first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  /* phase 1: reduce my part into out and into my slot (only I touch part `rank` of my slot) */
  size_t lo = (size_t)c.rank * c.per, hi = lo + c.per < c.count ? lo + c.per : c.count;
  T *mine = reinterpret_cast<T *>(c.ptrs.p[c.rank] + c.slot_off);
  for (size_t i = lo + first; i < hi; i += stride) {
    float acc = to_f32(reinterpret_cast<const T *>(c.ptrs.p[0] + c.slot_off)[i]);
    for (int q = 1; q < c.world; q++) acc += to_f32(reinterpret_cast<const T *>(c.ptrs.p[q] + c.slot_off)[i]);
    T v = from_f32<T>(acc);
    out[i] = v;
    mine[i] = v;
  }
  if (!block_barrier(c, AR_FLAGS_B_OFFSET)) return poison(c, out);
  /* phase 2: the other parts, from the slots of the ranks that reduced them */
  for (int q = 0; q < c.world; q++) {
    if (q == c.rank) continue;
    size_t qlo = (size_t)q * c.per, qhi = qlo + c.per < c.count ? qlo + c.per : c.count;
    const T *theirs = reinterpret_cast<const T *>(c.ptrs.p[q] + c.slot_off);
    for (size_t i = qlo + first; i < qhi; i += stride) out[i] = theirs[i];
  }
}

static llmmem_status_t create_on_device(llmmem_cuda_ar_t *ar, void *handle_out) {
  size_t total = AR_FLAG_BYTES + 2 * ar->max_bytes;
  LLMMEM_CUDA_TRY(cudaMalloc((void **)&ar->local, total));
  LLMMEM_CUDA_TRY(cudaMemset(ar->local, 0, AR_FLAG_BYTES));
  ar_error_t *host = NULL;
  LLMMEM_CUDA_TRY(cudaHostAlloc((void **)&host, sizeof(ar_error_t), cudaHostAllocMapped));
  memset(host, 0, sizeof *host);
  ar->error_host = host;
  LLMMEM_CUDA_TRY(cudaHostGetDevicePointer((void **)&ar->error, host, 0));
  cudaIpcMemHandle_t h;
  LLMMEM_CUDA_TRY(cudaIpcGetMemHandle(&h, ar->local));
  memcpy(handle_out, &h, sizeof h);
  LLMMEM_CUDA_TRY(cudaDeviceSynchronize());
  return LLMMEM_OK;
}

static void release(llmmem_cuda_ar_t *ar) {
  device_guard guard(ar->device); /* best effort: the frees below run whatever its outcome */
  /* Kernels of ours may still be queued on a stream, reading the peers' buffers through the
   * mappings closed below (cudaIpcCloseMemHandle does not wait for them): wait first. Bounded:
   * a kernel waiting for a peer gives up after the timeout. */
  if (ar->connected) (void)cudaDeviceSynchronize();
  for (int q = 0; q < ar->world; q++)
    if (q != ar->rank && ar->peers[q]) (void)cudaIpcCloseMemHandle(ar->peers[q]);
  if (ar->local) (void)cudaFree(ar->local);
  if (ar->error_host) (void)cudaFreeHost((void *)ar->error_host);
  (void)cudaGetLastError();
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
  device_guard guard(device); /* the caller's device is current again on every return below */
  if (guard.err != cudaSuccess) {
    (void)cudaGetLastError();
    delete ar;
    return LLMMEM_FAIL(_llmmem_cuda_is_no_device(guard.err) ? LLMMEM_ERR_NO_DEVICE : LLMMEM_ERR_CUDA,
                       "llmmem_cuda_ar_create: cannot use device %d: %s", device, cudaGetErrorString(guard.err));
  }
  llmmem_status_t st = create_on_device(ar, handle_out);
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
  device_guard guard(ar->device);
  LLMMEM_CUDA_TRY(guard.err);
  return connect_on_device(ar, handles);
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
  device_guard guard(ar->device);
  LLMMEM_CUDA_TRY(guard.err);
  return all_reduce_on_device(ar, in, out, count, dtype, stream);
}

/* The recorded failure of this rank's kernels as an error naming the collective (LLMMEM_OK if none). */
static llmmem_status_t report_failure(const llmmem_cuda_ar_t *ar, const char *when) {
  const volatile ar_error_t *e = ar->error_host;
  int kind = e->kind;
  if (kind == AR_FAIL_NONE) return LLMMEM_OK;
  switch (kind) {
    case AR_FAIL_TIMEOUT:
      return LLMMEM_FAIL(LLMMEM_ERR_STATE,
                         "llmmem cuda all_reduce%s: rank %d timed out after %.3g s waiting for rank %d in call #%u "
                         "(did every rank call the same collective?); the communicator is unusable",
                         when, ar->rank, ar->timeout_s, e->peer, e->epoch);
    case AR_FAIL_MISMATCH:
      return LLMMEM_FAIL(LLMMEM_ERR_INVALID,
                         "llmmem cuda all_reduce%s: ranks disagree: rank %d called all_reduce #%u with %llu elements "
                         "of dtype %u, rank %d called all_reduce #%u with %llu elements of dtype %u; the communicator "
                         "is unusable",
                         when, ar->rank, e->epoch, (unsigned long long)e->count, e->dtype, e->peer, e->peer_epoch,
                         (unsigned long long)e->peer_count, e->peer_dtype);
    default:
      return LLMMEM_FAIL(LLMMEM_ERR_STATE,
                         "llmmem cuda all_reduce%s: rank %d stopped call #%u because rank %d failed (timed out or "
                         "disagreed; see its error); the communicator is unusable",
                         when, ar->rank, e->epoch, e->peer);
  }
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
  /* an earlier kernel gave up (seen without synchronising): refuse instead of reducing stale data */
  LLMMEM_TRY(report_failure(ar, " (an earlier call)"));
  cudaStream_t s = (cudaStream_t)stream;
  if (ar->world == 1) {
    if (count && in != out) LLMMEM_CUDA_TRY(cudaMemcpyAsync(out, in, count * es, cudaMemcpyDeviceToDevice, s));
    return LLMMEM_OK;
  }
  /* An empty call still takes part (one block, a barrier, no data): skipping it would leave this
   * rank an epoch behind, its next call paired with the peers' current one, and a peer that called
   * with elements would not be told of the disagreement (the shared-memory engine does the same). */
  uint32_t epoch = ++ar->epoch;
  ArCall c;
  memset(&c, 0, sizeof c);
  for (int q = 0; q < ar->world; q++) c.ptrs.p[q] = ar->peers[q];
  c.rank = ar->rank;
  c.world = ar->world;
  c.epoch = epoch;
  c.dtype = (uint32_t)dtype;
  c.count = count;
  c.slot_off = AR_FLAG_BYTES + (size_t)(epoch & 1u) * ar->max_bytes;
  c.timeout_ns = (uint64_t)(ar->timeout_s * 1e9);
  c.error = ar->error;
  if (count) LLMMEM_CUDA_TRY(cudaMemcpyAsync(ar->local + c.slot_off, in, count * es, cudaMemcpyDeviceToDevice, s));
  /* The grid depends on count only; a rank that disagrees on count may launch another grid: its
   * extra blocks (or ours) then stop at the abort word the first disagreeing block writes. */
  const bool two_shot = count * es >= TWO_SHOT_MIN_BYTES;
  if (two_shot) c.per = (count + (size_t)ar->world - 1) / (size_t)ar->world;
  size_t want = ((two_shot ? c.per : count) + AR_THREADS - 1) / AR_THREADS;
  int blocks = want == 0 ? 1 : want < AR_MAX_BLOCKS ? (int)want : AR_MAX_BLOCKS;
  switch (dtype) {
    case LLMMEM_COMM_F32:
      if (two_shot)
        two_shot_all_reduce_kernel<float><<<blocks, AR_THREADS, 0, s>>>(c, (float *)out);
      else
        one_shot_all_reduce_kernel<float><<<blocks, AR_THREADS, 0, s>>>(c, (float *)out);
      break;
    case LLMMEM_COMM_F16:
      if (two_shot)
        two_shot_all_reduce_kernel<__half><<<blocks, AR_THREADS, 0, s>>>(c, (__half *)out);
      else
        one_shot_all_reduce_kernel<__half><<<blocks, AR_THREADS, 0, s>>>(c, (__half *)out);
      break;
    default:
      if (two_shot)
        two_shot_all_reduce_kernel<__nv_bfloat16><<<blocks, AR_THREADS, 0, s>>>(c, (__nv_bfloat16 *)out);
      else
        one_shot_all_reduce_kernel<__nv_bfloat16><<<blocks, AR_THREADS, 0, s>>>(c, (__nv_bfloat16 *)out);
      break;
  }
  LLMMEM_CUDA_TRY(cudaGetLastError());
  return LLMMEM_OK;
}

extern "C" LLMMEM_API llmmem_status_t llmmem_cuda_ar_check(llmmem_cuda_ar_t *ar, void *stream) {
  LLMMEM_CHECK_ARG(ar != NULL, "llmmem_cuda_ar_check: ar must not be NULL");
  LLMMEM_CUDA_TRY(cudaStreamSynchronize((cudaStream_t)stream));
  return report_failure(ar, "");
}
