/*
 * relax.h — the inner loop of the planner's DP, in one place so that it can be compiled for the
 * CPU's widest vector unit and can skip the stretches where it cannot change anything.
 *
 *   best[m] = min(best[m], (c + a[m - shift]) + b[m - shift])   for m in [lo, hi)
 *
 * Every DP row is non-increasing in m (more free memory never makes a plan slower: each option is
 * a sum of non-increasing rows, rounding is monotone, and a min of non-increasing rows is one), so
 * over a stretch [j, j + n) the candidate is at least its value at the last slot, and best is at
 * most its value at the first: when the first bound is not below the second the stretch is
 * skipped. The result is bitwise that of the plain loop (same sums, min is exact); only the work
 * changes. Not part of the ABI.
 */
#ifndef LLMMEM_PLAN_RELAX_H
#define LLMMEM_PLAN_RELAX_H

#include <stdint.h>

typedef void (*plan_relax_fn)(float *best, const float *a, const float *b, float c, int64_t shift, int64_t lo,
                              int64_t hi);

/* The variant for this CPU (AVX-512, AVX2 or portable C); `forced` >= 0 caps the level (tests). */
plan_relax_fn plan_relax_pick(int forced);

#endif /* LLMMEM_PLAN_RELAX_H */
