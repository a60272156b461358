/*
 * checkpointing.c — the Python binding of the recompute planner (csrc/checkpointing/,
 * llmmem/checkpointing.h).
 *
 * A chain is a dict of lists (ChainProfile.to_chain builds it):
 *   fwd_time [L][K], bwd_time [L][K], input_bytes [L+1], saved_bytes [L][K] (required);
 *   fwd_nostore_time [L], fwd_tmp_bytes [L], fwd_nostore_tmp_bytes [L] and fwd_tape_tmp_bytes [L][K]
 *   (absent: fwd_tmp_bytes),
 *   bwd_tmp_bytes [L][K], mode_nestable [K], output_kept [L][K], cut_before [L],
 *   host_bandwidth (a number, bytes per time unit; 0 or absent: no offloading) (optional).
 * Regions come back as (start, end) pairs, with the offloaded ones listed again under "offloaded";
 * plan_simulate takes (start, end) or (start, end, offload) tuples.
 * Arguments are copied (llmmem_py_snapshot) and checked for type and shape by args.c (ValueError
 * naming the key and the index); ranges (finite, >= 0, sizes) are checked by the core, whose
 * InvalidArgumentError is a ValueError. The solver runs with the GIL released.
 */
#include "binding.h" /* Python.h first, as CPython requires */

#include <stdlib.h>
#include <string.h>

#include <llmmem/checkpointing.h>

/* Snapshot depths (see llmmem_py_snapshot): dict -> list -> list -> number, list -> number,
 * list -> tuple -> int. */
#define CHAIN_DEPTH   3
#define MODES_DEPTH   1
#define REGIONS_DEPTH 2

/* The chain argument, copied and checked: 0, or -1 with an exception set. */
static int parse_chain(PyObject *obj, args_chain_t *cs) {
  args_arena_t a = {0};
  args_value_t v;
  args_error_t e;
  memset(cs, 0, sizeof *cs);
  int st = llmmem_py_snapshot(obj, CHAIN_DEPTH, &a, &v);
  if (st == 0 && _llmmem_args_chain(&v, cs, &e) < 0) {
    llmmem_py_args_raise(&e);
    st = -1;
  }
  _llmmem_args_arena_free(&a);
  return st;
}

static PyObject *plan_to_dict(const llmmem_plan_t *plan, int32_t L, const llmmem_plan_prediction_t *p,
                              uint64_t least) {
  PyObject *modes = PyList_New(L), *regions = PyList_New(plan->n_regions), *offloaded = PyList_New(0);
  if (!modes || !regions || !offloaded) goto fail;
  for (int32_t i = 0; i < L; i++) {
    PyObject *v = PyLong_FromLong(plan->mode[i]);
    if (!v) goto fail;
    PyList_SET_ITEM(modes, i, v);
  }
  for (int32_t r = 0; r < plan->n_regions; r++) {
    PyObject *t = Py_BuildValue("(ii)", plan->regions[r].start, plan->regions[r].end);
    if (!t) goto fail;
    PyList_SET_ITEM(regions, r, t);
    if (plan->regions[r].offload && PyList_Append(offloaded, t) < 0) goto fail;
  }
  PyObject *d =
      Py_BuildValue("{s:N,s:N,s:N,s:d,s:d,s:d,s:K,s:K,s:K,s:K}", "modes", modes, "regions", regions, "offloaded",
                    offloaded, "time", p->time, "overhead_time", p->overhead_time, "transfer_time", p->transfer_time,
                    "peak_bytes", (unsigned long long)p->peak_bytes, "held_bytes", (unsigned long long)p->held_bytes,
                    "host_bytes", (unsigned long long)p->host_bytes, "min_budget_bytes", (unsigned long long)least);
  return d;
fail:
  Py_XDECREF(modes);
  Py_XDECREF(regions);
  Py_XDECREF(offloaded);
  return NULL;
}

