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

/* Slots per stretch: long enough for the vector loop to run at speed, short enough that the
 * bound is tight (rows fall steeply where it matters). */
#define PLAN_RELAX_STRETCH 128

/* ca[t] and cb[t] are a[(t + 1) * STRETCH - 1] and b[...] (plan_relax_sample): the bounds are read
 * from these short contiguous copies, not from a cache line of each row per stretch, whose latency
 * would dominate the loop. */
typedef void (*plan_relax_fn)(float *best, const float *a, const float *b, const float *ca, const float *cb, float c,
                              int64_t shift, int64_t lo, int64_t hi);

/* Fills coarse[t] = row[(t + 1) * STRETCH - 1] for t < width / STRETCH. */
static inline void plan_relax_sample(const float *row, float *coarse, int64_t width) {
  for (int64_t t = 0; t < width / PLAN_RELAX_STRETCH; t++) coarse[t] = row[(t + 1) * PLAN_RELAX_STRETCH - 1];
}

/* The variant for this CPU (AVX-512, AVX2 or portable C); `forced` >= 0 caps the level (tests). */
plan_relax_fn plan_relax_pick(int forced);

#endif /* LLMMEM_PLAN_RELAX_H */
