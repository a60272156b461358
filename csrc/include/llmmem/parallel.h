/*
 * parallel.h — llmmem's intra-node collectives for tensor parallelism.
 *
 * Two engines, each an opaque communicator shared by the ranks (processes) of one group:
 *
 *  - shm: CPU buffers, ranks on one host. A POSIX shared-memory segment holds, per rank, a control
 *    block (flags as C11 atomics) and two data slots used alternately. Sum all-reduce, all-gather
 *    and reduce-scatter for fp32 / fp16 / bf16, accumulated in fp32 in rank order 0..n-1, so every
 *    rank gets bitwise the same result. Messages of any size are sent in chunks of one slot.
 *
 *  - cuda_ar: CUDA buffers, ranks on one node. Each rank allocates a buffer and shares it with an
 *    IPC handle; a one-shot kernel reads all peers' buffers and reduces in fp32 in rank order.
 *    Built only with CUDA (otherwise every call returns LLMMEM_ERR_NOT_BUILT).
 *
 * Waits are bounded: a peer that does not arrive within the communicator's timeout, or whose
 * process has exited, makes the call fail with LLMMEM_ERR_STATE and a detail naming the
 * collective and the rank. After any failure the communicator is broken (all later calls fail)
 * and the other ranks are told through the segment, so they fail fast too. Communicators are not
 * thread-safe: one thread per rank uses one at a time, as with a process group.
 */
#ifndef LLMMEM_COMM_H
#define LLMMEM_COMM_H

#include <llmmem/llmmem.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types of the collectives. Values are stable (the Python binding passes them). */
typedef enum llmmem_comm_dtype_e {
  LLMMEM_COMM_F32 = 0,
  LLMMEM_COMM_F16 = 1,
  LLMMEM_COMM_BF16 = 2,
  LLMMEM_COMM_DTYPE_COUNT_ = 3
} llmmem_comm_dtype_t;

/* Bytes of one element of `dtype`, 0 for an unknown type. */
LLMMEM_API size_t llmmem_comm_dtype_size(llmmem_comm_dtype_t dtype);

/* ---------------------------------------------------------------- shared memory (CPU) */

typedef struct llmmem_shm_comm_s llmmem_shm_comm_t;

/* Called about every 50 ms by a thread that waits in llmmem_shm_comm_open or a collective (never
 * on the fast path); a nonzero return stops the wait: the call fails with LLMMEM_ERR_STATE
 * ("interrupted"), the communicator is broken and the peers are told, as after a timeout. */
typedef int (*llmmem_comm_poll_fn)(void *ctx);

/* Sets the calling thread's wait poll (NULL: none, the default). The Python binding uses it to
 * deliver Ctrl-C promptly instead of after the timeout. Per thread; it affects nothing else. */
LLMMEM_API llmmem_status_t llmmem_comm_set_wait_poll(llmmem_comm_poll_fn fn, void *ctx);

/* Joins the group's segment `name`: a file name (no '/', at most 200 characters) created under
 * /dev/shm, the tmpfs behind POSIX shared memory on Linux (opened directly, so no librt is needed).
 * Rank 0 creates it (it must not exist yet) with `slot_bytes` per slot (rounded up to 4 KiB; 0
 * picks the default, 1 MiB); the other ranks wait up to `timeout_s` seconds for it to appear and
 * check that it was made for the same world size. The name is published with a complete header
 * (O_TMPFILE + link where the kernel has it) and removed by the last rank to join, so nothing is
 * left in /dev/shm once every rank has mapped it, even if a process is killed later. Before that:
 * a rank that fails removes it; a rank that finds the creator or a joined peer dead fails at
 * once; and rank 0 first sweeps away names starting with "llmmem-" whose header says their
 * creator (in this PID namespace) is dead — segments left by a job killed during set-up. Memory
 * is reserved up front (posix_fallocate), so a full /dev/shm is an error here, not a SIGBUS later. */
LLMMEM_API llmmem_status_t llmmem_shm_comm_open(const char *name, int rank, int world_size, size_t slot_bytes,
                                                double timeout_s, llmmem_shm_comm_t **out);

