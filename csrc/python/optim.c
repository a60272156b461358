/*
 * optim.c — the Python binding of csrc/optim/ (called by llmmem/optim/kernels.py).
 *
 * Tensors arrive as plain ints (data_ptr(), numel(), dtype codes), never as torch objects. A step
 * takes a list of records, one tuple per parameter:
 *   (param, master, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, step, numel, seed,
 *    param_dtype, grad, grad_dtype)
 * (the gradient last: the Python layer keeps the rest of a record from step to step and adds the
 * gradient, which changes, at the end)
 * addresses as ints (0 = NULL), and the group's hyper-parameters. The CPU step releases the GIL
 * for its whole run; the CUDA step only queues work. Argument errors raise
 * llmmem.InvalidArgumentError (a ValueError) naming the argument.
 *
 * Records and their items must be exact tuples and ints: nothing read here runs Python code, so
 * the list cannot change while it is read.
 *
 * PRIVATE AND UNSAFE: these functions take raw addresses and trust them. They check only what
 * they see (lengths, codes, NULLs, alignment); a wrong address corrupts memory or crashes the
 * process. All validation of tensors lives in llmmem/optim/kernels.py, the only supported caller.
 */
#include "binding.h" /* first: Python.h must precede the system headers */

#include <llmmem/optim.h>

#define RECORD_LEN 12

static int record_int(PyObject *rec, Py_ssize_t i, Py_ssize_t k, unsigned long long *out) {
  PyObject *v = PyTuple_GET_ITEM(rec, k);
  if (!PyLong_CheckExact(v)) {
    PyErr_Format(PyExc_TypeError, "records[%zd][%zd] must be an int, got %.100s", i, k, Py_TYPE(v)->tp_name);
    return -1;
  }
  if (k == 8) { /* the seed: any 64-bit pattern */
    *out = PyLong_AsUnsignedLongLongMask(v);
  } else {
    long long x = PyLong_AsLongLong(v);
    if (x < 0 && !PyErr_Occurred()) {
      PyErr_Format(PyExc_ValueError, "records[%zd][%zd] must be >= 0, got %lld", i, k, x);
      return -1;
    }
    *out = (unsigned long long)x;
  }
  return PyErr_Occurred() ? -1 : 0;
}

/* A PyMem_Malloc'd array of the records (*out, freed by the caller), or -1 with an exception set. */
static int parse_records(PyObject *records, llmmem_optim_tensor_t **out, size_t *count) {
  *out = NULL;
  if (!PyList_CheckExact(records)) {
    PyErr_Format(PyExc_TypeError, "records must be a list of tuples, got %.100s", Py_TYPE(records)->tp_name);
    return -1;
  }
  Py_ssize_t n = PyList_GET_SIZE(records);
  llmmem_optim_tensor_t *t = PyMem_Calloc((size_t)(n ? n : 1), sizeof *t);
  if (!t) {
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *rec = PyList_GET_ITEM(records, i);
    if (!PyTuple_CheckExact(rec) || PyTuple_GET_SIZE(rec) != RECORD_LEN) {
      PyErr_Format(PyExc_TypeError, "records[%zd] must be a tuple of %d ints", i, RECORD_LEN);
      PyMem_Free(t);
      return -1;
    }
    unsigned long long v[RECORD_LEN];
    for (Py_ssize_t k = 0; k < RECORD_LEN; k++) {
      if (record_int(rec, i, k, &v[k]) < 0) {
        PyMem_Free(t);
        return -1;
      }
    }
    if (v[7] > INT64_MAX || v[9] > INT32_MAX || v[11] > INT32_MAX) {
      PyErr_Format(PyExc_ValueError, "records[%zd]: numel or a dtype code is out of range", i);
      PyMem_Free(t);
      return -1;
    }
    t[i] = (llmmem_optim_tensor_t){
        .param = (void *)(uintptr_t)v[0],
        .master = (float *)(uintptr_t)v[1],
        .exp_avg = (void *)(uintptr_t)v[2],
        .exp_avg_sq = (void *)(uintptr_t)v[3],
        .exp_avg_scale = (float *)(uintptr_t)v[4],
        .exp_avg_sq_scale = (float *)(uintptr_t)v[5],
        .step = (float *)(uintptr_t)v[6],
        .numel = (int64_t)v[7],
        .seed = (uint64_t)v[8],
        .param_dtype = (int32_t)v[9],
        .grad = (const void *)(uintptr_t)v[10],
        .grad_dtype = (int32_t)v[11],
    };
  }
  *out = t;
  *count = (size_t)n;
  return 0;
}

