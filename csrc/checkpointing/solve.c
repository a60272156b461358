/*
 * solve.c — the Rotor dynamic program over (segment start, segment end, memory slots).
 *
 * Two families of states, both "the least time to run forward and backward of the blocks of a
 * segment, given its input is held outside and m slots are free":
 *   R(s, e, m), e < L: the content of a region, run during backward (a recompute; modes must be
 *     nestable; early stop means the last item never needs to be a region: it is never cheaper
 *     than inlining its content);
 *   T(s, m): the top-level sequence from block s to the end of the chain (any mode).
 * The first item of a segment is either block s keeping its tape in mode k (then the rest runs
 * with what the tape holds taken out of m), or a region [s, q) (its forward runs without tape, the
 * rest [q, e) runs holding a_q, then the region's content is solved as R(s, q, ...) with the
 * gradient of a_q held). The tables are float least times (the time of the chosen plan is recomputed
 * exactly by the simulator); choices are recovered by the walk: k for a tape mode, K + (q - s - 1)
 * for a region.
 *
 * Identical blocks: R(s, e) depends only on e - s, so one row per length is filled (fast path).
 * Offloaded regions (checkpointing.h) are one more option of the top-level rows: like a region, except that
 * the rest runs with x_s more slots free (the caller's slot of a_s), and the transfer time is added.
 *
 * Does not: parallelise (the rows of one length are independent: an OpenMP loop would do).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "plan_internal.h"
#include "relax.h"

#define DP_INF          INFINITY
#define MAX_TABLE_BYTES (6ULL << 30) /* refuse tables above 6 GiB: use fewer slots */
#define MAX_DP_STEPS    3e10         /* about half a minute on one core */

typedef struct dp_s {
  const plan_costs_t *c;
  int64_t M;     /* slots in the budget */
  uint64_t unit; /* bytes per slot */
  /* sizes in slots, rounded up */
  int64_t *x, *s, *ft, *fnt, *bt; /* ft [i*K+k]: a tape's forward transient, fnt [i]: a region's (no tape) */
  double *fnsum;                  /* prefix sums of the no-store forward times, [L + 1] */
  float *R, *T;                   /* [row][M + 1] least times; T: L rows where the first region may be offloaded,
                         then L rows where it may not (after a tape that keeps its output) */
  plan_relax_fn relax;            /* the split loop (relax.h) for this CPU */
  float *CR, *CT;                 /* samples of the R rows and of the first L T rows (plan_relax_sample), CW per row */
  int64_t CW;
} dp_t;

static inline int64_t to_slots(uint64_t bytes, uint64_t unit) { return (int64_t)((bytes + unit - 1) / unit); }

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static inline const float *row_of(const dp_t *dp, int32_t s, int32_t e) {
  const size_t W = (size_t)dp->M + 1;
  return e == dp->c->L ? dp->T + (size_t)s * W : dp->R + plan_row_R(dp->c, s, e) * W;
}

/* The samples of the row that row_of(dp, s, e) returns (relax.h). */
static inline const float *samples_of(const dp_t *dp, int32_t s, int32_t e) {
  return e == dp->c->L ? dp->CT + (size_t)s * dp->CW : dp->CR + plan_row_R(dp->c, s, e) * dp->CW;
}

/* Top-level row s: allow_offload = 0 after a tape that keeps a_s alive (checkpointing.h). */
static inline float *top_row(const dp_t *dp, int32_t s, int allow_offload) {
  const size_t W = (size_t)dp->M + 1;
  return dp->T + ((allow_offload ? 0 : (size_t)dp->c->L) + (size_t)s) * W;
}

/* The rest after block s kept as a tape in mode k, in segment [s, e) (s + 1 < e). */
static inline const float *tape_rest(const dp_t *dp, int32_t s, int32_t e, int32_t k) {
  return e == dp->c->L ? top_row(dp, s + 1, !plan_keeps_output(dp->c, s, k)) : row_of(dp, s + 1, e);
}

