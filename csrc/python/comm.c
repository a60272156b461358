/*
 * comm.c — the Python binding of csrc/comm/ (filled in by the issue that builds it).
 */
#include "binding.h"

PyMethodDef llmmem_py_comm_methods[] = {
    {NULL, NULL, 0, NULL},
};