/* Unmaps and frees; NULL is accepted. Does not wait for peers. */
LLMMEM_API llmmem_status_t llmmem_shm_comm_close(llmmem_shm_comm_t *comm);

LLMMEM_API llmmem_status_t llmmem_shm_comm_set_timeout(llmmem_shm_comm_t *comm, double timeout_s);

/* Bytes of one slot (the chunk size of the collectives). */
LLMMEM_API llmmem_status_t llmmem_shm_comm_slot_bytes(const llmmem_shm_comm_t *comm, size_t *out);

/* out[i] = sum over ranks of in[i], i < count. in == out is allowed (in place); otherwise the two
 * buffers must not overlap (nor may they in the two calls below). */
LLMMEM_API llmmem_status_t llmmem_shm_all_reduce(llmmem_shm_comm_t *comm, const void *in, void *out, size_t count,
                                                 llmmem_comm_dtype_t dtype);

/* out = concatenation of every rank's `in` (count elements each), in rank order: world*count elements. */
LLMMEM_API llmmem_status_t llmmem_shm_all_gather(llmmem_shm_comm_t *comm, const void *in, void *out, size_t count,
                                                 llmmem_comm_dtype_t dtype);

/* in holds world*count elements; out[i] = sum over ranks q of in_q[rank*count + i], i < count. */
LLMMEM_API llmmem_status_t llmmem_shm_reduce_scatter(llmmem_shm_comm_t *comm, const void *in, void *out, size_t count,
                                                     llmmem_comm_dtype_t dtype);

/* The fp32-accumulating, rank-ordered sum used by every engine (the C reference of the kernels):
 * out[i] = sum_{r < nsrc} srcs[r][i], accumulated in fp32 in order r = 0, 1, ... then rounded
 * once to `dtype` (round to nearest even). out may alias any source. */
LLMMEM_API llmmem_status_t llmmem_comm_sum_ref(const void *const *srcs, int nsrc, void *out, size_t count,
                                               llmmem_comm_dtype_t dtype);

/* ---------------------------------------------------------------- CUDA IPC all-reduce */

typedef struct llmmem_cuda_ar_s llmmem_cuda_ar_t;

/* Size of an IPC handle (cudaIpcMemHandle_t) in bytes. */
#define LLMMEM_CUDA_IPC_HANDLE_BYTES 64

/* Step 1 on every rank: allocates this rank's buffer (max_bytes of data, twice, plus flags) on
 * `device` and writes its IPC handle (LLMMEM_CUDA_IPC_HANDLE_BYTES bytes) to handle_out. */
LLMMEM_API llmmem_status_t llmmem_cuda_ar_create(int device, int rank, int world_size, size_t max_bytes,
                                                 double timeout_s, llmmem_cuda_ar_t **out, void *handle_out);

/* Step 2 on every rank, after exchanging the handles: opens the peers' buffers. `handles` holds
 * world_size handles in rank order (this rank's own is skipped). */
LLMMEM_API llmmem_status_t llmmem_cuda_ar_connect(llmmem_cuda_ar_t *ar, const void *handles);

LLMMEM_API llmmem_status_t llmmem_cuda_ar_close(llmmem_cuda_ar_t *ar);

/* Sum all-reduce of `count` elements (count * size <= max_bytes) of device memory, ordered on
 * `stream` (a cudaStream_t; NULL = legacy default stream). Asynchronous: a peer that never arrives
 * (timeout) or that called with another count or dtype (LLMMEM_ERR_INVALID) makes the kernels of
 * every rank stop, set `out` to NaN where they gave up, and record the failure, which
 * llmmem_cuda_ar_check reports; a call after a recorded failure fails at once (no launch). */
LLMMEM_API llmmem_status_t llmmem_cuda_ar_all_reduce(llmmem_cuda_ar_t *ar, const void *in, void *out, size_t count,
                                                     llmmem_comm_dtype_t dtype, void *stream);

/* Waits for `stream` and reports a recorded failure: LLMMEM_ERR_STATE (this rank timed out, or
 * stopped because a peer failed) or LLMMEM_ERR_INVALID (the ranks disagreed on count or dtype). */
LLMMEM_API llmmem_status_t llmmem_cuda_ar_check(llmmem_cuda_ar_t *ar, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* LLMMEM_COMM_H */
