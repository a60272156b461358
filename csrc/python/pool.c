/*
 * pool.c — the Python binding of csrc/pool/: pools as capsules, pool-backed buffers for CPU
 * tensors, statistics and snapshots as dicts, the pluggable-allocator slots.
 *
 * A pool lives in a capsule. Buffers handed out by pool_buffer() hold a reference to it, so the
 * pool outlives every CPU tensor made from its memory. When the capsule dies while blocks are
 * still out (CUDA segments PyTorch has not returned yet) the pool is destroyed by the last free.
 * Calls on an open pool hold the GIL throughout (see get_pool), and convert every argument before
 * they look the pool up: a conversion can run Python code (__index__), which could close it.
 */
#include "binding.h" /* first: Python.h sets the feature macros */

#include <llmmem/pool.h>

#define CAPSULE_NAME "llmmem._C.pool"

typedef struct {
  llmmem_pool_t *pool; /* NULL once closed */
} pool_holder_t;

static void capsule_destructor(PyObject *capsule) {
  pool_holder_t *h = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
  if (!h) {
    PyErr_Clear();
    return;
  }
  if (h->pool) llmmem_pool_release_when_empty(h->pool);
  PyMem_Free(h);
}

/* The open pool in `capsule`, or NULL with an exception set.
 *
 * Calls on an open pool keep the GIL: pool operations take tens of nanoseconds (less than giving
 * the GIL up and back), and holding it is what keeps MemoryPool.close() on one thread from
 * destroying a pool another Python thread is inside. Only pool_create, which touches no shared
 * pool, releases it. */
static llmmem_pool_t *get_pool(PyObject *capsule) {
  pool_holder_t *h = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
  if (!h) return NULL;
  if (!h->pool) {
    PyErr_SetString(PyExc_ValueError, "llmmem: this memory pool is closed");
    return NULL;
  }
  return h->pool;
}

static PyObject *raise_status(llmmem_status_t st) { return llmmem_py_raise(st); }

/* pool_create(kind, device, initial_size, max_size, growth_size[, fixed_segments]) -> capsule.
 * fixed_segments (default False) turns in-place growth off: for benchmarks comparing policies. */
static PyObject *py_pool_create(PyObject *self, PyObject *args) {
  (void)self;
  const char *kind;
  PyObject *device_obj, *initial_obj, *max_obj, *growth_obj;
  int fixed_segments = 0;
  if (!PyArg_ParseTuple(args, "sOOOO|p", &kind, &device_obj, &initial_obj, &max_obj, &growth_obj, &fixed_segments))
    return NULL;
  int64_t device;
  uint64_t initial, max, growth;
  if (llmmem_py_arg_int(device_obj, "device", -1, INT32_MAX, &device) < 0 ||
      llmmem_py_arg_uint(initial_obj, "initial_size", 0, SIZE_MAX, &initial) < 0 ||
      llmmem_py_arg_uint(max_obj, "max_size", 0, SIZE_MAX, &max) < 0 ||
      llmmem_py_arg_uint(growth_obj, "growth_size", 0, SIZE_MAX, &growth) < 0)
    return NULL;
  llmmem_pool_backend_t backend;
  llmmem_status_t st;
  if (strcmp(kind, "cpu") == 0)
    st = llmmem_pool_backend_host(0, &backend);
  else if (strcmp(kind, "pinned") == 0)
    st = llmmem_pool_backend_host(1, &backend);
  else if (strcmp(kind, "cuda") == 0)
    st = llmmem_pool_backend_cuda((int)device, &backend);
  else if (strcmp(kind, "cuda_vmm") == 0)
    st = llmmem_pool_backend_cuda_vmm((int)device, &backend);
  else {
    PyErr_Format(PyExc_ValueError, "device: expected 'cpu', 'pinned', 'cuda' or 'cuda_vmm', got %R",
                 PyTuple_GET_ITEM(args, 0));
    return NULL;
  }
  if (st != LLMMEM_OK) return raise_status(st);
  llmmem_pool_options_t opt = {(size_t)initial, (size_t)max, (size_t)growth, fixed_segments};
  llmmem_pool_t *pool = NULL;
  Py_BEGIN_ALLOW_THREADS st = llmmem_pool_create(&backend, &opt, &pool);
  Py_END_ALLOW_THREADS if (st != LLMMEM_OK) return raise_status(st);
  pool_holder_t *h = PyMem_Malloc(sizeof *h);
  if (!h) {
    (void)llmmem_pool_destroy(pool);
    return PyErr_NoMemory();
  }
  h->pool = pool;
  PyObject *capsule = PyCapsule_New(h, CAPSULE_NAME, capsule_destructor);
  if (!capsule) {
    (void)llmmem_pool_destroy(pool);
    PyMem_Free(h);
  }
  return capsule;
}

