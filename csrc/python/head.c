/*
 * head.c — the Python binding of csrc/head/ (called by llmmem/head/kernels.py): the two passes of
 * the fused LM head over a chunk of logits, on the CPU (the GIL released) or queued on a CUDA
 * stream. Addresses arrive as ints; argument errors raise llmmem.InvalidArgumentError naming the
 * argument (a label outside the vocabulary names its row).
 *
 * PRIVATE AND UNSAFE: the functions take raw addresses and trust them; llmmem/head/kernels.py,
 * the only supported caller, checks every tensor first.
 */
#include "binding.h" /* first: Python.h must precede the system headers */

#include <llmmem/head.h>

typedef long long ll;

/* head_stats(logits, labels, rows, vocab, ld, vocab_start, vocab_total, ignore_index, label_smoothing, softcap,
 *            dtype, max, sum, target, zsum, has_target, num_threads, device=-1, stream=0, bad_labels=0) */
static PyObject *py_head_stats(PyObject *self, PyObject *args) {
  (void)self;
  llmmem_head_chunk_t c;
  unsigned long long logits, labels, mx, sum, target, zsum, has, stream = 0, bad = 0;
  ll rows, vocab, ld, start, total, ignore;
  int num_threads, device = -1;
  if (!PyArg_ParseTuple(args, "KKLLLLLLffiKKKKKi|iKK", &logits, &labels, &rows, &vocab, &ld, &start, &total, &ignore,
                        &c.label_smoothing, &c.softcap, &c.dtype, &mx, &sum, &target, &zsum, &has, &num_threads,
                        &device, &stream, &bad))
    return NULL;
  c.logits = (void *)(uintptr_t)logits;
  c.labels = (const int64_t *)(uintptr_t)labels;
  c.rows = rows, c.vocab = vocab, c.ld = ld, c.vocab_start = start, c.vocab_total = total, c.ignore_index = ignore;
  llmmem_status_t st;
  if (device >= 0) {
    st = llmmem_head_stats_cuda(&c, (float *)(uintptr_t)mx, (float *)(uintptr_t)sum, (float *)(uintptr_t)target,
                                (float *)(uintptr_t)zsum, (uint8_t *)(uintptr_t)has, (int32_t *)(uintptr_t)bad, device,
                                (void *)(uintptr_t)stream);
  } else {
    Py_BEGIN_ALLOW_THREADS st =
        llmmem_head_stats(&c, (float *)(uintptr_t)mx, (float *)(uintptr_t)sum, (float *)(uintptr_t)target,
                          (float *)(uintptr_t)zsum, (uint8_t *)(uintptr_t)has, num_threads);
    Py_END_ALLOW_THREADS
  }
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  Py_RETURN_NONE;
}

/* head_grad(logits, labels, rows, vocab, ld, vocab_start, vocab_total, ignore_index, label_smoothing, softcap,
 *           dtype, lse, scale, num_threads, device=-1, stream=0) */
static PyObject *py_head_grad(PyObject *self, PyObject *args) {
  (void)self;
  llmmem_head_chunk_t c;
  unsigned long long logits, labels, lse, scale, stream = 0;
  ll rows, vocab, ld, start, total, ignore;
  int num_threads, device = -1;
  if (!PyArg_ParseTuple(args, "KKLLLLLLffiKKi|iK", &logits, &labels, &rows, &vocab, &ld, &start, &total, &ignore,
                        &c.label_smoothing, &c.softcap, &c.dtype, &lse, &scale, &num_threads, &device, &stream))
    return NULL;
  c.logits = (void *)(uintptr_t)logits;
  c.labels = (const int64_t *)(uintptr_t)labels;
  c.rows = rows, c.vocab = vocab, c.ld = ld, c.vocab_start = start, c.vocab_total = total, c.ignore_index = ignore;
  llmmem_status_t st;
  if (device >= 0) {
    st = llmmem_head_grad_cuda(&c, (const float *)(uintptr_t)lse, (const float *)(uintptr_t)scale, device,
                               (void *)(uintptr_t)stream);
  } else {
    Py_BEGIN_ALLOW_THREADS st =
        llmmem_head_grad(&c, (const float *)(uintptr_t)lse, (const float *)(uintptr_t)scale, num_threads);
    Py_END_ALLOW_THREADS
  }
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  Py_RETURN_NONE;
}

PyMethodDef llmmem_py_head_methods[] = {
    {"head_stats", py_head_stats, METH_VARARGS,
     "head_stats(logits, labels, rows, vocab, ld, vocab_start, vocab_total, ignore_index, label_smoothing, softcap, "
     "dtype, max, sum, target, zsum, has_target, num_threads, device=-1, stream=0, bad_labels=0): pass 1 of the "
     "fused LM head over a chunk of logits (see csrc/include/llmmem/head.h). Private and unsafe: raw addresses; "
     "use llmmem.head."},
    {"head_grad", py_head_grad, METH_VARARGS,
     "head_grad(logits, labels, rows, vocab, ld, vocab_start, vocab_total, ignore_index, label_smoothing, softcap, "
     "dtype, lse, scale, num_threads, device=-1, stream=0): pass 2, the logits' gradient in place. Private and "
     "unsafe: raw addresses; use llmmem.head."},
    {NULL, NULL, 0, NULL},
};
