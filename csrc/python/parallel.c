/*
 * parallel.c — the Python binding of csrc/parallel/: intra-node collectives.
 *
 * Communicators travel to Python as capsules that close themselves when collected (or earlier
 * through *_close). Buffers arrive as integer addresses (tensor.data_ptr()) with an element count
 * and a dtype code (llmmem_comm_dtype_t); llmmem/parallel/shm.py and cuda_ipc.py check the tensors
 * (device, contiguity, dtype, sizes) before calling. The GIL is released while a collective or a
 * set-up waits for the other ranks; the C side's wait poll re-takes it about every 50 ms of
 * waiting to run Python's signal handlers, so Ctrl-C raises KeyboardInterrupt promptly.
 */
#include "binding.h"

#include <llmmem/parallel.h>

#define SHM_CAPSULE     "llmmem.shm_comm"
#define CUDA_AR_CAPSULE "llmmem.cuda_ar"

typedef struct {
  void *comm; /* llmmem_shm_comm_t* or llmmem_cuda_ar_t*; NULL once closed */
  /* Blocking calls running on comm with the GIL released (changed only with the GIL held). A
   * close meanwhile (another thread, or a signal handler run by the wait poll in the middle of
   * the call) must not unmap under it: it only sets close_pending, the poll then stops the wait,
   * and the last call to leave closes. */
  int busy;
  int close_pending;
  int is_shm; /* which kind comm is */
} holder_t;

/* Closes a communicator of either kind; both accept NULL (already closed). */
static void close_comm(void *comm, int is_shm) {
  if (is_shm)
    (void)llmmem_shm_comm_close(comm);
  else
    (void)llmmem_cuda_ar_close(comm);
}

/* Closes the holder's communicator now (a pending close is then done). */
static void close_now(holder_t *h) {
  close_comm(h->comm, h->is_shm);
  h->comm = NULL;
  h->close_pending = 0;
}

static void free_holder(PyObject *cap, int is_shm) {
  holder_t *h = PyCapsule_GetPointer(cap, is_shm ? SHM_CAPSULE : CUDA_AR_CAPSULE);
  if (!h) return;
  close_now(h);
  PyMem_Free(h);
}

static void shm_capsule_free(PyObject *cap) { free_holder(cap, 1); }

static void cuda_ar_capsule_free(PyObject *cap) { free_holder(cap, 0); }

/* The holder of a live communicator inside a capsule, or NULL with an exception set. */
static holder_t *live(PyObject *cap, const char *kind) {
  holder_t *h = PyCapsule_GetPointer(cap, kind);
  if (!h) return NULL;
  if (!h->comm || h->close_pending) {
    PyErr_SetString(PyExc_ValueError, "llmmem: the communicator is closed");
    return NULL;
  }
  return h;
}

/* Ends a blocking call counted in h->busy (GIL held): the last one to leave performs a close that
 * was asked for meanwhile. */
static void leave_busy(holder_t *h) {
  if (--h->busy == 0 && h->close_pending) close_now(h);
}

/* The capsule owning `comm`; on failure `comm` is closed and NULL returned with an exception set. */
static PyObject *wrap(void *comm, int is_shm) {
  holder_t *h = PyMem_Malloc(sizeof *h);
  if (!h) {
    close_comm(comm, is_shm);
    return PyErr_NoMemory();
  }
  h->comm = comm;
  h->busy = 0;
  h->close_pending = 0;
  h->is_shm = is_shm;
  PyObject *cap =
      PyCapsule_New(h, is_shm ? SHM_CAPSULE : CUDA_AR_CAPSULE, is_shm ? shm_capsule_free : cuda_ar_capsule_free);
  if (!cap) {
    close_comm(comm, is_shm);
    PyMem_Free(h);
  }
  return cap;
}

/* shm_comm_close / cuda_ar_close: closes now, or, while a blocking call runs on it (another
 * thread, or the wait poll's signal handler), when that call returns (a shm wait stops early). */
