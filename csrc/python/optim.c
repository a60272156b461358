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
