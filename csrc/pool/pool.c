/*
 * pool.c — the public API of the caching pool: create/destroy, alloc/free, empty_cache.
 *
 * Everything runs under the pool's one mutex. Backend calls (cudaMalloc, event records) are made
 * with it held: they are rare on the hot path (a record per free on CUDA only). Blocks and their
 * events are in block.c, segments, chunks and growth in segment.c, the free-list index in tlsf.c,
 * statistics and snapshots in pool_query.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pool_internal.h"

/* How many pending events an allocation polls on its fast path: frees on one stream complete in
 * order, so the oldest few tell most of the story. */
#define POLL_ON_ALLOC 4

/* ---- public API ---------------------------------------------------------------------------- */

LLMMEM_API llmmem_status_t llmmem_pool_create(const llmmem_pool_backend_t *backend,
                                              const llmmem_pool_options_t *options, llmmem_pool_t **out) {
  if (out) *out = NULL;
  if (!backend) return LLMMEM_FAIL(LLMMEM_ERR_INVALID, "llmmem_pool_create: backend must not be NULL");
  llmmem_pool_options_t opt = {0, 0, 0};
  if (options) opt = *options;
  llmmem_status_t st = LLMMEM_OK;
  if (!out)
    st = LLMMEM_FAIL(LLMMEM_ERR_INVALID, "llmmem_pool_create: out must not be NULL");
  else if (!backend->reserve || !backend->release)
    st = LLMMEM_FAIL(LLMMEM_ERR_INVALID, "llmmem_pool_create: backend needs reserve and release");
  else if (!backend->event_record != !backend->event_done || !backend->event_record != !backend->event_wait ||
           !backend->event_record != !backend->event_release)
    st = LLMMEM_FAIL(LLMMEM_ERR_INVALID, "llmmem_pool_create: backend events must be all set or all NULL");
  else if (opt.max_size && opt.max_size < opt.initial_size)
    st = LLMMEM_FAIL(LLMMEM_ERR_INVALID, "max_size (%zu bytes) must be >= initial_size (%zu bytes)", opt.max_size,
                     opt.initial_size);
  else if (opt.initial_size > SIZE_MAX / 2 || opt.growth_size > SIZE_MAX / 2)
    st = LLMMEM_FAIL(LLMMEM_ERR_INVALID, "initial_size/growth_size too large");
  if (st != LLMMEM_OK) {
    if (backend->destroy) backend->destroy(backend->ctx);
    return st;
  }
  llmmem_pool_t *pool = calloc(1, sizeof *pool);
  if (!pool || _llmmem_ptrmap_init(&pool->live) != LLMMEM_OK) {
    free(pool);
    if (backend->destroy) backend->destroy(backend->ctx);
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_pool_create: no host memory for the pool");
  }
  pthread_mutex_init(&pool->lock, NULL);
  pool->backend = *backend;
  if (!pool->backend.name) pool->backend.name = "custom";
  opt.initial_size = _llmmem_round_up(opt.initial_size, LLMMEM_POOL_GRANULARITY);
  opt.growth_size = _llmmem_round_up(opt.growth_size, LLMMEM_POOL_GRANULARITY);
  pool->options = opt;
  pool->st.initial_size = opt.initial_size;
  pool->st.max_size = opt.max_size;
  if (pool->backend.configure) pool->backend.configure(pool->backend.ctx, &pool->options);
  if (opt.initial_size) {
    st = _llmmem_add_segment(pool, opt.initial_size, 1);
    if (st != LLMMEM_OK) {
      char detail[256];
      snprintf(detail, sizeof detail, "%s", llmmem_last_error());
      (void)llmmem_pool_destroy(pool);
      return LLMMEM_FAIL(st, "could not reserve initial_size %zu bytes of %s memory: %s", opt.initial_size,
                         backend->name ? backend->name : "custom", detail);
    }
  }
  *out = pool;
  return LLMMEM_OK;
}

/* Tears down a pool whose caller set `closing` under the lock, with no block allocated. Only
 * that caller may run it: whoever sees the last block come back and claims `closing` in the
 * same critical section owns the destroy, so no second thread can reach a freed pool. */