/* Tape option of block s in mode k: the least m it needs and its own slot footprint. */
static inline void tape_needs(const dp_t *dp, int32_t s, int32_t e, int32_t k, int64_t *lo, int64_t *hold) {
  const size_t ik = (size_t)s * dp->c->K + k;
  *hold = dp->s[ik] + dp->x[s + 1];
  *lo = max64(max64(*hold + dp->ft[ik], dp->s[ik] + (s + 1 < e ? dp->x[s + 1] : 0) + dp->x[s] + dp->bt[ik]), *hold);
}

/* The forward need of region [s, q) from that of [s, q - 1) (prev; 0 when q == s + 1): the
 * no-store run of block q - 1 holds its input (a_s is the caller's), its output and its no-store
 * transient. */
static inline int64_t region_fneed(const dp_t *dp, int32_t s, int32_t q, int64_t prev) {
  return max64(prev, (q - 1 > s ? dp->x[q - 1] : 0) + dp->x[q] + dp->fnt[q - 1]);
}

/* Free slots of the rest after offloaded region [s, q) with m free before it: a_s (held by the
 * caller, so m + x_s never exceeds the budget in a reachable state) leaves, a_q is held. Capped at
 * M for the unreachable states the table also fills (the table is non-increasing in m anyway). */
static inline int64_t offload_rest_m(const dp_t *dp, int32_t s, int32_t q, int64_t m) {
  const int64_t r = m + dp->x[s] - dp->x[q];
  return r > dp->M ? dp->M : r;
}

/* The offloaded-region options of top-level row s (checkpointing.h: the model). */
static void fill_offload(dp_t *dp, int32_t s, float *best) {
  const plan_costs_t *c = dp->c;
  const int32_t L = c->L;
  const int64_t W = dp->M + 1;
  int64_t fneed = 0;
  for (int32_t q = s + 1; q <= L - 1 && plan_region_ok(c, s, q); q++) {
    fneed = region_fneed(dp, s, q, fneed);
    const int64_t xq = dp->x[q];
    const int64_t lo = max64(fneed, xq);
    const double fsum = dp->fnsum[q] - dp->fnsum[s];
    const float base = (float)(fsum + plan_offload_time(c, s, fsum));
    const float *rest = row_of(dp, q, L);
    const float *inner = row_of(dp, s, q);
    for (int64_t m = lo; m < W; m++) {
      const float v = base + rest[offload_rest_m(dp, s, q, m)] + inner[m - xq];
      best[m] = v < best[m] ? v : best[m];
    }
  }
}

/* Fills one row: segment [s, e) (e == L: the top-level family). Only the costs are stored: the
 * walk re-evaluates the few states it visits to recover the choices, which keeps these loops
 * branch-free (they vectorise) and halves the memory. */
static void fill_row(dp_t *dp, int32_t s, int32_t e) {
  const plan_costs_t *c = dp->c;
  const int32_t K = c->K, L = c->L;
  const int top = e == L;
  const int64_t W = dp->M + 1;
  float *best = top ? top_row(dp, s, 0) : (float *)row_of(dp, s, e);
  for (int64_t m = 0; m < W; m++) best[m] = DP_INF;

  for (int32_t k = 0; k < K; k++) {
    if (!top && !c->nest[k]) continue;
    int64_t lo, hold;
    tape_needs(dp, s, e, k, &lo, &hold);
    const float base = (float)(c->f[(size_t)s * K + k] + c->b[(size_t)s * K + k]);
    if (s + 1 == e) {
      for (int64_t m = lo; m < W; m++) best[m] = base < best[m] ? base : best[m];
    } else {
      const float *rest = tape_rest(dp, s, e, k);
      for (int64_t m = lo; m < W; m++) {
        const float v = base + rest[m - hold];
        best[m] = v < best[m] ? v : best[m];
      }
    }
  }
  int64_t fneed = 0;
  /* Identical blocks, recompute family: region [s, q) then rest [q, e) has the same table terms as
   * region length e - q then rest q - s; the shorter region re-runs fewer forwards (and needs no
   * more memory: its forward need is the same for any length >= 2), so lengths <= half suffice. */
  const int32_t q_last = (c->identical && !top) ? s + (e - s) / 2 : e - 1;
  for (int32_t q = s + 1; q <= q_last && plan_region_ok(c, s, q); q++) {
    fneed = region_fneed(dp, s, q, fneed);
    const int64_t xq = dp->x[q];
    const int64_t lo = max64(fneed, xq);
    const float fsum = (float)(dp->fnsum[q] - dp->fnsum[s]);
    dp->relax(best, row_of(dp, q, e), row_of(dp, s, q), samples_of(dp, q, e), samples_of(dp, s, q), fsum, xq, lo, W);
  }
  if (top) { /* the states that may also offload a_s: the same options plus the offloaded regions */
    float *allowed = top_row(dp, s, 1);
    memcpy(allowed, best, (size_t)W * sizeof *best);
    if (plan_offload_ok(c, s)) fill_offload(dp, s, allowed);
    best = allowed; /* the row later rows read (row_of(dp, s, L)) */
  }
  plan_relax_sample(best, (float *)samples_of(dp, s, e), W);
}

