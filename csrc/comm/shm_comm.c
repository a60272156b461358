/*
 * shm_comm.c — the shared-memory communicator: joining the segment, the barrier, failures.
 *
 * Waiting is bounded everywhere: spin briefly (a peer is usually a few microseconds away), yield
 * the core for a few tens of microseconds, then sleep on a futex on the peer's arrival word (the
 * arriving rank wakes sleepers only when there are any, so the fast path makes no system call).
 * Sleeping matters: a rank still computing its matmul must not compete for a core with ranks
 * that spin waiting for it (ranks often outnumber cores on CPU). While waiting we watch
 * the abort word of the segment (another rank failed), the clock (timeout) and, every ~50 ms,
 * whether the awaited peer's process still exists, so a killed rank is reported quickly instead
 * of after the full timeout. This file does not move data; shm_collectives.c does.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include "shm_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void nap_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

/* Sleeps while *word == seen, at most `us` microseconds (a nap where futexes do not exist). */
static void sleep_on(_Atomic uint32_t *word, uint32_t seen, long us) {
#ifdef __linux__
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  /* not FUTEX_PRIVATE: the word is shared between processes */
  syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, seen, &ts, NULL, 0);
#else
  (void)word, (void)seen;
  nap_us(us);
#endif
}

static void wake_all(_Atomic uint32_t *word) {
#ifdef __linux__
  syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
#else
  (void)word;
#endif
}

