/*
 * tensor_attrs.c — fast reads of a torch tensor's attributes from C, for the binding's walks over
 * many tensors (amp_params.c: the unscale over param_groups; optim.c: the optimizer step). The
 * reads are the ones Python makes (TorchFunctionMode included), through the ordinary Python API:
 * no torch headers, no torch C++ ABI.
 *
 * torch defines these attributes on its C base class as getset or method descriptors; found once
 * on the type, they are called directly, skipping the generic lookup on every read (a tenth of a
 * walk's per-tensor cost). An instance attribute of the same name, which a method lookup by name
 * would prefer, is ignored: the walks want torch's own answer. When the type holds something else
 * under the name, the attribute is read by name.
 */
#include "binding.h" /* first: Python.h must precede the system headers */

typedef struct {
  const char *text;
  int is_method;
  PyObject *name;  /* interned */
  PyObject *descr; /* strong; NULL: read by name */
} reader_t;

static reader_t readers[LLMMEM_TA_COUNT] = {
    [LLMMEM_TA_GRAD] = {"grad", 0, NULL, NULL},         [LLMMEM_TA_DTYPE] = {"dtype", 0, NULL, NULL},
    [LLMMEM_TA_IS_CPU] = {"is_cpu", 0, NULL, NULL},     [LLMMEM_TA_IS_CONTIGUOUS] = {"is_contiguous", 1, NULL, NULL},
    [LLMMEM_TA_DATA_PTR] = {"data_ptr", 1, NULL, NULL}, [LLMMEM_TA_NBYTES] = {"nbytes", 0, NULL, NULL},
    [LLMMEM_TA_VERSION] = {"_version", 0, NULL, NULL},
};
static PyObject *readers_type;     /* the tensor type the descriptors were found on (strong) */
static int grad_descr_fits_params; /* Parameter resolves `grad` to the same descriptor */

int llmmem_py_tensor_attrs_resolve(PyObject *tensor_type, PyObject *param_type) {
  for (int r = 0; r < LLMMEM_TA_COUNT; r++) {
    if (readers[r].name) continue;
    readers[r].name = PyUnicode_InternFromString(readers[r].text);
    if (!readers[r].name) return -1;
  }
  if (readers_type == tensor_type) return 0;
  for (int r = 0; r < LLMMEM_TA_COUNT; r++) {
    Py_CLEAR(readers[r].descr);
    PyObject *d = PyObject_GetAttr(tensor_type, readers[r].name);
    if (!d) {
      PyErr_Clear(); /* read by name: a walk then meets the same error and hands the call over */
      continue;
    }
    int fits =
        readers[r].is_method ? PyObject_TypeCheck(d, &PyMethodDescr_Type) : PyObject_TypeCheck(d, &PyGetSetDescr_Type);
    if (fits)
      readers[r].descr = d;
    else
      Py_DECREF(d);
  }
  PyObject *pg = PyObject_GetAttr(param_type, readers[LLMMEM_TA_GRAD].name);
  if (!pg) PyErr_Clear();
  grad_descr_fits_params = pg && pg == readers[LLMMEM_TA_GRAD].descr;
  Py_XDECREF(pg);
  Py_INCREF(tensor_type);
  Py_XSETREF(readers_type, tensor_type);
  return 0;
}

PyObject *llmmem_py_tensor_attr(int r, PyObject *obj) {
  PyObject *d = readers[r].descr;
  if (d && readers[r].is_method) return PyObject_Vectorcall(d, &obj, 1, NULL);
  if (d) return Py_TYPE(d)->tp_descr_get(d, obj, (PyObject *)Py_TYPE(obj));
  return readers[r].is_method ? PyObject_CallMethodNoArgs(obj, readers[r].name)
                              : PyObject_GetAttr(obj, readers[r].name);
}

PyObject *llmmem_py_param_grad(PyObject *param, PyObject *tensor_type) {
  if ((PyObject *)Py_TYPE(param) == tensor_type || grad_descr_fits_params)
    return llmmem_py_tensor_attr(LLMMEM_TA_GRAD, param);
  return PyObject_GetAttr(param, readers[LLMMEM_TA_GRAD].name);
}

int llmmem_py_must_propagate(void) {
  return PyErr_ExceptionMatches(PyExc_MemoryError) || !PyErr_ExceptionMatches(PyExc_Exception);
}