/* The choice that gives the DP value of state (s, e, m) (top level: of the row allow_offload
 * selects): evaluates its options exactly as fill_row did and returns the closest (k for a tape
 * mode, K + q - s - 1 for a region [s, q), K + L + q - s - 1 for an offloaded one). */
static int32_t choose(const dp_t *dp, int32_t s, int32_t e, int64_t m, int allow_offload) {
  const plan_costs_t *c = dp->c;
  const int32_t K = c->K, L = c->L;
  const int top = e == L;
  const float target = top ? top_row(dp, s, allow_offload)[m] : row_of(dp, s, e)[m];
  int32_t best_choice = -1;
  float best_gap = INFINITY;
  for (int32_t k = 0; k < K; k++) {
    if (!top && !c->nest[k]) continue;
    int64_t lo, hold;
    tape_needs(dp, s, e, k, &lo, &hold);
    if (m < lo) continue;
    const float base = (float)(c->f[(size_t)s * K + k] + c->b[(size_t)s * K + k]);
    const float v = s + 1 == e ? base : base + tape_rest(dp, s, e, k)[m - hold];
    if (isfinite(v) && fabsf(v - target) < best_gap) best_gap = fabsf(v - target), best_choice = k;
  }
  int64_t fneed = 0;
  for (int32_t q = s + 1; q < e && plan_region_ok(c, s, q); q++) {
    fneed = region_fneed(dp, s, q, fneed);
    const int64_t xq = dp->x[q];
    if (m < max64(fneed, xq)) continue;
    const float fsum = (float)(dp->fnsum[q] - dp->fnsum[s]);
    const float v = fsum + row_of(dp, q, e)[m - xq] + row_of(dp, s, q)[m - xq];
    if (isfinite(v) && fabsf(v - target) < best_gap) best_gap = fabsf(v - target), best_choice = K + (q - s - 1);
  }
  if (top && allow_offload && plan_offload_ok(c, s)) {
    fneed = 0;
    for (int32_t q = s + 1; q < e && plan_region_ok(c, s, q); q++) {
      fneed = region_fneed(dp, s, q, fneed);
      const int64_t xq = dp->x[q];
      if (m < max64(fneed, xq)) continue;
      const double fsum = dp->fnsum[q] - dp->fnsum[s];
      const float v = (float)(fsum + plan_offload_time(c, s, fsum)) + row_of(dp, q, e)[offload_rest_m(dp, s, q, m)] +
                      row_of(dp, s, q)[m - xq];
      if (isfinite(v) && fabsf(v - target) < best_gap) best_gap = fabsf(v - target), best_choice = K + L + (q - s - 1);
    }
  }
  return best_choice;
}

typedef struct walk_s {
  llmmem_plan_t *plan;
  int32_t K;
} walk_t;

static llmmem_status_t add_region(walk_t *w, int32_t start, int32_t end, int32_t offload) {
  if (w->plan->n_regions >= w->plan->regions_capacity)
    return LLMMEM_FAIL(LLMMEM_ERR_INVALID, "plan->regions_capacity (%d) is too small; 2 * n_blocks always suffices",
                       w->plan->regions_capacity);
  w->plan->regions[w->plan->n_regions++] = (llmmem_plan_region_t){start, end, offload};
  return LLMMEM_OK;
}

