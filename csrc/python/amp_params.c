/*
 * amp_params.c — the CPU fast path of GradScaler.unscale_: one call walks an optimizer's
 * param_groups, reads every gradient's address, size and dtype, checks them, and runs the CPU
 * unscale + non-finite check (llmmem_scaler_unscale_check) on all of them. Its only caller is
 * llmmem/amp/cpu_unscale.py, which owns the protocol around it (hand-over, resume, partial failure).
 *
 * Why in C: on lists of thousands of small gradients the walk costs as much as the kernel. Done
 * in Python it is one interpreter loop per attribute (dtype, device, contiguity, address, size),
 * each going over all the tensors again; here each tensor is visited once, its attributes read
 * back to back while its object is in cache, through the ordinary Python API (attribute
 * reads and method calls with interned names): no torch headers, no torch C++ ABI.
 *
 * Contract: the plain case only. Every parameter an exact torch.Tensor or torch.nn.Parameter,
 * every gradient None or an exact torch.Tensor, strided, contiguous, on the CPU, aligned to its
 * elements, of a supported dtype (fp16 only when allowed). On anything else (a subclass, a sparse
 * or strided view gradient, another device, a Python error while reading an attribute, ...) the
 * call returns None having written nothing, and the caller runs its general path, which handles
 * the case or raises its usual error (MemoryError, and KeyboardInterrupt or any other error that
 * is no Exception, propagate instead). Nothing is cached between calls: addresses are read anew
 * each time, so gradients reallocated between steps (zero_grad(set_to_none=True)) are correct.
 *
 * Python code runs inside the walk (a dict key's __eq__, attribute reads under a TorchFunctionMode)
 * and may edit or drop any list or dict being read: every container is held by a reference of
 * our own while it is read, and list sizes are re-read at each step.
 */
#include "binding.h" /* first: Python.h must precede the system headers */

#include <llmmem/amp.h>

/* Interned attribute names, made once. */
static PyObject *s_params;

static int intern_names(void) {
  if (s_params) return 0;
  s_params = PyUnicode_InternFromString("params");
  return s_params ? 0 : -1;
}

/* The torch objects the walk compares against, handed in by the caller (llmmem/amp/cpu_unscale.py). */
typedef struct {
  PyObject *tensor_type, *param_type;
  PyObject *dtypes[LLMMEM_SCALER_DTYPE_COUNT_]; /* by llmmem_scaler_dtype_t code */
  int allow_fp16;
} kinds_t;

#define read_attr(r, obj) llmmem_py_tensor_attr((r), (obj))
#define must_propagate()  llmmem_py_must_propagate()
enum {
  R_DTYPE = LLMMEM_TA_DTYPE,
  R_IS_CPU = LLMMEM_TA_IS_CPU,
  R_IS_CONTIGUOUS = LLMMEM_TA_IS_CONTIGUOUS,
  R_DATA_PTR = LLMMEM_TA_DATA_PTR,
  R_NBYTES = LLMMEM_TA_NBYTES
};

/* 1: `grad` is a plain gradient, described in *out; 0: not the plain case (no exception set);
 * -1: a Python error that must propagate (see must_propagate). */
