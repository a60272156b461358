/*
 * plan.c — the Python binding of the recompute planner (csrc/checkpointing/, llmmem/checkpointing.h).
 *
 * A chain is passed as a dict of lists (see llmmem/planner.py, which builds it):
 *   fwd_time [L][K], bwd_time [L][K], input_bytes [L+1], saved_bytes [L][K] (required);
 *   fwd_nostore_time [L], fwd_tmp_bytes [L], bwd_tmp_bytes [L][K], mode_nestable [K], output_kept [L][K],
 *   host_bandwidth (a number, bytes per time unit; 0 or absent: no offloading) (optional).
 * Regions come back as (start, end) pairs, with the offloaded ones listed again under "offloaded";
 * plan_simulate takes (start, end) or (start, end, offload) tuples.
 * Every number is checked here for type and shape (ValueError naming the key and the index);
 * ranges (finite, >= 0, sizes) are checked by the core, whose InvalidArgumentError is a ValueError.
 * The solver runs with the GIL released.
 */
#include "binding.h" /* Python.h first, as CPython requires */

#include <stdlib.h>
#include <string.h>

#include <llmmem/checkpointing.h>

typedef struct chain_store_s {
  llmmem_plan_chain_t chain;
  double *f, *fn, *b;
  uint64_t *x, *s, *ft, *bt;
  uint8_t *nest, *kept;
} chain_store_t;

static void chain_store_free(chain_store_t *cs) {
  free(cs->f);
  free(cs->fn);
  free(cs->b);
  free(cs->x);
  free(cs->s);
  free(cs->ft);
  free(cs->bt);
  free(cs->nest);
  free(cs->kept);
  memset(cs, 0, sizeof *cs);
}

/* Fills out[rows * cols] from a list (cols == 0) or a list of lists (cols >= 1). is_bytes: ints >= 0. */
static int read_numbers(PyObject *obj, const char *key, Py_ssize_t rows, Py_ssize_t cols, int is_bytes, void *out) {
  PyObject *seq = PySequence_Fast(obj, "");
  if (!seq) {
    PyErr_Format(PyExc_ValueError, "plan: chain['%s'] must be a list, got %s", key, Py_TYPE(obj)->tp_name);
    return -1;
  }
  if (PySequence_Fast_GET_SIZE(seq) != rows) {
    PyErr_Format(PyExc_ValueError, "plan: chain['%s'] has %zd entries, expected %zd", key,
                 PySequence_Fast_GET_SIZE(seq), rows);
    Py_DECREF(seq);
    return -1;
  }
  for (Py_ssize_t i = 0; i < rows; i++) {
    PyObject *row = PySequence_Fast_GET_ITEM(seq, i);
    PyObject *rseq = NULL;
    Py_ssize_t n = 1;
    if (cols > 0) {
      rseq = PySequence_Fast(row, "");
      if (!rseq || PySequence_Fast_GET_SIZE(rseq) != cols) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "plan: chain['%s'][%zd] must be a list of %zd numbers (one per mode)", key, i,
                     cols);
        Py_XDECREF(rseq);
        Py_DECREF(seq);
        return -1;
      }
      n = cols;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
      PyObject *item = rseq ? PySequence_Fast_GET_ITEM(rseq, j) : row;
      const Py_ssize_t at = i * (cols > 0 ? cols : 1) + j;
      if (is_bytes) {
        if (!PyLong_Check(item) || PyBool_Check(item)) {
          PyErr_Format(PyExc_ValueError, "plan: chain['%s'] entry %zd must be an int number of bytes, got %s", key, at,
                       Py_TYPE(item)->tp_name);
          goto fail;
        }
        unsigned long long v = PyLong_AsUnsignedLongLong(item);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
          PyErr_Clear();
          PyErr_Format(PyExc_ValueError, "plan: chain['%s'] entry %zd must be a byte count >= 0, got %R", key, at,
                       item);
          goto fail;
        }
        ((uint64_t *)out)[at] = (uint64_t)v;
      } else {
        double v = PyFloat_AsDouble(item);
        if (v == -1.0 && PyErr_Occurred()) {
          PyErr_Clear();
          PyErr_Format(PyExc_ValueError, "plan: chain['%s'] entry %zd must be a number, got %s", key, at,
                       Py_TYPE(item)->tp_name);
          goto fail;
        }
        ((double *)out)[at] = v;
      }
    }
    Py_XDECREF(rseq);
    continue;
  fail:
    Py_XDECREF(rseq);
    Py_DECREF(seq);
    return -1;
  }
  Py_DECREF(seq);
  return 0;
}

static PyObject *get_key(PyObject *dict, const char *key, int required) {
  PyObject *v = PyDict_GetItemString(dict, key); /* borrowed */
  if (v == Py_None) v = NULL;
  if (!v && required) PyErr_Format(PyExc_ValueError, "plan: chain['%s'] is required", key);
  return v;
}

