/*
 * args_py.c — Python values into the snapshot trees that the parsers of args.c read.
 *
 * A container is read through a tuple the snapshot owns (a list is copied into one, a dict's items
 * into a list of pairs only it can reach), so every item stays alive while the conversions of the
 * others run user code (`__index__`, `__float__`, `__len__`, `__iter__`): code that empties or
 * rebinds the caller's containers cannot free what is being read. Ints and floats (subclasses
 * included) are read without calling into Python at all.
 */
#include "binding.h" /* Python.h first */

#include <string.h>

#include "args.h"

/* Longer strings are recorded by length only: no key or value of _C is longer. */
#define MAX_TEXT 256

/* A conversion raised TypeError: the value is just not of that kind (a numpy array's __index__,
 * say), so the next kind is tried. Any other exception is the user's and propagates. */
static int conversion_refused(void) {
  if (!PyErr_ExceptionMatches(PyExc_TypeError)) return 0;
  PyErr_Clear();
  return 1;
}

/* `num` is an int (or a subclass): read without running Python code. */
static int set_int(PyObject *num, args_value_t *out) {
  out->kind = ARGS_INT;
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(num, &overflow);
  if (v == -1 && PyErr_Occurred()) return -1;
  if (!overflow) {
    out->neg = v < 0;
    out->mag = v < 0 ? (uint64_t)(-(v + 1)) + 1 : (uint64_t)v;
    return 0;
  }
  if (overflow > 0) {
    const unsigned long long u = PyLong_AsUnsignedLongLong(num);
    if (!(u == (unsigned long long)-1 && PyErr_Occurred())) {
      out->mag = u;
      return 0;
    }
    PyErr_Clear();
  }
  /* Beyond 64 bits: only the sign and the bit count are kept, for messages. int.bit_length
   * itself is called (not a subclass's override), so no user code runs. */
  out->neg = overflow < 0;
  out->big = 1;
  PyObject *bits = PyObject_CallMethod((PyObject *)&PyLong_Type, "bit_length", "O", num);
  if (!bits) return -1;
  out->mag = PyLong_AsUnsignedLongLong(bits);
  Py_DECREF(bits);
  if (PyErr_Occurred()) return -1;
  return 0;
}

static const char *builtin_name(PyObject *obj) {
  if (obj == Py_None) return "NoneType";
  if (PyBool_Check(obj)) return "bool";
  if (PyLong_CheckExact(obj)) return "int";
  if (PyFloat_CheckExact(obj)) return "float";
  if (PyList_CheckExact(obj)) return "list";
  if (PyTuple_CheckExact(obj)) return "tuple";
  if (PyDict_CheckExact(obj)) return "dict";
  if (PyUnicode_CheckExact(obj)) return "str";
  return NULL;
}

/* The type's name, read after every conversion of obj has run: copied into the arena, or, in a
 * scalar snapshot (no arena), borrowed from the type, which obj keeps alive and which no Python
 * code can rename before the parser has used it. */
static int set_type_name(PyObject *obj, args_arena_t *a, args_value_t *out) {
  const char *name = builtin_name(obj);
  if (!name) name = Py_TYPE(obj)->tp_name;
  if (a && !builtin_name(obj)) {
    size_t len = strlen(name);
    name = _llmmem_args_text(a, name, len > 96 ? 96 : len);
    if (!name) {
      PyErr_NoMemory();
      return -1;
    }
  }
  out->type_name = name;
  return 0;
}

int llmmem_py_snapshot(PyObject *obj, int depth, args_arena_t *a, args_value_t *out);

/* Items of `tuple` (owned by the caller) into out, depth - 1 levels deeper. */
static int snapshot_items(PyObject *tuple, int depth, args_arena_t *a, args_value_t *out) {
  const Py_ssize_t n = PyTuple_GET_SIZE(tuple);
  out->kind = ARGS_LIST;
  out->seq.n = (size_t)n;
  if (n == 0) return 0;
  if ((size_t)n > ARGS_MAX_ITEMS || !(out->seq.items = _llmmem_args_nodes(a, (size_t)n))) {
    out->big = 1;
    if (a->out_of_memory) {
      PyErr_NoMemory();
      return -1;
    }
    return 0;
  }
  for (Py_ssize_t i = 0; i < n; i++)
    if (llmmem_py_snapshot(PyTuple_GET_ITEM(tuple, i), depth - 1, a, &out->seq.items[i]) < 0) return -1;
  return 0;
}

