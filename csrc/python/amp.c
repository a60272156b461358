/*
 * amp.c — the Python binding of csrc/amp/ (called by llmmem/amp/launch.py).
 *
 * Tensors arrive as plain ints from Python (data_ptr(), numel(), a dtype code), never as torch
 * objects: the core stays free of torch. Tensor i reports to tensor_flags[i]. The CPU unscale
 * releases the GIL for its whole run; the CUDA calls only queue work on the given stream.
 * Argument errors raise llmmem.InvalidArgumentError (a ValueError) naming the argument.
 *
 * Lists are read item by item through borrowed pointers, so their items must be exact ints: a
 * conversion that ran Python code (__index__ of an int-like) could empty a list while it is read.
 *
 * PRIVATE AND UNSAFE: the _C.scaler_* functions take raw addresses and trust them. They can check
 * only what they see (lengths, codes, NULLs), not that an address points at memory of the right
 * dtype, size, device or alignment; a wrong address corrupts memory or crashes the process. All
 * validation of tensors (dtype, device, element counts, alignment) lives in llmmem/amp/kernels.py,
 * the only supported caller.
 */
#include "binding.h" /* first: Python.h must precede the system headers */

#include <llmmem/amp.h>

/* The exact int items[i] of the list named `what`; -1 with TypeError set for anything else. No
 * Python code runs here, so the list cannot change while it is read. */
static int exact_int(PyObject *const *items, Py_ssize_t i, const char *what) {
  if (PyLong_CheckExact(items[i])) return 0;
  PyErr_Format(PyExc_TypeError, "%s[%zd] must be an int, got %.100s", what, i, Py_TYPE(items[i])->tp_name);
  return -1;
}

/* Parses three equally long sequences into a malloc'd tensor array (*out, freed by the caller). */
static int parse_tensors(PyObject *ptrs, PyObject *numels, PyObject *dtypes, llmmem_scaler_tensor_t **out,
                         Py_ssize_t *count) {
  *out = NULL;
  PyObject *fp = PySequence_Fast(ptrs, "ptrs must be a sequence of ints (data_ptr())");
  if (!fp) return -1;
  PyObject *fn = PySequence_Fast(numels, "numels must be a sequence of ints");
  if (!fn) {
    Py_DECREF(fp);
    return -1;
  }
  PyObject *fd = PySequence_Fast(dtypes, "dtypes must be a sequence of ints (dtype codes)");
  if (!fd) {
    Py_DECREF(fp);
    Py_DECREF(fn);
    return -1;
  }
  int rc = -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fp);
  if (PySequence_Fast_GET_SIZE(fn) != n || PySequence_Fast_GET_SIZE(fd) != n) {
    PyErr_Format(PyExc_ValueError, "ptrs, numels and dtypes must have the same length, got %zd, %zd and %zd", n,
                 PySequence_Fast_GET_SIZE(fn), PySequence_Fast_GET_SIZE(fd));
    goto done;
  }
  llmmem_scaler_tensor_t *t = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *t);
  if (!t) {
    PyErr_NoMemory();
    goto done;
  }
  PyObject **ip = PySequence_Fast_ITEMS(fp), **in = PySequence_Fast_ITEMS(fn), **id = PySequence_Fast_ITEMS(fd);
  for (Py_ssize_t i = 0; i < n; i++) {
    if (exact_int(ip, i, "ptrs") < 0 || exact_int(in, i, "numels") < 0 || exact_int(id, i, "dtypes") < 0) {
      PyMem_Free(t);
      goto done;
    }
    t[i].data = PyLong_AsVoidPtr(ip[i]);
    t[i].numel = PyLong_AsLongLong(in[i]);
    long long dt = PyLong_AsLongLong(id[i]);
    if (PyErr_Occurred()) {
      PyMem_Free(t);
      goto done;
    }
    /* Range-check before narrowing: (int32_t)(2**32 + 1) would be 1, a valid code (fp16), and the
     * core would then read fp32 data as fp16. Codes that fit are checked by the core itself. */
    if (dt < INT32_MIN || dt > INT32_MAX) {
      PyErr_Format(PyExc_ValueError, "dtypes[%zd] = %lld is not a dtype code", i, dt);
      PyMem_Free(t);
      goto done;
    }
    t[i].dtype = (int32_t)dt;
    t[i].flag = (int32_t)i;
  }
  *out = t;
  *count = n;
  rc = 0;
done:
  Py_DECREF(fp);
  Py_DECREF(fn);
  Py_DECREF(fd);
  return rc;
}

/* unscale_check(ptrs, numels, dtypes, scale_ptr, scale_is_inverse, found_inf_ptr, flags_ptr, n_flags, num_threads,
 * reference=False) */