static int chain_parse(PyObject *dict, chain_store_t *cs) {
  memset(cs, 0, sizeof *cs);
  if (!PyDict_Check(dict)) {
    PyErr_Format(PyExc_TypeError, "plan: chain must be a dict, got %s", Py_TYPE(dict)->tp_name);
    return -1;
  }
  PyObject *f = get_key(dict, "fwd_time", 1);
  if (!f) return -1;
  PyObject *b = get_key(dict, "bwd_time", 1), *x = get_key(dict, "input_bytes", 1),
           *s = get_key(dict, "saved_bytes", 1);
  if (!b || !x || !s) return -1;
  const Py_ssize_t L = PyObject_Length(f);
  if (L < 1 || L > LLMMEM_PLAN_MAX_BLOCKS) {
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "plan: chain['fwd_time'] must list 1..%d blocks", LLMMEM_PLAN_MAX_BLOCKS);
    return -1;
  }
  PyObject *row0 = PySequence_GetItem(f, 0);
  const Py_ssize_t K = row0 ? PyObject_Length(row0) : -1;
  Py_XDECREF(row0);
  if (K < 1 || K > LLMMEM_PLAN_MAX_MODES) {
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "plan: chain['fwd_time'][0] must list 1..%d modes", LLMMEM_PLAN_MAX_MODES);
    return -1;
  }
  const size_t LK = (size_t)L * (size_t)K;
  cs->f = malloc(LK * sizeof(double));
  cs->b = malloc(LK * sizeof(double));
  cs->x = malloc(((size_t)L + 1) * sizeof(uint64_t));
  cs->s = malloc(LK * sizeof(uint64_t));
  if (!cs->f || !cs->b || !cs->x || !cs->s) goto nomem;
  if (read_numbers(f, "fwd_time", L, K, 0, cs->f) < 0 || read_numbers(b, "bwd_time", L, K, 0, cs->b) < 0 ||
      read_numbers(x, "input_bytes", L + 1, 0, 1, cs->x) < 0 || read_numbers(s, "saved_bytes", L, K, 1, cs->s) < 0)
    goto fail;
  PyObject *fn = get_key(dict, "fwd_nostore_time", 0), *ft = get_key(dict, "fwd_tmp_bytes", 0);
  PyObject *bt = get_key(dict, "bwd_tmp_bytes", 0), *nest = get_key(dict, "mode_nestable", 0);
  if (fn) {
    if (!(cs->fn = malloc((size_t)L * sizeof(double)))) goto nomem;
    if (read_numbers(fn, "fwd_nostore_time", L, 0, 0, cs->fn) < 0) goto fail;
  }
  if (ft) {
    if (!(cs->ft = malloc((size_t)L * sizeof(uint64_t)))) goto nomem;
    if (read_numbers(ft, "fwd_tmp_bytes", L, 0, 1, cs->ft) < 0) goto fail;
  }
  if (bt) {
    if (!(cs->bt = malloc(LK * sizeof(uint64_t)))) goto nomem;
    if (read_numbers(bt, "bwd_tmp_bytes", L, K, 1, cs->bt) < 0) goto fail;
  }
  if (nest) {
    uint64_t tmp[LLMMEM_PLAN_MAX_MODES];
    if (read_numbers(nest, "mode_nestable", K, 0, 1, tmp) < 0) goto fail;
    if (!(cs->nest = malloc((size_t)K))) goto nomem;
    for (Py_ssize_t k = 0; k < K; k++) {
      if (tmp[k] > 1) {
        PyErr_Format(PyExc_ValueError, "plan: chain['mode_nestable'][%zd] must be 0 or 1", k);
        goto fail;
      }
      cs->nest[k] = (uint8_t)tmp[k];
    }
  }
  PyObject *kept = get_key(dict, "output_kept", 0), *bw = get_key(dict, "host_bandwidth", 0);
  if (kept) {
    uint64_t *tmp = malloc(LK * sizeof *tmp);
    if (!tmp || !(cs->kept = malloc(LK))) {
      free(tmp);
      goto nomem;
    }
    const int bad = read_numbers(kept, "output_kept", L, K, 1, tmp);
    Py_ssize_t at = -1;
    for (size_t i = 0; !bad && i < LK && at < 0; i++) {
      if (tmp[i] > 1) at = (Py_ssize_t)i;
      cs->kept[i] = (uint8_t)(tmp[i] != 0);
    }
    free(tmp);
    if (bad < 0) goto fail;
    if (at >= 0) {
      PyErr_Format(PyExc_ValueError, "plan: chain['output_kept'][%zd][%zd] must be 0 or 1", at / K, at % K);
      goto fail;
    }
  }
  double host_bandwidth = 0.0;
  if (bw) {
    host_bandwidth = PyFloat_AsDouble(bw);
    if (host_bandwidth == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      PyErr_Format(PyExc_ValueError, "plan: chain['host_bandwidth'] must be a number, got %s", Py_TYPE(bw)->tp_name);
      goto fail;
    }
  }
  cs->chain = (llmmem_plan_chain_t){(int32_t)L, (int32_t)K, cs->f,  cs->fn,   cs->b,    cs->x,
                                    cs->s,      cs->ft,     cs->bt, cs->nest, cs->kept, host_bandwidth};
  return 0;
