/*
 * simulate.c — validation of a plan and a step-by-step simulation of its memory and time.
 *
 * The simulation replays one training step the way nested non-reentrant checkpoints run it:
 * forward of the top-level sequence, loss, then backward item by item, where reaching a region
 * recomputes its content (a nested sequence) and differentiates it; an offloaded region's input
 * leaves the device after the region's forward and comes back when backward reaches it. It tracks live bytes with
 * explicit allocations and frees, independently of the DP's formulas, so tests can check the DP
 * against it (and brute force over all plans against both).
 */
#include <stdlib.h>
#include <string.h>

#include "plan_internal.h"

typedef struct node_s {
  int32_t start, end, offload;
  int32_t first_child, next_sibling; /* indices into the node array, -1 if none */
} node_t;

typedef struct sim_s {
  const plan_costs_t *c;
  const int32_t *mode;
  const node_t *nodes;
  int64_t live, peak, host;
  double time, transfer;
  int64_t *host_at_forward_end;
} sim_t;

static void touch(sim_t *st, int64_t extra) {
  if (st->live + extra > st->peak) st->peak = st->live + extra;
}

/* Runs the sequence of items of `node` ([s, e)): forward keeping tapes, then backward.
 * On entry a_s is live (counted by the caller) and so is the gradient of a_e when e is not the
 * end of the caller's sequence (or, at the top level, the reserved loss gradient).
 * `top`: the top-level sequence (no early stop). Returns the live bytes after the forward. */
static int64_t run_sequence(sim_t *st, int32_t n, int top) {
  const plan_costs_t *c = st->c;
  const int32_t K = c->K, s = st->nodes[n].start, e = st->nodes[n].end;
  int64_t after_forward;
  /* forward */
  int32_t child = st->nodes[n].first_child;
  int32_t i = s;
  while (i < e) {
    if (child >= 0 && st->nodes[child].start == i) {
      const node_t *r = &st->nodes[child];
      int last = r->end == e;
      if (!(last && !top)) { /* early stop: the recompute ends once the last region's input is saved */
        double fwd = 0.0;
        for (int32_t j = r->start; j < r->end; j++) {
          touch(st, (j > r->start ? (int64_t)c->x[j] : 0) + (int64_t)c->x[j + 1] + (int64_t)c->fnt[j]);
          fwd += c->fn[j];
        }
        st->time += fwd;
        st->live += (int64_t)c->x[r->end];
        if (r->offload) { /* the input's device copy is freed once the region's forward is done */
          const double t = plan_offload_time(c, r->start, fwd);
          st->live -= (int64_t)c->x[r->start];
          st->host += (int64_t)c->x[r->start];
          st->time += t;
          st->transfer += t;
        }
      }
      i = r->end;
      child = r->next_sibling;
    } else {
      const size_t ik = (size_t)i * K + st->mode[i];
      touch(st, (int64_t)c->s[ik] + (int64_t)c->x[i + 1] + (int64_t)c->ft[ik]);
      st->time += c->f[ik];
      st->live += (int64_t)c->s[ik] + (int64_t)c->x[i + 1];
      i++;
    }
  }
  after_forward = st->live;
  if (top) *st->host_at_forward_end = st->host;
  /* the output a_e: consumed by the loss (top) or dropped (recompute) */
  int32_t last_child = -1;
  for (int32_t ch = st->nodes[n].first_child; ch >= 0; ch = st->nodes[ch].next_sibling) last_child = ch;
  int last_is_skipped_region = !top && last_child >= 0 && st->nodes[last_child].end == e;
  if (!last_is_skipped_region) st->live -= (int64_t)c->x[e];

  /* backward, items in reverse order */
  int32_t stack_children[64];
  int32_t *children = stack_children;
  int32_t nchild = 0;
  for (int32_t ch = st->nodes[n].first_child; ch >= 0; ch = st->nodes[ch].next_sibling) nchild++;
  if (nchild > 64) {
    children = malloc((size_t)nchild * sizeof *children);
    if (!children) return -1;
  }
  nchild = 0;
  for (int32_t ch = st->nodes[n].first_child; ch >= 0; ch = st->nodes[ch].next_sibling) children[nchild++] = ch;
  i = e;
  while (i > s) {
    if (nchild > 0 && st->nodes[children[nchild - 1]].end == i) {
      const node_t *r = &st->nodes[children[--nchild]];
      if (r->offload) { /* copied back (not prefetched) when backward reaches the region */
        st->live += (int64_t)c->x[r->start];
        st->host -= (int64_t)c->x[r->start];
        touch(st, 0);
      }
      if (run_sequence(st, (int32_t)(r - st->nodes), 0) < 0) {
        if (children != stack_children) free(children);
        return -1;
      }
      if (r->end < e) st->live -= (int64_t)c->x[r->end];     /* gradient of the region output consumed */
      if (r->start > s) st->live -= (int64_t)c->x[r->start]; /* region input released */
      i = r->start;
    } else {
      const int32_t b = i - 1;
      const size_t ik = (size_t)b * K + st->mode[b];
      touch(st, (int64_t)c->x[b] + (int64_t)c->bt[ik]);
      st->time += c->b[ik];
      st->live += (int64_t)c->x[b];  /* gradient of a_b */
      st->live -= (int64_t)c->s[ik]; /* tape released */
      if (b + 1 < e) st->live -= (int64_t)c->x[b + 1];
      if (b > s) st->live -= (int64_t)c->x[b];
      i = b;
    }
  }
  if (children != stack_children) free(children);
  return after_forward;
}