/* pool_close(capsule): destroys the pool now; StateError while blocks are out. Idempotent. */
static PyObject *py_pool_close(PyObject *self, PyObject *capsule) {
  (void)self;
  pool_holder_t *h = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
  if (!h) return NULL;
  if (h->pool) {
    llmmem_status_t st = llmmem_pool_destroy(h->pool);
    if (st != LLMMEM_OK) return raise_status(st);
    h->pool = NULL;
  }
  Py_RETURN_NONE;
}

/* An address or a stream handle: an int in 0..UINTPTR_MAX. */
static int parse_address(PyObject *obj, const char *what, void **out) {
  uint64_t v = 0;
  if (obj && obj != Py_None && llmmem_py_arg_uint(obj, what, 0, UINTPTR_MAX, &v) < 0) return -1;
  *out = (void *)(uintptr_t)v;
  return 0;
}

/* pool_alloc(capsule, size, stream=0) -> int address */
static PyObject *py_pool_alloc(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *capsule, *size_obj, *stream_obj = NULL;
  if (!PyArg_ParseTuple(args, "OO|O", &capsule, &size_obj, &stream_obj)) return NULL;
  size_t size;
  void *stream;
  /* Every conversion (which may run Python code) before the pool is looked up. */
  if (llmmem_py_arg_size(size_obj, "size", 1, &size) < 0 || parse_address(stream_obj, "stream", &stream) < 0)
    return NULL;
  llmmem_pool_t *pool = get_pool(capsule);
  if (!pool) return NULL;
  void *ptr = NULL;
  llmmem_status_t st = llmmem_pool_alloc(pool, size, stream, &ptr);
  if (st != LLMMEM_OK) return raise_status(st);
  return PyLong_FromVoidPtr(ptr);
}

/* pool_free(capsule, address, stream=0) */
static PyObject *py_pool_free(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *capsule, *addr_obj, *stream_obj = NULL;
  if (!PyArg_ParseTuple(args, "OO|O", &capsule, &addr_obj, &stream_obj)) return NULL;
  void *ptr, *stream;
  if (parse_address(addr_obj, "address", &ptr) < 0 || parse_address(stream_obj, "stream", &stream) < 0) return NULL;
  llmmem_pool_t *pool = get_pool(capsule);
  if (!pool) return NULL;
  llmmem_status_t st = llmmem_pool_free(pool, ptr, stream);
  if (st != LLMMEM_OK) return raise_status(st);
  Py_RETURN_NONE;
}

static int set_item(PyObject *d, const char *key, PyObject *value) {
  if (!value) return -1;
  int r = PyDict_SetItemString(d, key, value);
  Py_DECREF(value);
  return r;
}

static int set_stat(PyObject *d, const char *name, llmmem_pool_stat_t s) {
  char key[64];
  PyOS_snprintf(key, sizeof key, "%s.current", name);
  if (set_item(d, key, PyLong_FromLongLong(s.current)) < 0) return -1;
  PyOS_snprintf(key, sizeof key, "%s.peak", name);
  return set_item(d, key, PyLong_FromLongLong(s.peak));
}

