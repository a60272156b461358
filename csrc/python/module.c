/*
 * module.c — llmmem._C, the CPython extension module over the C core.
 *
 * Each concern contributes a method table (info.c, errors.c, ...); this file merges them and
 * creates the exception classes. No torch headers: tensors reach the core as pointers and sizes
 * handed over by the Python layer.
 */
#include "binding.h"

static PyMethodDef *const method_tables[] = {
    llmmem_py_info_methods,          llmmem_py_errors_methods, llmmem_py_scaler_methods,
    llmmem_py_scaler_params_methods, llmmem_py_plan_methods,   llmmem_py_pool_methods,
    llmmem_py_comm_methods,          llmmem_py_optim_methods,  llmmem_py_head_methods,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "llmmem._C",
    .m_doc = "llmmem's C core (see csrc/include/llmmem/llmmem.h).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject *module = PyModule_Create(&module_def);
  if (!module) return NULL;
  for (size_t t = 0; t < sizeof method_tables / sizeof method_tables[0]; t++) {
    if (PyModule_AddFunctions(module, method_tables[t]) < 0) goto fail;
  }
  if (llmmem_py_errors_init(module) < 0) goto fail;
  if (PyModule_AddStringConstant(module, "__version__", LLMMEM_VERSION_STRING) < 0) goto fail;
  return module;
fail:
  Py_DECREF(module);
  return NULL;
}
