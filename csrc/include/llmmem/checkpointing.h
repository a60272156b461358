/*
 * checkpointing.h — the recompute planner: which blocks of a chain to checkpoint, and how, so that the
 * activation memory of one training step fits a budget at the least total time.
 *
 * The model (a chain of L blocks, as in Rotor: Beaumont et al. 2019, "Optimal checkpointing for
 * heterogeneous chains"). Block i maps activation a_i (input_bytes[i]) to a_{i+1}. A plan is
 * a set of properly nested checkpoint regions [start, end) plus a mode per block:
 *   - a block outside every region keeps its autograd tape in its mode k: store-all (k = 0) or a
 *     cheaper one such as selective recompute (keep matmul outputs, recompute pointwise work);
 *   - a region keeps only its input during the forward; when backward reaches it, its content is
 *     run again (a "recompute") and then differentiated. Nested regions inside it behave the same
 *     way within that recompute. A region of one block is the "store-input-only" mode.
 * These are exactly the semantics of nested non-reentrant checkpoints in PyTorch (llmmem.checkpoint),
 * including early stop: the recompute of a region ends after the last tensor it saves.
 *   - optionally (host_bandwidth > 0), a top-level region may be "offloaded": its input a_s is
 *     copied to host memory when its forward starts and freed on the device once that forward is
 *     done, and copied back when backward reaches the region (llmmem.checkpoint(offload=True),
 *     run without prefetch so that the input is back on the device only while its own region runs
 *     backward). Device bytes: a_s counts 0 from the end of the region's forward to the start of
 *     its backward. Time, bytes / host_bandwidth per copy: the device-to-host copy runs on a side
 *     stream and is hidden behind the region's own forward (no-store forward times), only the part
 *     that exceeds it is charged; the host-to-device copy is on the critical path (charged in
 *     full). So the transfer cost of offloading region [s, q) is
 *         x_s / bw  +  max(0, x_s / bw - sum of fwd_nostore_time over [s, q)).
 *     Not offloadable: a_0 (the chain input belongs to the caller), the input of a nested region
 *     (its copy would sit inside a recompute, on the critical path twice), and a_s when block
 *     s - 1 runs at the top level keeping its tape in a mode k that keeps its own output
 *     (output_kept[s - 1][k]: the device copy stays alive anyway).
 *
 * Memory accounting (bytes): a block run with its tape in mode k holds its input plus
 * saved_bytes[i][k]; a region holds its input. Transients: fwd_tmp[i] while block i runs forward
 * keeping its tape in mode k (at the top level, or inside a recompute; beyond its input, output and
 * tape): fwd_tape_tmp[i][k], or one figure fwd_tmp[i] for every mode; fwd_nostore_tmp[i] (or
 * fwd_tmp[i]) while it runs forward inside a region without keeping a tape (beyond its input and
 * output: it frees its intermediates as it goes, but holds more of them at once than a tape's
 * forward holds beyond its tape); bwd_tmp[i][k] while it runs backward (beyond its tape, the
 * incoming and the outgoing gradient). Gradients have the size of the activations. The loss
 * gradient of the chain output (input_bytes[L]) is reserved for the whole step.
 *
 * Solving: the Rotor dynamic program over (segment start, segment end, memory slots), with the
 * budget cut into `slots` equal slots and sizes rounded up (so a plan found always fits), plus a
 * fast path when all blocks but the last are identical (tables indexed by segment length only). Time O(K·M·L³)
 * in general, O(K·M·L²) for identical blocks; memory O(M·L²) resp. O(M·L) (M slots, K modes).
 * Offloading adds one option per top-level split (O(M·L²) more work, no more memory).
 *
 * Plain C11, no Python, no PyTorch; every function returns a status and never aborts.
 */
#ifndef LLMMEM_PLAN_H
#define LLMMEM_PLAN_H

#include <llmmem/llmmem.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LLMMEM_PLAN_MAX_MODES  8
#define LLMMEM_PLAN_MAX_BLOCKS 16384
#define LLMMEM_PLAN_MAX_SLOTS  100000
/* Any byte size above this (1 PiB) is rejected: it is a unit mistake, and it keeps sums exact. */
#define LLMMEM_PLAN_MAX_BYTES (1ULL << 50)

/* Costs of a chain of n_blocks blocks, each runnable in n_modes modes. Arrays indexed [i] have
 * n_blocks entries (input_bytes has n_blocks + 1); arrays indexed [i][k] are row-major,
 * n_blocks * n_modes entries. Times are in any one unit (seconds, say), finite and >= 0. */