/* adamw_step(records, lr, beta1, beta2, eps, weight_decay, decoupled, maximize, state, block_size,
 *            stochastic_rounding, num_threads, reference=False, device=-1, stream=0) */
static PyObject *py_adamw_step(PyObject *self, PyObject *args, PyObject *kwargs) {
  (void)self;
  static char *kw[] = {"records",
                       "lr",
                       "beta1",
                       "beta2",
                       "eps",
                       "weight_decay",
                       "decoupled",
                       "maximize",
                       "state",
                       "block_size",
                       "stochastic_rounding",
                       "num_threads",
                       "reference",
                       "device",
                       "stream",
                       NULL};
  PyObject *records;
  llmmem_optim_adamw_config_t cfg;
  int num_threads, reference = 0, device = -1;
  unsigned long long stream = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Odddddppiipi|piK", kw, &records, &cfg.lr, &cfg.beta1, &cfg.beta2,
                                   &cfg.eps, &cfg.weight_decay, &cfg.decoupled, &cfg.maximize, &cfg.state,
                                   &cfg.block_size, &cfg.stochastic_rounding, &num_threads, &reference, &device,
                                   &stream))
    return NULL;
  llmmem_optim_tensor_t *t;
  size_t n;
  if (parse_records(records, &t, &n) < 0) return NULL;
  llmmem_status_t st;
  if (device >= 0) {
    /* only queues kernels: the GIL is kept, releasing it would cost more than the call */
    st = llmmem_optim_adamw_step_cuda(t, n, &cfg, device, (void *)(uintptr_t)stream);
  } else {
    Py_BEGIN_ALLOW_THREADS st =
        reference ? llmmem_optim_adamw_step_ref(t, n, &cfg) : llmmem_optim_adamw_step(t, n, &cfg, num_threads);
    Py_END_ALLOW_THREADS
  }
  PyMem_Free(t);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  Py_RETURN_NONE;
}

/* ---- the hot path: a group's cached records, walked in C --------------------------------- */

/* The exact int `v` (an int of the head tuple); -1 with TypeError set otherwise. */
static int head_int(PyObject *head, Py_ssize_t k, unsigned long long *out) {
  PyObject *v = PyTuple_GET_ITEM(head, k);
  if (!PyLong_CheckExact(v)) {
    PyErr_SetString(PyExc_TypeError, "heads must hold tuples of ints");
    return -1;
  }
  *out = k == 8 ? PyLong_AsUnsignedLongLongMask(v) : PyLong_AsUnsignedLongLong(v);
  return PyErr_Occurred() ? -1 : 0;
}

/* The state entries whose addresses a head holds, with their fields in the head (the order of
 * llmmem/optim/adamw.py's _HEAD_KEYS, in which a walk's `tensors` tuples hold them). */
#define HEAD_TENSORS 6
static const char *const head_keys[HEAD_TENSORS] = {"master",        "exp_avg",          "exp_avg_sq",
                                                    "exp_avg_scale", "exp_avg_sq_scale", "step"};
static const int head_fields[HEAD_TENSORS] = {1, 2, 3, 4, 5, 6};

/* 1 when `state` still holds every tensor of `tensors` (None for an absent entry) under its key,
 * each on the storage whose address the head has; 0 otherwise; -1 on an error (set). The data_ptr
 * reads can run Python code: `tensors` keeps the tensors alive meanwhile (the caller holds it). */