static PyObject *close_capsule(PyObject *cap, int is_shm) {
  holder_t *h = PyCapsule_GetPointer(cap, is_shm ? SHM_CAPSULE : CUDA_AR_CAPSULE);
  if (!h) return NULL;
  if (h->busy)
    h->close_pending = 1;
  else
    close_now(h);
  Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ waiting with signals */

/* What the wait poll needs: the thread state saved when the GIL was released, and the holder of
 * the communicator waited on (NULL during set-up, when no one else can see it yet). */
typedef struct {
  PyThreadState *ts;
  holder_t *h;
} wait_ctx_t;

/* llmmem_comm_poll_fn: only called while C waits for a peer (never on the fast path). Runs the
 * pending signal handlers with the GIL held; a handler that raised (KeyboardInterrupt) stops the
 * wait and leaves its exception set for the caller below to return. */
static int poll_signals(void *p) {
  wait_ctx_t *w = p;
  PyEval_RestoreThread(w->ts);
  int raised = PyErr_CheckSignals() != 0;
  int stop = raised || (w->h && w->h->close_pending); /* a handler (or thread) closed it: give up */
  w->ts = PyEval_SaveThread();
  return stop;
}

/* Brackets a blocking C call: GIL released, the calling thread's wait poll set, the holder (if
 * any) counted busy so that a close meanwhile is deferred to end_wait. The CUDA all-reduce's
 * blocking calls use it too: they never call the poll, only the busy count matters to them. */
static void begin_wait(wait_ctx_t *w, holder_t *h) {
  w->h = h;
  if (h) h->busy++;
  w->ts = PyEval_SaveThread();
  llmmem_comm_set_wait_poll(poll_signals, w);
}

static void end_wait(wait_ctx_t *w) {
  llmmem_comm_set_wait_poll(NULL, NULL);
  PyEval_RestoreThread(w->ts);
  if (w->h) leave_busy(w->h);
}

/* The exception for a failed blocking call: the one a signal handler raised, else the status. */
static PyObject *raise_after_wait(llmmem_status_t st) {
  if (PyErr_Occurred()) return NULL;
  return llmmem_py_raise(st);
}

/* ------------------------------------------------------------------ arguments */

/* Integer arguments are converted here, before any capsule is looked at: a conversion may run
 * Python code (__index__), which could close the communicator. */
static int arg_int(PyObject *obj, const char *what, int *out) {
  int64_t v;
  if (llmmem_py_arg_int(obj, what, INT32_MIN, INT32_MAX, &v) < 0) return -1;
  *out = (int)v;
  return 0;
}

static int arg_u64(PyObject *obj, const char *what, uint64_t hi, uint64_t *out) {
  return llmmem_py_arg_uint(obj, what, 0, hi, out);
}

/* ------------------------------------------------------------------ shared memory */

/* shm_comm_open(name, rank, world_size, slot_bytes, timeout_s) -> capsule */
static PyObject *py_shm_comm_open(PyObject *self, PyObject *args) {
  (void)self;
  const char *name;
  PyObject *rank_obj, *world_obj, *slot_obj, *timeout_obj;
  if (!PyArg_ParseTuple(args, "sOOOO", &name, &rank_obj, &world_obj, &slot_obj, &timeout_obj)) return NULL;
  int rank, world;
  uint64_t slot;
  double timeout;
  if (arg_int(rank_obj, "rank", &rank) < 0 || arg_int(world_obj, "world_size", &world) < 0 ||
      arg_u64(slot_obj, "slot_bytes", SIZE_MAX, &slot) < 0 ||
      llmmem_py_arg_number(timeout_obj, "timeout_s", &timeout) < 0)
    return NULL;
  llmmem_shm_comm_t *comm = NULL;
  wait_ctx_t w;
  begin_wait(&w, NULL);
  llmmem_status_t st = llmmem_shm_comm_open(name, rank, world, (size_t)slot, timeout, &comm);
  end_wait(&w);
  if (st != LLMMEM_OK) return raise_after_wait(st);
  return wrap(comm, 1);
}

static PyObject *py_shm_comm_close(PyObject *self, PyObject *cap) {
  (void)self;
  return close_capsule(cap, 1);
}

static PyObject *py_shm_comm_set_timeout(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *cap, *timeout_obj;
  double timeout;
  if (!PyArg_ParseTuple(args, "OO", &cap, &timeout_obj) ||
      llmmem_py_arg_number(timeout_obj, "timeout_s", &timeout) < 0)
    return NULL;
  holder_t *h = live(cap, SHM_CAPSULE);
  if (!h) return NULL;
  llmmem_status_t st = llmmem_shm_comm_set_timeout(h->comm, timeout);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  Py_RETURN_NONE;
}

static PyObject *py_shm_comm_slot_bytes(PyObject *self, PyObject *cap) {
  (void)self;
  holder_t *h = live(cap, SHM_CAPSULE);
  if (!h) return NULL;
  size_t n = 0;
  llmmem_status_t st = llmmem_shm_comm_slot_bytes(h->comm, &n);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  return PyLong_FromSize_t(n);
}

typedef llmmem_status_t (*shm_op_fn)(llmmem_shm_comm_t *, const void *, void *, size_t, llmmem_comm_dtype_t);

/* (capsule, in_ptr, out_ptr, count, dtype) -> None */
static PyObject *shm_op(PyObject *args, shm_op_fn fn) {
  PyObject *cap, *in_obj, *out_obj, *count_obj, *dtype_obj;
  if (!PyArg_ParseTuple(args, "OOOOO", &cap, &in_obj, &out_obj, &count_obj, &dtype_obj)) return NULL;
  uint64_t in_ptr, out_ptr, count;
  int dtype;
  if (arg_u64(in_obj, "in_ptr", UINTPTR_MAX, &in_ptr) < 0 || arg_u64(out_obj, "out_ptr", UINTPTR_MAX, &out_ptr) < 0 ||
      arg_u64(count_obj, "count", SIZE_MAX, &count) < 0 || arg_int(dtype_obj, "dtype", &dtype) < 0)
    return NULL;
  holder_t *h = live(cap, SHM_CAPSULE); /* the capsule is the caller's: alive meanwhile */
  if (!h) return NULL;
  if (h->busy) {
    /* The communicator's epoch and step counters belong to the call in progress: a second one
     * would advance them under it. */
    PyErr_SetString(PyExc_RuntimeError,
                    "llmmem: a collective is already running on this communicator (on "
                    "another thread, or in a signal handler run while it waits); calls on "
                    "one communicator must not overlap");
    return NULL;
  }
  wait_ctx_t w;
  begin_wait(&w, h);
  llmmem_status_t st = fn(h->comm, (const void *)(uintptr_t)in_ptr, (void *)(uintptr_t)out_ptr, (size_t)count,
                          (llmmem_comm_dtype_t)dtype);
  end_wait(&w);
  if (st != LLMMEM_OK) return raise_after_wait(st);
  Py_RETURN_NONE;
}

static PyObject *py_shm_all_reduce(PyObject *self, PyObject *args) {
  (void)self;
  return shm_op(args, llmmem_shm_all_reduce);
}

static PyObject *py_shm_all_gather(PyObject *self, PyObject *args) {
  (void)self;
  return shm_op(args, llmmem_shm_all_gather);
}

static PyObject *py_shm_reduce_scatter(PyObject *self, PyObject *args) {
  (void)self;
  return shm_op(args, llmmem_shm_reduce_scatter);
}

/* ------------------------------------------------------------------ CUDA IPC all-reduce */

/* cuda_ar_create(device, rank, world_size, max_bytes, timeout_s) -> (capsule, handle: bytes) */
static PyObject *py_cuda_ar_create(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *device_obj, *rank_obj, *world_obj, *max_obj, *timeout_obj;
  if (!PyArg_ParseTuple(args, "OOOOO", &device_obj, &rank_obj, &world_obj, &max_obj, &timeout_obj)) return NULL;
  int device, rank, world;
  uint64_t max_bytes;
  double timeout;
  if (arg_int(device_obj, "device", &device) < 0 || arg_int(rank_obj, "rank", &rank) < 0 ||
      arg_int(world_obj, "world_size", &world) < 0 || arg_u64(max_obj, "max_bytes", SIZE_MAX, &max_bytes) < 0 ||
      llmmem_py_arg_number(timeout_obj, "timeout_s", &timeout) < 0)
    return NULL;
  llmmem_cuda_ar_t *ar = NULL;
  char handle[LLMMEM_CUDA_IPC_HANDLE_BYTES] = {0};
  llmmem_status_t st;
  Py_BEGIN_ALLOW_THREADS st = llmmem_cuda_ar_create(device, rank, world, (size_t)max_bytes, timeout, &ar, handle);
  Py_END_ALLOW_THREADS if (st != LLMMEM_OK) return llmmem_py_raise(st);
  PyObject *cap = wrap(ar, 0);
  if (!cap) return NULL;
  return Py_BuildValue("(Ny#)", cap, handle, (Py_ssize_t)sizeof handle);
}

/* cuda_ar_connect(capsule, handles: bytes of world_size * 64) */
static PyObject *py_cuda_ar_connect(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *cap;
  const char *handles;
  Py_ssize_t len;
  if (!PyArg_ParseTuple(args, "Oy#", &cap, &handles, &len)) return NULL;
  holder_t *h = live(cap, CUDA_AR_CAPSULE);
  if (!h) return NULL;
  if (len <= 0 || len % LLMMEM_CUDA_IPC_HANDLE_BYTES != 0) {
    PyErr_Format(PyExc_ValueError, "cuda_ar_connect: handles must be world_size * %d bytes, got %zd",
                 LLMMEM_CUDA_IPC_HANDLE_BYTES, len);
    return NULL;
  }
  wait_ctx_t w; /* a close from another thread meanwhile waits for us (see holder_t) */
  begin_wait(&w, h);
  llmmem_status_t st = llmmem_cuda_ar_connect(h->comm, handles);
  end_wait(&w);
  if (st != LLMMEM_OK) return raise_after_wait(st);
  Py_RETURN_NONE;
}

/* cuda_ar_all_reduce(capsule, in_ptr, out_ptr, count, dtype, stream) -> None */
static PyObject *py_cuda_ar_all_reduce(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *cap, *in_obj, *out_obj, *count_obj, *dtype_obj, *stream_obj;
  if (!PyArg_ParseTuple(args, "OOOOOO", &cap, &in_obj, &out_obj, &count_obj, &dtype_obj, &stream_obj)) return NULL;
  uint64_t in_ptr, out_ptr, count, stream;
  int dtype;
  if (arg_u64(in_obj, "in_ptr", UINTPTR_MAX, &in_ptr) < 0 || arg_u64(out_obj, "out_ptr", UINTPTR_MAX, &out_ptr) < 0 ||
      arg_u64(count_obj, "count", SIZE_MAX, &count) < 0 || arg_int(dtype_obj, "dtype", &dtype) < 0 ||
      arg_u64(stream_obj, "stream", UINTPTR_MAX, &stream) < 0)
    return NULL;
  holder_t *h = live(cap, CUDA_AR_CAPSULE);
  if (!h) return NULL;
  llmmem_status_t st = llmmem_cuda_ar_all_reduce(h->comm, (const void *)(uintptr_t)in_ptr, (void *)(uintptr_t)out_ptr,
                                                 (size_t)count, (llmmem_comm_dtype_t)dtype, (void *)(uintptr_t)stream);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  Py_RETURN_NONE;
}

/* cuda_ar_check(capsule, stream) -> None; waits for the stream, raises if a kernel timed out */
static PyObject *py_cuda_ar_check(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *cap, *stream_obj;
  uint64_t stream;
  if (!PyArg_ParseTuple(args, "OO", &cap, &stream_obj) || arg_u64(stream_obj, "stream", UINTPTR_MAX, &stream) < 0)
    return NULL;
  holder_t *h = live(cap, CUDA_AR_CAPSULE);
  if (!h) return NULL;
  wait_ctx_t w; /* a close from another thread meanwhile waits for us (see holder_t) */
  begin_wait(&w, h);
  llmmem_status_t st = llmmem_cuda_ar_check(h->comm, (void *)(uintptr_t)stream);
  end_wait(&w);
  if (st != LLMMEM_OK) return raise_after_wait(st);
  Py_RETURN_NONE;
}

static PyObject *py_cuda_ar_close(PyObject *self, PyObject *cap) {
  (void)self;
  return close_capsule(cap, 0);
}

PyMethodDef llmmem_py_comm_methods[] = {
    {"shm_comm_open", py_shm_comm_open, METH_VARARGS,
     "shm_comm_open(name, rank, world_size, slot_bytes, timeout_s) -> communicator (joins /dev/shm/<name>)"},
    {"shm_comm_close", py_shm_comm_close, METH_O, "shm_comm_close(comm): unmap now (idempotent)"},
    {"shm_comm_set_timeout", py_shm_comm_set_timeout, METH_VARARGS, "shm_comm_set_timeout(comm, seconds)"},
    {"shm_comm_slot_bytes", py_shm_comm_slot_bytes, METH_O, "shm_comm_slot_bytes(comm) -> bytes per chunk"},
    {"shm_all_reduce", py_shm_all_reduce, METH_VARARGS, "shm_all_reduce(comm, in_ptr, out_ptr, count, dtype)"},
    {"shm_all_gather", py_shm_all_gather, METH_VARARGS, "shm_all_gather(comm, in_ptr, out_ptr, count, dtype)"},
    {"shm_reduce_scatter", py_shm_reduce_scatter, METH_VARARGS,
     "shm_reduce_scatter(comm, in_ptr, out_ptr, count, dtype): count = output elements"},
    {"cuda_ar_create", py_cuda_ar_create, METH_VARARGS,
     "cuda_ar_create(device, rank, world_size, max_bytes, timeout_s) -> (communicator, ipc_handle)"},
    {"cuda_ar_connect", py_cuda_ar_connect, METH_VARARGS, "cuda_ar_connect(comm, handles): all ranks' handles"},
    {"cuda_ar_all_reduce", py_cuda_ar_all_reduce, METH_VARARGS,
     "cuda_ar_all_reduce(comm, in_ptr, out_ptr, count, dtype, stream)"},
    {"cuda_ar_check", py_cuda_ar_check, METH_VARARGS, "cuda_ar_check(comm, stream): raise if a peer timed out"},
    {"cuda_ar_close", py_cuda_ar_close, METH_O, "cuda_ar_close(comm)"},
    {NULL, NULL, 0, NULL},
};
