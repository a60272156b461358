/*
 * chain.c — validation of the planner's input (llmmem_plan_chain_t) into plan_costs_t.
 *
 * Every number is checked here, once, so the DP and the simulator can trust their input: times
 * finite and >= 0, byte sizes <= LLMMEM_PLAN_MAX_BYTES (so sums of a few thousand never overflow),
 * at least one way to run each block.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "plan_internal.h"

void plan_costs_free(plan_costs_t *c) {
  if (!c) return;
  free(c->f);
  free(c->fn);
  free(c->b);
  free(c->x);
  free(c->s);
  free(c->ft);
  free(c->fnt);
  free(c->bt);
  free(c->kept);
  free(c->reach);
  memset(c, 0, sizeof *c);
}

static llmmem_status_t check_times(const double *t, size_t n, const char *name) {
  for (size_t i = 0; i < n; i++)
    LLMMEM_CHECK_ARG(isfinite(t[i]) && t[i] >= 0.0, "%s[%zu] must be a finite time >= 0, got %g", name, i, t[i]);
  return LLMMEM_OK;
}

static llmmem_status_t check_bytes(const uint64_t *v, size_t n, const char *name) {
  for (size_t i = 0; i < n; i++)
    LLMMEM_CHECK_ARG(v[i] <= LLMMEM_PLAN_MAX_BYTES, "%s[%zu] = %llu bytes is larger than 1 PiB", name, i,
                     (unsigned long long)v[i]);
  return LLMMEM_OK;
}

static int all_rows_equal_d(const double *a, int32_t L, int32_t w) {
  for (int32_t i = 1; i < L; i++)
    if (memcmp(a, a + (size_t)i * w, (size_t)w * sizeof *a) != 0) return 0;
  return 1;
}

static int all_rows_equal_u(const uint64_t *a, int32_t L, int32_t w) {
  for (int32_t i = 1; i < L; i++)
    if (memcmp(a, a + (size_t)i * w, (size_t)w * sizeof *a) != 0) return 0;
  return 1;
}

llmmem_status_t plan_costs_load(const llmmem_plan_chain_t *chain, plan_costs_t *out) {
  LLMMEM_CHECK_ARG(chain != NULL && out != NULL, "chain and out must not be NULL");
  memset(out, 0, sizeof *out);
  const int32_t L = chain->n_blocks, K = chain->n_modes;
  LLMMEM_CHECK_ARG(L >= 1 && L <= LLMMEM_PLAN_MAX_BLOCKS, "n_blocks must be in 1..%d, got %d", LLMMEM_PLAN_MAX_BLOCKS,
                   L);
  LLMMEM_CHECK_ARG(K >= 1 && K <= LLMMEM_PLAN_MAX_MODES, "n_modes must be in 1..%d, got %d", LLMMEM_PLAN_MAX_MODES, K);
  LLMMEM_CHECK_ARG(chain->fwd_time && chain->bwd_time && chain->input_bytes && chain->saved_bytes,
                   "fwd_time, bwd_time, input_bytes and saved_bytes must not be NULL");
  const size_t LK = (size_t)L * (size_t)K;
  LLMMEM_TRY(check_times(chain->fwd_time, LK, "fwd_time"));
  LLMMEM_TRY(check_times(chain->bwd_time, LK, "bwd_time"));
  if (chain->fwd_nostore_time) LLMMEM_TRY(check_times(chain->fwd_nostore_time, (size_t)L, "fwd_nostore_time"));
  LLMMEM_TRY(check_bytes(chain->input_bytes, (size_t)L + 1, "input_bytes"));
  LLMMEM_TRY(check_bytes(chain->saved_bytes, LK, "saved_bytes"));
  if (chain->fwd_tmp_bytes) LLMMEM_TRY(check_bytes(chain->fwd_tmp_bytes, (size_t)L, "fwd_tmp_bytes"));
  if (chain->fwd_tape_tmp_bytes) LLMMEM_TRY(check_bytes(chain->fwd_tape_tmp_bytes, LK, "fwd_tape_tmp_bytes"));
  if (chain->fwd_nostore_tmp_bytes)
    LLMMEM_TRY(check_bytes(chain->fwd_nostore_tmp_bytes, (size_t)L, "fwd_nostore_tmp_bytes"));
  if (chain->bwd_tmp_bytes) LLMMEM_TRY(check_bytes(chain->bwd_tmp_bytes, LK, "bwd_tmp_bytes"));
  if (chain->mode_nestable)
    for (int32_t k = 0; k < K; k++)
      LLMMEM_CHECK_ARG(chain->mode_nestable[k] <= 1, "mode_nestable[%d] must be 0 or 1, got %u", k,
                       (unsigned)chain->mode_nestable[k]);

  if (chain->cut_before)
    for (int32_t i = 0; i < L; i++)
      LLMMEM_CHECK_ARG(chain->cut_before[i] <= 1, "cut_before[%d] must be 0 or 1, got %u", i,
                       (unsigned)chain->cut_before[i]);
  if (chain->output_kept)
    for (size_t i = 0; i < LK; i++)
      LLMMEM_CHECK_ARG(chain->output_kept[i] <= 1, "output_kept[%zu] must be 0 or 1, got %u", i,
                       (unsigned)chain->output_kept[i]);
  LLMMEM_CHECK_ARG(isfinite(chain->host_bandwidth) && chain->host_bandwidth >= 0.0,
                   "host_bandwidth must be a finite number of bytes per time unit >= 0 (0: no offloading), got %g",
                   chain->host_bandwidth);

  out->L = L;
  out->K = K;
  out->f = malloc(LK * sizeof(double));
  out->fn = malloc((size_t)L * sizeof(double));
  out->b = malloc(LK * sizeof(double));
  out->x = malloc(((size_t)L + 1) * sizeof(uint64_t));
  out->s = malloc(LK * sizeof(uint64_t));
  out->ft = calloc(LK, sizeof(uint64_t));
  out->fnt = calloc((size_t)L, sizeof(uint64_t));
  out->bt = calloc(LK, sizeof(uint64_t));
  out->kept = calloc(LK, 1);
  out->reach = malloc((size_t)L * sizeof(int32_t));
  if (!out->f || !out->fn || !out->b || !out->x || !out->s || !out->ft || !out->fnt || !out->bt || !out->kept ||
      !out->reach) {
    plan_costs_free(out);
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "cannot allocate the planner's copy of a %d-block chain", L);
  }
  memcpy(out->f, chain->fwd_time, LK * sizeof(double));
  memcpy(out->b, chain->bwd_time, LK * sizeof(double));
  memcpy(out->x, chain->input_bytes, ((size_t)L + 1) * sizeof(uint64_t));
  memcpy(out->s, chain->saved_bytes, LK * sizeof(uint64_t));
  for (int32_t i = 0; i < L; i++)
    out->fn[i] = chain->fwd_nostore_time ? chain->fwd_nostore_time[i] : out->f[(size_t)i * K];
  /* absent: fwd_tmp_bytes for every forward of the block, as before the specific ones existed */
  for (int32_t i = 0; i < L; i++) {
    const uint64_t one = chain->fwd_tmp_bytes ? chain->fwd_tmp_bytes[i] : 0;
    for (int32_t k = 0; k < K; k++) {
      const size_t ik = (size_t)i * K + k;
      out->ft[ik] = chain->fwd_tape_tmp_bytes ? chain->fwd_tape_tmp_bytes[ik] : one;
    }
    out->fnt[i] = chain->fwd_nostore_tmp_bytes ? chain->fwd_nostore_tmp_bytes[i] : one;
  }
  if (chain->bwd_tmp_bytes) memcpy(out->bt, chain->bwd_tmp_bytes, LK * sizeof(uint64_t));
  if (chain->output_kept) memcpy(out->kept, chain->output_kept, LK);
  out->bw = chain->host_bandwidth;
  for (int32_t k = 0; k < K; k++) out->nest[k] = chain->mode_nestable ? chain->mode_nestable[k] : (uint8_t)(k == 0);
  int cuts = 0;
  for (int32_t i = L - 1, next = L; i >= 0; i--) {
    out->reach[i] = next;
    if (i > 0 && chain->cut_before && chain->cut_before[i]) next = i, cuts = 1;
  }

  /* No recompute holds the last block or a_L, so the fast path needs only blocks 0..L-2 and
   * a_0..a_{L-1} alike: the last block may differ (a model's head and loss, from the Python side). */
  const int32_t Lr = L - 1;
  int same_x = 1;
  for (int32_t i = 1; i < L; i++) same_x &= out->x[i] == out->x[0];
  out->identical = same_x && all_rows_equal_d(out->f, Lr, K) && all_rows_equal_d(out->fn, Lr, 1) &&
                   all_rows_equal_d(out->b, Lr, K) && all_rows_equal_u(out->s, Lr, K) &&
                   all_rows_equal_u(out->ft, Lr, K) && all_rows_equal_u(out->fnt, Lr, 1) &&
                   all_rows_equal_u(out->bt, Lr, K) && !cuts; /* a cut makes R(s, e) depend on s */
  /* (kept is not part of it: it only matters in the top-level rows, which are per block anyway) */
  return LLMMEM_OK;
}
