/*
 * unscale_pipe.c — the CPU unscale + check over a tensor list the caller is still writing
 * (llmmem_scaler_pipe_*): worker threads claim published work while the caller describes more.
 *
 * Why: on a list of thousands of small gradients, finding them (the Python binding reads each
 * gradient's attributes, several cache misses each) costs about as much as unscaling them. Done
 * one after the other the two costs add up; here they overlap, and the caller joins the workers
 * for what is left when it is done describing.
 *
 * Work is claimed under one mutex in pieces of about CLAIM_BYTES: several whole small tensors, or
 * a slice of a large one (slices start on multiples of 64 elements so vector loops stay aligned),
 * so a 400 MB embedding is shared by all threads rather than left to one. A claim costs one
 * uncontended lock, about as long as checking a few hundred bytes; a piece is tens of KiB.
 *
 * What it does not do: strided tensors, or any allocation besides the pipe and thread stacks.
 */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include <llmmem/amp.h>

#include "addr_set.h"
#include "internal.h"
#include "scaler_internal.h"

#define CLAIM_BYTES ((size_t)64 << 10) /* small tensors are claimed together up to this */
#define SLICE_BYTES ((size_t)1 << 20)  /* a large tensor is claimed in slices of this */
/* The first worker starts once this much is published: below it, starting a thread (tens of
 * microseconds) costs more than the caller unscaling it all in finish. Each further worker waits
 * for MORE_BYTES more, as llmmem_scaler_unscale_check spreads threads (a few MiB each), so a long
 * list of small gradients does not start a thread per CPU for a few MiB. */
#define START_BYTES ((size_t)512 << 10)
#define MORE_BYTES  ((size_t)3 << 20)
#define MAX_WORKERS 63

struct llmmem_scaler_pipe_s {
  const llmmem_scaler_tensor_t *tensors;
  size_t capacity;
  uint8_t *flags; /* slices of one tensor may run on two threads: see _llmmem_scaler_run_span */
  size_t n_flags;
  float inv;
  int write;
  _llmmem_scaler_range_fn run;

  /* guards the cursor, published and closed; next_tensor, published and closed are also read
   * without it (atomic loads) by waiting workers, and so written with atomic stores */
  pthread_mutex_t lock;
  size_t next_tensor; /* cursor: the first element not yet claimed */
  int64_t next_offset;
  size_t published; /* tensors [0, published) may be claimed */
  int closed;       /* no more will be published: workers leave when nothing is left */
  int found;        /* any claimed piece held inf/NaN */

  size_t published_bytes; /* the publisher's own count, to decide when to start the workers */
  size_t want_workers, n_workers;
  size_t team_size, team_members; /* _llmmem_scaler_pipe_drain_on_team: how many join, joined so far */
  _llmmem_addr_set_t seen;        /* data pointers published so far, to refuse a second listing */
  pthread_t workers[MAX_WORKERS];
};

typedef _llmmem_scaler_pos_t pos_t;

/* Claims the next piece [*from, *to) of published work under the lock; 0 when none is published
 * now. A piece is whole tensors up to CLAIM_BYTES, or one slice of at most SLICE_BYTES of a tensor
 * larger than what is left of CLAIM_BYTES. */
static int claim(llmmem_scaler_pipe_t *p, pos_t *from, pos_t *to) {
  if (p->next_tensor >= p->published) return 0;
  *from = (pos_t){p->next_tensor, p->next_offset};
  size_t bytes = 0;
  while (p->next_tensor < p->published && bytes < CLAIM_BYTES) {
    const llmmem_scaler_tensor_t *t = &p->tensors[p->next_tensor];
    size_t es = llmmem_scaler_dtype_size(t->dtype);
    int64_t left = t->numel - p->next_offset;
    if ((uint64_t)left <= (CLAIM_BYTES - bytes) / es) {
      bytes += (size_t)left * es;
      __atomic_store_n(&p->next_tensor, p->next_tensor + 1, __ATOMIC_RELAXED);
      p->next_offset = 0;
      continue;
    }
    if (bytes > 0) break;                       /* leave the large tensor to the next claim, sliced from its start */
    int64_t take = (int64_t)(SLICE_BYTES / es); /* a multiple of 64 elements: vector loops stay aligned */
    if (take >= left) {
      __atomic_store_n(&p->next_tensor, p->next_tensor + 1, __ATOMIC_RELAXED);
      p->next_offset = 0;
    } else {
      p->next_offset += take;
    }
    break;
  }
  *to = (pos_t){p->next_tensor, p->next_offset};
  return 1;
}

