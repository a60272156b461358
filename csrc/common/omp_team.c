/*
 * omp_team.c — runs threaded CPU work (the unscale, the optimizer step) on the process's OpenMP team (torch's libgomp, or a
 * runtime with the same GNU entry points, such as Intel's), when there is one.
 *
 * Why: after a parallel torch op, torch's OpenMP threads keep spinning for a few milliseconds,
 * waiting for the next one. Threads of our own, started then, share the CPUs with them; the
 * team's threads instead take the work at once (benchmarks/README.md).
 *
 * The runtime is looked up by name in the process (dlsym), never linked: without one loaded
 * (no torch, or a torch on another threading backend) the callers use threads of their own.
 * The team is never used:
 *   - from inside an active parallel region (a nested team would get one thread);
 *   - in a child process forked after llmmem was loaded (the GNU runtime does not survive fork: a
 *     child's first region can wait for threads that exist only in the parent);
 *   - when the runtime's default team size (omp_get_max_threads) is below 2. (A team can still
 *     come out smaller, e.g. under OMP_DYNAMIC: the caller then drains the work alone.)
 * Teams always have the runtime's default size: one of another size makes the runtime stop or
 * start threads of the pool that torch's next op then starts or stops again. The work decides
 * how many of the team's threads join it (see _llmmem_scaler_pipe_drain_on_team).
 *
 * What it does not do: run anything between its start and end but the caller's C function (no
 * Python code runs inside a team of ours).
 */
#define _GNU_SOURCE /* RTLD_DEFAULT */
#include <dlfcn.h>
#include <pthread.h>
#include <string.h>

#include "cpu_threads.h"

typedef void (*parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);
typedef int (*query_fn)(void);

enum { NOT_FOUND, LOOKING, FOUND, OFF_AFTER_FORK };
static int state = NOT_FOUND;
static parallel_fn gomp_parallel; /* written once, by the thread that moves state to LOOKING */
static query_fn omp_in_parallel_, omp_get_max_threads_;

static int runs; /* teams run: the tests' evidence that the team path was taken */

static void off_in_child(void) { __atomic_store_n(&state, OFF_AFTER_FORK, __ATOMIC_RELEASE); }
/* Registered when the library is loaded: a child forked any time after that never uses the team,
 * also when its parent ran OpenMP regions (torch's) before llmmem first looked for the runtime
 * (DataLoader workers, fork-based pools). Only a child forked before llmmem was loaded cannot be
 * told from its parent. */
__attribute__((constructor)) static void guard_fork(void) { (void)pthread_atfork(NULL, NULL, off_in_child); }

/* Whether the runtime is found. Looked up until found, not once: llmmem's core may be loaded
 * before torch, whose import loads the runtime (a miss costs a dlsym per threaded call, in
 * processes without OpenMP). One thread looks at a time; the others use their own threads
 * meanwhile. */
static int runtime_found(void) {
  int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
  if (s != NOT_FOUND) return s == FOUND;
  if (!__atomic_compare_exchange_n(&state, &s, LOOKING, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return s == FOUND;
  void *par = dlsym(RTLD_DEFAULT, "GOMP_parallel");
  void *inp = par ? dlsym(RTLD_DEFAULT, "omp_in_parallel") : NULL;
  void *maxt = inp ? dlsym(RTLD_DEFAULT, "omp_get_max_threads") : NULL;
  int next = NOT_FOUND;
  if (maxt) {
    /* dlsym returns data pointers; POSIX guarantees they convert to function pointers */
    memcpy(&gomp_parallel, &par, sizeof gomp_parallel);
    memcpy(&omp_in_parallel_, &inp, sizeof omp_in_parallel_);
    memcpy(&omp_get_max_threads_, &maxt, sizeof omp_get_max_threads_);
    next = FOUND;
  }
  /* defensive: only a fork from a signal handler while looking could have turned this OFF */
  int looking = LOOKING;
  __atomic_compare_exchange_n(&state, &looking, next, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  return next == FOUND && looking == LOOKING;
}

int _llmmem_omp_team_usable(void) { return runtime_found() && !omp_in_parallel_() && omp_get_max_threads_() >= 2; }

int _llmmem_omp_team_run(void (*fn)(void *), void *data) {
  if (!_llmmem_omp_team_usable()) return 0;
  gomp_parallel(fn, data, 0, 0); /* 0 threads: the runtime's default size */
  __atomic_fetch_add(&runs, 1, __ATOMIC_RELAXED);
  return 1;
}

int _llmmem_omp_team_runs(void) { return __atomic_load_n(&runs, __ATOMIC_RELAXED); }