/* Walks the slot-DP choices of segment [s, e) with m slots free, writing modes and regions. */
static llmmem_status_t walk_dp(const dp_t *dp, walk_t *w, int32_t s, int32_t e, int64_t m) {
  const plan_costs_t *c = dp->c;
  const int32_t K = c->K, L = c->L;
  const int64_t W = dp->M + 1;
  int allow_offload = 1; /* a_s of the first item is held by the caller, who never keeps it in a tape */
  while (s < e) {
    LLMMEM_ASSERT_INTERNAL(m >= 0 && m < W);
    (void)W;
    const int32_t ch = choose(dp, s, e, m, allow_offload);
    if (ch < 0) return LLMMEM_FAIL(LLMMEM_ERR_INTERNAL, "DP walk found no choice at [%d, %d) (please report)", s, e);
    if (!plan_choice_is_region(ch, K)) {
      w->plan->mode[s] = ch;
      m -= dp->s[(size_t)s * K + ch] + dp->x[s + 1];
      allow_offload = !plan_keeps_output(c, s, ch);
      s++;
    } else {
      allow_offload = 1;
      const int offload = plan_choice_is_offload(ch, K, L);
      const int32_t q = s + plan_choice_length(ch, K, L);
      LLMMEM_TRY(add_region(w, s, q, offload));
      LLMMEM_TRY(walk_dp(dp, w, s, q, m - dp->x[q]));
      m = offload ? offload_rest_m(dp, s, q, m) : m - dp->x[q];
      s = q;
    }
  }
  return LLMMEM_OK;
}

/* Walks the least-memory choices (min_budget.c) of segment [s, e). */
static llmmem_status_t walk_need(const plan_costs_t *c, const int32_t *chT, const int32_t *chR, walk_t *w, int32_t s,
                                 int32_t e) {
  const int32_t K = c->K, L = c->L;
  int allow_offload = 1;
  while (s < e) {
    const int32_t ch = e == L ? chT[(allow_offload ? 0 : L) + s] : chR[plan_row_R(c, s, e)];
    LLMMEM_ASSERT_INTERNAL(ch >= 0);
    if (!plan_choice_is_region(ch, K)) {
      w->plan->mode[s] = ch;
      allow_offload = !plan_keeps_output(c, s, ch);
      s++;
    } else {
      allow_offload = 1;
      const int32_t q = s + plan_choice_length(ch, K, L);
      LLMMEM_TRY(add_region(w, s, q, plan_choice_is_offload(ch, K, L)));
      LLMMEM_TRY(walk_need(c, chT, chR, w, s, q));
      s = q;
    }
  }
  return LLMMEM_OK;
}

static void dp_free(dp_t *dp) {
  free(dp->x);
  free(dp->s);
  free(dp->ft);
  free(dp->fnt);
  free(dp->bt);
  free(dp->fnsum);
  free(dp->R);
  free(dp->T);
  free(dp->CR);
  free(dp->CT);
}