static int region_order(const void *pa, const void *pb) {
  const llmmem_plan_region_t *a = pa, *b = pb;
  if (a->start != b->start) return a->start < b->start ? -1 : 1;
  if (a->end != b->end) return a->end > b->end ? -1 : 1;
  return 0;
}

llmmem_status_t plan_simulate_costs(const plan_costs_t *c, const llmmem_plan_t *plan, llmmem_plan_prediction_t *pred) {
  LLMMEM_CHECK_ARG(plan != NULL && pred != NULL, "plan and pred must not be NULL");
  LLMMEM_CHECK_ARG(plan->mode != NULL, "plan->mode must not be NULL");
  const int32_t L = c->L, K = c->K, R = plan->n_regions;
  LLMMEM_CHECK_ARG(R >= 0 && R <= 2 * L, "plan->n_regions must be in 0..%d (2 * n_blocks), got %d", 2 * L, R);
  LLMMEM_CHECK_ARG(R == 0 || plan->regions != NULL, "plan->regions must not be NULL when n_regions > 0");
  for (int32_t i = 0; i < L; i++)
    LLMMEM_CHECK_ARG(plan->mode[i] >= 0 && plan->mode[i] < K, "plan->mode[%d] = %d is not a mode (0..%d)", i,
                     plan->mode[i], K - 1);

  llmmem_status_t status = LLMMEM_OK;
  /* Small plans (the common case, and brute force in tests) use the stack: no allocation. */
  enum { SMALL = 64 };
  llmmem_plan_region_t regs_s[SMALL];
  node_t nodes_s[SMALL];
  int32_t depth_s[SMALL], stack_s[SMALL], last_child_s[SMALL];
  const int small = R + 1 <= SMALL && L + 1 <= SMALL;
  llmmem_plan_region_t *regs = small ? regs_s : malloc(((size_t)R + 1) * sizeof *regs);
  node_t *nodes = small ? nodes_s : malloc(((size_t)R + 1) * sizeof *nodes);
  int32_t *depth = small ? depth_s : malloc(((size_t)L + 1) * sizeof *depth);
  int32_t *stack = small ? stack_s : malloc(((size_t)R + 1) * sizeof *stack);
  int32_t *last_child = small ? last_child_s : malloc(((size_t)R + 1) * sizeof *last_child);
  if (depth) memset(depth, 0, ((size_t)L + 1) * sizeof *depth);
  if (!regs || !nodes || !depth || !stack || !last_child) {
    status = LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "cannot allocate the simulation of a plan with %d regions", R);
    goto done;
  }
  if (R > 0) memcpy(regs, plan->regions, (size_t)R * sizeof *regs);
  for (int32_t r = 0; r < R; r++) {
    if (regs[r].start < 0 || regs[r].end > L || regs[r].start >= regs[r].end) {
      status = LLMMEM_FAIL(LLMMEM_ERR_INVALID, "plan region [%d, %d) is not a non-empty range of blocks 0..%d",
                           regs[r].start, regs[r].end, L);
      goto done;
    }
    if (!plan_region_ok(c, regs[r].start, regs[r].end)) {
      status = LLMMEM_FAIL(LLMMEM_ERR_INVALID,
                           "plan region [%d, %d) spans a cut: block %d's input is not block %d's output (cut_before)",
                           regs[r].start, regs[r].end, c->reach[regs[r].start], c->reach[regs[r].start] - 1);
      goto done;
    }
  }
  qsort(regs, (size_t)R, sizeof *regs, region_order);
  /* node 0 is the whole chain; region r is node r + 1 */
  nodes[0] = (node_t){0, L, 0, -1, -1};
  last_child[0] = -1;
  int32_t top = 0;
  stack[0] = 0;
  for (int32_t r = 0; r < R; r++) {
    if (r > 0 && regs[r].start == regs[r - 1].start && regs[r].end == regs[r - 1].end) {
      status = LLMMEM_FAIL(LLMMEM_ERR_INVALID, "plan region [%d, %d) is listed twice", regs[r].start, regs[r].end);
      goto done;
    }
    while (top > 0 && nodes[stack[top]].end <= regs[r].start) top--;
    const int32_t parent = stack[top];
    if (regs[r].end > nodes[parent].end) {
      status = LLMMEM_FAIL(LLMMEM_ERR_INVALID, "plan regions [%d, %d) and [%d, %d) overlap without nesting",
                           nodes[parent].start, nodes[parent].end, regs[r].start, regs[r].end);
      goto done;
    }
    if (regs[r].offload != 0) {
      const char *why = regs[r].offload != 1 ? "its offload flag must be 0 or 1"
                        : c->bw <= 0.0       ? "the chain has no host_bandwidth (offloading is off)"
                        : parent != 0        ? "only top-level regions can be offloaded"
                        : regs[r].start == 0 ? "the chain input a_0 cannot be offloaded"
                                             : NULL;
      if (why) {
        status = LLMMEM_FAIL(LLMMEM_ERR_INVALID, "plan region [%d, %d) cannot be offloaded: %s", regs[r].start,
                             regs[r].end, why);
        goto done;
      }
    }
    const int32_t n = r + 1;
    nodes[n] = (node_t){regs[r].start, regs[r].end, regs[r].offload, -1, -1};
    last_child[n] = -1;
    if (last_child[parent] < 0)
      nodes[parent].first_child = n;
    else
      nodes[last_child[parent]].next_sibling = n;
    last_child[parent] = n;
    stack[++top] = n;
    depth[regs[r].start]++;
    depth[regs[r].end]--;
  }
  for (int32_t i = 0, d = 0; i < L; i++) {
    d += depth[i];
    if (d > 0 && !c->nest[plan->mode[i]]) {
      status = LLMMEM_FAIL(LLMMEM_ERR_INVALID, "block %d is inside a region but its mode %d cannot be nested", i,
                           plan->mode[i]);
      goto done;
    }
    /* depth[i] now holds how many regions contain block i (read below for offloaded regions) */
    depth[i] = d;
  }
  for (int32_t r = 0; r < R; r++) {
    const int32_t b = regs[r].start - 1; /* offloaded regions start at >= 1 (checked above) */
    if (regs[r].offload && depth[b] == 0 && c->kept[(size_t)b * K + plan->mode[b]]) {
      status = LLMMEM_FAIL(LLMMEM_ERR_INVALID,
                           "plan region [%d, %d) cannot be offloaded: block %d before it keeps its output in mode %d "
                           "(output_kept)",
                           regs[r].start, regs[r].end, b, plan->mode[b]);
      goto done;
    }
  }

  sim_t st = {c, plan->mode, nodes, 0, 0, 0, 0.0, 0.0, NULL};
  st.live = (int64_t)c->x[0] + (int64_t)c->x[L]; /* the chain input and the reserved loss gradient */
  st.peak = st.live;
  int64_t host_after_forward = 0;
  st.host_at_forward_end = &host_after_forward;
  const int64_t after_forward = run_sequence(&st, 0, 1);
  if (after_forward < 0) {
    status = LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "out of memory while simulating a plan");
    goto done;
  }
  double plain = 0.0;
  for (int32_t i = 0; i < L; i++) plain += c->f[(size_t)i * K] + c->b[(size_t)i * K];
  pred->time = st.time;
  pred->overhead_time = st.time - plain;
  pred->peak_bytes = (uint64_t)st.peak;
  pred->held_bytes = (uint64_t)(after_forward - 2 * (int64_t)c->x[L]);
  pred->transfer_time = st.transfer;
  pred->host_bytes = (uint64_t)host_after_forward;
done:
  if (!small) {
    free(regs);
    free(nodes);
    free(depth);
    free(stack);
    free(last_child);
  }
  return status;
}

LLMMEM_API llmmem_status_t llmmem_plan_simulate(const llmmem_plan_chain_t *chain, const llmmem_plan_t *plan,
                                                llmmem_plan_prediction_t *pred) {
  plan_costs_t c;
  LLMMEM_TRY(plan_costs_load(chain, &c));
  llmmem_status_t st = plan_simulate_costs(&c, plan, pred);
  plan_costs_free(&c);
  return st;
}