static int describe_grad(PyObject *grad, const kinds_t *k, llmmem_scaler_tensor_t *out) {
  if ((PyObject *)Py_TYPE(grad) != k->tensor_type) return 0;
  int plain = 0;
  PyObject *dtype = NULL, *is_cpu = NULL, *contig = NULL, *ptr = NULL, *nbytes = NULL;
  dtype = read_attr(R_DTYPE, grad);
  if (!dtype) goto done;
  int code = -1;
  for (int c = 0; c < LLMMEM_SCALER_DTYPE_COUNT_; c++)
    if (dtype == k->dtypes[c]) code = c;
  if (code < 0 || (code == LLMMEM_SCALER_F16 && !k->allow_fp16)) goto done;
  /* The layout is not read: every other one fails another test. Sparse and mkldnn tensors have no
   * storage, so data_ptr() raises (it must: the compressed and mkldnn ones give the dense size as
   * nbytes); the sparse compressed ones also raise in is_contiguous(), and COO ones return False
   * (tests/amp/test_amp_fast_path.py tries each). Jagged nested tensors are a Python subclass (the
   * type test above; their data_ptr() is 0). Not reading it saves about a seventh of the walk. */
  is_cpu = read_attr(R_IS_CPU, grad);
  if (is_cpu != Py_True) goto done;
  contig = read_attr(R_IS_CONTIGUOUS, grad);
  if (contig != Py_True) goto done;
  ptr = read_attr(R_DATA_PTR, grad);
  /* the size from the `nbytes` getter: a getter call skips the argument parsing of numel() */
  nbytes = ptr ? read_attr(R_NBYTES, grad) : NULL;
  if (!nbytes || !PyLong_Check(ptr) || !PyLong_Check(nbytes)) goto done;
  out->data = PyLong_AsVoidPtr(ptr);
  long long size = PyLong_AsLongLong(nbytes);
  const long long es = (long long)llmmem_scaler_dtype_size(code);
  out->numel = size / es;
  out->dtype = code;
  if (PyErr_Occurred() || size < 0 || size % es) goto done;
  if (out->numel == 0)
    out->data = NULL; /* nothing to touch; its address need not be aligned */
  else if (!out->data || (uintptr_t)out->data % (uintptr_t)es)
    goto done;
  plain = 1;
done:
  Py_XDECREF(dtype);
  Py_XDECREF(is_cpu);
  Py_XDECREF(contig);
  Py_XDECREF(ptr);
  Py_XDECREF(nbytes);
  if (PyErr_Occurred()) {
    if (must_propagate()) return -1;
    PyErr_Clear(); /* the general path reads the same attribute and reports the error itself */
    return 0;
  }
  return plain;
}

/* groups[g]["params"] as a new reference when it is a list and groups[g] an exact dict; else NULL,
 * with an exception set only when it must propagate (see must_propagate). The lookup can run a
 * key's __eq__, which may drop the group from `groups`: the group is held meanwhile. */
static PyObject *params_of(PyObject *groups, Py_ssize_t g) {
  PyObject *group = PyList_GET_ITEM(groups, g);
  if (!PyDict_CheckExact(group)) return NULL;
  Py_INCREF(group);
  PyObject *params = PyDict_GetItemWithError(group, s_params); /* borrowed from the group */
  if (params && PyList_Check(params))
    Py_INCREF(params);
  else
    params = NULL;
  Py_DECREF(group);
  if (!params && PyErr_Occurred() && !must_propagate()) PyErr_Clear();
  return params;
}

/* Sum of len(group["params"]) over the groups; -1 when the groups are not a list of dicts holding
 * lists, -2 with an exception set when it must propagate. */
static Py_ssize_t count_params(PyObject *groups) {
  if (!PyList_Check(groups)) return -1;
  Py_ssize_t total = 0;
  for (Py_ssize_t g = 0; g < PyList_GET_SIZE(groups); g++) {
    PyObject *params = params_of(groups, g);
    if (!params) return PyErr_Occurred() ? -2 : -1;
    total += PyList_GET_SIZE(params);
    Py_DECREF(params);
  }
  return total;
}

/* Tensors described between two publications to the pipe: one lock per few tensors, while the
 * workers, a tensor behind at most, still overlap nearly all of the walk. */
#define PUBLISH_EVERY 8

/* Walks the groups into `t` / `grads` (owned references) / `slots`; 1 plain, 0 not, -1 error.
 * *n_out: the gradients held in `grads`; the first *n_plain of them are described in `t`.
 * With a pipe, each described gradient is handed to it (in batches) as soon as it is read, and
 * *stop_slot is the slot of the parameter the walk stopped at when it returns 0: one that is not
 * the plain case, or whose gradient was already handed over (listed twice). */
