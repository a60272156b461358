/*
 * min_budget.c — the least budget (exact bytes, no slot rounding) for which some plan fits, and
 * a plan that achieves it (the fallback of the solver when slot rounding loses every plan).
 *
 * Same recursion as the slot DP in solve.c, but it minimises the memory a segment needs instead
 * of the time it takes: need(segment) = min over the first item of the max of that item's own
 * peaks and (what it holds + need(rest)). Ties are broken by time. O(K·L³) (O(K·L²) for
 * identical blocks, where a segment's need depends only on its length). Offloaded regions are a
 * third option at the top level (see checkpointing.h for their model).
 */
#include <stdlib.h>

#include "plan_internal.h"

#define MAXU(a, b) ((a) > (b) ? (a) : (b))

/* A broken invariant: record it and leave through the cleanup label (never abort). */
#define LLMMEM_ASSERT_INTERNAL_GOTO(cond, status, label)                                             \
  do {                                                                                               \
    if (!(cond)) {                                                                                   \
      status = LLMMEM_FAIL(LLMMEM_ERR_INTERNAL, "internal check failed: %s (please report)", #cond); \
      goto label;                                                                                    \
    }                                                                                                \
  } while (0)

/* Row of segment [s, e) (e <= L - 1) in the R tables; identical blocks share rows by length. */
static size_t rowR(const plan_costs_t *c, int32_t s, int32_t e) {
  return c->identical ? (size_t)(e - s - 1) : (size_t)e * (size_t)(e - 1) / 2 + (size_t)s;
}

size_t plan_rows_R(const plan_costs_t *c) {
  return c->identical ? (size_t)(c->L > 1 ? c->L - 1 : 0) : (size_t)c->L * (size_t)(c->L - 1) / 2;
}

size_t plan_row_R(const plan_costs_t *c, int32_t s, int32_t e) { return rowR(c, s, e); }

/* One segment's least need: e == L means the top-level sequence (any mode), else a recompute.
 * Top level: needT/timeT are the states where the first item may be an offloaded region,
 * needTn/timeTn those where it may not (after a block whose tape keeps its output);
 * allow_offload says which of the two is being computed. */
static void need_segment(const plan_costs_t *c, int32_t s, int32_t e, uint64_t *needR, double *timeR,
                         const uint64_t *needT, const double *timeT, const uint64_t *needTn, const double *timeTn,
                         int allow_offload, uint64_t *need_out, double *time_out, int32_t *choice_out) {
  const int32_t K = c->K, L = c->L;
  const int top = e == L;
  uint64_t best = UINT64_MAX;
  double best_t = 0.0;
  int32_t best_c = -1;
  for (int32_t k = 0; k < K; k++) {
    if (!top && !c->nest[k]) continue;
    const size_t ik = (size_t)s * K + k;
    const uint64_t hold = c->s[ik] + c->x[s + 1];
    uint64_t need =
        MAXU(c->s[ik] + c->x[s + 1] + c->ft[ik], c->s[ik] + (s + 1 < e ? c->x[s + 1] : 0) + c->x[s] + c->bt[ik]);
    double t = c->f[ik] + c->b[ik];
    if (s + 1 < e) {
      const int pinned = top && plan_keeps_output(c, s, k);
      const uint64_t rest = top ? (pinned ? needTn : needT)[s + 1] : needR[rowR(c, s + 1, e)];
      if (rest == UINT64_MAX) continue;
      need = MAXU(need, hold + rest);
      t += top ? (pinned ? timeTn : timeT)[s + 1] : timeR[rowR(c, s + 1, e)];
    } else {
      need = MAXU(need, hold);
    }
    if (need < best || (need == best && t < best_t)) best = need, best_t = t, best_c = k;
  }
  uint64_t fneed = 0;
  double fsum = 0.0;
  for (int32_t q = s + 1; q < e && plan_region_ok(c, s, q); q++) {
    fneed = MAXU(fneed, (q - 1 > s ? c->x[q - 1] : 0) + c->x[q] + c->fnt[q - 1]);
    fsum += c->fn[q - 1];
    const uint64_t rest = top ? needT[q] : needR[rowR(c, q, e)];
    const uint64_t inner = needR[rowR(c, s, q)];
    if (rest == UINT64_MAX || inner == UINT64_MAX) continue;
    const uint64_t need = MAXU(fneed, c->x[q] + MAXU(rest, inner));
    const double t = fsum + (top ? timeT[q] : timeR[rowR(c, q, e)]) + timeR[rowR(c, s, q)];
    if (need < best || (need == best && t < best_t)) best = need, best_t = t, best_c = K + (q - s - 1);
    if (top && allow_offload && plan_offload_ok(c, s)) {
      /* Offloaded region [s, q): a_s leaves the device after the forward, so the rest runs with
       * x_s more free bytes; it is back (in the caller's slot) for the region's own backward. */
      const uint64_t rest_need = c->x[q] + rest > c->x[s] ? c->x[q] + rest - c->x[s] : 0;
      const uint64_t oneed = MAXU(MAXU(fneed, c->x[q] + inner), rest_need);
      const double ot = fsum + plan_offload_time(c, s, fsum) + timeT[q] + timeR[rowR(c, s, q)];
      if (oneed < best || (oneed == best && ot < best_t)) best = oneed, best_t = ot, best_c = K + L + (q - s - 1);
    }
  }
  *need_out = best;
  *time_out = best_t;
  *choice_out = best_c;
}

/* Fills the least-need tables; choice_T[s] and choice_R[row] are the argmins (may be NULL). */
llmmem_status_t plan_costs_min_budget(const plan_costs_t *c, uint64_t *out, int32_t *choice_T, int32_t *choice_R) {
  const int32_t L = c->L;
  const size_t nR = plan_rows_R(c);
  uint64_t *needR = calloc(nR ? nR : 1, sizeof *needR);
  double *timeR = calloc(nR ? nR : 1, sizeof *timeR);
  int32_t *chR = choice_R ? choice_R : malloc((nR ? nR : 1) * sizeof *chR);
  /* [0, L]: first region may be offloaded; [L + 1, 2L + 1]: may not */
  uint64_t *needT = calloc(2 * (size_t)(L + 1), sizeof *needT);
  double *timeT = calloc(2 * (size_t)(L + 1), sizeof *timeT);
  int32_t *chT = choice_T ? choice_T : malloc(2 * (size_t)L * sizeof *chT);
  llmmem_status_t status = LLMMEM_OK;
  if (!needR || !timeR || !chR || !needT || !timeT || !chT) {
    status = LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "cannot allocate the least-budget tables of a %d-block chain", L);
    goto done;
  }
  for (int32_t d = 1; d <= L - 1; d++) {
    const int32_t s_last = c->identical ? 0 : L - 1 - d;
    for (int32_t s = 0; s <= s_last; s++) {
      const size_t row = rowR(c, s, s + d);
      need_segment(c, s, s + d, needR, timeR, NULL, NULL, NULL, NULL, 0, &needR[row], &timeR[row], &chR[row]);
    }
  }
  uint64_t *needTn = needT + L + 1;
  double *timeTn = timeT + L + 1;
  for (int32_t s = L - 1; s >= 0; s--) {
    need_segment(c, s, L, needR, timeR, needT, timeT, needTn, timeTn, 0, &needTn[s], &timeTn[s], &chT[L + s]);
    need_segment(c, s, L, needR, timeR, needT, timeT, needTn, timeTn, 1, &needT[s], &timeT[s], &chT[s]);
  }
  /* At the top level every mode is allowed, so keeping every tape is always a plan. */
  LLMMEM_ASSERT_INTERNAL_GOTO(needT[0] != UINT64_MAX, status, done);
  *out = c->x[0] + c->x[L] + needT[0];
done:
  free(needR);
  free(timeR);
  free(needT);
  free(timeT);
  if (!choice_R) free(chR);
  if (!choice_T) free(chT);
  return status;
}

LLMMEM_API llmmem_status_t llmmem_plan_min_budget(const llmmem_plan_chain_t *chain, uint64_t *min_budget_bytes) {
  LLMMEM_CHECK_ARG(min_budget_bytes != NULL, "min_budget_bytes must not be NULL");
  plan_costs_t c;
  LLMMEM_TRY(plan_costs_load(chain, &c));
  if (!c.identical && c.L > PLAN_MAX_GENERAL_BLOCKS) {
    const int32_t L = c.L; /* plan_costs_free clears c */
    plan_costs_free(&c);
    return LLMMEM_FAIL(LLMMEM_ERR_INVALID,
                       "%d heterogeneous blocks: at most %d (group blocks so the chain is shorter)", L,
                       PLAN_MAX_GENERAL_BLOCKS);
  }
  const llmmem_status_t st = plan_costs_min_budget(&c, min_budget_bytes, NULL, NULL);
  plan_costs_free(&c);
  return st;
}
