/*
 * test_checkpointing.c — the recompute planner: DP against brute force over every plan of small random
 * chains, monotonicity in the budget, the identical-block fast path against the general DP, the
 * least budget, infeasible budgets, malformed input, and the accounting of the two forward transients
 * (a tape's and a region's no-store one) against a hand computation.
 */
#include <math.h>
#include <string.h>

#include <llmmem/checkpointing.h>

#include "testhelper.h"
#include "../../csrc/checkpointing/plan_internal.h" /* the uniform plans' flat simulation (internal) */
#include "../../csrc/checkpointing/relax.h"         /* the DP's inner loop (internal) */

#define MAXL 8
#define MAXK 3

typedef struct chain_buf_s {
  double f[MAXL * MAXK], fn[MAXL], b[MAXL * MAXK];
  uint64_t x[MAXL + 1], s[MAXL * MAXK], ft[MAXL], fnt[MAXL], ftk[MAXL * MAXK], bt[MAXL * MAXK];
  uint8_t nest[MAXK], kept[MAXL * MAXK], cut[MAXL];
  llmmem_plan_chain_t chain;
} chain_buf_t;

static void random_chain(chain_buf_t *cb, int32_t L, int32_t K, unsigned long long *rng, int identical) {
  memset(cb, 0, sizeof *cb);
  for (int32_t i = 0; i < L; i++) {
    const int32_t src = identical ? 0 : i;
    if (identical && i > 0) {
      cb->fn[i] = cb->fn[0];
      cb->ft[i] = cb->ft[0];
      for (int32_t k = 0; k < K; k++) {
        cb->f[i * K + k] = cb->f[k], cb->b[i * K + k] = cb->b[k];
        cb->s[i * K + k] = cb->s[k], cb->bt[i * K + k] = cb->bt[k];
      }
      continue;
    }
    (void)src;
    cb->fn[i] = 1.0 + (double)(th_rand(rng) % 7);
    cb->ft[i] = th_rand(rng) % 3;
    uint64_t full = 4 + th_rand(rng) % 12;
    for (int32_t k = 0; k < K; k++) {
      /* mode 0 keeps the most and recomputes nothing; later modes keep less and pay in backward */
      cb->f[i * K + k] = cb->fn[i] + 0.25 * k;
      cb->s[i * K + k] = k == 0 ? full : full / (uint64_t)(k + 1);
      cb->b[i * K + k] = 2.0 * cb->fn[i] + (double)k * (1.0 + (double)(th_rand(rng) % 3));
      cb->bt[i * K + k] = th_rand(rng) % 3;
    }
  }
  uint64_t x0 = 1 + th_rand(rng) % 4;
  for (int32_t i = 0; i <= L; i++) cb->x[i] = identical ? x0 : 1 + th_rand(rng) % 4;
  for (int32_t k = 0; k < K; k++) cb->nest[k] = k == 0 || (th_rand(rng) & 1);
  cb->chain = (llmmem_plan_chain_t){L, K, cb->f, cb->fn, cb->b, cb->x, cb->s, cb->ft, cb->bt, cb->nest};
}

/* Gives the no-store forward (inside a region) a transient of its own, above or below the tape
 * forward's, and each mode's tape forward its own (identical: the same for every block, so the
 * fast path still applies). */
static void with_forward_tmps(chain_buf_t *cb, unsigned long long *rng, int identical) {
  const int32_t K = cb->chain.n_modes;
  for (int32_t i = 0; i < cb->chain.n_blocks; i++) {
    cb->fnt[i] = identical && i > 0 ? cb->fnt[0] : th_rand(rng) % 9;
    for (int32_t k = 0; k < K; k++) cb->ftk[i * K + k] = identical && i > 0 ? cb->ftk[k] : th_rand(rng) % 6;
  }
  cb->chain.fwd_nostore_tmp_bytes = cb->fnt;
  cb->chain.fwd_tape_tmp_bytes = cb->ftk;
}

/* Turns offloading on: a bandwidth that makes a copy cost about as much as a block's forward
 * (sometimes more, sometimes less), and some (block, mode) tapes that keep the block's output. */
static void with_offload(chain_buf_t *cb, unsigned long long *rng) {
  static const double bandwidths[] = {0.5, 1.0, 4.0};
  for (int32_t i = 0; i < cb->chain.n_blocks * cb->chain.n_modes; i++) cb->kept[i] = th_rand(rng) % 4 == 0;
  cb->chain.output_kept = cb->kept;
  cb->chain.host_bandwidth = bandwidths[th_rand(rng) % 3];
}

/* ---- brute force: every plan (laminar regions without duplicates, every allowed mode) ---- */

typedef struct seg_s {
  int32_t s, e, depth, is_region_body;
  int32_t after_kept; /* top level: the item before keeps a_s alive (no offloaded region at s) */
} seg_t;

#define NBUDGETS 4

typedef struct brute_s {
  const llmmem_plan_chain_t *chain;
  uint64_t budget[NBUDGETS];
  int32_t mode[MAXL];
  llmmem_plan_region_t regions[2 * MAXL];
  int32_t n_regions;
  seg_t pending[4 * MAXL];
  int32_t n_pending;
  double best_time[NBUDGETS]; /* least time among plans that fit each budget */
  uint64_t least_peak;        /* least peak among all plans */
  long plans;
  int sim_failures;
} brute_t;