static int walk(PyObject *groups, Py_ssize_t cap, const kinds_t *k, llmmem_scaler_tensor_t *t, PyObject **grads,
                Py_ssize_t *slots, Py_ssize_t *n_out, Py_ssize_t *n_plain, llmmem_scaler_pipe_t *pipe,
                Py_ssize_t *stop_slot) {
  Py_ssize_t n = 0, slot = 0, published = 0, plain = 0, repeat_slot = -1;
  int rc = 1;
  for (Py_ssize_t g = 0; rc == 1 && g < PyList_GET_SIZE(groups); g++) {
    PyObject *params = params_of(groups, g);
    if (!params) {
      rc = PyErr_Occurred() ? -1 : 0;
      break;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params); i++, slot++) {
      if (slot >= cap) { /* the lists grew under us */
        rc = 0;
        break;
      }
      PyObject *param = PyList_GET_ITEM(params, i);
      PyTypeObject *pt = Py_TYPE(param);
      if ((PyObject *)pt != k->param_type && (PyObject *)pt != k->tensor_type) {
        rc = 0;
        break;
      }
      Py_INCREF(param);
      PyObject *grad = llmmem_py_param_grad(param, k->tensor_type);
      Py_DECREF(param);
      if (!grad) {
        rc = must_propagate() ? -1 : 0;
        if (rc == 0) PyErr_Clear();
        break;
      }
      if (grad == Py_None) {
        Py_DECREF(grad);
        continue;
      }
      grads[n] = grad; /* owned until the kernel is done: another thread may drop param.grad meanwhile */
      rc = describe_grad(grad, k, &t[n]);
      t[n].flag = (int32_t)n;
      slots[n] = slot;
      n++;
      if (rc != 1) break;
      plain = n;
      if (pipe && n - published >= PUBLISH_EVERY) {
        size_t done;
        llmmem_status_t st = llmmem_scaler_pipe_publish(pipe, (size_t)n, &done);
        if (st != LLMMEM_OK) { /* cannot happen: every field was checked by describe_grad */
          rc = -1;
          llmmem_py_raise(st);
          break;
        }
        if ((Py_ssize_t)done < n) { /* a gradient listed twice: the general path takes over at it */
          rc = 0;
          plain = (Py_ssize_t)done;
          repeat_slot = slots[done];
          break;
        }
        published = n;
      }
    }
    Py_DECREF(params);
  }
  *n_out = n;
  *n_plain = plain;
  *stop_slot = repeat_slot >= 0 ? repeat_slot : slot;
  return rc;
}

/* From this many parameters on, with more than one thread, the walk feeds a pipe (workers unscale
 * what it has read while it reads on); below, it reads everything first and then runs the kernel.
 * A pipe changes gradients before the walk has seen them all, so when it meets one that is not the
 * plain case it cannot send the whole call to the general path; it returns where it stopped
 * instead. Few parameters are walked in microseconds: there the simpler contract is kept. */
#define PIPE_MIN_PARAMS 256

static PyObject *slot_list_of(const Py_ssize_t *slots, Py_ssize_t n, Py_ssize_t cap) {
  if (n == cap) Py_RETURN_NONE; /* None: the grads sit at slots 0..n-1 */
  PyObject *list = PyList_New(n);
  for (Py_ssize_t i = 0; list && i < n; i++) {
    PyObject *v = PyLong_FromSsize_t(slots[i]);
    if (!v)
      Py_CLEAR(list);
    else
      PyList_SET_ITEM(list, i, v);
  }
  return list;
}

/* The progress cell: `obj` None (no cell) or a writable buffer of exactly one int64, such as
 * array("q", [0]). Held (an array cannot be resized meanwhile) until released by the caller. */
static int get_progress(PyObject *obj, Py_buffer *view, int64_t **cell) {
  *cell = NULL;
  if (obj == Py_None) return 0;
  int ok = PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_FORMAT) == 0;
  if (ok && (view->len != (Py_ssize_t)sizeof(int64_t) || view->itemsize != (Py_ssize_t)sizeof(int64_t) ||
             !view->format || strcmp(view->format, "q") != 0)) {
    PyBuffer_Release(view);
    ok = 0;
  }
  if (!ok) {
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_BufferError))
      return -1;
    PyErr_Clear();
    PyErr_SetString(PyExc_TypeError, "progress must be None or a writable buffer of one int64 (array('q', [0]))");
    return -1;
  }
  *cell = view->buf;
  return 0;
}