/* pool_stats(capsule) -> dict (PyTorch's names: allocated_bytes.current, ...) */
static PyObject *py_pool_stats(PyObject *self, PyObject *capsule) {
  (void)self;
  llmmem_pool_t *pool = get_pool(capsule);
  if (!pool) return NULL;
  llmmem_pool_stats_t s;
  llmmem_status_t st = llmmem_pool_stats(pool, &s);
  if (st != LLMMEM_OK) return raise_status(st);
  PyObject *d = PyDict_New();
  if (!d) return NULL;
  if (set_stat(d, "allocated_bytes", s.allocated_bytes) < 0 || set_stat(d, "requested_bytes", s.requested_bytes) < 0 ||
      set_stat(d, "active_bytes", s.active_bytes) < 0 || set_stat(d, "reserved_bytes", s.reserved_bytes) < 0 ||
      set_stat(d, "allocation", s.allocations) < 0 || set_stat(d, "segment", s.segments) < 0 ||
      set_item(d, "num_allocs", PyLong_FromUnsignedLongLong(s.num_allocs)) < 0 ||
      set_item(d, "num_frees", PyLong_FromUnsignedLongLong(s.num_frees)) < 0 ||
      set_item(d, "num_ooms", PyLong_FromUnsignedLongLong(s.num_ooms)) < 0 ||
      set_item(d, "num_invalid_frees", PyLong_FromUnsignedLongLong(s.num_invalid_frees)) < 0 ||
      set_item(d, "num_device_alloc", PyLong_FromUnsignedLongLong(s.num_backend_reserves)) < 0 ||
      set_item(d, "num_device_free", PyLong_FromUnsignedLongLong(s.num_backend_releases)) < 0 ||
      set_item(d, "num_sync_events", PyLong_FromUnsignedLongLong(s.num_event_waits)) < 0 ||
      set_item(d, "free_bytes", PyLong_FromSize_t(s.free_bytes)) < 0 ||
      set_item(d, "decommitted_bytes", PyLong_FromSize_t(s.decommitted_bytes)) < 0 ||
      set_item(d, "largest_free_block", PyLong_FromSize_t(s.largest_free_block)) < 0 ||
      set_item(d, "fragmentation", PyFloat_FromDouble(s.fragmentation)) < 0 ||
      set_item(d, "small_chunks", PyLong_FromSize_t(s.small_chunks)) < 0 ||
      set_item(d, "initial_size", PyLong_FromSize_t(s.initial_size)) < 0 ||
      set_item(d, "max_size", s.max_size ? PyLong_FromSize_t(s.max_size) : Py_NewRef(Py_None)) < 0) {
    Py_DECREF(d);
    return NULL;
  }
  return d;
}

/* pool_snapshot(capsule) -> list of block tuples
 * (segment_base, segment_size, addr, size, requested, state, small, stream), address order. */
static PyObject *py_pool_snapshot(PyObject *self, PyObject *capsule) {
  (void)self;
  llmmem_pool_t *pool = get_pool(capsule);
  if (!pool) return NULL;
  llmmem_pool_block_info_t *info = NULL;
  size_t n = 0, cap = 0;
  for (;;) { /* the pool may change between the two calls (other threads): retry until it fits */
    llmmem_status_t st = llmmem_pool_snapshot(pool, info, cap, &n);
    if (st != LLMMEM_OK) {
      PyMem_Free(info);
      return raise_status(st);
    }
    if (n <= cap) break;
    cap = n + 16;
    PyMem_Free(info);
    info = PyMem_Malloc(cap * sizeof *info);
    if (!info) return PyErr_NoMemory();
  }
  PyObject *list = PyList_New((Py_ssize_t)n);
  for (size_t i = 0; list && i < n; i++) {
    static const char *states[] = {"inactive", "active_allocated", "active_pending_free"};
    PyObject *t =
        Py_BuildValue("(KnKnnsOK)", (unsigned long long)info[i].segment_base, (Py_ssize_t)info[i].segment_size,
                      (unsigned long long)info[i].addr, (Py_ssize_t)info[i].size, (Py_ssize_t)info[i].requested,
                      states[info[i].state], info[i].small ? Py_True : Py_False, (unsigned long long)info[i].stream);
    if (!t) {
      Py_CLEAR(list);
      break;
    }
    PyList_SET_ITEM(list, (Py_ssize_t)i, t);
  }
  PyMem_Free(info);
  return list;
}