static int snapshot_dict(PyObject *dict, int depth, args_arena_t *a, args_value_t *out) {
  out->kind = ARGS_DICT;
  out->seq.n = (size_t)PyDict_GET_SIZE(dict);
  if (!a || depth <= 0) {
    out->big = 1;
    return 0;
  }
  PyObject *pairs = PyDict_Items(dict); /* a new list of new (key, value) tuples: ours alone */
  if (!pairs) return -1;
  const Py_ssize_t n = PyList_GET_SIZE(pairs);
  out->seq.n = (size_t)n;
  int st = 0;
  if (n > 0) {
    args_value_t *keys = (size_t)n <= ARGS_MAX_ITEMS ? _llmmem_args_nodes(a, (size_t)n) : NULL;
    args_value_t *values = keys ? _llmmem_args_nodes(a, (size_t)n) : NULL;
    if (!values) {
      out->big = 1;
      if (a->out_of_memory) {
        PyErr_NoMemory();
        st = -1;
      }
    } else {
      out->seq.keys = keys;
      out->seq.items = values;
      for (Py_ssize_t i = 0; st == 0 && i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        st = llmmem_py_snapshot(PyTuple_GET_ITEM(pair, 0), 0, a, &keys[i]);
        if (st == 0) st = llmmem_py_snapshot(PyTuple_GET_ITEM(pair, 1), depth - 1, a, &values[i]);
      }
    }
  }
  Py_DECREF(pairs);
  return st;
}

static int snapshot_str(PyObject *obj, args_arena_t *a, args_value_t *out) {
  out->kind = ARGS_STR;
  Py_ssize_t len = 0;
  const char *text = PyUnicode_AsUTF8AndSize(obj, &len);
  if (!text) { /* lone surrogates: not text any key could match */
    if (!PyErr_ExceptionMatches(PyExc_UnicodeError)) return -1;
    PyErr_Clear();
    out->big = 1;
    out->seq.n = (size_t)PyUnicode_GET_LENGTH(obj);
    return 0;
  }
  out->seq.n = (size_t)len;
  if (!a || len > MAX_TEXT) {
    out->big = 1;
    return 0;
  }
  if (!(out->seq.text = _llmmem_args_text(a, text, (size_t)len))) {
    PyErr_NoMemory();
    return -1;
  }
  return 0;
}

/* A sized sequence other than list/tuple/str/bytes: copied through a tuple of its items. */
static int snapshot_sequence(PyObject *obj, int depth, args_arena_t *a, args_value_t *out, int *done) {
  *done = 0;
  const Py_ssize_t n = PyObject_Size(obj); /* may run __len__ */
  if (n < 0) return conversion_refused() ? 0 : -1;
  *done = 1;
  out->kind = ARGS_LIST;
  out->seq.n = (size_t)n;
  if (!a || depth <= 0 || (size_t)n > ARGS_MAX_ITEMS) {
    out->big = 1;
    return 0;
  }
  PyObject *tuple = PySequence_Tuple(obj); /* may run __iter__ */
  if (!tuple) {
    if (!conversion_refused()) return -1;
    *done = 0;
    out->kind = ARGS_NONE;
    out->seq.n = 0;
    return 0;
  }
  const int st = snapshot_items(tuple, depth, a, out);
  Py_DECREF(tuple);
  return st;
}

/* Copies `obj` into *out (zeroed first). depth: how many levels of containers to copy (0: a
 * container is recorded by length only); a == NULL: a scalar snapshot, nothing copied into an
 * arena. -1 with a Python exception set (MemoryError, KeyboardInterrupt, ...); a value of a kind
 * the parsers do not take is not an error here (ARGS_OTHER). */