static void brute_eval(brute_t *bf) {
  llmmem_plan_t plan = {bf->mode, bf->regions, 2 * MAXL, bf->n_regions};
  llmmem_plan_prediction_t p;
  if (llmmem_plan_simulate(bf->chain, &plan, &p) != LLMMEM_OK) {
    bf->sim_failures++;
    return;
  }
  bf->plans++;
  if (p.peak_bytes < bf->least_peak) bf->least_peak = p.peak_bytes;
  for (int i = 0; i < NBUDGETS; i++)
    if (p.peak_bytes <= bf->budget[i] && p.time < bf->best_time[i]) bf->best_time[i] = p.time;
}

static int offload_allowed(const llmmem_plan_chain_t *chain, seg_t seg) {
  return chain->host_bandwidth > 0 && seg.depth == 0 && seg.s >= 1 && !seg.after_kept;
}

static int keeps_output(const llmmem_plan_chain_t *chain, int32_t i, int32_t k) {
  return chain->output_kept && chain->output_kept[i * chain->n_modes + k];
}

static void brute_gen(brute_t *bf) {
  if (bf->n_pending == 0) {
    brute_eval(bf);
    return;
  }
  const seg_t seg = bf->pending[--bf->n_pending];
  if (seg.s == seg.e) {
    brute_gen(bf);
  } else {
    const int32_t K = bf->chain->n_modes;
    for (int32_t k = 0; k < K; k++) {
      if (seg.depth > 0 && !bf->chain->mode_nestable[k]) continue;
      bf->mode[seg.s] = k;
      bf->pending[bf->n_pending++] = (seg_t){seg.s + 1, seg.e, seg.depth, 0, keeps_output(bf->chain, seg.s, k)};
      brute_gen(bf);
      bf->n_pending--;
    }
    for (int32_t q = seg.s + 1; q <= seg.e; q++) {
      if (seg.is_region_body && q == seg.e) continue; /* the same region twice */
      for (int32_t off = 0; off <= offload_allowed(bf->chain, seg); off++) {
        bf->regions[bf->n_regions++] = (llmmem_plan_region_t){seg.s, q, off};
        bf->pending[bf->n_pending++] = (seg_t){q, seg.e, seg.depth, 0, 0};
        bf->pending[bf->n_pending++] = (seg_t){seg.s, q, seg.depth + 1, 1, 0};
        brute_gen(bf);
        bf->n_pending -= 2;
        bf->n_regions--;
      }
    }
  }
  bf->pending[bf->n_pending++] = seg;
}

static void brute_force(const llmmem_plan_chain_t *chain, const uint64_t *budgets, brute_t *bf) {
  memset(bf, 0, sizeof *bf);
  bf->chain = chain;
  for (int i = 0; i < NBUDGETS; i++) bf->budget[i] = budgets[i], bf->best_time[i] = INFINITY;
  bf->least_peak = UINT64_MAX;
  bf->pending[bf->n_pending++] = (seg_t){0, chain->n_blocks, 0, 0, 0};
  brute_gen(bf);
}

static int close_enough(double a, double b) { return fabs(a - b) <= 1e-4 * fmax(1.0, fabs(b)); }

static llmmem_status_t solve(const llmmem_plan_chain_t *chain, uint64_t budget, int32_t slots, uint32_t flags,
                             llmmem_plan_prediction_t *p, uint64_t *least) {
  int32_t mode[64];
  llmmem_plan_region_t regions[128];
  llmmem_plan_t plan = {mode, regions, 128, 0};
  return llmmem_plan_solve(chain, budget, slots, flags, &plan, p, least);
}

