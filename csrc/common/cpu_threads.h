/*
 * cpu_threads.h — the threads the CPU kernels run on: how many CPUs this process may use, the
 * process's OpenMP team (omp_team.c), and a parallel run over either (cpu_threads.c).
 *
 * Work given to _llmmem_cpu_parallel claims its own pieces (an atomic cursor), so it is correct
 * with any number of participants, including one: a team smaller than asked for, or threads that
 * could not be started, only make it slower. No Python code runs on these threads.
 */
#ifndef LLMMEM_CPU_THREADS_H
#define LLMMEM_CPU_THREADS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The CPUs this process may run on (its affinity mask where the OS has one, else the online
 * CPUs), at least 1. */
int _llmmem_online_cpus(void);

/* omp_team.c: whether a team of the process's OpenMP runtime can run work now (a runtime is
 * loaded, this thread is not in an active parallel region, this is not a child forked after
 * llmmem was loaded, omp_get_max_threads() >= 2). */
int _llmmem_omp_team_usable(void);
/* omp_team.c test hook: how many teams _llmmem_omp_team_run has run in this process. */
int _llmmem_omp_team_runs(void);
/* omp_team.c: runs fn(data) on every thread of a team of the runtime's default size, the caller
 * included, and returns 1 when they are all done; 0 (nothing run) when no team is usable. */
int _llmmem_omp_team_run(void (*fn)(void *), void *data);

/* Runs work(data) on up to `threads` threads, the caller included, and returns when all are done:
 * on the OpenMP team when one is usable (members beyond `threads` leave at once), else on threads
 * started here and joined before returning. `threads` is capped at _llmmem_online_cpus(); with 1
 * (or when no thread can be started) work runs on the caller alone. */
void _llmmem_cpu_parallel(void (*work)(void *), void *data, size_t threads);

#ifdef __cplusplus
}
#endif

#endif /* LLMMEM_CPU_THREADS_H */