int llmmem_py_snapshot(PyObject *obj, int depth, args_arena_t *a, args_value_t *out) {
  memset(out, 0, sizeof *out);
  if (!obj) {
    out->type_name = "NoneType";
    return 0;
  }
  Py_INCREF(obj); /* whatever the conversions below run, obj lives until we are done */
  int st = 0;
  if (obj == Py_None) {
    out->kind = ARGS_NONE;
  } else if (PyBool_Check(obj)) {
    out->kind = ARGS_BOOL;
    out->mag = obj == Py_True;
  } else if (PyLong_Check(obj)) {
    st = set_int(obj, out);
  } else if (PyFloat_Check(obj)) {
    out->kind = ARGS_FLOAT;
    out->f = PyFloat_AS_DOUBLE(obj);
  } else if (PyUnicode_Check(obj)) {
    st = snapshot_str(obj, a, out);
  } else if (PyDict_Check(obj)) {
    st = snapshot_dict(obj, depth, a, out);
  } else if (PyTuple_Check(obj) || PyList_Check(obj)) {
    if (!a || depth <= 0) {
      out->kind = ARGS_LIST;
      out->big = 1;
      out->seq.n = (size_t)Py_SIZE(obj);
    } else {
      PyObject *tuple = PySequence_Tuple(obj); /* a list is copied without running Python code */
      if (!tuple) {
        st = -1;
      } else {
        st = snapshot_items(tuple, depth, a, out);
        Py_DECREF(tuple);
      }
    }
  } else {
    /* Anything else (numpy scalars and arrays, Decimal, user classes): as an int if it has an
     * exact integer value, else as a float, else as a sequence, else as itself. */
    out->kind = ARGS_OTHER;
    PyNumberMethods *nb = Py_TYPE(obj)->tp_as_number;
    int done = 0;
    if (!done && PyIndex_Check(obj)) {
      PyObject *r = PyNumber_Index(obj);
      if (r) {
        st = set_int(r, out);
        Py_DECREF(r);
        done = 1;
      } else if (!conversion_refused()) {
        st = -1;
        done = 1;
      }
    }
    if (!done && nb && nb->nb_float) {
      PyObject *r = PyNumber_Float(obj);
      if (r) {
        out->kind = ARGS_FLOAT;
        out->f = PyFloat_AS_DOUBLE(r);
        Py_DECREF(r);
        done = 1;
      } else if (!conversion_refused()) {
        st = -1;
        done = 1;
      }
    }
    if (!done && PySequence_Check(obj) && !PyBytes_Check(obj) && !PyByteArray_Check(obj)) {
      st = snapshot_sequence(obj, depth, a, out, &done);
      if (!done) out->kind = ARGS_OTHER;
    }
  }
  if (st == 0) st = set_type_name(obj, a, out);
  Py_DECREF(obj);
  return st;
}

PyObject *llmmem_py_args_raise(const args_error_t *e) {
  switch (e->status) {
    case ARGS_TYPE: PyErr_SetString(PyExc_TypeError, e->msg); break;
    case ARGS_NOMEM: PyErr_SetString(PyExc_MemoryError, e->msg); break;
    case ARGS_TOO_BIG: llmmem_py_raise_message(LLMMEM_ERR_NOMEM, e->msg); break;
    default: PyErr_SetString(PyExc_ValueError, e->msg); break;
  }
  return NULL;
}

int llmmem_py_arg_uint(PyObject *obj, const char *what, uint64_t lo, uint64_t hi, uint64_t *out) {
  args_value_t v;
  args_error_t e;
  if (llmmem_py_snapshot(obj, 0, NULL, &v) < 0) return -1;
  if (_llmmem_args_uint(&v, what, lo, hi, out, &e) < 0) {
    llmmem_py_args_raise(&e);
    return -1;
  }
  return 0;
}

int llmmem_py_arg_int(PyObject *obj, const char *what, int64_t lo, int64_t hi, int64_t *out) {
  args_value_t v;
  args_error_t e;
  if (llmmem_py_snapshot(obj, 0, NULL, &v) < 0) return -1;
  if (_llmmem_args_int(&v, what, lo, hi, out, &e) < 0) {
    llmmem_py_args_raise(&e);
    return -1;
  }
  return 0;
}

int llmmem_py_arg_size(PyObject *obj, const char *what, size_t min, size_t *out) {
  args_value_t v;
  args_error_t e;
  if (llmmem_py_snapshot(obj, 0, NULL, &v) < 0) return -1;
  if (_llmmem_args_size(&v, what, min, out, &e) < 0) {
    llmmem_py_args_raise(&e);
    return -1;
  }
  return 0;
}

int llmmem_py_arg_number(PyObject *obj, const char *what, double *out) {
  args_value_t v;
  args_error_t e;
  if (llmmem_py_snapshot(obj, 0, NULL, &v) < 0) return -1;
  if (_llmmem_args_number(&v, what, out, &e) < 0) {
    llmmem_py_args_raise(&e);
    return -1;
  }
  return 0;
}