/* 1 when process `pid` is gone (no such process, or a zombie waiting to be reaped). */
static int process_dead(int pid) {
  if (pid <= 0) return 0;
  if (kill(pid, 0) != 0 && errno == ESRCH) return 1;
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0; /* no /proc: rely on kill() and the timeout */
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  const char *paren = strrchr(buf, ')'); /* "pid (comm) S ..." — comm may contain spaces */
  return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

/* Identity of this process's PID namespace (0 if unknown): a pid only means something to a
 * process in the same namespace (containers may share /dev/shm but not PIDs). */
static uint64_t pid_namespace(void) {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

static void path_of(char *out, size_t cap, const char *name) { snprintf(out, cap, "/dev/shm/%s", name); }

llmmem_status_t _llmmem_shm_fail(llmmem_shm_comm_t *c, llmmem_status_t status, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  c->broken = 1;
  /* Tell the other ranks (the first failure wins), so they stop waiting for us. */
  int expected = 0;
  if (atomic_compare_exchange_strong(&c->hdr->abort_claim, &expected, c->rank + 1)) {
    snprintf(c->hdr->abort_msg, sizeof c->hdr->abort_msg, "%s", msg);
    atomic_store_explicit(&c->hdr->abort_rank, c->rank + 1, memory_order_release);
    for (int q = 0; q < c->world_size; q++) wake_all(&c->ctl[q].arrive32); /* sleepers: look at the abort */
  }
  return LLMMEM_FAIL(status, "%s", msg);
}

static llmmem_status_t check_abort(llmmem_shm_comm_t *c, const char *what) {
  int failed = atomic_load_explicit(&c->hdr->abort_rank, memory_order_acquire);
  if (!failed) return LLMMEM_OK;
  c->broken = 1;
  return LLMMEM_FAIL(LLMMEM_ERR_STATE, "llmmem shm %s on rank %d: rank %d failed: %s", what, c->rank, failed - 1,
                     c->hdr->abort_msg);
}

/* Waits until ctl[peer].arrive >= epoch. */
static llmmem_status_t wait_arrive(llmmem_shm_comm_t *c, int peer, uint64_t epoch, const char *what) {
  double start = 0, next_liveness = 0;
  for (unsigned long iter = 0;; iter++) {
    if (atomic_load_explicit(&c->ctl[peer].arrive, memory_order_acquire) >= epoch) return LLMMEM_OK;
    if (iter < 128) {
      CPU_RELAX();
      continue;
    }
    if ((iter & 63) == 0 || iter >= 160) { /* every time once sleeping: a sleep is 10 ms */
      LLMMEM_TRY(check_abort(c, what));
      double t = now_s();
      if (start == 0) start = t, next_liveness = t + 0.05;
      if (t >= next_liveness) {
        next_liveness = t + 0.05;
        if (c->ctl[peer].pid_ns != 0 && c->ctl[peer].pid_ns == c->ctl[c->rank].pid_ns &&
            process_dead(c->ctl[peer].pid) &&
            atomic_load_explicit(&c->ctl[peer].arrive, memory_order_acquire) < epoch)
          return _llmmem_shm_fail(c, LLMMEM_ERR_STATE,
                                  "llmmem shm %s: rank %d (pid %d) exited while rank %d was waiting for it",
                                  what, peer, c->ctl[peer].pid, c->rank);
      }
      if (t - start > c->timeout_s)
        return _llmmem_shm_fail(c, LLMMEM_ERR_STATE,
                                "llmmem shm %s: timed out after %.3g s on rank %d waiting for rank %d "
                                "(did every rank call the same collective?)",
                                what, c->timeout_s, c->rank, peer);
    }
    if (iter < 160) {
      sched_yield();
      continue;
    }
    /* Sleep until the peer arrives (it wakes us) or 10 ms pass (to check abort, liveness, time). */
    shm_ctl_t *p = &c->ctl[peer];
    atomic_fetch_add(&p->waiters, 1); /* seq_cst: pairs with the arriver's store + load of waiters */
    uint32_t seen = atomic_load(&p->arrive32);
    if ((int32_t)(seen - (uint32_t)epoch) < 0) sleep_on(&p->arrive32, seen, 10000);
    atomic_fetch_sub(&p->waiters, 1);
  }
}

llmmem_status_t _llmmem_shm_barrier(llmmem_shm_comm_t *c, const char *what) {
  LLMMEM_TRY(check_abort(c, what));
  uint64_t epoch = ++c->epoch;
  shm_ctl_t *me = &c->ctl[c->rank];
  atomic_store_explicit(&me->arrive, epoch, memory_order_release);
  atomic_store(&me->arrive32, (uint32_t)epoch); /* seq_cst: a sleeper either sees it or is counted */
  if (atomic_load(&me->waiters) > 0) wake_all(&me->arrive32);
  for (int q = 0; q < c->world_size; q++) {
    if (q == c->rank) continue;
    LLMMEM_TRY(wait_arrive(c, q, epoch, what));
  }
  /* A peer that gave up (timeout) after arriving must not leave us with a half-done collective:
   * a late rank sees the abort word here, even though every peer's arrival flag is set. */
  return check_abort(c, what);
}

static size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

static void unmap(llmmem_shm_comm_t *c) {
  if (c->base) munmap(c->base, c->total_bytes);
  c->base = NULL;
}

/* Rank 0: create, size, reserve and initialise the segment; publish it by setting the magic. */
static llmmem_status_t create_segment(llmmem_shm_comm_t *c, const char *path) {
  int fd = open(path, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0)
    return LLMMEM_FAIL(errno == EEXIST ? LLMMEM_ERR_STATE : LLMMEM_ERR_NOMEM, "llmmem_shm_comm_open: cannot create %s: %s",
                       path, strerror(errno));
  int err = ftruncate(fd, (off_t)c->total_bytes) != 0 ? errno : posix_fallocate(fd, 0, (off_t)c->total_bytes);
  if (err != 0) {
    close(fd);
    unlink(path);
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_shm_comm_open: cannot reserve %zu bytes in %s: %s",
                       c->total_bytes, path, strerror(err));
  }
  void *p = mmap(NULL, c->total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    unlink(path);
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_shm_comm_open: mmap of %zu bytes failed: %s", c->total_bytes,
                       strerror(errno));
  }
  c->base = p;
  shm_header_t *h = (shm_header_t *)c->base;
  h->version = LLMMEM_SHM_VERSION;
  h->world_size = c->world_size;
  h->slot_bytes = c->slot_bytes;
  h->total_bytes = c->total_bytes;
  atomic_store_explicit(&h->magic, LLMMEM_SHM_MAGIC, memory_order_release);
  return LLMMEM_OK;
}