/* _C.plan_solve(chain, budget_bytes, slots, fast_path=True) -> dict */
static PyObject *py_plan_solve(PyObject *self, PyObject *args, PyObject *kwargs) {
  (void)self;
  static char *kwlist[] = {"chain", "budget_bytes", "slots", "fast_path", NULL};
  PyObject *chain_obj, *budget_obj, *slots_obj;
  int fast_path = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|p", kwlist, &chain_obj, &budget_obj, &slots_obj, &fast_path))
    return NULL;
  uint64_t budget;
  int64_t slots;
  if (llmmem_py_arg_uint(budget_obj, "plan: budget_bytes", 0, UINT64_MAX, &budget) < 0 ||
      llmmem_py_arg_int(slots_obj, "plan: slots", 1, LLMMEM_PLAN_MAX_SLOTS, &slots) < 0)
    return NULL;
  args_chain_t cs;
  if (parse_chain(chain_obj, &cs) < 0) return NULL;
  const int32_t L = cs.chain.n_blocks;
  int32_t *mode = malloc((size_t)L * sizeof *mode);
  llmmem_plan_region_t *regions = malloc(2 * (size_t)L * sizeof *regions);
  PyObject *result = NULL;
  if (!mode || !regions) {
    PyErr_NoMemory();
    goto done;
  }
  llmmem_plan_t plan = {mode, regions, 2 * L, 0};
  llmmem_plan_prediction_t pred;
  uint64_t least = 0;
  llmmem_status_t st;
  Py_BEGIN_ALLOW_THREADS st = llmmem_plan_solve(&cs.chain, budget, (int32_t)slots,
                                                fast_path ? 0u : LLMMEM_PLAN_NO_FAST_PATH, &plan, &pred, &least);
  Py_END_ALLOW_THREADS if (st != LLMMEM_OK) {
    llmmem_py_raise(st);
    goto done;
  }
  result = plan_to_dict(&plan, L, &pred, least);
done:
  free(mode);
  free(regions);
  _llmmem_args_chain_free(&cs);
  return result;
}

/* _C.plan_simulate(chain, modes, regions) -> dict */
static PyObject *py_plan_simulate(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *chain_obj, *modes_obj, *regions_obj;
  if (!PyArg_ParseTuple(args, "OOO", &chain_obj, &modes_obj, &regions_obj)) return NULL;
  args_chain_t cs;
  if (parse_chain(chain_obj, &cs) < 0) return NULL;
  const int32_t L = cs.chain.n_blocks;
  PyObject *result = NULL;
  int32_t *mode = malloc((size_t)L * sizeof *mode);
  llmmem_plan_region_t *regions = NULL;
  int32_t n_regions = 0;
  args_arena_t a = {0};
  args_value_t modes_v, regions_v;
  args_error_t e;
  if (!mode) {
    PyErr_NoMemory();
    goto done;
  }
  if (llmmem_py_snapshot(modes_obj, MODES_DEPTH, &a, &modes_v) < 0 ||
      llmmem_py_snapshot(regions_obj, REGIONS_DEPTH, &a, &regions_v) < 0)
    goto done;
  if (_llmmem_args_plan_modes(&modes_v, L, mode, &e) < 0 ||
      _llmmem_args_plan_regions(&regions_v, L, &regions, &n_regions, &e) < 0) {
    llmmem_py_args_raise(&e);
    goto done;
  }
  llmmem_plan_t plan = {mode, regions, n_regions, n_regions};
  llmmem_plan_prediction_t pred;
  llmmem_status_t st = llmmem_plan_simulate(&cs.chain, &plan, &pred);
  if (st != LLMMEM_OK) {
    llmmem_py_raise(st);
    goto done;
  }
  result = Py_BuildValue("{s:d,s:d,s:d,s:K,s:K,s:K}", "time", pred.time, "overhead_time", pred.overhead_time,
                         "transfer_time", pred.transfer_time, "peak_bytes", (unsigned long long)pred.peak_bytes,
                         "held_bytes", (unsigned long long)pred.held_bytes, "host_bytes",
                         (unsigned long long)pred.host_bytes);
done:
  _llmmem_args_arena_free(&a);
  free(mode);
  free(regions);
  _llmmem_args_chain_free(&cs);
  return result;
}

/* _C.plan_min_budget(chain) -> int */
static PyObject *py_plan_min_budget(PyObject *self, PyObject *chain_obj) {
  (void)self;
  args_chain_t cs;
  if (parse_chain(chain_obj, &cs) < 0) return NULL;
  uint64_t least = 0;
  llmmem_status_t st;
  Py_BEGIN_ALLOW_THREADS st = llmmem_plan_min_budget(&cs.chain, &least);
  Py_END_ALLOW_THREADS _llmmem_args_chain_free(&cs);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  return PyLong_FromUnsignedLongLong(least);
}

PyMethodDef llmmem_py_plan_methods[] = {
    {"plan_solve", (PyCFunction)(void (*)(void))py_plan_solve, METH_VARARGS | METH_KEYWORDS,
     "plan_solve(chain, budget_bytes, slots, fast_path=True) -> dict(modes, regions, offloaded, time, overhead_time, "
     "transfer_time, peak_bytes, held_bytes, host_bytes, min_budget_bytes). Raises InfeasibleError (a ValueError) "
     "below the least budget."},
    {"plan_simulate", py_plan_simulate, METH_VARARGS,
     "plan_simulate(chain, modes, regions) -> dict(time, overhead_time, transfer_time, peak_bytes, held_bytes, "
     "host_bytes); regions are (start, end) or (start, end, offload) tuples."},
    {"plan_min_budget", py_plan_min_budget, METH_O,
     "plan_min_budget(chain) -> int: the least feasible budget (bytes)."},
    {NULL, NULL, 0, NULL},
};
