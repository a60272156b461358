/*
 * uniform.c — the uniform plans, checked against the DP's: the solver never returns a plan that one
 * of them beats (less time, peak within the budget) in its own model.
 *
 * The DP rounds sizes up to slots of budget / slots bytes, so a plan whose exact peak is at or just
 * under the budget can be lost to it: at the budget of "every block in its cheaper mode", for one,
 * the DP took a plan with twice that plan's recompute (a GPT-2 block chain). The uniform plans are
 * what users compare a planner with, so each is simulated exactly and the best that fits wins over
 * the DP's plan when it is faster:
 *   - every block in one mode k (no region);
 *   - every k-th block checkpointed alone (regions [i, i + 1) for i = off mod k, off = 0 or k - 1),
 *     k = 1 (every block) .. L - 1;
 *   - consecutive segments of k blocks, each one region (torch's checkpoint_sequential), k = 2 .. L - 1;
 * the blocks outside regions in one mode (any), the last block in any mode. The last
 * block is never in a region, as in the DP: its recompute would follow its forward at once and save
 * nothing (and on the Python side the last block may be a model's head).
 *
 * Cost: about 2 * K^2 * L candidates of O(L) steps each (most passed over without a simulation),
 * O(K^2 * L^2) in all, below the DP's O(M * L^2) for M >= 2 * K^2 slots. Does not: offload (these are
 * the plans without host copies).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "plan_internal.h"

enum { FAMILY_MODE, FAMILY_EVERY, FAMILY_SEGMENTS };

/* Writes the candidate into mode/reg; returns its number of regions. */
static int32_t fill_candidate(const plan_costs_t *c, int family, int32_t k, int32_t off, int32_t base, int32_t last,
                              int32_t *mode, llmmem_plan_region_t *reg) {
  const int32_t L = c->L;
  int32_t R = 0;
  for (int32_t i = 0; i < L; i++) mode[i] = base;
  mode[L - 1] = last;
  if (family == FAMILY_EVERY) {
    for (int32_t i = off; i < L - 1; i += k) {
      reg[R++] = (llmmem_plan_region_t){i, i + 1, 0};
      mode[i] = 0;
    }
  } else if (family == FAMILY_SEGMENTS) {
    for (int32_t s = 0; s < L - 1; s += k) {
      const int32_t e = s + k < L - 1 ? s + k : L - 1;
      reg[R++] = (llmmem_plan_region_t){s, e, 0};
      for (int32_t j = s; j < e; j++) mode[j] = 0;
    }
  }
  return R;
}

/* Strictly faster, beyond the rounding of two sums of the same costs in another order. */
static int faster(double a, double b) { return a < b - 1e-12 * fabs(b); }

/* The time and the bytes held when the forward ends (a lower bound of the peak) of a candidate, in
 * one pass: most candidates are slower than the plan in hand or hold more than the budget, and are
 * passed over without simulating them. Counted as simulate.c counts them. */
static void estimate(const plan_costs_t *c, const int32_t *mode, const llmmem_plan_region_t *reg, int32_t R,
                     double *time, uint64_t *held) {
  const int32_t L = c->L, K = c->K;
  double t = 0.0;
  uint64_t h = c->x[0] + c->x[L];
  int32_t r = 0;
  for (int32_t i = 0; i < L; i++) {
    const size_t ik = (size_t)i * K + mode[i];
    if (r < R && i >= reg[r].start) {
      t += c->fn[i] + c->f[ik] + c->b[ik];
      if (i == reg[r].end - 1) h += c->x[reg[r++].end];
    } else {
      t += c->f[ik] + c->b[ik];
      h += c->s[ik] + c->x[i + 1];
    }
  }
  *time = t, *held = h;
}

#define TOUCH(extra)                                                    \
  do {                                                                  \
    if (live + (int64_t)(extra) > peak) peak = live + (int64_t)(extra); \
  } while (0)

/* simulate.c's step for a flat plan (regions at the top level only, none nested, none offloaded),
 * the same allocations and frees in the same order, without its tree, sort and allocations: the
 * peak of each candidate that passes estimate(). The winner is simulated by simulate.c again. */