static void destroy_claimed(llmmem_pool_t *pool) {
  /* PyTorch may be inside a slot call on another thread: unbind, and wait for it to leave. */
  _llmmem_slots_forget(pool);
  /* Memory may still be read by queued work on a stream: wait before handing it back. */
  for (pool_block_t *b = pool->pending_head; b; b = b->pend_next)
    (void)pool->backend.event_wait(pool->backend.ctx, b->event);
  while (pool->pending_head) _llmmem_block_clear_event(pool, pool->pending_head);
  for (pool_region_t *c = pool->chunks, *next; c; c = next) {
    next = c->next;
    free(c);
  }
  for (pool_region_t *r = pool->segments, *next; r; r = next) {
    next = r->next;
    pool->backend.release(pool->backend.ctx, (void *)r->base, r->size);
    free(r->decommitted);
    free(r);
  }
  for (pool_slab_t *s = pool->slabs, *next; s; s = next) {
    next = s->next;
    free(s);
  }
  _llmmem_ptrmap_free(&pool->live);
  if (pool->backend.destroy) pool->backend.destroy(pool->backend.ctx);
  pthread_mutex_destroy(&pool->lock);
  free(pool);
}

LLMMEM_API llmmem_status_t llmmem_pool_destroy(llmmem_pool_t *pool) {
  LLMMEM_CHECK_ARG(pool != NULL, "llmmem_pool_destroy: pool must not be NULL");
  pthread_mutex_lock(&pool->lock);
  if (pool->closing) {
    pthread_mutex_unlock(&pool->lock);
    return LLMMEM_FAIL(LLMMEM_ERR_STATE, "llmmem_pool_destroy: the pool is already being destroyed");
  }
  if (pool->st.allocations.current > 0) {
    int64_t n = pool->st.allocations.current;
    pthread_mutex_unlock(&pool->lock);
    return LLMMEM_FAIL(LLMMEM_ERR_STATE, "llmmem_pool_destroy: %lld blocks are still allocated", (long long)n);
  }
  /* Checked with the count under one lock: no allocation can slip in between. */
  pool->closing = 1;
  pthread_mutex_unlock(&pool->lock);
  destroy_claimed(pool);
  return LLMMEM_OK;
}

LLMMEM_API void llmmem_pool_release_when_empty(llmmem_pool_t *pool) {
  if (!pool) return;
  pthread_mutex_lock(&pool->lock);
  pool->release_when_empty = 1;
  /* Claimed here, not in a later llmmem_pool_destroy: a slot call could otherwise allocate and
   * free a block in between, destroy the pool from its free, and leave this thread a freed pool. */
  int now = pool->st.allocations.current == 0 && !pool->closing;
  if (now) pool->closing = 1;
  pthread_mutex_unlock(&pool->lock);
  if (now) destroy_claimed(pool);
}

