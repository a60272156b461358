/*
 * shm_internal.h — layout of the shared segment and the communicator (private to csrc/parallel/).
 *
 * Segment: [header, 4 KiB][control block per rank, 128 B each, rounded to 4 KiB][data slots]
 * with data slot (rank r, buffer b) at data + (2r + b) * slot_bytes. Buffer b = step & 1: a rank
 * that reached step s passed the barrier of step s-1, which every rank reached only after it had
 * finished reading step s-2's buffers, so writing buffer (s & 1) at step s never races a reader.
 */
#ifndef LLMMEM_COMM_SHM_INTERNAL_H
#define LLMMEM_COMM_SHM_INTERNAL_H

#include <stdatomic.h>
#include <stdint.h>

#include <llmmem/parallel.h>

#include "internal.h"

#define LLMMEM_SHM_MAGIC        0x6c6c6d6d73686d31ULL /* "llmmshm1" */
#define LLMMEM_SHM_VERSION      2u
#define LLMMEM_SHM_HEADER_BYTES 4096u
#define LLMMEM_SHM_CTL_BYTES    128u /* one control block per rank: two cache lines, no false sharing */
#define LLMMEM_SHM_MAX_WORLD    64
#define LLMMEM_SHM_DEFAULT_SLOT (1u << 20)

typedef enum { SHM_OP_ALL_REDUCE = 1, SHM_OP_ALL_GATHER = 2, SHM_OP_REDUCE_SCATTER = 3 } shm_op_t;

typedef struct {
  uint64_t seq;   /* collective number on this communicator, from 1 */
  uint32_t kind;  /* shm_op_t */
  uint32_t dtype; /* llmmem_comm_dtype_t */
  uint64_t count; /* elements per rank, as passed by the caller */
} shm_desc_t;

typedef struct {
  _Atomic uint64_t arrive;   /* last barrier epoch this rank reached (release after its writes) */
  _Atomic uint32_t arrive32; /* its low 32 bits: the futex word peers sleep on */
  _Atomic uint32_t waiters;  /* peers asleep (or about to sleep) on arrive32: wake only if > 0 */
  int32_t pid;               /* for telling a dead peer from a slow one ... */
  int32_t pad0;
  uint64_t pid_ns;    /* ... when it lives in our PID namespace (inode of /proc/self/ns/pid) */
  shm_desc_t desc[2]; /* what this rank is doing, indexed by collective seq & 1 */
} shm_ctl_t;

typedef struct {
  _Atomic uint64_t magic; /* set last by rank 0, with release: the header is complete */
  uint32_t version;
  int32_t world_size;
  int32_t creator_pid; /* rank 0's process: a set-up sweep removes names whose creator died */
  int32_t pad1;
  uint64_t creator_pid_ns; /* its PID namespace (see pid_ns in shm_ctl_t) */
  uint64_t slot_bytes;
  uint64_t total_bytes;
  _Atomic int32_t joined;      /* ranks that mapped the segment */
  _Atomic int32_t abort_claim; /* first rank to fail claims the message slot (CAS from 0) */
  _Atomic int32_t abort_rank;  /* rank + 1 of the failed rank once abort_msg is written, else 0 */
  int32_t pad0;
  char abort_msg[512];
} shm_header_t;

struct llmmem_shm_comm_s {
  unsigned char *base; /* the mapping */
  size_t total_bytes;
  shm_header_t *hdr;
  shm_ctl_t *ctl; /* ctl[world_size] */
  unsigned char *data;
  size_t slot_bytes;
  int rank, world_size;
  double timeout_s;
  uint64_t epoch; /* barriers passed */
  uint64_t step;  /* chunks moved (selects the buffer) */
  uint64_t seq;   /* collectives started */
  int broken;     /* a failure left the ranks out of step: every later call fails */
  char name[256];
};

_Static_assert(sizeof(shm_ctl_t) <= LLMMEM_SHM_CTL_BYTES, "control block too large");
_Static_assert(sizeof(shm_header_t) <= LLMMEM_SHM_HEADER_BYTES, "header too large");

static inline unsigned char *shm_slot(llmmem_shm_comm_t *c, int rank, uint64_t step) {
  return c->data + ((size_t)rank * 2u + (size_t)(step & 1u)) * c->slot_bytes;
}

/* shm_comm.c: barrier with bounded, abort- and death-aware waiting; failure recording. */
llmmem_status_t _llmmem_shm_barrier(llmmem_shm_comm_t *c, const char *what);
llmmem_status_t _llmmem_shm_fail(llmmem_shm_comm_t *c, llmmem_status_t status, const char *fmt, ...)
    LLMMEM_PRINTF(3, 4);
double _llmmem_shm_now(void);
/* 1 when process `pid` is gone (no such process, or a zombie); 0 when alive or unknown. */
int _llmmem_shm_process_dead(int pid);
/* Identity of this process's PID namespace (0 if unknown). */
uint64_t _llmmem_shm_pid_namespace(void);
/* 1 when `pid`, of PID namespace `ns`, is known to be dead to a process of namespace `ours` (a
 * pid of another namespace, or of an unknown one, means nothing here). */
int _llmmem_shm_dead_in_namespace(int pid, uint64_t ns, uint64_t ours);
/* Sleeps `us` microseconds. */
void _llmmem_shm_nap_us(long us);
/* 1 when the calling thread's wait poll (llmmem_comm_set_wait_poll) asks to stop waiting. */
int _llmmem_shm_poll_says_stop(void);
/* Seconds between two looks at the poll and at the liveness of awaited processes while waiting. */
#define LLMMEM_SHM_CHECK_PERIOD_S 0.05

/* For probes (benchmarks/parallel_comm_tune.c), not exported: the two-shot chunk size in bytes (0 =
 * automatic; every rank must set the same; shm_collectives.c), the pauses a waiting rank spins
 * before it yields and the microseconds it yields before it sleeps (-1 = default; shm_comm.c). */
size_t _llmmem_shm_force_chunk_bytes(size_t bytes);
long _llmmem_shm_force_spin(long spins);
long _llmmem_shm_force_yield_us(long us);

/* sum_cpu.c: the reference's sum (sum_ref.c), vectorised for the CPU at hand; _sum2 also writes
 * the result to out2 (may be NULL) from the same accumulator, saving a re-read. */
void _llmmem_comm_sum(const void *const *srcs, int nsrc, void *out, size_t count, llmmem_comm_dtype_t dtype);
void _llmmem_comm_sum2(const void *const *srcs, int nsrc, void *out, void *out2, size_t count,
                       llmmem_comm_dtype_t dtype);
/* Test hook (not exported): 0 = plain C, 1 = AVX2+F16C, 2 = AVX-512, -1 = automatic; levels the
 * CPU lacks fall back to the best it has. Returns the level that will run. */
int _llmmem_comm_force_isa(int isa);

#endif /* LLMMEM_COMM_SHM_INTERNAL_H */