static int state_unchanged(PyObject *state, PyObject *tensors, const unsigned long long *v) {
  static PyObject *names[HEAD_TENSORS];
  if (!PyTuple_CheckExact(tensors) || PyTuple_GET_SIZE(tensors) != HEAD_TENSORS) return 0;
  for (int k = 0; k < HEAD_TENSORS; k++) {
    PyObject *t = PyTuple_GET_ITEM(tensors, k);
    if (t == Py_None) {
      if (v[head_fields[k]] != 0) return 0;
      continue;
    }
    PyObject *ptr = llmmem_py_tensor_attr(LLMMEM_TA_DATA_PTR, t);
    if (!ptr) return -1;
    unsigned long long at = PyLong_Check(ptr) ? PyLong_AsUnsignedLongLong(ptr) : 0;
    Py_DECREF(ptr);
    if (PyErr_Occurred()) return -1;
    if (at != v[head_fields[k]]) return 0;
  }
  /* last: the lookups of str keys run no Python code, so nothing changes the state in between */
  for (int k = 0; k < HEAD_TENSORS; k++) {
    if (!names[k] && !(names[k] = PyUnicode_InternFromString(head_keys[k]))) return -1;
    PyObject *have = PyDict_GetItemWithError(state, names[k]); /* borrowed; compared by identity only */
    if (!have && PyErr_Occurred()) return -1;
    if ((have ? have : Py_None) != PyTuple_GET_ITEM(tensors, k)) return 0;
  }
  return 1;
}

/* Reads one parameter for the cached walk. 1: it has a plain gradient, described in *t (its
 * head's fields and the gradient's address and dtype), the gradient held in *grad_out; 2: no
 * gradient (skipped); 0: not the cached plain case (no exception set); -1: an error that must
 * propagate. */