/* Runs the slot DP. *found = 1 and the plan written when a plan fits in the rounded budget. */
static llmmem_status_t solve_slots(const plan_costs_t *c, uint64_t budget, int32_t slots, llmmem_plan_t *plan,
                                   int *found) {
  const int32_t L = c->L, K = c->K;
  const size_t LK = (size_t)L * K;
  dp_t dp = {0};
  dp.c = c;
  dp.relax = plan_relax_pick(-1);
  dp.unit = budget / (uint64_t)slots + (budget % (uint64_t)slots != 0);
  if (dp.unit == 0) dp.unit = 1;
  dp.M = (int64_t)(budget / dp.unit);
  *found = 0;
  const size_t W = (size_t)dp.M + 1, nR = plan_rows_R(c);
  const double table_bytes = (double)(nR + 2 * (size_t)L) * (double)W * sizeof(float);
  if (table_bytes > (double)MAX_TABLE_BYTES)
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM,
                       "the DP tables for %d blocks and %d slots would need %.1f GiB; use fewer slots", L, slots,
                       table_bytes / (double)(1ULL << 30));
  llmmem_status_t status = LLMMEM_OK;
  dp.x = malloc(((size_t)L + 1) * sizeof(int64_t));
  dp.s = malloc(LK * sizeof(int64_t));
  dp.ft = malloc(LK * sizeof(int64_t));
  dp.fnt = malloc((size_t)L * sizeof(int64_t));
  dp.bt = malloc(LK * sizeof(int64_t));
  dp.fnsum = malloc(((size_t)L + 1) * sizeof(double));
  dp.R = malloc((nR ? nR : 1) * W * sizeof(float));
  dp.T = malloc(2 * (size_t)L * W * sizeof(float));
  dp.CW = (int64_t)W / PLAN_RELAX_STRETCH;
  dp.CR = malloc((nR ? nR : 1) * (size_t)(dp.CW ? dp.CW : 1) * sizeof(float));
  dp.CT = malloc((size_t)L * (size_t)(dp.CW ? dp.CW : 1) * sizeof(float));
  if (!dp.x || !dp.s || !dp.ft || !dp.fnt || !dp.bt || !dp.fnsum || !dp.R || !dp.T || !dp.CR || !dp.CT) {
    status = LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "cannot allocate the DP tables (%.1f MiB) for %d blocks and %d slots",
                         table_bytes / (double)(1 << 20), L, slots);
    goto done;
  }
  for (int32_t i = 0; i <= L; i++) dp.x[i] = to_slots(c->x[i], dp.unit);
  for (size_t ik = 0; ik < LK; ik++) {
    dp.s[ik] = to_slots(c->s[ik], dp.unit), dp.bt[ik] = to_slots(c->bt[ik], dp.unit);
    dp.ft[ik] = to_slots(c->ft[ik], dp.unit);
  }
  dp.fnsum[0] = 0.0;
  for (int32_t i = 0; i < L; i++) {
    dp.fnt[i] = to_slots(c->fnt[i], dp.unit);
    dp.fnsum[i + 1] = dp.fnsum[i] + c->fn[i];
  }

  for (int32_t d = 1; d <= L - 1; d++) {
    const int32_t s_last = c->identical ? 0 : L - 1 - d;
    for (int32_t s = 0; s <= s_last; s++) fill_row(&dp, s, s + d);
  }
  for (int32_t s = L - 1; s >= 0; s--) fill_row(&dp, s, L);

  const int64_t m_top = dp.M - dp.x[0] - dp.x[L];
  if (m_top >= 0 && isfinite(dp.T[m_top])) {
    walk_t w = {plan, K};
    plan->n_regions = 0;
    status = walk_dp(&dp, &w, 0, L, m_top);
    if (status == LLMMEM_OK) *found = 1;
  }
done:
  dp_free(&dp);
  return status;
}