/* A hint, read without the lock: nothing is published beyond the cursor and more may come. */
static int nothing_new(llmmem_scaler_pipe_t *p) {
  return __atomic_load_n(&p->published, __ATOMIC_RELAXED) <= __atomic_load_n(&p->next_tensor, __ATOMIC_RELAXED) &&
         !__atomic_load_n(&p->closed, __ATOMIC_RELAXED);
}

/* Works until the pipe is closed and drained (the caller: until nothing is published). Waits for
 * the publisher by spinning briefly, then yielding, then sleeping: the publisher may be held up
 * (a Python attribute read can run Python code), and a waiting worker must not take its core. */
static void work(llmmem_scaler_pipe_t *p, int is_caller) {
  int found = 0;
  unsigned idle = 0;
  for (;;) {
    /* A waiting worker looks without the lock first, so as not to take it from the publisher. */
    if (is_caller || idle == 0 || !nothing_new(p)) {
      pos_t from, to;
      pthread_mutex_lock(&p->lock);
      int got = claim(p, &from, &to);
      int done = !got && p->closed;
      pthread_mutex_unlock(&p->lock);
      if (got) {
        found |= _llmmem_scaler_run_span(p->tensors, from, to, p->inv, p->write, p->flags, p->run);
        idle = 0;
        continue;
      }
      if (done || is_caller) break;
    }
    if (++idle < 64) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else if (idle < 4096) {
      sched_yield();
    } else {
      struct timespec nap = {0, 50 * 1000};
      nanosleep(&nap, NULL);
    }
  }
  if (found) {
    pthread_mutex_lock(&p->lock);
    p->found = 1;
    pthread_mutex_unlock(&p->lock);
  }
}

static void *worker_main(void *arg) {
  work((llmmem_scaler_pipe_t *)arg, 0);
  return NULL;
}

static void team_member(void *arg) {
  llmmem_scaler_pipe_t *p = arg;
  /* the team has the runtime's size; members beyond the wanted count leave at once */
  if (__atomic_fetch_add(&p->team_members, 1, __ATOMIC_RELAXED) >= p->team_size) return;
  work(p, 1); /* everything is published: claim until nothing is left */
}

int _llmmem_scaler_pipe_drain_on_team(llmmem_scaler_pipe_t *p, size_t threads) {
  p->team_size = threads;
  return _llmmem_omp_team_run(team_member, p);
}

LLMMEM_API llmmem_status_t llmmem_scaler_cpu_workers(int *uses_openmp) {
  LLMMEM_CHECK_ARG(uses_openmp != NULL, "llmmem_scaler_cpu_workers: uses_openmp must not be NULL");
  *uses_openmp = _llmmem_omp_team_usable();
  return LLMMEM_OK;
}

LLMMEM_API llmmem_status_t llmmem_scaler_pipe_start(const llmmem_scaler_tensor_t *tensors, size_t capacity,
                                                    const float *scale, int scale_is_inverse, uint8_t *tensor_flags,
                                                    size_t n_flags, int workers, llmmem_scaler_pipe_t **out) {
  LLMMEM_CHECK_ARG(out != NULL, "llmmem_scaler_pipe_start: out must not be NULL");
  *out = NULL;
  LLMMEM_CHECK_ARG(tensors != NULL || capacity == 0, "llmmem_scaler_pipe_start: tensors is NULL but capacity is %zu",
                   capacity);
  LLMMEM_CHECK_ARG(workers >= 0, "llmmem_scaler_pipe_start: workers must be >= 0, got %d", workers);
  float inv;
  LLMMEM_TRY(_llmmem_scaler_resolve_inv(scale, scale_is_inverse, &inv));
  llmmem_scaler_pipe_t *p = calloc(1, sizeof *p);
  if (!p) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_scaler_pipe_start: no memory for the pipe");
  p->tensors = tensors;
  p->capacity = capacity;
  p->flags = tensor_flags;
  p->n_flags = n_flags;
  p->inv = inv;
  p->write = inv != 1.0f; /* torch leaves values untouched when inv_scale == 1 */
  p->run = _llmmem_scaler_pick_range_fn();
  if (pthread_mutex_init(&p->lock, NULL) != 0) {
    free(p);
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_scaler_pipe_start: pthread_mutex_init failed");
  }
  /* the caller works too: more workers than the other CPUs would only take turns with it */
  size_t others = (size_t)_llmmem_online_cpus() - 1;
  size_t want = (size_t)workers < others ? (size_t)workers : others;
  p->want_workers = want < MAX_WORKERS ? want : MAX_WORKERS;
  if (_llmmem_addr_set_init(&p->seen, capacity) != 0) {
    pthread_mutex_destroy(&p->lock);
    free(p);
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_scaler_pipe_start: no memory for %zu addresses", capacity);
  }
  *out = p;
  return LLMMEM_OK;
}

