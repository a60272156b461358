/*
 * pool.c — the Python binding of csrc/pool/ (filled in by the issue that builds it).
 */
#include "binding.h"

PyMethodDef llmmem_py_pool_methods[] = {
    {NULL, NULL, 0, NULL},
};