/* Other ranks: wait for the segment to exist and be published, check it, map it whole. */
static llmmem_status_t attach_segment(llmmem_shm_comm_t *c, const char *path, double deadline) {
  for (;;) {
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd >= 0) {
      struct stat st;
      if (fstat(fd, &st) == 0 && (size_t)st.st_size >= LLMMEM_SHM_HEADER_BYTES) {
        shm_header_t *h = mmap(NULL, LLMMEM_SHM_HEADER_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (h == MAP_FAILED) {
          close(fd);
          return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_shm_comm_open: mmap of %s failed: %s", path, strerror(errno));
        }
        if (atomic_load_explicit(&h->magic, memory_order_acquire) == LLMMEM_SHM_MAGIC) {
          int ws = h->world_size;
          uint32_t ver = h->version;
          size_t slot = h->slot_bytes, total = h->total_bytes;
          munmap(h, LLMMEM_SHM_HEADER_BYTES);
          if (ver != LLMMEM_SHM_VERSION || ws != c->world_size || (size_t)st.st_size < total) {
            close(fd);
            return LLMMEM_FAIL(LLMMEM_ERR_STATE,
                               "llmmem_shm_comm_open: segment %s was made for world size %d (version %u), this "
                               "rank expects %d (version %u)", path, ws, ver, c->world_size, LLMMEM_SHM_VERSION);
          }
          void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
          close(fd);
          if (p == MAP_FAILED)
            return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_shm_comm_open: mmap of %zu bytes failed: %s", total,
                               strerror(errno));
          c->base = p;
          c->slot_bytes = slot;
          c->total_bytes = total;
          return LLMMEM_OK;
        }
        munmap(h, LLMMEM_SHM_HEADER_BYTES);
      }
      close(fd);
    } else if (errno != ENOENT) {
      return LLMMEM_FAIL(LLMMEM_ERR_STATE, "llmmem_shm_comm_open: cannot open %s: %s", path, strerror(errno));
    }
    if (now_s() > deadline)
      return LLMMEM_FAIL(LLMMEM_ERR_STATE,
                         "llmmem_shm_comm_open: rank %d: segment %s did not appear within %.3g s (is rank 0 on "
                         "this host and does it share /dev/shm?)", c->rank, path, c->timeout_s);
    nap_us(500);
  }
}