nomem:
  PyErr_NoMemory();
fail:
  chain_store_free(cs);
  return -1;
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

static int parse_u64(PyObject *obj, const char *name, uint64_t *out) {
  if (!PyLong_Check(obj) || PyBool_Check(obj)) {
    PyErr_Format(PyExc_ValueError, "plan: %s must be an int, got %s", name, Py_TYPE(obj)->tp_name);
    return -1;
  }
  unsigned long long v = PyLong_AsUnsignedLongLong(obj);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "plan: %s must be >= 0 and < 2**64, got %R", name, obj);
    return -1;
  }
  *out = (uint64_t)v;
  return 0;
}

/* _C.plan_solve(chain, budget_bytes, slots, fast_path=True) -> dict */
static PyObject *py_plan_solve(PyObject *self, PyObject *args, PyObject *kwargs) {
  (void)self;
  static char *kwlist[] = {"chain", "budget_bytes", "slots", "fast_path", NULL};
  PyObject *chain_obj, *budget_obj;
  int slots, fast_path = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOi|p", kwlist, &chain_obj, &budget_obj, &slots, &fast_path))
    return NULL;
  uint64_t budget;
  if (parse_u64(budget_obj, "budget_bytes", &budget) < 0) return NULL;
  chain_store_t cs;
  if (chain_parse(chain_obj, &cs) < 0) return NULL;
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
  Py_BEGIN_ALLOW_THREADS st =
      llmmem_plan_solve(&cs.chain, budget, slots, fast_path ? 0u : LLMMEM_PLAN_NO_FAST_PATH, &plan, &pred, &least);
  Py_END_ALLOW_THREADS if (st != LLMMEM_OK) {
    llmmem_py_raise(st);
    goto done;
  }
  result = plan_to_dict(&plan, L, &pred, least);
done:
  free(mode);
  free(regions);
  chain_store_free(&cs);
  return result;
}

/* _C.plan_simulate(chain, modes, regions) -> dict */
static PyObject *py_plan_simulate(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *chain_obj, *modes_obj, *regions_obj;
  if (!PyArg_ParseTuple(args, "OOO", &chain_obj, &modes_obj, &regions_obj)) return NULL;
  chain_store_t cs;
  if (chain_parse(chain_obj, &cs) < 0) return NULL;
  const int32_t L = cs.chain.n_blocks;
  PyObject *result = NULL, *rseq = NULL;
  int32_t *mode = malloc((size_t)L * sizeof *mode);
  uint64_t *tmp = malloc((size_t)L * sizeof *tmp);
  llmmem_plan_region_t *regions = NULL;
  if (!mode || !tmp) {
    PyErr_NoMemory();
    goto done;
  }
  if (read_numbers(modes_obj, "modes", L, 0, 1, tmp) < 0) goto done;
  for (int32_t i = 0; i < L; i++) mode[i] = tmp[i] > 1000 ? 1000 : (int32_t)tmp[i];
  rseq = PySequence_Fast(regions_obj, "plan: regions must be a list of (start, end) pairs");
  if (!rseq) goto done;
  const Py_ssize_t R = PySequence_Fast_GET_SIZE(rseq);
  regions = malloc(((size_t)R + 1) * sizeof *regions);
  if (!regions) {
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t r = 0; r < R; r++) {
    int start, end, offload = 0;
    PyObject *item = PySequence_Fast_GET_ITEM(rseq, r);
    if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "ii|i", &start, &end, &offload)) {
      PyErr_Clear();
      PyErr_Format(PyExc_ValueError,
                   "plan: regions[%zd] must be a (start, end) or (start, end, offload) tuple of ints", r);
      goto done;
    }
    regions[r] = (llmmem_plan_region_t){start, end, offload};
  }
  if (R > 2 * (Py_ssize_t)L) {
    PyErr_Format(PyExc_ValueError, "plan: %zd regions for %d blocks cannot be properly nested", R, L);
    goto done;
  }
  llmmem_plan_t plan = {mode, regions, (int32_t)R, (int32_t)R};
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
  Py_XDECREF(rseq);
  free(mode);
  free(tmp);
  free(regions);
  chain_store_free(&cs);
  return result;
}

/* _C.plan_min_budget(chain) -> int */
static PyObject *py_plan_min_budget(PyObject *self, PyObject *chain_obj) {
  (void)self;
  chain_store_t cs;
  if (chain_parse(chain_obj, &cs) < 0) return NULL;
  uint64_t least = 0;
  llmmem_status_t st;
  Py_BEGIN_ALLOW_THREADS st = llmmem_plan_min_budget(&cs.chain, &least);
  Py_END_ALLOW_THREADS chain_store_free(&cs);
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
