/*
 * binding.h — what the files of the CPython module llmmem._C share.
 *
 * The C core reports failures as llmmem_status_t; these helpers turn them into the Python
 * exception classes of llmmem (created once in errors.c), carrying the core's detail string.
 */
#ifndef LLMMEM_BINDING_H
#define LLMMEM_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <llmmem/llmmem.h>

/* Creates the exception classes and adds them to the module. 0 on success, -1 with an exception set. */
int llmmem_py_errors_init(PyObject *module);

/* Sets the Python exception for `status` (with llmmem_last_error() as detail) and returns NULL. */
PyObject *llmmem_py_raise(llmmem_status_t status);

/* Method tables of each concern, NULL-terminated, merged by module.c. */
extern PyMethodDef llmmem_py_info_methods[];
extern PyMethodDef llmmem_py_errors_methods[];
extern PyMethodDef llmmem_py_scaler_methods[];        /* scaler.c: loss-scaler kernels */
extern PyMethodDef llmmem_py_scaler_params_methods[]; /* amp_params.c: unscale_ fast path over param_groups */
extern PyMethodDef llmmem_py_plan_methods[];          /* plan.c: recompute planner */
extern PyMethodDef llmmem_py_pool_methods[];          /* pool.c: caching allocator */
extern PyMethodDef llmmem_py_comm_methods[];          /* comm.c: intra-node collectives */

#endif /* LLMMEM_BINDING_H */