typedef struct llmmem_plan_chain_s {
  int32_t n_blocks;               /* L >= 1 */
  int32_t n_modes;                /* K in 1..LLMMEM_PLAN_MAX_MODES; mode 0 is store-all */
  const double *fwd_time;         /* [i][k] forward of block i keeping its tape in mode k */
  const double *fwd_nostore_time; /* [i] forward of block i inside a region (tape not kept); NULL: fwd_time[i][0] */
  const double *bwd_time;         /* [i][k] backward of block i in mode k (with any in-block recompute) */
  const uint64_t *input_bytes;    /* [i], i = 0..L: bytes of a_i; a_L is the chain output */
  const uint64_t *saved_bytes;    /* [i][k] bytes block i keeps for backward beyond its input */
  const uint64_t *fwd_tmp_bytes;  /* [i] transient peak of every forward of block i (unless given below); NULL: 0 */
  const uint64_t *bwd_tmp_bytes;  /* [i][k] transient peak of the backward; NULL: all 0 */
  const uint8_t *mode_nestable;   /* [k] 1 if mode k may be used inside a region; NULL: only mode 0 */
  const uint8_t *output_kept;     /* [i][k] 1 if block i's tape in mode k keeps its output a_{i+1}; NULL: none */
  double host_bandwidth;          /* bytes per time unit of a host<->device copy; 0: no offloading */
  /* Added last, so callers built before them (positional initialisers, zeroed structs) keep their
   * meaning. [i] transient peak of the forward inside a region (no tape kept); NULL: fwd_tmp_bytes[i]. */
  const uint64_t *fwd_nostore_tmp_bytes;
  const uint64_t *fwd_tape_tmp_bytes; /* [i][k] of the forward keeping its tape in mode k; NULL: fwd_tmp_bytes[i] */
  /* [i] 1 where block i's input is not block i - 1's output (the model changes it in between, or a
   * second stack of blocks starts there): no region holds both blocks, since a recompute feeds each
   * block the previous one's output. NULL: none (cut_before[0] is ignored). */
  const uint8_t *cut_before;
} llmmem_plan_chain_t;

typedef struct llmmem_plan_region_s {
  int32_t start;   /* first block of the region */
  int32_t end;     /* one past its last block */
  int32_t offload; /* 1: the region's input is kept in host memory (top-level regions only) */
} llmmem_plan_region_t;

/* A plan, in caller-owned arrays. Regions are listed in pre-order (by start, outer before inner);
 * 2 * n_blocks entries always suffice. */
typedef struct llmmem_plan_s {
  int32_t *mode;                 /* [n_blocks] mode of each block */
  llmmem_plan_region_t *regions; /* [regions_capacity] */
  int32_t regions_capacity;
  int32_t n_regions; /* out: number of regions written */
} llmmem_plan_t;

typedef struct llmmem_plan_prediction_s {
  double time;          /* forward + recompute + backward time of one step */
  double overhead_time; /* time minus that of keeping every tape in mode 0 (no checkpointing) */
  uint64_t peak_bytes;  /* peak activation memory of the step (model above), from a simulation */
  uint64_t held_bytes;  /* device bytes held for backward at the end of the forward (input a_0 included) */
  double transfer_time; /* part of time (and of overhead_time) charged to host<->device copies */
  uint64_t host_bytes;  /* bytes of offloaded region inputs in host memory at the end of the forward */
} llmmem_plan_prediction_t;

/* Solve for the fastest plan whose simulated peak is <= budget_bytes, with the budget cut into
 * `slots` slots (1..LLMMEM_PLAN_MAX_SLOTS; more slots: closer to optimal, slower). Whatever the
 * rounding to slots, the plan is never slower than a uniform plan that fits the budget (every block
 * in one mode; every k-th block, or segments of k blocks, checkpointed: csrc/checkpointing/uniform.c).
 * flags: LLMMEM_PLAN_NO_FAST_PATH forces the general DP even for identical blocks.
 * On success fills plan and pred (pred may be NULL). When no plan fits, returns
 * LLMMEM_ERR_INFEASIBLE. In both cases *min_budget_bytes (may be NULL) receives the smallest
 * budget for which a plan exists; at or above it, solve always succeeds (if rounding to slots
 * loses the last plans, the least-memory plan is returned). */
#define LLMMEM_PLAN_NO_FAST_PATH 1u
LLMMEM_API llmmem_status_t llmmem_plan_solve(const llmmem_plan_chain_t *chain, uint64_t budget_bytes, int32_t slots,
                                             uint32_t flags, llmmem_plan_t *plan, llmmem_plan_prediction_t *pred,
                                             uint64_t *min_budget_bytes);

/* The smallest budget (bytes) for which some plan fits; exact (no slot rounding). */
LLMMEM_API llmmem_status_t llmmem_plan_min_budget(const llmmem_plan_chain_t *chain, uint64_t *min_budget_bytes);

/* Validate any plan (regions properly nested, no duplicates, modes in range, only nestable modes
 * inside regions, offload flags 0/1 and only where the model above allows) and simulate one step of it: time, peak and held bytes. */
LLMMEM_API llmmem_status_t llmmem_plan_simulate(const llmmem_plan_chain_t *chain, const llmmem_plan_t *plan,
                                                llmmem_plan_prediction_t *pred);

#ifdef __cplusplus
}
#endif

#endif /* LLMMEM_PLAN_H */