/* (n_grads, slots or None, resume_slot or None, flags): see the method's docstring. */
static PyObject *walk_result(Py_ssize_t n, const Py_ssize_t *slots, Py_ssize_t cap, PyObject *resume,
                             const uint8_t *flags) {
  PyObject *slot_list = slot_list_of(slots, n, cap);
  if (!slot_list) return NULL;
  return Py_BuildValue("(nNOy#)", n, slot_list, resume, (const char *)flags, n);
}

/* unscale_param_groups(param_groups, kinds, allow_fp16, scale_ptr, scale_is_inverse, found_inf_ptr, num_threads,
 *                      progress) -> None | (n_grads, slots or None, resume_slot or None, flags) */
static PyObject *py_unscale_param_groups(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *groups, *kinds_tuple, *progress;
  unsigned long long scale_ptr, found_ptr;
  int allow_fp16, inverse, num_threads;
  if (!PyArg_ParseTuple(args, "OO!pKpKiO", &groups, &PyTuple_Type, &kinds_tuple, &allow_fp16, &scale_ptr, &inverse,
                        &found_ptr, &num_threads, &progress))
    return NULL;
  if (PyTuple_GET_SIZE(kinds_tuple) != 2 + LLMMEM_SCALER_DTYPE_COUNT_)
    return PyErr_Format(PyExc_ValueError, "kinds must be (Tensor, Parameter, float32, float16, bfloat16, float64)");
  if (!found_ptr) return PyErr_Format(PyExc_ValueError, "found_inf_ptr must not be 0");
  if (num_threads < 0) return PyErr_Format(PyExc_ValueError, "num_threads must be >= 0, got %d", num_threads);
  if (intern_names() < 0) return NULL;
  kinds_t k = {PyTuple_GET_ITEM(kinds_tuple, 0), PyTuple_GET_ITEM(kinds_tuple, 1), {0}, allow_fp16};
  for (int c = 0; c < LLMMEM_SCALER_DTYPE_COUNT_; c++) k.dtypes[c] = PyTuple_GET_ITEM(kinds_tuple, 2 + c);
  if (llmmem_py_tensor_attrs_resolve(k.tensor_type, k.param_type) < 0) return NULL;
  /* How many gradients are unscaled, written as soon as it is known: an exception (one raised in
   * the walk, or a signal handled as this call returns, which discards its result) must not hide
   * that some are. */
  Py_buffer progress_view;
  int64_t *done_count;
  if (get_progress(progress, &progress_view, &done_count) < 0) return NULL;

  PyObject *result = NULL;
  llmmem_scaler_tensor_t *t = NULL;
  PyObject **grads = NULL;
  Py_ssize_t *slots = NULL;
  uint8_t *flags = NULL;
  Py_ssize_t n = 0, n_plain = 0, stop_slot = 0;
  Py_ssize_t cap = count_params(groups);
  if (cap == -2) goto done;
  if (cap < 0) {
    Py_INCREF(Py_None);
    result = Py_None;
    goto done;
  }
  const float *scale = (const float *)(uintptr_t)scale_ptr;
  float *found = (float *)(uintptr_t)found_ptr;
  size_t alloc = (size_t)(cap ? cap : 1);
  t = PyMem_Malloc(alloc * sizeof *t);
  grads = PyMem_Malloc(alloc * sizeof *grads);
  slots = PyMem_Malloc(alloc * sizeof *slots);
  flags = PyMem_Calloc(alloc, 1); /* flags[i]: the i-th gradient held inf/NaN */
  if (!t || !grads || !slots || !flags) {
    PyErr_NoMemory();
    goto done;
  }
  llmmem_status_t st = LLMMEM_OK;
  if (num_threads >= 2 && cap >= PIPE_MIN_PARAMS) {
    llmmem_scaler_pipe_t *pipe;
    st = llmmem_scaler_pipe_start(t, (size_t)cap, scale, inverse, flags, (size_t)cap, num_threads - 1, &pipe);
    if (st != LLMMEM_OK) {
      llmmem_py_raise(st);
      goto done;
    }
    int rc = walk(groups, cap, &k, t, grads, slots, &n, &n_plain, pipe, &stop_slot);
    /* What was read is unscaled whatever happened next: workers may have begun on it. */
    size_t done_n;
    st = llmmem_scaler_pipe_publish(pipe, (size_t)n_plain, &done_n);
    if (st == LLMMEM_OK && (Py_ssize_t)done_n < n_plain) { /* a repeat in the last batch */
      if (rc == 1) rc = 0;
      if (rc == 0) stop_slot = slots[done_n];
      n_plain = (Py_ssize_t)done_n;
    }
    llmmem_status_t st2;
    Py_BEGIN_ALLOW_THREADS st2 = llmmem_scaler_pipe_finish(pipe, found);
    Py_END_ALLOW_THREADS if (done_count) *done_count = n_plain;
    if (rc < 0) goto done; /* the walk's exception */
    if (st == LLMMEM_OK) st = st2;
    if (st != LLMMEM_OK) {
      llmmem_py_raise(st);
      goto done;
    }
    if (rc == 1) {
      result = walk_result(n_plain, slots, cap, Py_None, flags);
    } else if (n_plain == 0) { /* stopped at the first gradient: nothing done */
      Py_INCREF(Py_None);
      result = Py_None;
    } else {
      PyObject *resume = PyLong_FromSsize_t(stop_slot);
      if (resume) result = walk_result(n_plain, slots, cap, resume, flags);
      Py_XDECREF(resume);
    }
    goto done;
  }
  int rc = walk(groups, cap, &k, t, grads, slots, &n, &n_plain, NULL, &stop_slot);
  if (rc < 0) goto done;
  if (rc == 0) {
    Py_INCREF(Py_None);
    result = Py_None;
    goto done;
  }
  if (n > 0) {
    Py_BEGIN_ALLOW_THREADS st =
        llmmem_scaler_unscale_check(t, (size_t)n, scale, inverse, found, flags, (size_t)n, num_threads);
    Py_END_ALLOW_THREADS
  }
  if (st != LLMMEM_OK) {
    llmmem_py_raise(st);
    goto done;
  }
  if (done_count) *done_count = n;
  result = walk_result(n, slots, cap, Py_None, flags);
done:
  for (Py_ssize_t i = 0; grads && i < n; i++) Py_DECREF(grads[i]);
  PyMem_Free(t);
  PyMem_Free(grads);
  PyMem_Free(slots);
  PyMem_Free(flags);
  if (done_count) PyBuffer_Release(&progress_view);
  return result;
}

PyMethodDef llmmem_py_scaler_params_methods[] = {
    {"scaler_unscale_param_groups", py_unscale_param_groups, METH_VARARGS,
     "scaler_unscale_param_groups(param_groups, kinds, allow_fp16, scale_ptr, scale_is_inverse, found_inf_ptr, "
     "num_threads, progress) -> None | (n_grads, slots, resume_slot, flags): the CPU unscale + check of every "
     "gradient of param_groups in one call. None: nothing was done (a parameter or gradient is not the plain case "
     "and the walk had unscaled nothing, always so with few parameters or one thread). Otherwise the first n_grads "
     "gradients are done: all of them (resume_slot None) or, pipelined, those before the first parameter that is "
     "not the plain case, whose flat position is resume_slot. slots: each done gradient's flat position in "
     "param_groups, None when they are slots 0..n_grads-1; flags: bytes, flags[i] = 1 when the i-th done gradient "
     "held inf/NaN. progress: None or array('q', [0]), which gets n_grads before the call returns or raises. "
     "Private and unsafe: takes raw addresses for the scale and found_inf; use llmmem.amp.cpu_unscale."},
    {NULL, NULL, 0, NULL},
};