static int walk_one(PyObject *param, PyObject *head, PyObject *state, PyObject *tensors, long long version,
                    PyObject *const *kinds, llmmem_optim_tensor_t *t, PyObject **grad_out) {
  PyObject *tensor_type = kinds[0], *param_type = kinds[1];
  if ((PyObject *)Py_TYPE(param) != param_type && (PyObject *)Py_TYPE(param) != tensor_type) return 0;
  PyObject *grad = llmmem_py_param_grad(param, tensor_type);
  if (!grad) return llmmem_py_must_propagate() ? -1 : (PyErr_Clear(), 0);
  if (grad == Py_None) {
    Py_DECREF(grad);
    return 2;
  }
  int rc = 0;
  PyObject *dtype = NULL, *is_cpu = NULL, *contig = NULL, *ptr = NULL, *nbytes = NULL, *pptr = NULL, *pcontig = NULL,
           *ver = NULL;
  if (head == Py_None || !PyTuple_CheckExact(head) || PyTuple_GET_SIZE(head) != 10) goto done;
  if ((PyObject *)Py_TYPE(grad) != tensor_type || !PyDict_CheckExact(state)) goto done;
  unsigned long long v[10];
  for (Py_ssize_t k = 0; k < 10; k++)
    if (head_int(head, k, &v[k]) < 0) goto done;
  if (v[7] > (unsigned long long)INT64_MAX || v[9] > 2) goto done;
  /* every state tensor the head points at is still the state's, on the same storage */
  if (state_unchanged(state, tensors, v) != 1) goto done;
  dtype = llmmem_py_tensor_attr(LLMMEM_TA_DTYPE, grad);
  if (!dtype) goto done;
  int code = dtype == kinds[2]   ? LLMMEM_OPTIM_F32
             : dtype == kinds[3] ? LLMMEM_OPTIM_F16
             : dtype == kinds[4] ? LLMMEM_OPTIM_BF16
                                 : -1;
  if (code < 0) goto done;
  const long long es = code == LLMMEM_OPTIM_F32 ? 4 : 2;
  if (!(is_cpu = llmmem_py_tensor_attr(LLMMEM_TA_IS_CPU, grad)) || is_cpu != Py_True) goto done;
  if (!(contig = llmmem_py_tensor_attr(LLMMEM_TA_IS_CONTIGUOUS, grad)) || contig != Py_True) goto done;
  if (!(ptr = llmmem_py_tensor_attr(LLMMEM_TA_DATA_PTR, grad)) || !PyLong_Check(ptr)) goto done;
  if (!(nbytes = llmmem_py_tensor_attr(LLMMEM_TA_NBYTES, grad)) || !PyLong_Check(nbytes)) goto done;
  if (PyLong_AsLongLong(nbytes) != (long long)v[7] * es || PyErr_Occurred()) goto done;
  /* the parameter's storage and layout are those the head was made from */
  if (!(pptr = llmmem_py_tensor_attr(LLMMEM_TA_DATA_PTR, param)) || !PyLong_Check(pptr)) goto done;
  if (PyLong_AsUnsignedLongLong(pptr) != v[0] || PyErr_Occurred()) goto done;
  if (!(pcontig = llmmem_py_tensor_attr(LLMMEM_TA_IS_CONTIGUOUS, param)) || pcontig != Py_True) goto done;
  if (version >= 0) { /* a master: the weight must not have been written outside the step */
    if (!(ver = llmmem_py_tensor_attr(LLMMEM_TA_VERSION, param)) || !PyLong_Check(ver)) goto done;
    if (PyLong_AsLongLong(ver) != version || PyErr_Occurred()) goto done;
  }
  void *gp = PyLong_AsVoidPtr(ptr);
  if (PyErr_Occurred() || (v[7] > 0 && (!gp || (uintptr_t)gp % (uintptr_t)es))) goto done;
  *t = (llmmem_optim_tensor_t){
      .param = (void *)(uintptr_t)v[0],
      .master = (float *)(uintptr_t)v[1],
      .exp_avg = (void *)(uintptr_t)v[2],
      .exp_avg_sq = (void *)(uintptr_t)v[3],
      .exp_avg_scale = (float *)(uintptr_t)v[4],
      .exp_avg_sq_scale = (float *)(uintptr_t)v[5],
      .step = (float *)(uintptr_t)v[6],
      .numel = (int64_t)v[7],
      .seed = (uint64_t)v[8],
      .param_dtype = (int32_t)v[9],
      .grad = gp,
      .grad_dtype = code,
  };
  rc = 1;
done:
  Py_XDECREF(dtype);
  Py_XDECREF(is_cpu);
  Py_XDECREF(contig);
  Py_XDECREF(ptr);
  Py_XDECREF(nbytes);
  Py_XDECREF(pptr);
  Py_XDECREF(pcontig);
  Py_XDECREF(ver);
  if (PyErr_Occurred()) {
    if (llmmem_py_must_propagate())
      rc = -1;
    else
      PyErr_Clear(), rc = 0;
  }
  if (rc == 1)
    *grad_out = grad;
  else
    Py_DECREF(grad);
  return rc;
}

/* What a walk found, for the run that follows (a capsule): the tensors, their formats, the
 * gradients held until the run is done. */
typedef struct {
  llmmem_optim_tensor_t *t;
  long *fmt;
  PyObject **grads;
  Py_ssize_t count;
  int ran;
} walked_t;

static void walked_free(PyObject *capsule) {
  walked_t *w = PyCapsule_GetPointer(capsule, "llmmem.optim.walked");
  if (!w) return;
  for (Py_ssize_t i = 0; i < w->count; i++) Py_XDECREF(w->grads[i]);
  PyMem_Free(w->t);
  PyMem_Free(w->fmt);
  PyMem_Free(w->grads);
  PyMem_Free(w);
}

/* adamw_walk(live, params, heads, states, tensors, versions, formats, kinds) -> capsule | None
 *   tensors[i]: the state tensors heads[i] points at (see head_keys), or None.
 *   formats[i] = state format << 16 | block size. None: a parameter is not the cached plain case
 *   (the caller takes its general path). Nothing is written: adamw_run steps what was walked. */