llmmem_status_t llmmem_shm_comm_open(const char *name, int rank, int world_size, size_t slot_bytes, double timeout_s,
                                     llmmem_shm_comm_t **out) {
  LLMMEM_CHECK_ARG(out != NULL, "llmmem_shm_comm_open: out must not be NULL");
  *out = NULL;
  LLMMEM_CHECK_ARG(name != NULL && name[0] != '\0', "llmmem_shm_comm_open: name must be a non-empty string");
  LLMMEM_CHECK_ARG(strlen(name) <= 200 && strchr(name, '/') == NULL,
                   "llmmem_shm_comm_open: name must have at most 200 characters and no '/', got \"%.220s\"", name);
  LLMMEM_CHECK_ARG(world_size >= 1 && world_size <= LLMMEM_SHM_MAX_WORLD,
                   "llmmem_shm_comm_open: world_size must be in 1..%d, got %d", LLMMEM_SHM_MAX_WORLD, world_size);
  LLMMEM_CHECK_ARG(rank >= 0 && rank < world_size, "llmmem_shm_comm_open: rank must be in 0..%d, got %d",
                   world_size - 1, rank);
  LLMMEM_CHECK_ARG(timeout_s > 0, "llmmem_shm_comm_open: timeout_s must be > 0, got %g", timeout_s);
  LLMMEM_CHECK_ARG(slot_bytes <= ((size_t)1 << 32), "llmmem_shm_comm_open: slot_bytes must be <= 4 GiB, got %zu",
                   slot_bytes);
  llmmem_shm_comm_t *c = calloc(1, sizeof *c);
  if (!c) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_shm_comm_open: out of host memory");
  c->rank = rank;
  c->world_size = world_size;
  c->timeout_s = timeout_s;
  c->slot_bytes = round_up(slot_bytes ? slot_bytes : LLMMEM_SHM_DEFAULT_SLOT, 4096);
  size_t ctl_bytes = round_up((size_t)world_size * LLMMEM_SHM_CTL_BYTES, 4096);
  c->total_bytes = LLMMEM_SHM_HEADER_BYTES + ctl_bytes + (size_t)world_size * 2u * c->slot_bytes;
  snprintf(c->name, sizeof c->name, "%s", name);
  char path[300];
  path_of(path, sizeof path, name);
  double deadline = now_s() + timeout_s;

  llmmem_status_t st = rank == 0 ? create_segment(c, path) : attach_segment(c, path, deadline);
  if (st != LLMMEM_OK) {
    free(c);
    return st;
  }
  c->hdr = (shm_header_t *)c->base;
  c->ctl = (shm_ctl_t *)(c->base + LLMMEM_SHM_HEADER_BYTES);
  c->data = c->base + LLMMEM_SHM_HEADER_BYTES + round_up((size_t)world_size * LLMMEM_SHM_CTL_BYTES, 4096);
  c->ctl[rank].pid = (int32_t)getpid();
  c->ctl[rank].pid_ns = pid_namespace();
  atomic_fetch_add_explicit(&c->hdr->joined, 1, memory_order_acq_rel);

  /* Everyone waits for everyone: a rank that never joins fails the set-up on all the others. */
  while (atomic_load_explicit(&c->hdr->joined, memory_order_acquire) < world_size) {
    if (atomic_load_explicit(&c->hdr->abort_rank, memory_order_acquire)) {
      st = LLMMEM_FAIL(LLMMEM_ERR_STATE, "llmmem_shm_comm_open: another rank gave up: %s", c->hdr->abort_msg);
      break;
    }
    if (now_s() > deadline) {
      st = _llmmem_shm_fail(c, LLMMEM_ERR_STATE,
                            "llmmem_shm_comm_open: only %d of %d ranks joined segment %s within %.3g s",
                            atomic_load(&c->hdr->joined), world_size, name, timeout_s);
      break;
    }
    nap_us(200);
  }
  /* The name is only needed to join: remove it now, so a crash can never leave it behind. */
  if (rank == 0 || st != LLMMEM_OK) unlink(path);
  if (st != LLMMEM_OK) {
    unmap(c);
    free(c);
    return st;
  }
  *out = c;
  return LLMMEM_OK;
}

llmmem_status_t llmmem_shm_comm_close(llmmem_shm_comm_t *comm) {
  if (!comm) return LLMMEM_OK;
  unmap(comm);
  free(comm);
  return LLMMEM_OK;
}

llmmem_status_t llmmem_shm_comm_set_timeout(llmmem_shm_comm_t *comm, double timeout_s) {
  LLMMEM_CHECK_ARG(comm != NULL, "llmmem_shm_comm_set_timeout: comm must not be NULL");
  LLMMEM_CHECK_ARG(timeout_s > 0, "llmmem_shm_comm_set_timeout: timeout_s must be > 0, got %g", timeout_s);
  comm->timeout_s = timeout_s;
  return LLMMEM_OK;
}

llmmem_status_t llmmem_shm_comm_slot_bytes(const llmmem_shm_comm_t *comm, size_t *out) {
  LLMMEM_CHECK_ARG(comm != NULL && out != NULL, "llmmem_shm_comm_slot_bytes: comm and out must not be NULL");
  *out = comm->slot_bytes;
  return LLMMEM_OK;
}