void _llmmem_scaler_pipe_publish_checked(llmmem_scaler_pipe_t *p, size_t count, size_t *published) {
  size_t upto = p->published, bytes = 0; /* up to a repeat, if any, and the bytes before it */
  for (; upto < count && _llmmem_addr_set_add(&p->seen, p->tensors[upto].data); upto++)
    bytes += (size_t)p->tensors[upto].numel * llmmem_scaler_dtype_size(p->tensors[upto].dtype);
  pthread_mutex_lock(&p->lock);
  __atomic_store_n(&p->published, upto, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&p->lock);
  if (published) *published = upto;
  p->published_bytes += bytes;
  while (p->n_workers < p->want_workers && p->published_bytes >= START_BYTES + p->n_workers * MORE_BYTES) {
    if (pthread_create(&p->workers[p->n_workers], NULL, worker_main, p) != 0) {
      p->want_workers = p->n_workers; /* fewer is fine */
      break;
    }
    p->n_workers++;
  }
}

LLMMEM_API llmmem_status_t llmmem_scaler_pipe_publish(llmmem_scaler_pipe_t *p, size_t count, size_t *published) {
  LLMMEM_CHECK_ARG(p != NULL, "llmmem_scaler_pipe_publish: pipe must not be NULL");
  /* Only the publishing thread changes `published`, so reading it unlocked here is exact. */
  size_t have = p->published;
  if (published) *published = have;
  LLMMEM_CHECK_ARG(!p->closed, "llmmem_scaler_pipe_publish: the pipe is finished");
  LLMMEM_CHECK_ARG(count >= have && count <= p->capacity,
                   "llmmem_scaler_pipe_publish: count %zu must be in [%zu, capacity %zu]", count, have, p->capacity);
  if (count == have) return LLMMEM_OK;
  float unused = 0.0f;
  size_t checked_bytes;
  LLMMEM_TRY(_llmmem_scaler_check_tensors("llmmem_scaler_pipe_publish", p->tensors + have, count - have, &unused,
                                          p->flags, p->n_flags, &checked_bytes));
  _llmmem_scaler_pipe_publish_checked(p, count, published);
  return LLMMEM_OK;
}

LLMMEM_API llmmem_status_t llmmem_scaler_pipe_finish(llmmem_scaler_pipe_t *p, float *found_inf) {
  LLMMEM_CHECK_ARG(p != NULL, "llmmem_scaler_pipe_finish: pipe must not be NULL");
  pthread_mutex_lock(&p->lock);
  __atomic_store_n(&p->closed, 1, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&p->lock);
  work(p, 1);
  for (size_t k = 0; k < p->n_workers; k++) pthread_join(p->workers[k], NULL);
  int found = p->found;
  pthread_mutex_destroy(&p->lock);
  _llmmem_addr_set_free(&p->seen);
  free(p);
  /* Checked last: the published work must complete whatever the caller passes. */
  LLMMEM_CHECK_ARG(found_inf != NULL,
                   "llmmem_scaler_pipe_finish: found_inf must not be NULL (the pipe was "
                   "finished and freed)");
  if (found) *found_inf = 1.0f;
  return LLMMEM_OK;
}
