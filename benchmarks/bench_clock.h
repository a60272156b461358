/* Timing helpers shared by the C probes in benchmarks/ (parallel_comm_phases.c, parallel_comm_tune.c): a monotonic
 * clock in seconds and a comparator for qsort-ing samples to take medians. Header-only because the
 * probes are built by hand, one cc line each (see their file headers). */
#ifndef LLMMEM_BENCH_CLOCK_H
#define LLMMEM_BENCH_CLOCK_H

#include <time.h>

static inline double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static inline int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

#endif