static PyObject *py_adamw_walk(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *live, *params, *heads, *states, *tensors, *versions, *formats, *kinds;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O!", &PyList_Type, &live, &PyList_Type, &params, &PyList_Type, &heads,
                        &PyList_Type, &states, &PyList_Type, &tensors, &PyList_Type, &versions, &PyList_Type, &formats,
                        &PyTuple_Type, &kinds))
    return NULL;
  if (PyTuple_GET_SIZE(kinds) != 5)
    return PyErr_Format(PyExc_ValueError, "kinds must be (Tensor, Parameter, float32, float16, bfloat16)");
  const Py_ssize_t n = PyList_GET_SIZE(params);
  if (PyList_GET_SIZE(heads) != n || PyList_GET_SIZE(states) != n || PyList_GET_SIZE(tensors) != n ||
      PyList_GET_SIZE(versions) != n || PyList_GET_SIZE(formats) != n)
    return PyErr_Format(PyExc_ValueError, "params, heads, states, tensors, versions and formats must have one length");
  PyObject *const kind_items[5] = {PyTuple_GET_ITEM(kinds, 0), PyTuple_GET_ITEM(kinds, 1), PyTuple_GET_ITEM(kinds, 2),
                                   PyTuple_GET_ITEM(kinds, 3), PyTuple_GET_ITEM(kinds, 4)};
  if (llmmem_py_tensor_attrs_resolve(kind_items[0], kind_items[1]) < 0) return NULL;
  /* the cached lists are the caller's own; the group's live list is compared item by item: a
   * parameter added, dropped or replaced sends the call to the general path */
  if (PyList_GET_SIZE(live) != n) Py_RETURN_NONE;
  for (Py_ssize_t i = 0; i < n; i++)
    if (PyList_GET_ITEM(live, i) != PyList_GET_ITEM(params, i)) Py_RETURN_NONE;
  walked_t *w = PyMem_Calloc(1, sizeof *w);
  if (!w) return PyErr_NoMemory();
  w->t = PyMem_Calloc((size_t)(n ? n : 1), sizeof *w->t);
  w->fmt = PyMem_Calloc((size_t)(n ? n : 1), sizeof *w->fmt);
  w->grads = PyMem_Calloc((size_t)(n ? n : 1), sizeof *w->grads);
  PyObject *capsule = PyCapsule_New(w, "llmmem.optim.walked", walked_free);
  if (!capsule) {
    PyMem_Free(w->t), PyMem_Free(w->fmt), PyMem_Free(w->grads), PyMem_Free(w);
    return NULL;
  }
  if (!w->t || !w->fmt || !w->grads) {
    Py_DECREF(capsule);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *param = PyList_GET_ITEM(params, i), *head = PyList_GET_ITEM(heads, i);
    PyObject *state = PyList_GET_ITEM(states, i), *held = PyList_GET_ITEM(tensors, i);
    long long version = PyLong_AsLongLong(PyList_GET_ITEM(versions, i));
    long format = PyLong_AsLong(PyList_GET_ITEM(formats, i));
    if (PyErr_Occurred()) {
      Py_DECREF(capsule);
      return NULL;
    }
    /* held while their attributes are read: the reads can run Python code */
    Py_INCREF(param), Py_INCREF(head), Py_INCREF(state), Py_INCREF(held);
    int rc = walk_one(param, head, state, held, version, kind_items, &w->t[w->count], &w->grads[w->count]);
    Py_DECREF(param), Py_DECREF(head), Py_DECREF(state), Py_DECREF(held);
    if (rc < 0) {
      Py_DECREF(capsule);
      return NULL;
    }
    if (rc == 0) {
      Py_DECREF(capsule);
      Py_RETURN_NONE;
    }
    if (rc == 1) w->fmt[w->count++] = format;
  }
  return capsule;
}

/* adamw_run(walked, lr, beta1, beta2, eps, weight_decay, decoupled, maximize, stochastic_rounding, num_threads)
 * -> the tensors stepped: one kernel call per state format, in the order the formats appear. Once. */
