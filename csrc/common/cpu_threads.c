/*
 * cpu_threads.c — how many CPUs this process may use, and a parallel run of self-scheduling
 * work on the OpenMP team or on threads of our own (see cpu_threads.h).
 */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include "cpu_threads.h"

#define MAX_OWN_THREADS 63

int _llmmem_online_cpus(void) {
#if defined(__linux__)
  /* the CPUs this process may run on (taskset, cgroup cpusets), not all the machine has */
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

typedef struct {
  void (*work)(void *);
  void *data;
  size_t wanted, joined; /* team members beyond `wanted` leave at once */
} run_t;

static void team_member(void *arg) {
  run_t *r = arg;
  if (__atomic_fetch_add(&r->joined, 1, __ATOMIC_RELAXED) >= r->wanted) return;
  r->work(r->data);
}

static void *own_thread(void *arg) {
  run_t *r = arg;
  r->work(r->data);
  return NULL;
}

void _llmmem_cpu_parallel(void (*work)(void *), void *data, size_t threads) {
  size_t cpus = (size_t)_llmmem_online_cpus();
  if (threads > cpus) threads = cpus; /* memory-bound work: more threads than CPUs take turns */
  run_t r = {work, data, threads, 0};
  if (threads <= 1 || !_llmmem_omp_team_run(team_member, &r)) {
    pthread_t ids[MAX_OWN_THREADS];
    size_t started = 0;
    size_t others = threads > 1 ? threads - 1 : 0;
    if (others > MAX_OWN_THREADS) others = MAX_OWN_THREADS;
    while (started < others && pthread_create(&ids[started], NULL, own_thread, &r) == 0) started++;
    work(data); /* the caller works too; the work claims pieces, so fewer threads are still correct */
    for (size_t k = 0; k < started; k++) pthread_join(ids[k], NULL);
  }
}