static PyObject *py_unscale_check(PyObject *self, PyObject *args, PyObject *kwargs) {
  (void)self;
  static char *kw[] = {
      "ptrs",    "numels",      "dtypes",    "scale_ptr", "scale_is_inverse", "found_inf_ptr", "flags_ptr",
      "n_flags", "num_threads", "reference", NULL};
  PyObject *ptrs, *numels, *dtypes;
  unsigned long long scale_ptr, found_ptr, flags_ptr;
  Py_ssize_t n_flags;
  int num_threads, reference = 0, inverse;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOKpKKni|p", kw, &ptrs, &numels, &dtypes, &scale_ptr, &inverse,
                                   &found_ptr, &flags_ptr, &n_flags, &num_threads, &reference))
    return NULL;
  if (n_flags < 0) return PyErr_Format(PyExc_ValueError, "n_flags must be >= 0, got %zd", n_flags);
  llmmem_scaler_tensor_t *t;
  Py_ssize_t n;
  if (parse_tensors(ptrs, numels, dtypes, &t, &n) < 0) return NULL;
  llmmem_status_t st;
  Py_BEGIN_ALLOW_THREADS if (reference) st =
      llmmem_scaler_unscale_check_ref(t, (size_t)n, (const float *)(uintptr_t)scale_ptr, inverse,
                                      (float *)(uintptr_t)found_ptr, (uint8_t *)(uintptr_t)flags_ptr, (size_t)n_flags);
  else st = llmmem_scaler_unscale_check(t, (size_t)n, (const float *)(uintptr_t)scale_ptr, inverse,
                                        (float *)(uintptr_t)found_ptr, (uint8_t *)(uintptr_t)flags_ptr,
                                        (size_t)n_flags, num_threads);
  Py_END_ALLOW_THREADS PyMem_Free(t);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  Py_RETURN_NONE;
}

/* unscale_check_cuda(ptrs, numels, dtypes, scale_ptr, scale_is_inverse, found_inf_ptr, flags_ptr, n_flags, device,
 * stream) */
static PyObject *py_unscale_check_cuda(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *ptrs, *numels, *dtypes;
  unsigned long long scale_ptr, found_ptr, flags_ptr, stream;
  Py_ssize_t n_flags;
  int device, inverse;
  if (!PyArg_ParseTuple(args, "OOOKpKKniK", &ptrs, &numels, &dtypes, &scale_ptr, &inverse, &found_ptr, &flags_ptr,
                        &n_flags, &device, &stream))
    return NULL;
  if (n_flags < 0) return PyErr_Format(PyExc_ValueError, "n_flags must be >= 0, got %zd", n_flags);
  llmmem_scaler_tensor_t *t;
  Py_ssize_t n;
  if (parse_tensors(ptrs, numels, dtypes, &t, &n) < 0) return NULL;
  /* Only queues kernels (no wait), so the GIL is kept: releasing it would cost more than the call. */
  llmmem_status_t st = llmmem_scaler_unscale_check_cuda(t, (size_t)n, (const float *)(uintptr_t)scale_ptr, inverse,
                                                        (float *)(uintptr_t)found_ptr, (uint8_t *)(uintptr_t)flags_ptr,
                                                        (size_t)n_flags, device, (void *)(uintptr_t)stream);
  PyMem_Free(t);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  Py_RETURN_NONE;
}

/* Parses the found_inf pointer list shared by update / update_cuda. */
static int parse_found(PyObject *seq, const float **out, size_t cap, size_t *n) {
  PyObject *f = PySequence_Fast(seq, "found_inf_ptrs must be a sequence of ints");
  if (!f) return -1;
  Py_ssize_t len = PySequence_Fast_GET_SIZE(f);
  if ((size_t)len > cap) {
    Py_DECREF(f);
    PyErr_Format(PyExc_ValueError, "found_inf_ptrs: at most %zu flags per update, got %zd", cap, len);
    return -1;
  }
  PyObject **items = PySequence_Fast_ITEMS(f);
  for (Py_ssize_t i = 0; i < len; i++) {
    if (exact_int(items, i, "found_inf_ptrs") == 0) out[i] = (const float *)PyLong_AsVoidPtr(items[i]);
    if (PyErr_Occurred()) {
      Py_DECREF(f);
      return -1;
    }
  }
  *n = (size_t)len;
  Py_DECREF(f);
  return 0;
}

/* update(scale_ptr, growth_ptr, hyst_ptr, stats_ptr, found_inf_ptrs, growth_factor, backoff_factor,
 *        growth_interval, hysteresis, min_scale[, device, stream, hysteresis_on_growth]): device >= 0: CUDA. */