static PyObject *py_adamw_run(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *capsule;
  llmmem_optim_adamw_config_t cfg = {0};
  int num_threads;
  if (!PyArg_ParseTuple(args, "Odddddpppi", &capsule, &cfg.lr, &cfg.beta1, &cfg.beta2, &cfg.eps, &cfg.weight_decay,
                        &cfg.decoupled, &cfg.maximize, &cfg.stochastic_rounding, &num_threads))
    return NULL;
  walked_t *w = PyCapsule_GetPointer(capsule, "llmmem.optim.walked");
  if (!w) return NULL;
  if (w->ran) return PyErr_Format(PyExc_RuntimeError, "optim_adamw_run: this walk was run already");
  w->ran = 1;
  llmmem_optim_tensor_t *sorted = PyMem_Calloc((size_t)(w->count ? w->count : 1), sizeof *sorted);
  if (!sorted) return PyErr_NoMemory();
  llmmem_status_t st = LLMMEM_OK;
  for (Py_ssize_t first = 0; first < w->count && st == LLMMEM_OK; first++) {
    if (w->fmt[first] < 0) continue; /* taken with an earlier format */
    const long f = w->fmt[first];
    size_t k = 0;
    for (Py_ssize_t i = first; i < w->count; i++)
      if (w->fmt[i] == f) sorted[k++] = w->t[i], w->fmt[i] = -1;
    cfg.state = (int32_t)(f >> 16);
    cfg.block_size = (int32_t)(f & 0xffff);
    Py_BEGIN_ALLOW_THREADS st = llmmem_optim_adamw_step(sorted, k, &cfg, num_threads);
    Py_END_ALLOW_THREADS
  }
  PyMem_Free(sorted);
  if (st != LLMMEM_OK) return llmmem_py_raise(st); /* a bad hyper-parameter: nothing was stepped */
  return PyLong_FromSsize_t(w->count);
}

/* adamw_check(lr, beta1, beta2, eps, weight_decay, state, block_size): raises on a bad value. */
static PyObject *py_adamw_check(PyObject *self, PyObject *args) {
  (void)self;
  llmmem_optim_adamw_config_t cfg = {.decoupled = 1};
  if (!PyArg_ParseTuple(args, "dddddii", &cfg.lr, &cfg.beta1, &cfg.beta2, &cfg.eps, &cfg.weight_decay, &cfg.state,
                        &cfg.block_size))
    return NULL;
  llmmem_status_t st = llmmem_optim_adamw_config_check(&cfg);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  Py_RETURN_NONE;
}

/* state_bytes(state, numel, block_size) -> (bytes of one moment, scales per moment) */
static PyObject *py_state_bytes(PyObject *self, PyObject *args) {
  (void)self;
  int state, block;
  long long numel;
  if (!PyArg_ParseTuple(args, "iLi", &state, &numel, &block)) return NULL;
  size_t bytes;
  int64_t scales;
  llmmem_status_t st = llmmem_optim_state_bytes(state, numel, block, &bytes, &scales);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  return Py_BuildValue("(nL)", (Py_ssize_t)bytes, (long long)scales);
}

/* code_values(code) -> list of floats */
static PyObject *py_code_values(PyObject *self, PyObject *arg) {
  (void)self;
  int code = PyLong_Check(arg) ? (int)PyLong_AsLong(arg) : -1;
  if (PyErr_Occurred()) return NULL;
  float values[256];
  size_t n;
  llmmem_status_t st = llmmem_optim_code_values(code, values, &n);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  PyObject *list = PyList_New((Py_ssize_t)n);
  for (size_t i = 0; list && i < n; i++) {
    PyObject *v = PyFloat_FromDouble((double)values[i]);
    if (!v) {
      Py_CLEAR(list);
      break;
    }
    PyList_SET_ITEM(list, (Py_ssize_t)i, v);
  }
  return list;
}

/* quantize(x_ptr, n, code, block_size, codes_ptr, scales_ptr) */
static PyObject *py_quantize(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long x, codes, scales;
  long long n;
  int code, block;
  if (!PyArg_ParseTuple(args, "KLiiKK", &x, &n, &code, &block, &codes, &scales)) return NULL;
  llmmem_status_t st;
  Py_BEGIN_ALLOW_THREADS st = llmmem_optim_quantize((const float *)(uintptr_t)x, n, code, block,
                                                    (void *)(uintptr_t)codes, (float *)(uintptr_t)scales);
  Py_END_ALLOW_THREADS if (st != LLMMEM_OK) return llmmem_py_raise(st);
  Py_RETURN_NONE;
}