LLMMEM_API llmmem_status_t llmmem_pool_alloc(llmmem_pool_t *pool, size_t size, void *stream, void **out) {
  LLMMEM_CHECK_ARG(out != NULL, "llmmem_pool_alloc: out must not be NULL");
  *out = NULL;
  LLMMEM_CHECK_ARG(pool != NULL, "llmmem_pool_alloc: pool must not be NULL");
  LLMMEM_CHECK_ARG(size > 0, "llmmem_pool_alloc: size must be > 0 bytes");
  LLMMEM_CHECK_ARG(stream != POOL_ANY_STREAM, "llmmem_pool_alloc: stream %p is reserved", stream);
  if (size > SIZE_MAX / 2) {
    pthread_mutex_lock(&pool->lock);
    pool->st.num_ooms++;
    pthread_mutex_unlock(&pool->lock);
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "cannot allocate %zu bytes: larger than any address space", size);
  }
  size_t rsize = _llmmem_round_up(size, LLMMEM_POOL_GRANULARITY);
  pthread_mutex_lock(&pool->lock);
  if (pool->closing) {
    pthread_mutex_unlock(&pool->lock);
    return LLMMEM_FAIL(LLMMEM_ERR_STATE, "llmmem_pool_alloc: the pool is being closed");
  }
  pool_block_t *rest = _llmmem_block_new(pool);
  if (!rest) {
    pthread_mutex_unlock(&pool->lock);
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "pool: no host memory for block metadata");
  }
  if (pool->pending_head) _llmmem_poll_events(pool, POLL_ON_ALLOC);
  pool_block_t *b = NULL;
  llmmem_status_t why = LLMMEM_OK;
  if (rsize <= LLMMEM_POOL_SMALL_MAX) {
    b = _llmmem_heap_find(pool, &pool->small, rsize, stream, POOL_SCAN_LIMIT);
    if (!b && pool->pending_head) {
      _llmmem_poll_events(pool, 0);
      b = _llmmem_heap_find(pool, &pool->small, rsize, stream, 0);
    }
    if (b) {
      _llmmem_heap_remove(&pool->small, b);
      if (_llmmem_region_empty(b->region)) pool->empty_chunks--;
    } else {
      /* A large-heap remnant smaller than a chunk (the tail of a segment, say) cannot split any big
       * range, so it serves small requests before a new chunk is carved. */
      b = _llmmem_heap_find(pool, &pool->large, rsize, stream, POOL_SCAN_LIMIT);
      if (b && b->size < LLMMEM_POOL_CHUNK_SIZE)
        _llmmem_heap_remove(&pool->large, b);
      else
        b = _llmmem_new_chunk(pool); /* NULL: no room for 2 MiB; the large heap may still fit this request */
    }
  }
  if (!b) b = _llmmem_large_take(pool, rsize, stream, &why);
  if (!b) {
    pool->st.num_ooms++;
    _llmmem_block_recycle(pool, rest);
    size_t reserved = (size_t)pool->st.reserved_bytes.current, allocated = (size_t)pool->st.allocated_bytes.current;
    size_t max = pool->options.max_size, largest = _llmmem_largest_free(pool);
    int64_t segments = pool->st.segments.current;
    char detail[256];
    snprintf(detail, sizeof detail, "%s", llmmem_last_error());
    pthread_mutex_unlock(&pool->lock);
    if (why != LLMMEM_ERR_NOMEM && why != LLMMEM_OK) return LLMMEM_FAIL(why, "allocating %zu bytes: %s", size, detail);
    char cap[64];
    if (max)
      snprintf(cap, sizeof cap, "max_size %zu", max);
    else
      snprintf(cap, sizeof cap, "no max_size");
    /* The pool's summary in one line: what the OOM report of any caller (install_allocator's
     * exception, use_pool's torch.OutOfMemoryError, MemoryPool.empty) carries. */
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM,
                       "out of memory allocating %zu bytes (%zu rounded): %zu bytes allocated, %zu reserved "
                       "(%zu free, largest free block %zu) in %lld segments, %s; %s",
                       size, rsize, allocated, reserved, reserved - allocated, largest, (long long)segments, cap,
                       detail);
  }
  if (b->size - rsize >= LLMMEM_POOL_GRANULARITY) {
    _llmmem_split(pool, b, rsize, rest);
  } else {
    _llmmem_split(pool, b, b->size, NULL);
    _llmmem_block_recycle(pool, rest);
  }
  if (!b->small && b->region->decommitted_pages) {
    llmmem_status_t cst = _llmmem_commit_block(pool, b);
    if (cst != LLMMEM_OK) {
      pool->st.num_ooms++;
      _llmmem_put_back(pool, b);
      pthread_mutex_unlock(&pool->lock);
      return cst;
    }
  }
  if (_llmmem_ptrmap_put(&pool->live, b->addr, b) != LLMMEM_OK) {
    b->is_free = 1;
    _llmmem_put_back(pool, b);
    pthread_mutex_unlock(&pool->lock);
    return LLMMEM_ERR_NOMEM;
  }
  b->is_free = 0;
  b->requested = size;
  b->stream = stream;
  _llmmem_stat_add(&pool->st.allocated_bytes, (int64_t)b->size);
  _llmmem_stat_add(&pool->st.requested_bytes, (int64_t)size);
  _llmmem_stat_add(&pool->st.allocations, 1);
  pool->st.num_allocs++;
  _llmmem_update_active(pool);
  *out = (void *)b->addr;
  pthread_mutex_unlock(&pool->lock);
  return LLMMEM_OK;
}