int64_t plan_flat_peak(const plan_costs_t *c, const int32_t *mode, const llmmem_plan_region_t *reg, int32_t R) {
  const int32_t L = c->L, K = c->K;
  const uint64_t *x = c->x;
  int64_t live = (int64_t)(x[0] + x[L]), peak = live;
  for (int32_t i = 0, r = 0; i < L;) {
    if (r < R && reg[r].start == i) {
      const int32_t a = i, e = reg[r++].end;
      for (int32_t j = a; j < e; j++) TOUCH((j > a ? x[j] : 0) + x[j + 1] + c->fnt[j]);
      live += (int64_t)x[e];
      i = e;
    } else {
      const size_t ik = (size_t)i * K + mode[i];
      TOUCH(c->s[ik] + x[i + 1] + c->ft[ik]);
      live += (int64_t)(c->s[ik] + x[i + 1]);
      i++;
    }
  }
  live -= (int64_t)x[L];
  for (int32_t i = L, r = R - 1; i > 0;) {
    const int region = r >= 0 && reg[r].end == i;
    const int32_t a = region ? reg[r].start : i - 1, e = region ? i : L;
    if (region) { /* its recompute: the tapes forward, then their backward */
      for (int32_t j = a; j < e; j++) {
        const size_t jk = (size_t)j * K + mode[j];
        TOUCH(c->s[jk] + x[j + 1] + c->ft[jk]);
        live += (int64_t)(c->s[jk] + x[j + 1]);
      }
      live -= (int64_t)x[e];
      r--;
    }
    for (int32_t b = (region ? e : i) - 1; b >= a; b--) { /* backward of a tape, in or out of the region */
      const size_t bk = (size_t)b * K + mode[b];
      TOUCH(x[b] + c->bt[bk]);
      live += (int64_t)x[b] - (int64_t)c->s[bk];
      if (b + 1 < e) live -= (int64_t)x[b + 1];
      if (b > (region ? a : 0)) live -= (int64_t)x[b];
    }
    if (region && e < L) live -= (int64_t)x[e];
    if (region && a > 0) live -= (int64_t)x[a];
    i = a;
  }
  return peak;
}

llmmem_status_t plan_best_uniform(const plan_costs_t *c, uint64_t budget, llmmem_plan_t *plan,
                                  llmmem_plan_prediction_t *pred, int *found) {
  const int32_t L = c->L, K = c->K;
  int32_t *mode = malloc((size_t)L * sizeof *mode);
  llmmem_plan_region_t *reg = malloc((size_t)(L > 1 ? L : 1) * sizeof *reg);
  if (!mode || !reg) {
    free(mode);
    free(reg);
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "cannot allocate the uniform plans of a %d-block chain", L);
  }
  double best_time = *found ? pred->time : INFINITY;
  int won = 0;
  /* regions hold their blocks in mode 0, which must be nestable for them to be plans at all; the
   * uniform regions are cut nowhere, so a chain with cuts has only the one-mode plans here */
  int regions_ok = c->nest[0] && L >= 2;
  for (int32_t i = 0; i < L; i++) regions_ok &= c->reach[i] == L;
  for (int family = FAMILY_MODE; family <= FAMILY_SEGMENTS; family++) {
    if (family != FAMILY_MODE && !regions_ok) break;
    const int32_t k_first = family == FAMILY_MODE ? 1 : family == FAMILY_EVERY ? 1 : 2;
    const int32_t k_last = family == FAMILY_MODE ? 1 : L - 1;
    for (int32_t k = k_first; k <= k_last; k++) {
      for (int o = 0; o < (family == FAMILY_EVERY && k > 1 ? 2 : 1); o++) {
        const int32_t off = o == 0 ? 0 : k - 1;
        /* segments hold every block but the last: their base mode is never used */
        for (int32_t base = 0; base < (family == FAMILY_SEGMENTS ? 1 : K); base++) {
          for (int32_t last = 0; last < K; last++) {
            const int32_t R = fill_candidate(c, family, k, off, base, last, mode, reg);
            if (R > plan->regions_capacity) continue;
            double time;
            uint64_t held;
            estimate(c, mode, reg, R, &time, &held);
            if (held > budget || (*found && !faster(time, best_time))) continue;
            if ((uint64_t)plan_flat_peak(c, mode, reg, R) > budget) continue;
            memcpy(plan->mode, mode, (size_t)L * sizeof *mode);
            memcpy(plan->regions, reg, (size_t)R * sizeof *reg);
            plan->n_regions = R;
            best_time = time;
            *found = won = 1;
          }
        }
      }
    }
  }
  /* the figures returned are simulate.c's */
  const llmmem_status_t status = won ? plan_simulate_costs(c, plan, pred) : LLMMEM_OK;
  free(mode);
  free(reg);
  return status;
}
