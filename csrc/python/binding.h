/*
 * binding.h — what the files of the CPython module llmmem._C share.
 *
 * The C core reports failures as llmmem_status_t; these helpers turn them into the Python
 * exception classes of llmmem (created once in errors.c), carrying the core's detail string.
 * Arguments are read through args_py.c (a snapshot that holds what it reads) and checked by the
 * plain-C parsers of args.c.
 */
#ifndef LLMMEM_BINDING_H
#define LLMMEM_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <llmmem/llmmem.h>

#include "args.h"

/* Creates the exception classes and adds them to the module. 0 on success, -1 with an exception set. */
int llmmem_py_errors_init(PyObject *module);

/* Sets the Python exception for `status` (with llmmem_last_error() as detail) and returns NULL. */
PyObject *llmmem_py_raise(llmmem_status_t status);
/* The same with `message` as the detail. */
PyObject *llmmem_py_raise_message(llmmem_status_t status, const char *message);

/* ---- arguments (args_py.c) ----------------------------------------------------------------- */

/* Copies obj into *out: `depth` levels of containers into arena `a` (NULL: a scalar, containers
 * recorded by length only). Runs the conversions (__index__, __float__, ...) while holding what it
 * reads. -1 with a Python exception set. */
int llmmem_py_snapshot(PyObject *obj, int depth, args_arena_t *a, args_value_t *out);
/* Raises the exception a parser described; returns NULL. */
PyObject *llmmem_py_args_raise(const args_error_t *e);
/* One scalar argument, checked (see args.h); `what` names it. 0, or -1 with an exception set. */
int llmmem_py_arg_uint(PyObject *obj, const char *what, uint64_t lo, uint64_t hi, uint64_t *out);
int llmmem_py_arg_int(PyObject *obj, const char *what, int64_t lo, int64_t hi, int64_t *out);
int llmmem_py_arg_size(PyObject *obj, const char *what, size_t min, size_t *out);
int llmmem_py_arg_number(PyObject *obj, const char *what, double *out);

/* ---- tensor attributes (tensor_attrs.c) -------------------------------------------------- */

enum {
  LLMMEM_TA_GRAD,
  LLMMEM_TA_DTYPE,
  LLMMEM_TA_IS_CPU,
  LLMMEM_TA_IS_CONTIGUOUS,
  LLMMEM_TA_DATA_PTR,
  LLMMEM_TA_NBYTES,
  LLMMEM_TA_VERSION,
  LLMMEM_TA_COUNT
};
/* Finds the attributes' descriptors on tensor_type (once per type; param_type is checked for its
 * `grad`); -1 with an exception set on failure. Call before the reads below. */
int llmmem_py_tensor_attrs_resolve(PyObject *tensor_type, PyObject *param_type);
/* obj's attribute (LLMMEM_TA_*; the methods called without arguments): a new reference, or NULL
 * with an exception set. */
PyObject *llmmem_py_tensor_attr(int which, PyObject *obj);
/* param.grad (by descriptor where the type fits): a new reference, or NULL with an exception set. */
PyObject *llmmem_py_param_grad(PyObject *param, PyObject *tensor_type);
/* With an exception set: whether it must reach the caller rather than send a walk's call to its
 * general path (which reads the same attributes and reports their errors itself): running out of
 * memory, and what is no Exception (KeyboardInterrupt from a signal handler run by Python code a
 * TorchFunctionMode executes during an attribute read, SystemExit), which must not be swallowed. */
int llmmem_py_must_propagate(void);

/* Method tables of each concern, NULL-terminated, merged by module.c. */
extern PyMethodDef llmmem_py_info_methods[];
extern PyMethodDef llmmem_py_errors_methods[];
extern PyMethodDef llmmem_py_scaler_methods[];        /* amp.c: loss-scaler kernels */
extern PyMethodDef llmmem_py_scaler_params_methods[]; /* amp_params.c: unscale_ fast path over param_groups */
extern PyMethodDef llmmem_py_plan_methods[];          /* checkpointing.c: recompute planner */
extern PyMethodDef llmmem_py_pool_methods[];          /* pool.c: caching allocator */
extern PyMethodDef llmmem_py_comm_methods[];          /* parallel.c: intra-node collectives */
extern PyMethodDef llmmem_py_optim_methods[];         /* optim.c: the AdamW step and its codes */
extern PyMethodDef llmmem_py_head_methods[];          /* head.c: the fused LM head's passes */

#endif /* LLMMEM_BINDING_H */
