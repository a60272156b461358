/*
 * plan_internal.h — what the files of csrc/plan share: the validated chain in one flat form.
 * Not part of the ABI.
 */
#ifndef LLMMEM_PLAN_INTERNAL_H
#define LLMMEM_PLAN_INTERNAL_H

#include <llmmem/checkpointing.h>

#include "internal.h"

/* The chain with the optional arrays filled in, so the solver and the simulator never branch on NULL.
 * Owns its arrays (plan_chain_free). */
typedef struct plan_costs_s {
  int32_t L, K;
  double *f;      /* [i*K+k] tape forward time */
  double *fn;     /* [i] no-store forward time */
  double *b;      /* [i*K+k] backward time */
  uint64_t *x;    /* [i], i = 0..L */
  uint64_t *s;    /* [i*K+k] saved bytes beyond the input */
  uint64_t *ft;   /* [i*K+k] forward transient keeping a tape in mode k */
  uint64_t *fnt;  /* [i] forward transient inside a region (no tape) */
  uint64_t *bt;   /* [i*K+k] backward transient */
  uint8_t *kept;  /* [i*K+k] block i's tape in mode k keeps a_{i+1} */
  double bw;      /* host<->device bytes per time unit; 0: no offloading */
  int32_t *reach; /* [i] the end of the longest region that may start at block i: the next cut, or L */
  uint8_t nest[LLMMEM_PLAN_MAX_MODES];
  int identical; /* 1 when blocks 0..L-2 have the same costs and a_0..a_{L-1} the same size (chain.c) */
} plan_costs_t;

/* May region [s, e) exist? Not across a cut (checkpointing.h: cut_before). */
static inline int plan_region_ok(const plan_costs_t *c, int32_t s, int32_t e) { return e <= c->reach[s]; }

/* Checks every field (names the bad one in the error detail) and copies it into *out. */
llmmem_status_t plan_costs_load(const llmmem_plan_chain_t *chain, plan_costs_t *out);
void plan_costs_free(plan_costs_t *c);

/* Heterogeneous chains are O(L^3) even without slots: longer ones are refused, not run for hours. */
#define PLAN_MAX_GENERAL_BLOCKS 2048

/* Exact least budget (bytes) for which a plan exists, into *out. choice_T ([2 * L]: top-level
 * states where the first region may be offloaded, then those where it may not) and choice_R
 * ([plan_rows_R]) receive the least-memory plan's choices when not NULL. */
llmmem_status_t plan_costs_min_budget(const plan_costs_t *c, uint64_t *out, int32_t *choice_T, int32_t *choice_R);

/* Rows of the per-segment tables: one per segment [s, e) with e <= L - 1, or one per length when
 * all blocks are identical. */
size_t plan_rows_R(const plan_costs_t *c);
size_t plan_row_R(const plan_costs_t *c, int32_t s, int32_t e);

/* The uniform plans (uniform.c): replaces *plan and *pred (the DP's, or none when !*found) by the
 * fastest uniform plan whose simulated peak fits budget, when it is faster; sets *found then. */
llmmem_status_t plan_best_uniform(const plan_costs_t *c, uint64_t budget, llmmem_plan_t *plan,
                                  llmmem_plan_prediction_t *pred, int *found);

/* The simulated peak of a flat plan (regions in order, at the top level, none offloaded), as
 * plan_simulate_costs counts it (uniform.c). */
int64_t plan_flat_peak(const plan_costs_t *c, const int32_t *mode, const llmmem_plan_region_t *reg, int32_t R);

/* Simulates a validated plan given as a mode per block and regions in pre-order. */
llmmem_status_t plan_simulate_costs(const plan_costs_t *c, const llmmem_plan_t *plan, llmmem_plan_prediction_t *pred);

/* A plan choice: a tape mode k (0..K-1), a region of length r (encoded K - 1 + r, r in 1..L), or
 * an offloaded region of length r (encoded K - 1 + L + r). */
static inline int plan_choice_is_region(int32_t choice, int32_t K) { return choice >= K; }
static inline int plan_choice_is_offload(int32_t choice, int32_t K, int32_t L) { return choice >= K + L; }
static inline int32_t plan_choice_length(int32_t choice, int32_t K, int32_t L) {
  return plan_choice_is_offload(choice, K, L) ? choice - K - L + 1 : choice - K + 1;
}

/* May a top-level region starting at block s keep its input in host memory? Not a_0 (checkpointing.h);
 * whether the item before it keeps a_s anyway is the caller's part (plan_keeps_output). */
static inline int plan_offload_ok(const plan_costs_t *c, int32_t s) { return c->bw > 0.0 && s >= 1; }

/* Block i run as a tape in mode k keeps its output a_{i+1} alive: the next region cannot offload it. */
static inline int plan_keeps_output(const plan_costs_t *c, int32_t i, int32_t k) {
  return c->kept[(size_t)i * c->K + k];
}

/* Transfer time charged for offloading the input of region [s, q) whose no-store forward takes
 * fwd_time: the copy back is on the critical path; the copy out hides behind that forward. */
static inline double plan_offload_time(const plan_costs_t *c, int32_t s, double fwd_time) {
  const double one_way = (double)c->x[s] / c->bw;
  return one_way + (one_way > fwd_time ? one_way - fwd_time : 0.0);
}

#endif /* LLMMEM_PLAN_INTERNAL_H */
