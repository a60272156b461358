/*
 * scaler.c — the Python binding of csrc/scaler/ (filled in by the issue that builds it).
 */
#include "binding.h"

PyMethodDef llmmem_py_scaler_methods[] = {
    {NULL, NULL, 0, NULL},
};