LLMMEM_API llmmem_status_t llmmem_plan_solve(const llmmem_plan_chain_t *chain, uint64_t budget_bytes, int32_t slots,
                                             uint32_t flags, llmmem_plan_t *plan, llmmem_plan_prediction_t *pred,
                                             uint64_t *min_budget_bytes) {
  LLMMEM_CHECK_ARG(plan != NULL && plan->mode != NULL && (plan->regions != NULL || plan->regions_capacity == 0),
                   "plan, plan->mode and plan->regions must not be NULL");
  LLMMEM_CHECK_ARG(slots >= 1 && slots <= LLMMEM_PLAN_MAX_SLOTS, "slots must be in 1..%d, got %d",
                   LLMMEM_PLAN_MAX_SLOTS, slots);
  LLMMEM_CHECK_ARG((flags & ~LLMMEM_PLAN_NO_FAST_PATH) == 0, "unknown flags 0x%x", flags);
  LLMMEM_CHECK_ARG(budget_bytes <= LLMMEM_PLAN_MAX_BYTES * 64, "budget_bytes = %llu is implausibly large",
                   (unsigned long long)budget_bytes);
  plan_costs_t c;
  LLMMEM_TRY(plan_costs_load(chain, &c));
  if (flags & LLMMEM_PLAN_NO_FAST_PATH) c.identical = 0;
  {
    /* Refuse work that would run for minutes instead of hanging the caller: the split loops are
     * ~L^3/6 (general) or ~L^2 (identical blocks) steps per slot. */
    const double L = (double)c.L, steps = (c.identical ? L * L : L * L * L / 6.0) * ((double)slots + 1.0);
    if (steps > MAX_DP_STEPS) {
      const int32_t n_blocks = c.L, identical = c.identical; /* plan_costs_free clears c */
      plan_costs_free(&c);
      return LLMMEM_FAIL(LLMMEM_ERR_INVALID,
                         "%d %s blocks with %d slots is about %.1e DP steps (limit %.0e): use fewer slots, or group "
                         "blocks so the chain is shorter",
                         n_blocks, identical ? "identical" : "heterogeneous", slots, steps, MAX_DP_STEPS);
    }
  }
  const size_t nR = plan_rows_R(&c);
  int32_t *chT = malloc(2 * (size_t)c.L * sizeof *chT);
  int32_t *chR = malloc((nR ? nR : 1) * sizeof *chR);
  llmmem_status_t status = LLMMEM_OK;
  uint64_t least = 0;
  if (!chT || !chR) {
    status = LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "cannot allocate the planner's tables for %d blocks", c.L);
    goto done;
  }
  status = plan_costs_min_budget(&c, &least, chT, chR);
  if (status != LLMMEM_OK) goto done;
  if (min_budget_bytes) *min_budget_bytes = least;
  if (budget_bytes < least) {
    status =
        LLMMEM_FAIL(LLMMEM_ERR_INFEASIBLE,
                    "no checkpointing plan fits a budget of %llu bytes; the smallest feasible budget is %llu bytes",
                    (unsigned long long)budget_bytes, (unsigned long long)least);
    goto done;
  }
  int found = 0;
  /* Keeping every tape in mode 0 is the fastest plan whenever mode 0 is each block's fastest mode;
   * check it exactly first, so slot rounding never loses it at a budget it just fits. */
  int mode0_fastest = 1;
  for (int32_t i = 0; i < c.L; i++)
    for (int32_t k = 1; k < c.K; k++)
      if (c.f[(size_t)i * c.K + k] + c.b[(size_t)i * c.K + k] < c.f[(size_t)i * c.K] + c.b[(size_t)i * c.K])
        mode0_fastest = 0;
  if (mode0_fastest) {
    for (int32_t i = 0; i < c.L; i++) plan->mode[i] = 0;
    plan->n_regions = 0;
    llmmem_plan_prediction_t all;
    status = plan_simulate_costs(&c, plan, &all);
    if (status != LLMMEM_OK) goto done;
    found = all.peak_bytes <= budget_bytes;
  }
  const int nothing_recomputed = found; /* the fastest plan there is: no uniform one beats it */
  if (!found) status = solve_slots(&c, budget_bytes, slots, plan, &found);
  if (status != LLMMEM_OK) goto done;
  if (!found) { /* rounding sizes up to slots lost every plan: the least-memory plan still fits */
    walk_t w = {plan, c.K};
    plan->n_regions = 0;
    status = walk_need(&c, chT, chR, &w, 0, c.L);
    if (status != LLMMEM_OK) goto done;
  }
  llmmem_plan_prediction_t p;
  status = plan_simulate_costs(&c, plan, &p);
  if (status != LLMMEM_OK) goto done;
  if (!nothing_recomputed) {
    int have = 1;
    status = plan_best_uniform(&c, budget_bytes, plan, &p, &have);
    if (status != LLMMEM_OK) goto done;
  }
  if (p.peak_bytes > budget_bytes) {
    status = LLMMEM_FAIL(LLMMEM_ERR_INTERNAL, "the plan's simulated peak %llu exceeds the budget %llu (please report)",
                         (unsigned long long)p.peak_bytes, (unsigned long long)budget_bytes);
    goto done;
  }
  if (pred) *pred = p;
done:
  free(chT);
  free(chR);
  plan_costs_free(&c);
  return status;
}
