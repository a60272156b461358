/*
 * errors.c — the exception classes of llmmem and the status → exception mapping.
 *
 * Every class derives from llmmem.LlmmemError (itself a RuntimeError) and also from the builtin
 * a user would catch for that kind of failure: an invalid argument is a ValueError, an exhausted
 * pool a MemoryError, a missing capability a NotImplementedError. The instance carries the C
 * status code as `.status`.
 */
#include "binding.h"

typedef struct {
  llmmem_status_t status;
  const char *name; /* attribute name on the module and class __name__ */
  const char *doc;
  PyObject **builtin; /* second base class, or NULL */
  PyObject *cls;      /* created in llmmem_py_errors_init */
} error_class_t;

static PyObject *base_error = NULL;

static error_class_t classes[] = {
    {LLMMEM_ERR_INVALID, "InvalidArgumentError", "An argument is out of range or inconsistent.", &PyExc_ValueError,
     NULL},
    {LLMMEM_ERR_NOMEM, "OutOfMemoryError", "Host or device memory could not be obtained.", &PyExc_MemoryError, NULL},
    {LLMMEM_ERR_CUDA, "CudaError", "A CUDA runtime call failed.", NULL, NULL},
    {LLMMEM_ERR_NO_DEVICE, "NoDeviceError", "No CUDA driver or GPU is available.", NULL, NULL},
    {LLMMEM_ERR_NOT_BUILT, "NotBuiltError", "The capability was not compiled into this build of llmmem.",
     &PyExc_NotImplementedError, NULL},
    {LLMMEM_ERR_INFEASIBLE, "InfeasibleError",
     "The request cannot be met (for example a memory budget that is too small).", &PyExc_ValueError, NULL},
    {LLMMEM_ERR_STATE, "StateError", "A call was made in the wrong order or on a closed object.", NULL, NULL},
    {LLMMEM_ERR_INTERNAL, "InternalError", "A broken invariant inside llmmem; please report it.", NULL, NULL},
};

#define N_CLASSES (sizeof classes / sizeof classes[0])

int llmmem_py_errors_init(PyObject *module) {
  base_error = PyErr_NewExceptionWithDoc("llmmem.LlmmemError", "Base class of the errors raised by llmmem's C core.",
                                         PyExc_RuntimeError, NULL);
  if (!base_error) return -1;
  Py_INCREF(base_error);
  if (PyModule_AddObject(module, "LlmmemError", base_error) < 0) {
    Py_DECREF(base_error);
    return -1;
  }
  for (size_t i = 0; i < N_CLASSES; i++) {
    char qualname[96];
    PyOS_snprintf(qualname, sizeof qualname, "llmmem.%s", classes[i].name);
    PyObject *bases =
        classes[i].builtin ? PyTuple_Pack(2, base_error, *classes[i].builtin) : PyTuple_Pack(1, base_error);
    if (!bases) return -1;
    classes[i].cls = PyErr_NewExceptionWithDoc(qualname, classes[i].doc, bases, NULL);
    Py_DECREF(bases);
    if (!classes[i].cls) return -1;
    Py_INCREF(classes[i].cls);
    if (PyModule_AddObject(module, classes[i].name, classes[i].cls) < 0) {
      Py_DECREF(classes[i].cls);
      return -1;
    }
  }
  return 0;
}

/* Raises the class mapped to `status` with "llmmem: <status name>[: detail]" and .status set. */
static PyObject *raise_with(llmmem_status_t status, const char *detail) {
  PyObject *cls = base_error;
  for (size_t i = 0; i < N_CLASSES; i++)
    if (classes[i].status == status) cls = classes[i].cls;
  PyObject *msg = detail[0] ? PyUnicode_FromFormat("llmmem: %s: %s", llmmem_strerror(status), detail)
                            : PyUnicode_FromFormat("llmmem: %s", llmmem_strerror(status));
  if (!msg) return NULL;
  PyObject *exc = PyObject_CallOneArg(cls, msg);
  Py_DECREF(msg);
  if (!exc) return NULL;
  PyObject *code = PyLong_FromLong((long)status);
  if (!code || PyObject_SetAttrString(exc, "status", code) < 0) {
    Py_XDECREF(code);
    Py_DECREF(exc);
    return NULL;
  }
  Py_DECREF(code);
  PyErr_SetObject(cls, exc);
  Py_DECREF(exc);
  return NULL;
}

PyObject *llmmem_py_raise(llmmem_status_t status) {
  raise_with(status, llmmem_last_error());
  llmmem_clear_error();
  return NULL;
}

PyObject *llmmem_py_raise_message(llmmem_status_t status, const char *message) { return raise_with(status, message); }

/* _C.strerror(status) -> str */
static PyObject *py_strerror(PyObject *self, PyObject *arg) {
  (void)self;
  int64_t code;
  if (llmmem_py_arg_int(arg, "strerror: status", INT32_MIN, INT32_MAX, &code) < 0) return NULL;
  return PyUnicode_FromString(llmmem_strerror((llmmem_status_t)code));
}

/* _C._raise_status(status, detail): raises what the binding raises for that status (for tests). */
static PyObject *py_raise_status(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *code_obj;
  const char *detail;
  int64_t code;
  if (!PyArg_ParseTuple(args, "Os", &code_obj, &detail) ||
      llmmem_py_arg_int(code_obj, "_raise_status: status", 1, LLMMEM_STATUS_COUNT_ - 1, &code) < 0)
    return NULL;
  /* Goes through the same recording path as the core so the detail format is what users see. */
  extern llmmem_status_t _llmmem_set_error(llmmem_status_t, const char *, int, const char *, ...);
  return llmmem_py_raise(_llmmem_set_error((llmmem_status_t)code, __FILE__, __LINE__, "%s", detail));
}

PyMethodDef llmmem_py_errors_methods[] = {
    {"strerror", py_strerror, METH_O, "strerror(status) -> str: the name of a C status code."},
    {"_raise_status", py_raise_status, METH_VARARGS, "Raise the exception mapped to a status (testing aid)."},
    {NULL, NULL, 0, NULL},
};