static llmmem_status_t bad_free(llmmem_pool_t *pool, void *ptr) {
  pool->st.num_invalid_frees++;
  uintptr_t p = (uintptr_t)ptr;
  for (pool_region_t *r = pool->segments; r; r = r->next)
    if (p >= r->base && p < r->base + r->size)
      return LLMMEM_FAIL(LLMMEM_ERR_INVALID,
                         "free of %p: inside this pool but not a live block (double free, or a pointer into a block)",
                         ptr);
  return LLMMEM_FAIL(LLMMEM_ERR_INVALID, "free of %p: not allocated by this pool", ptr);
}

LLMMEM_API llmmem_status_t llmmem_pool_free(llmmem_pool_t *pool, void *ptr, void *stream) {
  LLMMEM_CHECK_ARG(pool != NULL, "llmmem_pool_free: pool must not be NULL");
  if (!ptr) return LLMMEM_OK; /* like free(NULL) */
  pthread_mutex_lock(&pool->lock);
  pool_block_t *b = _llmmem_ptrmap_take(&pool->live, (uintptr_t)ptr);
  if (!b) {
    llmmem_status_t st = bad_free(pool, ptr);
    pthread_mutex_unlock(&pool->lock);
    return st;
  }
  pool_event_t ev = {NULL, stream, 0};
  if (pool->backend.event_record) {
    llmmem_status_t st = pool->backend.event_record(pool->backend.ctx, stream, &ev.event);
    if (st != LLMMEM_OK) {
      /* Without an event the memory cannot be safely reused: keep it allocated, say so. */
      (void)_llmmem_ptrmap_put(&pool->live, b->addr, b);
      pthread_mutex_unlock(&pool->lock);
      return st;
    }
    ev.seq = ++pool->event_seq;
  }
  _llmmem_stat_add(&pool->st.allocated_bytes, -(int64_t)b->size);
  _llmmem_stat_add(&pool->st.requested_bytes, -(int64_t)b->requested);
  _llmmem_stat_add(&pool->st.allocations, -1);
  pool->st.num_frees++;
  b->is_free = 1;
  b->requested = 0;
  b->stream = NULL;
  _llmmem_attach_event(pool, b, ev);
  _llmmem_put_back(pool, b);
  _llmmem_update_active(pool);
  int destroy = pool->release_when_empty && pool->st.allocations.current == 0 && !pool->closing;
  if (destroy) pool->closing = 1; /* claimed under the lock that saw the count reach 0 */
  pthread_mutex_unlock(&pool->lock);
  if (destroy) destroy_claimed(pool);
  return LLMMEM_OK;
}

LLMMEM_API llmmem_status_t llmmem_pool_block_size(llmmem_pool_t *pool, const void *ptr, size_t *requested) {
  LLMMEM_CHECK_ARG(pool != NULL && requested != NULL, "llmmem_pool_block_size: pool and requested must not be NULL");
  pthread_mutex_lock(&pool->lock);
  pool_block_t *b = _llmmem_ptrmap_get(&pool->live, (uintptr_t)ptr);
  *requested = b ? b->requested : 0;
  pthread_mutex_unlock(&pool->lock);
  if (!b) return LLMMEM_FAIL(LLMMEM_ERR_INVALID, "%p is not a live block of this pool", ptr);
  return LLMMEM_OK;
}

LLMMEM_API llmmem_status_t llmmem_pool_empty_cache(llmmem_pool_t *pool, size_t *released) {
  LLMMEM_CHECK_ARG(pool != NULL, "llmmem_pool_empty_cache: pool must not be NULL");
  if (released) *released = 0;
  pthread_mutex_lock(&pool->lock);
  llmmem_status_t st = _llmmem_wait_all_events(pool);
  _llmmem_release_empty_chunks(pool);
  size_t total = 0;
  for (pool_region_t *r = pool->segments, *next; r; r = next) {
    next = r->next;
    if (_llmmem_segment_releasable(r)) {
      total += _llmmem_release_segment(pool, r);
    } else {
      total += _llmmem_shrink_segment(pool, r);
    }
  }
  pthread_mutex_unlock(&pool->lock);
  if (released) *released = total;
  return st;
}

LLMMEM_API llmmem_status_t llmmem_pool_device(llmmem_pool_t *pool, const char **name, int *device) {
  LLMMEM_CHECK_ARG(pool != NULL, "llmmem_pool_device: pool must not be NULL");
  if (name) *name = pool->backend.name;
  if (device) *device = pool->backend.device;
  return LLMMEM_OK;
}