static PyObject *py_update(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long scale_ptr, growth_ptr, hyst_ptr, stats_ptr, stream = 0;
  PyObject *found_seq;
  llmmem_scaler_config_t cfg;
  long long interval;
  int hysteresis, device = -1, on_growth = 0;
  float min_scale;
  if (!PyArg_ParseTuple(args, "KKKKOddLif|iKp", &scale_ptr, &growth_ptr, &hyst_ptr, &stats_ptr, &found_seq,
                        &cfg.growth_factor, &cfg.backoff_factor, &interval, &hysteresis, &min_scale, &device, &stream,
                        &on_growth))
    return NULL;
  cfg.growth_interval = interval;
  cfg.hysteresis = hysteresis;
  cfg.min_scale = min_scale;
  cfg.hysteresis_on_growth = on_growth;
  const float *found[LLMMEM_SCALER_CUDA_MAX_FOUND];
  size_t n_found = 0;
  if (parse_found(found_seq, found, LLMMEM_SCALER_CUDA_MAX_FOUND, &n_found) < 0) return NULL;
  llmmem_status_t st;
  if (device < 0)
    st = llmmem_scaler_update((float *)(uintptr_t)scale_ptr, (int32_t *)(uintptr_t)growth_ptr,
                              (int32_t *)(uintptr_t)hyst_ptr, (int64_t *)(uintptr_t)stats_ptr, found, n_found, &cfg);
  else
    st = llmmem_scaler_update_cuda((float *)(uintptr_t)scale_ptr, (int32_t *)(uintptr_t)growth_ptr,
                                   (int32_t *)(uintptr_t)hyst_ptr, (int64_t *)(uintptr_t)stats_ptr, found, n_found,
                                   &cfg, device, (void *)(uintptr_t)stream);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  Py_RETURN_NONE;
}

/* check_config(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale) */
static PyObject *py_check_config(PyObject *self, PyObject *args) {
  (void)self;
  llmmem_scaler_config_t cfg;
  long long interval;
  int hysteresis;
  float min_scale;
  if (!PyArg_ParseTuple(args, "ddLif", &cfg.growth_factor, &cfg.backoff_factor, &interval, &hysteresis, &min_scale))
    return NULL;
  cfg.growth_interval = interval;
  cfg.hysteresis = hysteresis;
  cfg.min_scale = min_scale;
  cfg.hysteresis_on_growth = 0;
  llmmem_status_t st = llmmem_scaler_config_check(&cfg);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  Py_RETURN_NONE;
}

static PyObject *py_inv_scale(PyObject *self, PyObject *arg) {
  (void)self;
  double scale = PyFloat_AsDouble(arg);
  if (scale == -1.0 && PyErr_Occurred()) return NULL;
  float inv;
  llmmem_status_t st = llmmem_scaler_inv_scale((float)scale, &inv);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  return PyFloat_FromDouble((double)inv);
}

static PyObject *py_cpu_workers(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  int uses_openmp = 0;
  llmmem_status_t st = llmmem_scaler_cpu_workers(&uses_openmp);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  return PyUnicode_FromString(uses_openmp ? "openmp" : "own");
}

PyMethodDef llmmem_py_scaler_methods[] = {
    {"scaler_cpu_workers", py_cpu_workers, METH_NOARGS,
     "scaler_cpu_workers() -> 'openmp' | 'own': whether the threaded CPU unscale, called now from this thread, "
     "runs on the process's OpenMP team (torch's) or on threads of llmmem's own."},
    {"scaler_unscale_check", (PyCFunction)(void (*)(void))py_unscale_check, METH_VARARGS | METH_KEYWORDS,
     "scaler_unscale_check(ptrs, numels, dtypes, scale_ptr, scale_is_inverse, found_inf_ptr, flags_ptr, n_flags, "
     "num_threads, "
     "reference=False): CPU unscale + non-finite check in place (scale_ptr 0 = check only). Releases the GIL. "
     "Private and unsafe: takes raw addresses; use llmmem.amp.kernels, which validates the tensors."},
    {"scaler_unscale_check_cuda", py_unscale_check_cuda, METH_VARARGS,
     "scaler_unscale_check_cuda(ptrs, numels, dtypes, scale_ptr, scale_is_inverse, found_inf_ptr, flags_ptr, n_flags, "
     "device, stream): "
     "queues the CUDA unscale + check on `stream`; no host synchronisation. "
     "Private and unsafe: takes raw addresses; use llmmem.amp.kernels, which validates the tensors."},
    {"scaler_update", py_update, METH_VARARGS,
     "scaler_update(scale_ptr, growth_ptr, hyst_ptr, stats_ptr, found_inf_ptrs, growth_factor, backoff_factor, "
     "growth_interval, hysteresis, min_scale[, device, stream, hysteresis_on_growth]): one scale update "
     "(device >= 0: on the GPU; -1: on the host). "
     "Private and unsafe: takes raw addresses; use llmmem.amp.kernels, which validates the tensors."},
    {"scaler_check_config", py_check_config, METH_VARARGS,
     "scaler_check_config(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale): raises on a bad "
     "value."},
    {"scaler_inv_scale", py_inv_scale, METH_O, "scaler_inv_scale(scale) -> float: (float)(1.0 / (double)scale)."},
    {NULL, NULL, 0, NULL},
};
