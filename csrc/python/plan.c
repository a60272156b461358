/*
 * plan.c — the Python binding of csrc/plan/ (filled in by the issue that builds it).
 */
#include "binding.h"

PyMethodDef llmmem_py_plan_methods[] = {
    {NULL, NULL, 0, NULL},
};