int main(void) {
  unsigned long long rng = 12345;

  TEST("DP is optimal: equals brute force over every plan (L <= 5 with 1-3 modes, L = 6 with one)") {
    int cases = 0;
    for (int32_t trial = 0; trial < 30; trial++) {
      const int32_t L = trial == 0 ? 6 : 1 + (int32_t)(th_rand(&rng) % 5);
      const int32_t K = trial == 0 ? 1 : 1 + (int32_t)(th_rand(&rng) % (L <= 4 ? 3 : 2));
      chain_buf_t cb;
      random_chain(&cb, L, K, &rng, 0);
      if (trial % 2) with_forward_tmps(&cb, &rng, 0);
      uint64_t least = 0;
      CHECK_OK(llmmem_plan_min_budget(&cb.chain, &least));
      /* budgets from the least to beyond keeping everything; slots = budget: 1 byte per slot, exact */
      uint64_t budgets[NBUDGETS] = {least, 0, 0, 4 * least};
      budgets[1] = least + th_rand(&rng) % (least + 2);
      budgets[2] = least + th_rand(&rng) % (least + 2);
      brute_t bf;
      brute_force(&cb.chain, budgets, &bf);
      CHECK(bf.sim_failures == 0);
      CHECK(least == bf.least_peak);
      for (int i = 0; i < NBUDGETS; i++) {
        llmmem_plan_prediction_t p;
        CHECK_OK(solve(&cb.chain, budgets[i], (int32_t)budgets[i], 0, &p, NULL));
        CHECK(p.peak_bytes <= budgets[i]);
        if (!close_enough(p.time, bf.best_time[i]))
          printf("  L=%d K=%d budget=%llu: dp %.6f brute %.6f over %ld plans\n", L, K, (unsigned long long)budgets[i],
                 p.time, bf.best_time[i], bf.plans);
        CHECK(close_enough(p.time, bf.best_time[i]));
        cases++;
      }
    }
    CHECK(cases == 30 * NBUDGETS);
  }

  TEST("with cuts (a second stack starts): the DP equals brute force over the plans that span none") {
    long refused = 0;
    for (int32_t trial = 0; trial < 16; trial++) {
      const int32_t L = trial == 0 ? 6 : 2 + (int32_t)(th_rand(&rng) % 4);
      const int32_t K = trial == 0 ? 1 : 1 + (int32_t)(th_rand(&rng) % 2);
      chain_buf_t cb;
      random_chain(&cb, L, K, &rng, trial % 4 == 3);
      for (int32_t i = 1; i < L; i++) cb.cut[i] = trial == 0 ? i == 3 : th_rand(&rng) % 3 == 0;
      cb.chain.cut_before = cb.cut;
      uint64_t least = 0;
      CHECK_OK(llmmem_plan_min_budget(&cb.chain, &least));
      uint64_t budgets[NBUDGETS] = {least, least + th_rand(&rng) % (least + 2), least + 1, 4 * least};
      brute_t bf;
      brute_force(&cb.chain, budgets, &bf); /* plans across a cut are refused by the simulator */
      refused += bf.sim_failures;
      CHECK(bf.plans > 0 && least == bf.least_peak);
      for (int i = 0; i < NBUDGETS; i++) {
        int32_t mode[64];
        llmmem_plan_region_t regions[128];
        llmmem_plan_t plan = {mode, regions, 128, 0};
        llmmem_plan_prediction_t p;
        CHECK_OK(llmmem_plan_solve(&cb.chain, budgets[i], (int32_t)budgets[i], 0, &plan, &p, NULL));
        CHECK(p.peak_bytes <= budgets[i] && close_enough(p.time, bf.best_time[i]));
        for (int32_t r = 0; r < plan.n_regions; r++)
          for (int32_t c = regions[r].start + 1; c < regions[r].end; c++) CHECK(!cb.cut[c]);
      }
    }
    CHECK(refused > 0);
    chain_buf_t cb;
    random_chain(&cb, 3, 1, &rng, 0);
    cb.cut[1] = 2;
    cb.chain.cut_before = cb.cut;
    uint64_t least = 0;
    CHECK(llmmem_plan_min_budget(&cb.chain, &least) == LLMMEM_ERR_INVALID);
  }

  TEST("more budget never gives more predicted time; the peak always fits") {
    for (int32_t trial = 0; trial < 10; trial++) {
      chain_buf_t cb;
      random_chain(&cb, 8, 2, &rng, 0);
      uint64_t least = 0;
      CHECK_OK(llmmem_plan_min_budget(&cb.chain, &least));
      double prev = INFINITY;
      for (uint64_t budget = least; budget < 3 * least; budget++) {
        llmmem_plan_prediction_t p;
        CHECK_OK(solve(&cb.chain, budget, (int32_t)budget, 0, &p, NULL));
        CHECK(p.peak_bytes <= budget);
        CHECK(p.time <= prev + 1e-6);
        prev = p.time;
      }
    }
  }

  TEST("the DP's split loop: every vector level, skipping stretches, equals the plain loop bitwise") {
    enum { WMAX = 700 };
    static float a[WMAX], b[WMAX], best0[WMAX], want[WMAX], got[WMAX], ca[WMAX], cb[WMAX];
    long improved = 0, unchanged = 0;
    for (int32_t trial = 0; trial < 300; trial++) {
      const int64_t W = 1 + (int64_t)(th_rand(&rng) % WMAX);
      float *rows[3] = {a, b, best0};
      for (int r = 0; r < 3; r++) { /* non-increasing, infinite below a random start, with ties */
        const int64_t start = (int64_t)(th_rand(&rng) % (uint64_t)(W + 1));
        /* a and b start in [10, 150), best in [40, 440): the candidate c + a + b (c < 80) wins some slots */
        float v = (r < 2 ? 10.0f : 40.0f) + (float)(th_rand(&rng) % 1000) / (r < 2 ? 7.0f : 2.5f);
        for (int64_t m = 0; m < W; m++) {
          if (m >= start && th_rand(&rng) % 3) v -= (float)(th_rand(&rng) % 100) / 997.0f;
          rows[r][m] = m < start ? INFINITY : v;
        }
      }
      plan_relax_sample(a, ca, W);
      plan_relax_sample(b, cb, W);
      const int64_t shift = (int64_t)(th_rand(&rng) % (uint64_t)W);
      const int64_t lo = shift + (int64_t)(th_rand(&rng) % (uint64_t)(W - shift));
      const float c = (float)(th_rand(&rng) % 1000) / 13.0f;
      memcpy(want, best0, sizeof(float) * (size_t)W);
      for (int64_t m = lo; m < W; m++) {
        const float v = c + a[m - shift] + b[m - shift];
        if (v < want[m]) improved++;
        want[m] = v < want[m] ? v : want[m];
      }
      for (int isa = 0; isa <= 2; isa++) {
        memcpy(got, best0, sizeof(float) * (size_t)W);
        plan_relax_pick(isa)(got, a, b, ca, cb, c, shift, lo, W);
        CHECK(memcmp(got, want, sizeof(float) * (size_t)W) == 0);
      }
      unchanged += W - lo;
    }
    unchanged -= improved;
    CHECK(improved > 1000 && unchanged > 1000); /* both cases are exercised */
  }

  TEST("identical blocks: the fast path equals the general DP") {
    for (int32_t trial = 0; trial < 40; trial++) {
      const int32_t L = 2 + (int32_t)(th_rand(&rng) % (MAXL - 1)), K = 1 + (int32_t)(th_rand(&rng) % MAXK);
      chain_buf_t cb;
      random_chain(&cb, L, K, &rng, 1);
      if (trial % 2) with_forward_tmps(&cb, &rng, 1);
      uint64_t least = 0;
      CHECK_OK(llmmem_plan_min_budget(&cb.chain, &least));
      for (uint64_t budget = least; budget < 2 * least + 4; budget += 1 + budget / 8) {
        llmmem_plan_prediction_t fast, general;
        CHECK_OK(solve(&cb.chain, budget, (int32_t)budget, 0, &fast, NULL));
        CHECK_OK(solve(&cb.chain, budget, (int32_t)budget, LLMMEM_PLAN_NO_FAST_PATH, &general, NULL));
        CHECK(close_enough(fast.time, general.time));
        CHECK(fast.peak_bytes <= budget && general.peak_bytes <= budget);
      }
    }
  }

  TEST("identical blocks but a different last block and output (a model's head): fast path equals general DP") {
    for (int32_t trial = 0; trial < 40; trial++) {
      const int32_t L = 2 + (int32_t)(th_rand(&rng) % (MAXL - 1)), K = 1 + (int32_t)(th_rand(&rng) % MAXK);
      chain_buf_t cb, other;
      random_chain(&cb, L, K, &rng, 1);
      random_chain(&other, 1, K, &rng, 0);
      const int32_t last = L - 1;
      cb.fn[last] = other.fn[0];
      cb.ft[last] = other.ft[0] + th_rand(&rng) % 8; /* a loss can need more than a layer */
      for (int32_t k = 0; k < K; k++) {
        cb.f[last * K + k] = other.f[k], cb.b[last * K + k] = other.b[k];
        cb.s[last * K + k] = other.s[k], cb.bt[last * K + k] = other.bt[k] + th_rand(&rng) % 8;
      }
      cb.x[L] = th_rand(&rng) % 3; /* a scalar loss: as good as nothing */
      uint64_t least = 0;
      CHECK_OK(llmmem_plan_min_budget(&cb.chain, &least));
      for (uint64_t budget = least; budget < 2 * least + 4; budget += 1 + budget / 8) {
        llmmem_plan_prediction_t fast, general;
        CHECK_OK(solve(&cb.chain, budget, (int32_t)budget, 0, &fast, NULL));
        CHECK_OK(solve(&cb.chain, budget, (int32_t)budget, LLMMEM_PLAN_NO_FAST_PATH, &general, NULL));
        CHECK(close_enough(fast.time, general.time));
        CHECK(fast.peak_bytes <= budget && general.peak_bytes <= budget);
      }
      if (L <= 5) { /* and both are optimal over every plan */
        uint64_t budgets[NBUDGETS] = {least, least + 1, least + least / 2, 3 * least};
        brute_t bf;
        brute_force(&cb.chain, budgets, &bf);
        CHECK(least == bf.least_peak);
        for (int i = 0; i < NBUDGETS; i++) {
          llmmem_plan_prediction_t p;
          CHECK_OK(solve(&cb.chain, budgets[i], (int32_t)budgets[i], 0, &p, NULL));
          CHECK(close_enough(p.time, bf.best_time[i]));
        }
      }
    }
  }

  TEST("few slots: rounding is conservative and solve still succeeds at the least budget") {
    for (int32_t trial = 0; trial < 10; trial++) {
      chain_buf_t cb;
      random_chain(&cb, 7, 2, &rng, 0);
      uint64_t least = 0;
      CHECK_OK(llmmem_plan_min_budget(&cb.chain, &least));
      for (int32_t slots = 1; slots <= 64; slots *= 2) {
        llmmem_plan_prediction_t p;
        CHECK_OK(solve(&cb.chain, least, slots, 0, &p, NULL));
        CHECK(p.peak_bytes <= least);
        CHECK_OK(solve(&cb.chain, least * 2, slots, 0, &p, NULL));
        CHECK(p.peak_bytes <= least * 2);
      }
    }
  }

  TEST("whatever the slots, the plan is never slower than a uniform plan that fits (at its own peak)") {
    long checked = 0;
    for (int32_t trial = 0; trial < 40; trial++) {
      const int32_t L = 2 + (int32_t)(th_rand(&rng) % 7), K = 1 + (int32_t)(th_rand(&rng) % 3);
      chain_buf_t cb;
      random_chain(&cb, L, K, &rng, trial % 3 == 0);
      uint64_t least = 0;
      CHECK_OK(llmmem_plan_min_budget(&cb.chain, &least));
      /* every block in mode `base`, but (family 1) every k-th from `off` (0 or k - 1) or (family 2)
       * segments of k checkpointed: regions over blocks 0..L-2, as the planner's list (uniform.c);
       * the last block in `last` */
      for (int family = 0; family < 3; family++)
        for (int32_t k = 1; k <= (family ? L - 1 : 1); k++)
          for (int32_t off = 0; off<(family == 1 ? k : 1); off += k> 1 ? k - 1 : 1) /* 0 and k - 1 */
            for (int32_t base = 0; base < K; base++)
              for (int32_t last = 0; last < K; last++) {
                int32_t mode[MAXL];
                llmmem_plan_region_t reg[MAXL];
                llmmem_plan_t u = {mode, reg, MAXL, 0};
                for (int32_t i = 0; i < L; i++) mode[i] = i == L - 1 ? last : base;
                for (int32_t i = 0; family == 1 && i < L - 1; i++)
                  if (i % k == off) reg[u.n_regions++] = (llmmem_plan_region_t){i, i + 1, 0}, mode[i] = 0;
                for (int32_t i = 0; family == 2 && i < L - 1; i++) {
                  if (i % k == 0) reg[u.n_regions++] = (llmmem_plan_region_t){i, i + k < L - 1 ? i + k : L - 1, 0};
                  mode[i] = 0;
                }
                llmmem_plan_prediction_t pu, p;
                CHECK_OK(llmmem_plan_simulate(&cb.chain, &u, &pu));
                if (pu.peak_bytes < least) continue;
                for (int32_t slots = 2; slots <= 32; slots *= 4) {
                  CHECK_OK(solve(&cb.chain, pu.peak_bytes, slots, 0, &p, NULL));
                  CHECK(p.peak_bytes <= pu.peak_bytes);
                  if (p.time > pu.time + 1e-9 * pu.time)
                    printf("  L=%d K=%d family %d k=%d off=%d base %d last %d slots %d: plan %.4f, uniform %.4f\n", L,
                           K, family, k, off, base, last, slots, p.time, pu.time);
                  CHECK(p.time <= pu.time + 1e-9 * pu.time);
                  checked++;
                }
              }
    }
    CHECK(checked > 1000);
  }

  TEST("the uniform plans' flat simulation counts the peak as the simulator does") {
    for (int32_t trial = 0; trial < 400; trial++) {
      const int32_t L = 1 + (int32_t)(th_rand(&rng) % MAXL), K = 1 + (int32_t)(th_rand(&rng) % MAXK);
      chain_buf_t cb;
      random_chain(&cb, L, K, &rng, trial % 4 == 0);
      if (trial % 2) with_forward_tmps(&cb, &rng, trial % 4 == 0);
      int32_t mode[MAXL];
      llmmem_plan_region_t reg[MAXL];
      llmmem_plan_t plan = {mode, reg, MAXL, 0};
      for (int32_t i = 0; i < L;) { /* a random flat plan: tapes in any mode, regions of 1..3 blocks in mode 0 */
        const int32_t len = 1 + (int32_t)(th_rand(&rng) % 3);
        if (th_rand(&rng) % 2 && i + len <= L) {
          reg[plan.n_regions++] = (llmmem_plan_region_t){i, i + len, 0};
          for (int32_t j = i; j < i + len; j++) mode[j] = 0;
          i += len;
        } else {
          mode[i++] = (int32_t)(th_rand(&rng) % (uint64_t)K);
        }
      }
      llmmem_plan_prediction_t p;
      CHECK_OK(llmmem_plan_simulate(&cb.chain, &plan, &p));
      plan_costs_t c;
      CHECK_OK(plan_costs_load(&cb.chain, &c));
      CHECK((uint64_t)plan_flat_peak(&c, mode, reg, plan.n_regions) == p.peak_bytes);
      plan_costs_free(&c);
    }
  }

  TEST("an infeasible budget reports the least feasible one") {
    chain_buf_t cb;
    random_chain(&cb, 5, 2, &rng, 0);
    uint64_t least = 0, reported = 0;
    CHECK_OK(llmmem_plan_min_budget(&cb.chain, &least));
    llmmem_plan_prediction_t p;
    CHECK_STATUS(solve(&cb.chain, least - 1, 100, 0, &p, &reported), LLMMEM_ERR_INFEASIBLE);
    CHECK(reported == least);
    char expected[64];
    snprintf(expected, sizeof expected, "smallest feasible budget is %llu bytes", (unsigned long long)least);
    CHECK(strstr(llmmem_last_error(), expected) != NULL);
    CHECK_STATUS(solve(&cb.chain, 0, 100, 0, &p, &reported), LLMMEM_ERR_INFEASIBLE);
    CHECK_OK(solve(&cb.chain, least, 100, 0, &p, &reported));
  }

  TEST("large chains solve and stay within the budget (general and fast path)") {
    enum { BIG = 64 };
    static double f[BIG * 2], fn[BIG], b[BIG * 2];
    static uint64_t x[BIG + 1], s[BIG * 2], ft[BIG], bt[BIG * 2];
    uint8_t nest[2] = {1, 0};
    for (int hetero = 0; hetero < 2; hetero++) {
      for (int32_t i = 0; i < BIG; i++) {
        fn[i] = 1.0 + (hetero ? (double)(i % 5) : 0.0);
        ft[i] = 10;
        f[2 * i] = fn[i], f[2 * i + 1] = fn[i] * 1.05;
        b[2 * i] = 2 * fn[i], b[2 * i + 1] = 2.3 * fn[i];
        s[2 * i] = 300 + (hetero ? (uint64_t)(i % 7) * 40 : 0), s[2 * i + 1] = 90;
        bt[2 * i] = bt[2 * i + 1] = 20;
      }
      for (int32_t i = 0; i <= BIG; i++) x[i] = 25;
      llmmem_plan_chain_t chain = {BIG, 2, f, fn, b, x, s, ft, bt, nest};
      uint64_t least = 0;
      CHECK_OK(llmmem_plan_min_budget(&chain, &least));
      double prev = INFINITY;
      for (uint64_t budget = least; budget <= 40 * least; budget *= 2) {
        llmmem_plan_prediction_t p;
        CHECK_OK(solve(&chain, budget, 500, 0, &p, NULL));
        CHECK(p.peak_bytes <= budget);
        CHECK(p.time <= prev * (1 + 1e-6));
        prev = p.time;
      }
    }
  }

  TEST("malformed chains are rejected with the field named") {
    chain_buf_t cb;
    random_chain(&cb, 4, 2, &rng, 0);
    llmmem_plan_prediction_t p;
    uint64_t least;
    cb.f[3] = NAN;
    CHECK_STATUS(llmmem_plan_min_budget(&cb.chain, &least), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "fwd_time[3]") != NULL);
    cb.f[3] = 1.0;
    cb.b[0] = -1.0;
    CHECK_STATUS(solve(&cb.chain, 1000, 100, 0, &p, NULL), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "bwd_time[0]") != NULL);
    cb.b[0] = 1.0;
    cb.x[2] = LLMMEM_PLAN_MAX_BYTES + 1;
    CHECK_STATUS(solve(&cb.chain, 1000, 100, 0, &p, NULL), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "input_bytes[2]") != NULL);
    cb.x[2] = 1;
    cb.chain.n_blocks = 0;
    CHECK_STATUS(solve(&cb.chain, 1000, 100, 0, &p, NULL), LLMMEM_ERR_INVALID);
    cb.chain.n_blocks = 4;
    cb.chain.n_modes = 0;
    CHECK_STATUS(solve(&cb.chain, 1000, 100, 0, &p, NULL), LLMMEM_ERR_INVALID);
    cb.chain.n_modes = 2;
    CHECK_STATUS(solve(&cb.chain, 1000, 0, 0, &p, NULL), LLMMEM_ERR_INVALID);
    CHECK_STATUS(solve(&cb.chain, 1000, 100, 8, &p, NULL), LLMMEM_ERR_INVALID);
    CHECK_STATUS(solve(NULL, 1000, 100, 0, &p, NULL), LLMMEM_ERR_INVALID);
    const double *saved = cb.chain.fwd_time;
    cb.chain.fwd_time = NULL;
    CHECK_STATUS(solve(&cb.chain, 1000, 100, 0, &p, NULL), LLMMEM_ERR_INVALID);
    cb.chain.fwd_time = saved;
    cb.fnt[1] = LLMMEM_PLAN_MAX_BYTES + 1;
    cb.chain.fwd_nostore_tmp_bytes = cb.fnt;
    CHECK_STATUS(solve(&cb.chain, 1000, 100, 0, &p, NULL), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "fwd_nostore_tmp_bytes[1]") != NULL);
    cb.chain.fwd_nostore_tmp_bytes = NULL;
    cb.ftk[7] = LLMMEM_PLAN_MAX_BYTES + 1;
    cb.chain.fwd_tape_tmp_bytes = cb.ftk;
    CHECK_STATUS(solve(&cb.chain, 1000, 100, 0, &p, NULL), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "fwd_tape_tmp_bytes[7]") != NULL);
    cb.chain.fwd_tape_tmp_bytes = NULL;
    int32_t mode[4];
    llmmem_plan_region_t regions[8];
    llmmem_plan_t small = {mode, regions, 0, 0};
    CHECK_OK(llmmem_plan_min_budget(&cb.chain, &least));
    /* a budget where keeping everything fits needs no region: capacity 0 is then enough */
    CHECK_OK(llmmem_plan_solve(&cb.chain, 1u << 20, 100, 0, &small, &p, NULL));
    CHECK(small.n_regions == 0);
  }

  TEST("malformed plans are rejected by the simulator") {
    chain_buf_t cb;
    random_chain(&cb, 5, 2, &rng, 0);
    cb.nest[1] = 0;
    int32_t mode[5] = {0, 0, 0, 0, 0};
    llmmem_plan_region_t regions[4];
    llmmem_plan_t plan = {mode, regions, 4, 0};
    llmmem_plan_prediction_t p;
    regions[0] = (llmmem_plan_region_t){0, 3};
    regions[1] = (llmmem_plan_region_t){2, 4};
    plan.n_regions = 2;
    CHECK_STATUS(llmmem_plan_simulate(&cb.chain, &plan, &p), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "overlap") != NULL);
    regions[1] = (llmmem_plan_region_t){0, 3};
    CHECK_STATUS(llmmem_plan_simulate(&cb.chain, &plan, &p), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "twice") != NULL);
    regions[1] = (llmmem_plan_region_t){3, 3};
    CHECK_STATUS(llmmem_plan_simulate(&cb.chain, &plan, &p), LLMMEM_ERR_INVALID);
    regions[1] = (llmmem_plan_region_t){4, 6};
    CHECK_STATUS(llmmem_plan_simulate(&cb.chain, &plan, &p), LLMMEM_ERR_INVALID);
    plan.n_regions = 1;
    mode[1] = 1;
    CHECK_STATUS(llmmem_plan_simulate(&cb.chain, &plan, &p), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "cannot be nested") != NULL);
    mode[1] = 2;
    plan.n_regions = 0;
    CHECK_STATUS(llmmem_plan_simulate(&cb.chain, &plan, &p), LLMMEM_ERR_INVALID);
    mode[1] = 1;
    CHECK_OK(llmmem_plan_simulate(&cb.chain, &plan, &p));
    plan.n_regions = -1;
    CHECK_STATUS(llmmem_plan_simulate(&cb.chain, &plan, &p), LLMMEM_ERR_INVALID);
  }

  TEST("store-all prediction: held bytes are every input and tape; overhead is zero") {
    chain_buf_t cb;
    random_chain(&cb, 6, 1, &rng, 0);
    int32_t mode[6] = {0};
    llmmem_plan_t plan = {mode, NULL, 0, 0};
    llmmem_plan_prediction_t p;
    CHECK_OK(llmmem_plan_simulate(&cb.chain, &plan, &p));
    uint64_t held = 0;
    for (int32_t i = 0; i < 6; i++) held += cb.x[i] + cb.s[i];
    CHECK(p.held_bytes == held);
    CHECK(fabs(p.overhead_time) < 1e-9);
  }

  TEST("offload: DP equals brute force over every plan including offloaded regions (L <= 5)") {
    int cases = 0, offloaded_best = 0;
    for (int32_t trial = 0; trial < 24; trial++) {
      const int32_t L = 2 + (int32_t)(th_rand(&rng) % 4);
      const int32_t K = 1 + (int32_t)(th_rand(&rng) % (L <= 4 ? 3 : 2));
      chain_buf_t cb;
      random_chain(&cb, L, K, &rng, trial % 4 == 0);
      with_offload(&cb, &rng);
      if (trial % 3 == 1) with_forward_tmps(&cb, &rng, trial % 4 == 0);
      uint64_t least = 0;
      CHECK_OK(llmmem_plan_min_budget(&cb.chain, &least));
      uint64_t budgets[NBUDGETS] = {least, least + th_rand(&rng) % (least + 2), least + th_rand(&rng) % (least + 2),
                                    4 * least};
      brute_t bf;
      brute_force(&cb.chain, budgets, &bf);
      CHECK(bf.sim_failures == 0);
      CHECK(least == bf.least_peak);
      for (int i = 0; i < NBUDGETS; i++) {
        int32_t mode[MAXL];
        llmmem_plan_region_t regions[2 * MAXL];
        llmmem_plan_t plan = {mode, regions, 2 * MAXL, 0};
        llmmem_plan_prediction_t p;
        CHECK_OK(llmmem_plan_solve(&cb.chain, budgets[i], (int32_t)budgets[i], 0, &plan, &p, NULL));
        CHECK(p.peak_bytes <= budgets[i]);
        if (!close_enough(p.time, bf.best_time[i]))
          printf("  offload L=%d K=%d budget=%llu: dp %.6f brute %.6f over %ld plans\n", L, K,
                 (unsigned long long)budgets[i], p.time, bf.best_time[i], bf.plans);
        CHECK(close_enough(p.time, bf.best_time[i]));
        for (int32_t r = 0; r < plan.n_regions; r++) offloaded_best += regions[r].offload;
        cases++;
      }
    }
    CHECK(cases == 24 * NBUDGETS);
    CHECK(offloaded_best > 0); /* the option was really exercised */
  }

  TEST("offload makes smaller budgets feasible; more budget never gives more time") {
    int smaller = 0;
    for (int32_t trial = 0; trial < 10; trial++) {
      chain_buf_t cb;
      random_chain(&cb, 8, 2, &rng, trial % 2);
      uint64_t without = 0, with = 0;
      CHECK_OK(llmmem_plan_min_budget(&cb.chain, &without));
      with_offload(&cb, &rng);
      memset(cb.kept, 0, sizeof cb.kept);
      CHECK_OK(llmmem_plan_min_budget(&cb.chain, &with));
      CHECK(with <= without);
      smaller += with < without;
      double prev = INFINITY;
      for (uint64_t budget = with; budget < 3 * without; budget++) {
        llmmem_plan_prediction_t p;
        CHECK_OK(solve(&cb.chain, budget, (int32_t)budget, 0, &p, NULL));
        CHECK(p.peak_bytes <= budget);
        CHECK(p.time <= prev + 1e-6);
        CHECK(p.transfer_time >= 0.0 && p.transfer_time <= p.overhead_time + 1e-9);
        prev = p.time;
      }
    }
    CHECK(smaller > 0);
  }

  TEST("offload: simulated accounting and rejected placements") {
    chain_buf_t cb;
    random_chain(&cb, 4, 1, &rng, 0);
    for (int32_t i = 0; i <= 4; i++) cb.x[i] = 8;
    cb.chain.host_bandwidth = 2.0; /* 4 time units per copy */
    for (int32_t i = 0; i < 4; i++) cb.fn[i] = 1.0;
    int32_t mode[4] = {0, 0, 0, 0};
    llmmem_plan_region_t regions[3] = {{1, 2, 1}, {2, 3, 1}};
    llmmem_plan_t plan = {mode, regions, 3, 2};
    llmmem_plan_prediction_t off, on;
    CHECK_OK(llmmem_plan_simulate(&cb.chain, &plan, &off));
    regions[0].offload = regions[1].offload = 0;
    CHECK_OK(llmmem_plan_simulate(&cb.chain, &plan, &on));
    /* two inputs on the host instead of the device; each copy: 4 back + (4 - 1) out not hidden */
    CHECK(off.host_bytes == 16 && on.host_bytes == 0);
    CHECK(off.held_bytes + 16 == on.held_bytes);
    CHECK(close_enough(off.transfer_time, 2 * (4.0 + 3.0)) && on.transfer_time == 0.0);
    CHECK(close_enough(off.time, on.time + off.transfer_time));
    regions[0] = (llmmem_plan_region_t){0, 2, 1};
    plan.n_regions = 1;
    CHECK_STATUS(llmmem_plan_simulate(&cb.chain, &plan, &on), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "chain input") != NULL);
    regions[0] = (llmmem_plan_region_t){1, 3, 0};
    regions[1] = (llmmem_plan_region_t){1, 2, 1};
    plan.n_regions = 2;
    CHECK_STATUS(llmmem_plan_simulate(&cb.chain, &plan, &on), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "top-level") != NULL);
    regions[0] = (llmmem_plan_region_t){2, 3, 2};
    plan.n_regions = 1;
    CHECK_STATUS(llmmem_plan_simulate(&cb.chain, &plan, &on), LLMMEM_ERR_INVALID);
    regions[0].offload = 1;
    memset(cb.kept, 0, sizeof cb.kept);
    cb.kept[1] = 1; /* block 1 (mode 0) keeps a_2: fine inside a region, not as a top-level tape */
    cb.chain.output_kept = cb.kept;
    CHECK_STATUS(llmmem_plan_simulate(&cb.chain, &plan, &on), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "output_kept") != NULL);
    regions[1] = (llmmem_plan_region_t){1, 2, 0};
    plan.n_regions = 2;
    CHECK_OK(llmmem_plan_simulate(&cb.chain, &plan, &on));
    plan.n_regions = 1;
    cb.chain.output_kept = NULL;
    cb.chain.host_bandwidth = 0.0;
    CHECK_STATUS(llmmem_plan_simulate(&cb.chain, &plan, &on), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "host_bandwidth") != NULL);
    cb.chain.host_bandwidth = NAN;
    CHECK_STATUS(llmmem_plan_simulate(&cb.chain, &plan, &on), LLMMEM_ERR_INVALID);
    cb.chain.host_bandwidth = -1.0;
    CHECK_STATUS(llmmem_plan_simulate(&cb.chain, &plan, &on), LLMMEM_ERR_INVALID);
    cb.chain.host_bandwidth = 1.0;
    cb.kept[0] = 2;
    cb.chain.output_kept = cb.kept;
    CHECK_STATUS(llmmem_plan_simulate(&cb.chain, &plan, &on), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "output_kept[0]") != NULL);
  }

  TEST("forward transients: a region's no-store forward and a tape's forward per mode (recompute), by hand") {
    /* Block 0 checkpointed alone, block 1 (a head, say) keeps its tape. Byte sizes are distinct so
     * that each step of the sum shows. */
    double f[2] = {1.0, 1.0}, b[2] = {2.0, 2.0};
    uint64_t x[3] = {10, 20, 5}, s[2] = {100, 50}, ft[2] = {7, 3}, fnt[2] = {300, 1000}, bt[2] = {11, 13};
    uint8_t nest[1] = {1};
    llmmem_plan_chain_t chain = {2, 1, f, NULL, b, x, s, ft, bt, nest};
    chain.fwd_nostore_tmp_bytes = fnt;
    int32_t mode[2] = {0, 0};
    llmmem_plan_region_t regions[1] = {{0, 1, 0}};
    llmmem_plan_t plan = {mode, regions, 1, 1};
    llmmem_plan_prediction_t p;
    /* held from the start: a_0 + the loss gradient (x[2]) = 15.
     * region forward, no tape: 15 + a_1 + fnt[0]                           = 15 + 20 + 300      = 335
     * block 1 forward, tape:   15 + a_1 + s[1] + a_2 + ft[1]               = 35 + 50 + 5 + 3    = 93
     * block 1 backward:        after the loss, 85 + grad a_1 + bt[1]       = 85 + 20 + 13       = 118
     * region recompute, tape:  a_0 + x[2] + grad a_1 + s[0] + a_1 + ft[0] = 35 + 100 + 20 + 7  = 162
     * its backward:            a_0 + x[2] + grad a_1 + s[0] + grad a_0 + bt[0] = 135 + 10 + 11  = 156 */
    CHECK_OK(llmmem_plan_simulate(&chain, &plan, &p));
    CHECK(p.peak_bytes == 335);
    CHECK(p.held_bytes == 10 + 20 + 50); /* a_0, a_1, block 1's tape */
    fnt[0] = 120;                        /* the recompute of block 0 (keeping its tape) is now the peak */
    CHECK_OK(llmmem_plan_simulate(&chain, &plan, &p));
    CHECK(p.peak_bytes == 162);
    /* absent: the tape's transient for both (7 for block 0), as chains without the field always meant */
    chain.fwd_nostore_tmp_bytes = NULL;
    CHECK_OK(llmmem_plan_simulate(&chain, &plan, &p));
    CHECK(p.peak_bytes == 162);
    ft[0] = 120; /* ... and one transient of 120 for both forwards counts it in the recompute too */
    CHECK_OK(llmmem_plan_simulate(&chain, &plan, &p));
    CHECK(p.peak_bytes == 35 + 100 + 20 + 120);
    /* per mode: mode 1 keeps 40 bytes with a forward transient of 90, mode 0 (as above) 7; both
     * override fwd_tmp_bytes (120) for the tapes, fnt for the region's forward */
    {
      double f2[4] = {1.0, 1.5, 1.0, 1.5}, b2[4] = {2.0, 3.0, 2.0, 3.0};
      uint64_t s2[4] = {100, 40, 50, 50}, bt2[4] = {11, 11, 13, 13}, ftk[4] = {7, 90, 3, 3};
      uint8_t nest2[2] = {1, 1};
      llmmem_plan_chain_t chain2 = {2, 2, f2, NULL, b2, x, s2, ft, bt2, nest2};
      chain2.fwd_nostore_tmp_bytes = fnt;
      chain2.fwd_tape_tmp_bytes = ftk;
      fnt[0] = 120;
      CHECK_OK(llmmem_plan_simulate(&chain2, &plan, &p));
      CHECK(p.peak_bytes == 162); /* region forward 15 + 20 + 120 = 155; recompute in mode 0: 162 */
      mode[0] = 1;                /* recompute in mode 1: 35 + 40 + 20 + 90 */
      CHECK_OK(llmmem_plan_simulate(&chain2, &plan, &p));
      CHECK(p.peak_bytes == 185);
      mode[0] = 0;
    }
    /* the least budget and the solver agree with every plan simulated (fnt[1] never counts: block 1
     * runs inside a region only in plans that put the head in one) */
    ft[0] = 7, fnt[0] = 300;
    chain.fwd_nostore_tmp_bytes = fnt;
    uint64_t least = 0;
    CHECK_OK(llmmem_plan_min_budget(&chain, &least));
    uint64_t budgets[NBUDGETS] = {least, least + 1, 2 * least, 4 * least};
    brute_t bf;
    brute_force(&chain, budgets, &bf);
    CHECK(bf.sim_failures == 0 && least == bf.least_peak);
    for (int i = 0; i < NBUDGETS; i++) {
      CHECK_OK(solve(&chain, budgets[i], (int32_t)budgets[i], 0, &p, NULL));
      CHECK(p.peak_bytes <= budgets[i] && close_enough(p.time, bf.best_time[i]));
    }
  }

  return TEST_SUMMARY();
}
