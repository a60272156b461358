/*
 * shm_comm.c — the shared-memory communicator's waiting: the barrier, failures, the wait poll.
 *
 * Waiting is bounded everywhere: spin a handful of times, yield the core for up to 100
 * microseconds, then sleep on a futex on the peer's arrival word (the arriving rank wakes
 * sleepers only when there are any, so the fast path makes no system call). Yielding early
 * matters: when ranks share a core (ranks outnumber cores, or other jobs hold some), a spinning
 * rank delays the peer it waits for by its whole spin. Yielding long enough before a sleep
 * matters as much: waking a sleeper costs tens of microseconds (its vCPU halted), so a rank woken
 * late makes its peer outwait a short yield budget, and that peer sleeps in turn; ranks can fall
 * into that cycle for whole runs. (The spin counts and budgets measured: benchmarks/README.md.)
 * Sleeping matters too: a rank still computing its matmul must not compete for a core with ranks
 * waiting for it. While waiting we watch the abort
 * word of the segment (another rank failed), the clock (timeout) and, every ~50 ms,
 * whether the awaited peer's process still exists, so a killed rank is reported quickly instead
 * of after the full timeout, and the calling thread's wait poll (the Python binding checks for
 * Ctrl-C there), so an interrupt is not held up for the whole timeout. This file does not move
 * data (shm_collectives.c does) nor set up the segment (shm_setup.c does).
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

double _llmmem_shm_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void _llmmem_shm_nap_us(long us) {
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
  _llmmem_shm_nap_us(us);
#endif
}

static void wake_all(_Atomic uint32_t *word) {
#ifdef __linux__
  syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
#else
  (void)word;
#endif
}

int _llmmem_shm_process_dead(int pid) {
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

/* A pid only means something to a process in the same PID namespace (containers may share
 * /dev/shm but not PIDs), hence this identity next to every pid in the segment. */
uint64_t _llmmem_shm_pid_namespace(void) {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

int _llmmem_shm_dead_in_namespace(int pid, uint64_t ns, uint64_t ours) {
  return ours != 0 && ns == ours && _llmmem_shm_process_dead(pid);
}

/* The calling thread's wait poll: a thread-local, because it belongs to the caller's blocking
 * call (the binding sets it around each call with the state it needs to re-take the GIL). */
static _Thread_local llmmem_comm_poll_fn poll_fn;
static _Thread_local void *poll_ctx;

llmmem_status_t llmmem_comm_set_wait_poll(llmmem_comm_poll_fn fn, void *ctx) {
  poll_fn = fn;
  poll_ctx = fn ? ctx : NULL;
  return LLMMEM_OK;
}

int _llmmem_shm_poll_says_stop(void) { return poll_fn != NULL && poll_fn(poll_ctx) != 0; }

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

/* Pauses before the first yield, and microseconds of yielding before a sleep (see the header);
 * a probe may change them. */
static _Atomic long spin_before_yield = 8;
static _Atomic long yield_before_sleep_us = 100;

long _llmmem_shm_force_spin(long spins) {
  spin_before_yield = spins < 0 ? 8 : spins;
  return spin_before_yield;
}

long _llmmem_shm_force_yield_us(long us) {
  yield_before_sleep_us = us < 0 ? 100 : us;
  return yield_before_sleep_us;
}

/* Waits until ctl[peer].arrive >= epoch. */
static llmmem_status_t wait_arrive(llmmem_shm_comm_t *c, int peer, uint64_t epoch, const char *what) {
  double start = 0, next_check = 0;
  const unsigned long spins = (unsigned long)spin_before_yield;
  const double yield_s = (double)yield_before_sleep_us * 1e-6;
  for (unsigned long iter = 0;; iter++) {
    if (atomic_load_explicit(&c->ctl[peer].arrive, memory_order_acquire) >= epoch) return LLMMEM_OK;
    if (iter < spins) {
      CPU_RELAX();
      continue;
    }
    /* past the spin: every round yields or sleeps, next to which a look at the clock is cheap */
    LLMMEM_TRY(check_abort(c, what));
    double t = _llmmem_shm_now();
    if (start == 0) start = t, next_check = t + LLMMEM_SHM_CHECK_PERIOD_S;
    if (t >= next_check) {
      next_check = t + LLMMEM_SHM_CHECK_PERIOD_S;
      if (_llmmem_shm_poll_says_stop())
        return _llmmem_shm_fail(c, LLMMEM_ERR_STATE, "llmmem shm %s: interrupted on rank %d while waiting for rank %d",
                                what, c->rank, peer);
      if (_llmmem_shm_dead_in_namespace(c->ctl[peer].pid, c->ctl[peer].pid_ns, c->ctl[c->rank].pid_ns) &&
          atomic_load_explicit(&c->ctl[peer].arrive, memory_order_acquire) < epoch)
        return _llmmem_shm_fail(c, LLMMEM_ERR_STATE,
                                "llmmem shm %s: rank %d (pid %d) exited while rank %d was waiting for it", what, peer,
                                c->ctl[peer].pid, c->rank);
    }
    if (t - start > c->timeout_s)
      return _llmmem_shm_fail(c, LLMMEM_ERR_STATE,
                              "llmmem shm %s: timed out after %.3g s on rank %d waiting for rank %d "
                              "(did every rank call the same collective?)",
                              what, c->timeout_s, c->rank, peer);
    if (t - start < yield_s) {
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