static PyObject *py_pool_empty_cache(PyObject *self, PyObject *capsule) {
  (void)self;
  llmmem_pool_t *pool = get_pool(capsule);
  if (!pool) return NULL;
  size_t released = 0;
  llmmem_status_t st = llmmem_pool_empty_cache(pool, &released);
  if (st != LLMMEM_OK) return raise_status(st);
  return PyLong_FromSize_t(released);
}

static PyObject *py_pool_reset_peak_stats(PyObject *self, PyObject *capsule) {
  (void)self;
  llmmem_pool_t *pool = get_pool(capsule);
  if (!pool) return NULL;
  llmmem_status_t st = llmmem_pool_reset_peak_stats(pool);
  if (st != LLMMEM_OK) return raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *py_pool_bind_slot(PyObject *self, PyObject *capsule) {
  (void)self;
  llmmem_pool_t *pool = get_pool(capsule);
  if (!pool) return NULL;
  int slot = -1;
  llmmem_status_t st = llmmem_pool_bind_slot(pool, &slot);
  if (st != LLMMEM_OK) return raise_status(st);
  return PyLong_FromLong(slot);
}

static PyObject *py_pool_unbind_slot(PyObject *self, PyObject *arg) {
  (void)self;
  int64_t slot;
  if (llmmem_py_arg_int(arg, "slot", INT32_MIN, INT32_MAX, &slot) < 0) return NULL;
  llmmem_status_t st = llmmem_pool_unbind_slot((int)slot);
  if (st != LLMMEM_OK) return raise_status(st);
  Py_RETURN_NONE;
}

/* pool_slot_call(slot, size, device) -> int: allocates through the exported entry point path,
 * exactly as PyTorch would (0 when it refuses); for tests without a GPU. */
static PyObject *py_pool_slot_alloc(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *slot_obj, *size_obj, *device_obj;
  if (!PyArg_ParseTuple(args, "OOO", &slot_obj, &size_obj, &device_obj)) return NULL;
  int64_t slot, device;
  size_t size;
  if (llmmem_py_arg_int(slot_obj, "slot", INT32_MIN, INT32_MAX, &slot) < 0 ||
      llmmem_py_arg_size(size_obj, "size", 0, &size) < 0 ||
      llmmem_py_arg_int(device_obj, "device", INT32_MIN, INT32_MAX, &device) < 0)
    return NULL;
  void *p = llmmem_pool_slot_alloc((int)slot, size, (int)device, NULL);
  return PyLong_FromVoidPtr(p);
}

static PyObject *py_pool_slot_free(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *slot_obj, *addr_obj, *size_obj, *device_obj;
  if (!PyArg_ParseTuple(args, "OOOO", &slot_obj, &addr_obj, &size_obj, &device_obj)) return NULL;
  int64_t slot, device;
  size_t size;
  void *ptr;
  if (llmmem_py_arg_int(slot_obj, "slot", INT32_MIN, INT32_MAX, &slot) < 0 ||
      parse_address(addr_obj, "address", &ptr) < 0 || llmmem_py_arg_size(size_obj, "size", 0, &size) < 0 ||
      llmmem_py_arg_int(device_obj, "device", INT32_MIN, INT32_MAX, &device) < 0)
    return NULL;
  llmmem_pool_slot_free((int)slot, ptr, size, (int)device, NULL);
  Py_RETURN_NONE;
}

/* ---- PoolBuffer: a writable buffer over one pool block, freed when the object dies ---------- */

typedef struct {
  PyObject_HEAD PyObject *capsule; /* keeps the pool alive */
  void *ptr;
  Py_ssize_t nbytes;
} pool_buffer_t;

static PyObject *buffer_type = NULL;

static int buffer_getbuffer(PyObject *obj, Py_buffer *view, int flags) {
  pool_buffer_t *b = (pool_buffer_t *)obj;
  return PyBuffer_FillInfo(view, obj, b->ptr, b->nbytes, 0, flags);
}

static void buffer_dealloc(PyObject *obj) {
  pool_buffer_t *b = (pool_buffer_t *)obj;
  PyTypeObject *tp = Py_TYPE(obj);
  if (b->ptr) {
    pool_holder_t *h = PyCapsule_GetPointer(b->capsule, CAPSULE_NAME);
    if (h && h->pool) (void)llmmem_pool_free(h->pool, b->ptr, NULL);
    llmmem_clear_error();
    PyErr_Clear();
  }
  Py_XDECREF(b->capsule);
  tp->tp_free(obj);
  Py_DECREF(tp);
}

static PyObject *buffer_get_ptr(PyObject *obj, void *closure) {
  (void)closure;
  return PyLong_FromVoidPtr(((pool_buffer_t *)obj)->ptr);
}

static PyObject *buffer_get_nbytes(PyObject *obj, void *closure) {
  (void)closure;
  return PyLong_FromSsize_t(((pool_buffer_t *)obj)->nbytes);
}

static PyGetSetDef buffer_getset[] = {
    {"ptr", buffer_get_ptr, NULL, "address of the block", NULL},
    {"nbytes", buffer_get_nbytes, NULL, "bytes of the buffer (as requested)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot buffer_slots[] = {
    {Py_tp_dealloc, buffer_dealloc},
    {Py_tp_getset, buffer_getset},
    {Py_bf_getbuffer, buffer_getbuffer},
    {Py_tp_doc,
     "A writable buffer over one block of an llmmem pool; the block returns to the pool "
     "when the last reference (e.g. a tensor made with torch.frombuffer) goes away."},
    {0, NULL},
};

static PyType_Spec buffer_spec = {"llmmem._C.PoolBuffer", sizeof(pool_buffer_t), 0, Py_TPFLAGS_DEFAULT, buffer_slots};

/* pool_buffer(capsule, nbytes) -> PoolBuffer */
static PyObject *py_pool_buffer(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *capsule, *nbytes_obj;
  if (!PyArg_ParseTuple(args, "OO", &capsule, &nbytes_obj)) return NULL;
  size_t nbytes;
  /* A buffer's length is a Py_ssize_t: more is more than any address space gives anyway. */
  if (llmmem_py_arg_size(nbytes_obj, "nbytes", 1, &nbytes) < 0) return NULL;
  if (nbytes > PY_SSIZE_T_MAX) {
    char msg[160];
    PyOS_snprintf(msg, sizeof msg, "nbytes must be at most %zd bytes, got %zu", PY_SSIZE_T_MAX, nbytes);
    return llmmem_py_raise_message(LLMMEM_ERR_NOMEM, msg);
  }
  llmmem_pool_t *pool = get_pool(capsule);
  if (!pool) return NULL;
  const char *kind = NULL;
  (void)llmmem_pool_device(pool, &kind, NULL);
  if (strcmp(kind, "host") != 0 && strcmp(kind, "pinned") != 0) {
    PyErr_Format(PyExc_ValueError, "pool_buffer: a %s pool's memory is not host memory", kind);
    return NULL;
  }
  if (!buffer_type) {
    buffer_type = PyType_FromSpec(&buffer_spec);
    if (!buffer_type) return NULL;
  }
  void *ptr = NULL;
  llmmem_status_t st = llmmem_pool_alloc(pool, nbytes, NULL, &ptr);
  if (st != LLMMEM_OK) return raise_status(st);
  pool_buffer_t *b = PyObject_New(pool_buffer_t, (PyTypeObject *)buffer_type);
  if (!b) {
    (void)llmmem_pool_free(pool, ptr, NULL);
    return NULL;
  }
  Py_INCREF(buffer_type); /* heap-type instances own a reference to their type */
  Py_INCREF(capsule);
  b->capsule = capsule;
  b->ptr = ptr;
  b->nbytes = (Py_ssize_t)nbytes;
  return (PyObject *)b;
}

static PyObject *py_pool_info(PyObject *self, PyObject *capsule) {
  (void)self;
  llmmem_pool_t *pool = get_pool(capsule);
  if (!pool) return NULL;
  const char *kind = NULL;
  int device = -1;
  (void)llmmem_pool_device(pool, &kind, &device);
  return Py_BuildValue("(si)", kind, device);
}

static PyObject *py_pool_host_memory(PyObject *self, PyObject *noargs) {
  (void)self;
  (void)noargs;
  size_t available = 0, total = 0;
  const char *bound = NULL;
  llmmem_status_t st = llmmem_pool_host_memory(&available, &total, &bound);
  if (st != LLMMEM_OK) return raise_status(st);
  return Py_BuildValue("(nns)", (Py_ssize_t)(available > PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX : available),
                       (Py_ssize_t)(total > PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX : total), bound);
}

PyMethodDef llmmem_py_pool_methods[] = {
    {"pool_create", py_pool_create, METH_VARARGS,
     "pool_create(kind, device, initial_size, max_size, growth_size[, fixed_segments]) -> pool capsule. "
     "kind: cpu|pinned|cuda|cuda_vmm (cuda_vmm: NoDeviceError when the driver lacks virtual memory management)."},
    {"pool_close", py_pool_close, METH_O, "pool_close(pool): destroy now (StateError while blocks are out)."},
    {"pool_alloc", py_pool_alloc, METH_VARARGS, "pool_alloc(pool, size, stream=0) -> address."},
    {"pool_free", py_pool_free, METH_VARARGS, "pool_free(pool, address, stream=0)."},
    {"pool_buffer", py_pool_buffer, METH_VARARGS, "pool_buffer(pool, nbytes) -> PoolBuffer (host pools)."},
    {"pool_stats", py_pool_stats, METH_O, "pool_stats(pool) -> dict."},
    {"pool_snapshot", py_pool_snapshot, METH_O, "pool_snapshot(pool) -> list of block tuples."},
    {"pool_empty_cache", py_pool_empty_cache, METH_O, "pool_empty_cache(pool) -> bytes released."},
    {"pool_reset_peak_stats", py_pool_reset_peak_stats, METH_O, "pool_reset_peak_stats(pool)."},
    {"pool_info", py_pool_info, METH_O, "pool_info(pool) -> (backend name, device)."},
    {"pool_host_memory", py_pool_host_memory, METH_NOARGS,
     "pool_host_memory() -> (available, total, bound): host bytes this process can still commit (capped at "
     "sys.maxsize: no limit known), the most it could ever have, what sets the first."},
    {"pool_bind_slot", py_pool_bind_slot, METH_O, "pool_bind_slot(pool) -> slot of llmmem_pool_alloc_<k>."},
    {"pool_unbind_slot", py_pool_unbind_slot, METH_O, "pool_unbind_slot(slot)."},
    {"pool_slot_alloc", py_pool_slot_alloc, METH_VARARGS, "pool_slot_alloc(slot, size, device) -> address or 0."},
    {"pool_slot_free", py_pool_slot_free, METH_VARARGS, "pool_slot_free(slot, address, size, device)."},
    {NULL, NULL, 0, NULL},
};