/* dequantize(codes_ptr, scales_ptr, n, code, block_size, out_ptr) */
static PyObject *py_dequantize(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long codes, scales, out;
  long long n;
  int code, block;
  if (!PyArg_ParseTuple(args, "KKLiiK", &codes, &scales, &n, &code, &block, &out)) return NULL;
  llmmem_status_t st;
  Py_BEGIN_ALLOW_THREADS st = llmmem_optim_dequantize((const void *)(uintptr_t)codes, (const float *)(uintptr_t)scales,
                                                      n, code, block, (float *)(uintptr_t)out);
  Py_END_ALLOW_THREADS if (st != LLMMEM_OK) return llmmem_py_raise(st);
  Py_RETURN_NONE;
}

/* round_bf16(x_ptr, n, seed, step, offset, out_ptr) */
static PyObject *py_round_bf16(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long x, seed, out;
  long long n, offset;
  float step;
  if (!PyArg_ParseTuple(args, "KLKfLK", &x, &n, &seed, &step, &offset, &out)) return NULL;
  llmmem_status_t st =
      llmmem_optim_round_bf16((const float *)(uintptr_t)x, n, seed, step, offset, (uint16_t *)(uintptr_t)out);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  Py_RETURN_NONE;
}

PyMethodDef llmmem_py_optim_methods[] = {
    {"optim_adamw_step", (PyCFunction)(void (*)(void))py_adamw_step, METH_VARARGS | METH_KEYWORDS,
     "optim_adamw_step(records, lr, beta1, beta2, eps, weight_decay, decoupled, maximize, state, block_size, "
     "stochastic_rounding, num_threads, reference=False, device=-1, stream=0): one AdamW step of every record "
     "(see csrc/python/optim.c); device >= 0 queues it on the GPU. Releases the GIL on the CPU. "
     "Private and unsafe: takes raw addresses; use llmmem.optim.kernels, which validates the tensors."},
    {"optim_adamw_walk", py_adamw_walk, METH_VARARGS,
     "optim_adamw_walk(live, params, heads, states, tensors, versions, formats, kinds) -> capsule | None: reads and "
     "checks every gradient of a CPU parameter group from its cached records (heads: llmmem.optim.records.head_of "
     "tuples, None for a parameter not cached); None when a parameter is not the cached plain case. Writes "
     "nothing. Private and unsafe: trusts the heads' addresses; use llmmem.optim.AdamW."},
    {"optim_adamw_run", py_adamw_run, METH_VARARGS,
     "optim_adamw_run(walked, lr, beta1, beta2, eps, weight_decay, decoupled, maximize, stochastic_rounding, "
     "num_threads) -> int: steps what optim_adamw_walk found (once), the GIL released."},
    {"optim_adamw_check", py_adamw_check, METH_VARARGS,
     "optim_adamw_check(lr, beta1, beta2, eps, weight_decay, state, block_size): raises on a bad value."},
    {"optim_state_bytes", py_state_bytes, METH_VARARGS,
     "optim_state_bytes(state, numel, block_size) -> (bytes of one moment, scales per moment)."},
    {"optim_code_values", py_code_values, METH_O, "optim_code_values(code) -> the value of every code, scale 1."},
    {"optim_quantize", py_quantize, METH_VARARGS,
     "optim_quantize(x_ptr, n, code, block_size, codes_ptr, scales_ptr): blockwise quantization (host memory). "
     "Private and unsafe: takes raw addresses."},
    {"optim_dequantize", py_dequantize, METH_VARARGS,
     "optim_dequantize(codes_ptr, scales_ptr, n, code, block_size, out_ptr): the inverse (host memory). "
     "Private and unsafe: takes raw addresses."},
    {"optim_round_bf16", py_round_bf16, METH_VARARGS,
     "optim_round_bf16(x_ptr, n, seed, step, offset, out_ptr): stochastic rounding to bf16 as the step does it. "
     "Private and unsafe: takes raw addresses."},
    {NULL, NULL, 0, NULL},
};
