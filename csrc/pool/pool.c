/*
 * pool.c — the caching pool: create/destroy, alloc/free with splitting and immediate coalescing,
 * small-request chunks, growth up to max_size, stream-ordered reuse through backend events.
 *
 * Everything here runs under the pool's one mutex. Backend calls (cudaMalloc, event records)
 * are made with it held: they are rare on the hot path (a record per free on CUDA only).
 * Statistics and snapshots are in pool_query.c, the free-list index in tlsf.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pool_internal.h"

#define SLAB_BLOCKS 256
/* A stream value no caller passes: "usable by every stream", for memory that stops being tied to
 * the stream that asks for it (a new chunk of small blocks). */
#define ANY_STREAM ((void *)UINTPTR_MAX)
/* How many pending events an allocation polls on its fast path: frees on one stream complete in
 * order, so the oldest few tell most of the story. */
#define POLL_ON_ALLOC 4

/* ---- block metadata ------------------------------------------------------------------------ */

static pool_block_t *block_new(llmmem_pool_t *pool) {
  if (!pool->spare_blocks) {
    pool_slab_t *slab = malloc(sizeof(pool_slab_t) + SLAB_BLOCKS * sizeof(pool_block_t));
    if (!slab) return NULL;
    slab->next = pool->slabs;
    pool->slabs = slab;
    for (int i = 0; i < SLAB_BLOCKS; i++) {
      slab->blocks[i].free_next = pool->spare_blocks;
      pool->spare_blocks = &slab->blocks[i];
    }
  }
  pool_block_t *b = pool->spare_blocks;
  pool->spare_blocks = b->free_next;
  memset(b, 0, sizeof *b);
  return b;
}

static void block_recycle(llmmem_pool_t *pool, pool_block_t *b) {
  b->free_next = pool->spare_blocks;
  pool->spare_blocks = b;
}

static inline pool_heap_t *heap_of(llmmem_pool_t *pool, const pool_block_t *b) {
  return b->small ? &pool->small : &pool->large;
}

static void update_active(llmmem_pool_t *pool) {
  int64_t active = pool->st.allocated_bytes.current + (int64_t)pool->pending_bytes;
  pool->st.active_bytes.current = active;
  if (active > pool->st.active_bytes.peak) pool->st.active_bytes.peak = active;
}

/* ---- events of free blocks ------------------------------------------------------------------ */

typedef struct {
  void *event;
  void *stream;
  uint64_t seq;
} pool_event_t;

static void attach_event(llmmem_pool_t *pool, pool_block_t *b, pool_event_t ev) {
  if (!ev.event) return;
  b->event = ev.event;
  b->stream = ev.stream;
  b->event_seq = ev.seq;
  b->pend_next = NULL;
  b->pend_prev = pool->pending_tail;
  if (pool->pending_tail) pool->pending_tail->pend_next = b;
  else pool->pending_head = b;
  pool->pending_tail = b;
  pool->pending_bytes += b->size;
}

/* Takes the event off `b` without releasing it. */
static pool_event_t detach_event(llmmem_pool_t *pool, pool_block_t *b) {
  pool_event_t ev = {b->event, b->stream, b->event_seq};
  if (!b->event) return ev;
  if (b->pend_prev) b->pend_prev->pend_next = b->pend_next;
  else pool->pending_head = b->pend_next;
  if (b->pend_next) b->pend_next->pend_prev = b->pend_prev;
  else pool->pending_tail = b->pend_prev;
  b->pend_prev = b->pend_next = NULL;
  pool->pending_bytes -= b->size;
  b->event = NULL;
  return ev;
}

static void release_event(llmmem_pool_t *pool, pool_event_t ev) {
  if (ev.event) pool->backend.event_release(pool->backend.ctx, ev.event);
}

void _llmmem_block_clear_event(llmmem_pool_t *pool, pool_block_t *b) {
  release_event(pool, detach_event(pool, b));
  update_active(pool);
}

int _llmmem_block_usable(llmmem_pool_t *pool, pool_block_t *b, void *stream) {
  if (!b->event) return 1;
  if (b->stream == stream) return 1;  /* same stream: the queue orders our use after the free */
  /* A completed event is left in place: poll_events clears it and coalesces, which a search
   * must not do under the caller's feet. */
  return pool->backend.event_done(pool->backend.ctx, b->event) == 1;
}

/* ---- coalescing ---------------------------------------------------------------------------- */

/* Two free neighbours become one block when neither waits for an event, or both wait on the same
 * stream (the later event covers the earlier). A waiting block is not merged with a free one:
 * that would make the free one wait too; they merge once the event is seen complete. */
static int mergeable(const pool_block_t *a, const pool_block_t *n) {
  if (!n || !n->is_free) return 0;
  if (!a->event && !n->event) return 1;
  return a->event && n->event && a->stream == n->stream;
}

/* lo absorbs its successor hi (both free, neither in a heap). On one stream the later event
 * covers the earlier one. */
static pool_block_t *merge(llmmem_pool_t *pool, pool_block_t *lo, pool_block_t *hi) {
  pool_event_t a = detach_event(pool, lo), b = detach_event(pool, hi);
  pool_event_t keep = a, drop = b;
  if (!a.event || (b.event && b.seq > a.seq)) {
    keep = b;
    drop = a;
  }
  release_event(pool, drop);
  lo->size += hi->size;
  lo->next = hi->next;
  if (hi->next) hi->next->prev = lo;
  block_recycle(pool, hi);
  attach_event(pool, lo, keep);
  return lo;
}

/* Merges free block b (not in a heap) with its free neighbours; returns the result, not in a heap.
 * An event-less b only absorbs event-less neighbours, which are never in the pending list, so
 * poll_events can call this while walking that list. */
static pool_block_t *coalesce(llmmem_pool_t *pool, pool_block_t *b) {
  pool_block_t *n = b->next;
  if (mergeable(b, n)) {
    _llmmem_heap_remove(heap_of(pool, n), n);
    b = merge(pool, b, n);
  }
  pool_block_t *p = b->prev;
  if (mergeable(b, p)) {
    _llmmem_heap_remove(heap_of(pool, p), p);
    b = merge(pool, p, b);
  }
  update_active(pool);
  return b;
}

/* ---- regions ------------------------------------------------------------------------------- */

static void region_link(pool_region_t **list, pool_region_t *r) {
  r->prev = NULL;
  r->next = *list;
  if (*list) (*list)->prev = r;
  *list = r;
}

static void region_unlink(pool_region_t **list, pool_region_t *r) {
  if (r->prev) r->prev->next = r->next;
  else *list = r->next;
  if (r->next) r->next->prev = r->prev;
}

static int region_empty(const pool_region_t *r) { return r->first->is_free && r->first->size == r->size; }

static llmmem_status_t add_segment(llmmem_pool_t *pool, size_t bytes, int is_initial) {
  void *ptr = NULL;
  llmmem_status_t st = pool->backend.reserve(pool->backend.ctx, bytes, &ptr);
  if (st != LLMMEM_OK) return st;
  if (!ptr || ((uintptr_t)ptr & (LLMMEM_POOL_GRANULARITY - 1))) {
    if (ptr) pool->backend.release(pool->backend.ctx, ptr, bytes);
    return LLMMEM_FAIL(LLMMEM_ERR_INTERNAL, "pool: backend %s returned a region not aligned to 512 bytes",
                       pool->backend.name);
  }
  pool_region_t *r = calloc(1, sizeof *r);
  pool_block_t *b = block_new(pool);
  if (!r || !b) {
    free(r);
    if (b) block_recycle(pool, b);
    pool->backend.release(pool->backend.ctx, ptr, bytes);
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "pool: no host memory for segment metadata");
  }
  r->base = (uintptr_t)ptr;
  r->size = bytes;
  r->first = b;
  r->is_initial = (uint8_t)is_initial;
  region_link(&pool->segments, r);
  b->addr = r->base;
  b->size = bytes;
  b->region = r;
  b->is_free = 1;
  _llmmem_heap_insert(&pool->large, b);
  pool->st.num_backend_reserves++;
  _llmmem_stat_add(&pool->st.reserved_bytes, (int64_t)bytes);
  _llmmem_stat_add(&pool->st.segments, 1);
  return LLMMEM_OK;
}

/* Gives a fully free, event-free segment back to the backend. */
static void release_segment(llmmem_pool_t *pool, pool_region_t *r) {
  pool_block_t *b = r->first;
  _llmmem_heap_remove(&pool->large, b);
  _llmmem_block_clear_event(pool, b);
  block_recycle(pool, b);
  region_unlink(&pool->segments, r);
  pool->backend.release(pool->backend.ctx, (void *)r->base, r->size);
  pool->st.num_backend_releases++;
  _llmmem_stat_add(&pool->st.reserved_bytes, -(int64_t)r->size);
  _llmmem_stat_add(&pool->st.segments, -1);
  free(r);
}

/* Splits free block b (not in a heap) so that it is `size` bytes; the rest goes back to b's heap
 * with b's event, if any (b itself is about to be used on the stream that event belongs to). */
static void split(llmmem_pool_t *pool, pool_block_t *b, size_t size, pool_block_t *rest) {
  pool_event_t ev = detach_event(pool, b);
  if (rest) {
    rest->addr = b->addr + size;
    rest->size = b->size - size;
    rest->region = b->region;
    rest->small = b->small;
    rest->is_free = 1;
    rest->prev = b;
    rest->next = b->next;
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = size;
    attach_event(pool, rest, ev);
    _llmmem_heap_insert(heap_of(pool, rest), rest);
  } else {
    release_event(pool, ev);
  }
  update_active(pool);
}

/* Frees large block `lb` that backed chunk `c`; the chunk's single free block `sb` goes away and
 * its event (if any) moves to lb. Returns lb, merged with its neighbours and in the large heap. */
static void release_chunk(llmmem_pool_t *pool, pool_region_t *c) {
  pool_block_t *sb = c->first, *lb = c->backing;
  _llmmem_heap_remove(&pool->small, sb);
  pool_event_t ev = detach_event(pool, sb);
  block_recycle(pool, sb);
  region_unlink(&pool->chunks, c);
  free(c);
  pool->st.small_chunks--;
  lb->chunk = NULL;
  lb->is_free = 1;
  attach_event(pool, lb, ev);
  lb = coalesce(pool, lb);
  _llmmem_heap_insert(&pool->large, lb);
}

/* A whole chunk just became free (block m covers it, not in a heap): keep one such chunk for the
 * next small request, give any other back to the large heap. */
static void chunk_became_empty(llmmem_pool_t *pool, pool_block_t *m) {
  _llmmem_heap_insert(&pool->small, m);
  if (pool->empty_chunks >= 1) release_chunk(pool, m->region);
  else pool->empty_chunks++;
}

static void release_empty_chunks(llmmem_pool_t *pool) {
  pool_region_t *c = pool->chunks;
  while (c) {
    pool_region_t *next = c->next;
    if (region_empty(c)) {
      release_chunk(pool, c);
      pool->empty_chunks--;
    }
    c = next;
  }
}

/* A block that just became free (not in a heap): merge it, file it, and handle a chunk that is
 * now entirely free. */
static void put_back(llmmem_pool_t *pool, pool_block_t *b) {
  pool_block_t *m = coalesce(pool, b);
  if (m->small && region_empty(m->region)) chunk_became_empty(pool, m);
  else _llmmem_heap_insert(heap_of(pool, m), m);
}

/* ---- events: polling and waiting ---------------------------------------------------------- */

/* Clears completed events, oldest first, and coalesces what they freed. max_checks 0 = all. */
static void poll_events(llmmem_pool_t *pool, int max_checks) {
  int checked = 0;
  pool_block_t *b = pool->pending_head;
  while (b && (max_checks == 0 || checked < max_checks)) {
    pool_block_t *next = b->pend_next;
    checked++;
    if (pool->backend.event_done(pool->backend.ctx, b->event) == 1) {
      int counted = b->small && region_empty(b->region);  /* an empty chunk already counted */
      _llmmem_heap_remove(heap_of(pool, b), b);
      _llmmem_block_clear_event(pool, b);
      pool_block_t *m = coalesce(pool, b);  /* event-less: `next` cannot be merged away */
      if (m->small && region_empty(m->region) && !counted) chunk_became_empty(pool, m);
      else _llmmem_heap_insert(heap_of(pool, m), m);
    }
    b = next;
  }
}

/* Waits for every outstanding event (the OOM path and empty_cache), then clears them. */
static llmmem_status_t wait_all_events(llmmem_pool_t *pool) {
  for (pool_block_t *b = pool->pending_head; b; b = b->pend_next) {
    LLMMEM_TRY(pool->backend.event_wait(pool->backend.ctx, b->event));
    pool->st.num_event_waits++;
  }
  poll_events(pool, 0);
  return LLMMEM_OK;
}

/* ---- growth -------------------------------------------------------------------------------- */

static llmmem_status_t grow(llmmem_pool_t *pool, size_t need) {
  size_t max = pool->options.max_size;
  size_t reserved = (size_t)pool->st.reserved_bytes.current;
  size_t seg = _llmmem_round_up(need, LLMMEM_POOL_CHUNK_SIZE);
  if (pool->options.growth_size > seg) seg = pool->options.growth_size;
  if (max) {
    size_t avail = max > reserved ? (max - reserved) / LLMMEM_POOL_GRANULARITY * LLMMEM_POOL_GRANULARITY : 0;
    if (avail < need)
      return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "max_size %zu bytes reached (%zu reserved, %zu more needed)", max,
                         reserved, need);
    if (seg > avail) seg = avail;
  }
  llmmem_status_t st = add_segment(pool, seg, 0);
  if (st == LLMMEM_ERR_NOMEM && seg > need) st = add_segment(pool, need, 0);  /* no slack then */
  return st;
}

#define POOL_MID_REQUEST ((size_t)10 << 20) /* bytes: below this, a segment may hold several requests */
#define POOL_MAX_GROUP 4
#define POOL_MAX_GROUP_SEGMENT ((size_t)20 << 20) /* bytes: PyTorch's segment for mid-size requests */

/* The segment to reserve for a request of `need` bytes that does not fit anywhere: a multiple of
 * 2 MiB (the granularity cudaMalloc maps anyway). A mid-size request gets room for up to
 * POOL_MAX_GROUP requests of its size (at most 20 MiB) when that cuts the rounding waste — 2.25 MiB
 * alone wastes 44% of a 4 MiB segment, four of them 10% of 10 MiB — since same-size requests come
 * in runs (one per layer); unused room stays one contiguous free block, usable by any request.
 * (The group size 4 was chosen on the GPT traces of benchmarks/traces; bench_pool reports it.) */
static size_t segment_for(size_t need) {
  size_t best = _llmmem_round_up(need, LLMMEM_POOL_CHUNK_SIZE);
  if (need >= POOL_MID_REQUEST || need <= LLMMEM_POOL_SMALL_MAX) return best;
  double best_waste = (double)(best - need) / (double)best;
  for (size_t n = 2; n <= POOL_MAX_GROUP; n++) {
    size_t seg = _llmmem_round_up(n * need, LLMMEM_POOL_CHUNK_SIZE);
    if (seg > POOL_MAX_GROUP_SEGMENT) break;
    double waste = (double)(seg - n * need) / (double)seg;
    if (waste + 0.02 < best_waste) {
      best = seg;
      best_waste = waste;
    }
  }
  return best;
}

/* Growth that does not strand memory: fully free growth segments are given back first and their
 * bytes re-reserved inside the one new segment, so free space that was scattered over segments
 * (which can never merge with each other) becomes contiguous; reserved memory grows only by what
 * the request adds. The release costs a backend free (cudaFree synchronizes the device), but only
 * on the growth path, which already pays for a cudaMalloc; a steady training loop never gets here. */
static llmmem_status_t grow_consolidating(llmmem_pool_t *pool, size_t need) {
  size_t freed = 0;
  release_empty_chunks(pool);
  for (pool_region_t *r = pool->segments, *next; r; r = next) {
    next = r->next;
    if (!r->is_initial && region_empty(r) && !r->first->event) {
      freed += r->size;
      release_segment(pool, r);
    }
  }
  size_t want = segment_for(need);
  if (freed > want) want = freed;
  if (want > need) {
    llmmem_status_t st = grow(pool, want);
    if (st != LLMMEM_ERR_NOMEM) return st;
  }
  return grow(pool, need);
}

/* A free large block of >= size usable on `stream`, removed from the heap, or NULL (OOM). */
static pool_block_t *large_take(llmmem_pool_t *pool, size_t size, void *stream, llmmem_status_t *why) {
  pool_block_t *b = _llmmem_heap_find(pool, &pool->large, size, stream, POOL_SCAN_LIMIT);
  if (!b && pool->pending_head) {
    poll_events(pool, 0);
    b = _llmmem_heap_find(pool, &pool->large, size, stream, 0);
  }
  if (!b) {
    *why = grow_consolidating(pool, size);
    if (*why == LLMMEM_OK) b = _llmmem_heap_find(pool, &pool->large, size, stream, 0);
  }
  if (!b && *why != LLMMEM_OK && *why != LLMMEM_ERR_NOMEM) return NULL;  /* a backend error, not OOM */
  if (!b) {
    /* Last resort, as PyTorch does: wait for other streams, return cached memory, try again. */
    if (pool->pending_head && wait_all_events(pool) == LLMMEM_OK)
      b = _llmmem_heap_find(pool, &pool->large, size, stream, 0);
    if (!b) {
      release_empty_chunks(pool);
      for (pool_region_t *r = pool->segments, *next; r; r = next) {
        next = r->next;
        if (!r->is_initial && region_empty(r) && !r->first->event) release_segment(pool, r);
      }
      b = _llmmem_heap_find(pool, &pool->large, size, stream, 0);
      if (!b) {
        *why = grow(pool, size);
        if (*why == LLMMEM_OK) b = _llmmem_heap_find(pool, &pool->large, size, stream, 0);
      }
    }
  }
  if (b) _llmmem_heap_remove(&pool->large, b);
  return b;
}

/* A fresh 2 MiB chunk for small requests; returns its single free block (not in a heap). */
static pool_block_t *new_chunk(llmmem_pool_t *pool) {
  pool_region_t *c = calloc(1, sizeof *c);
  pool_block_t *sb = block_new(pool), *rest = block_new(pool);
  llmmem_status_t why = LLMMEM_OK;
  pool_block_t *lb = c && sb && rest ? large_take(pool, LLMMEM_POOL_CHUNK_SIZE, ANY_STREAM, &why) : NULL;
  if (!lb) {
    free(c);
    if (sb) block_recycle(pool, sb);
    if (rest) block_recycle(pool, rest);
    return NULL;
  }
  if (lb->size - LLMMEM_POOL_CHUNK_SIZE >= LLMMEM_POOL_GRANULARITY) {
    split(pool, lb, LLMMEM_POOL_CHUNK_SIZE, rest);
  } else {
    split(pool, lb, lb->size, NULL);
    block_recycle(pool, rest);
  }
  lb->is_free = 0;
  lb->chunk = c;
  c->base = lb->addr;
  c->size = lb->size;
  c->first = sb;
  c->backing = lb;
  region_link(&pool->chunks, c);
  pool->st.small_chunks++;
  sb->addr = c->base;
  sb->size = c->size;
  sb->region = c;
  sb->small = 1;
  sb->is_free = 1;
  return sb;
}

/* ---- public API ---------------------------------------------------------------------------- */

LLMMEM_API llmmem_status_t llmmem_pool_create(const llmmem_pool_backend_t *backend,
                                              const llmmem_pool_options_t *options, llmmem_pool_t **out) {
  if (out) *out = NULL;
  if (!backend) return LLMMEM_FAIL(LLMMEM_ERR_INVALID, "llmmem_pool_create: backend must not be NULL");
  llmmem_pool_options_t opt = {0, 0, 0};
  if (options) opt = *options;
  llmmem_status_t st = LLMMEM_OK;
  if (!out) st = LLMMEM_FAIL(LLMMEM_ERR_INVALID, "llmmem_pool_create: out must not be NULL");
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
  if (opt.initial_size) {
    st = add_segment(pool, opt.initial_size, 1);
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

void _llmmem_slots_forget(llmmem_pool_t *pool);  /* slots.c */

LLMMEM_API llmmem_status_t llmmem_pool_destroy(llmmem_pool_t *pool) {
  LLMMEM_CHECK_ARG(pool != NULL, "llmmem_pool_destroy: pool must not be NULL");
  pthread_mutex_lock(&pool->lock);
  if (pool->st.allocations.current > 0) {
    int64_t n = pool->st.allocations.current;
    pthread_mutex_unlock(&pool->lock);
    return LLMMEM_FAIL(LLMMEM_ERR_STATE, "llmmem_pool_destroy: %lld blocks are still allocated", (long long)n);
  }
  pthread_mutex_unlock(&pool->lock);
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
  return LLMMEM_OK;
}

LLMMEM_API void llmmem_pool_release_when_empty(llmmem_pool_t *pool) {
  if (!pool) return;
  pthread_mutex_lock(&pool->lock);
  int now = pool->st.allocations.current == 0;
  pool->release_when_empty = 1;
  pthread_mutex_unlock(&pool->lock);
  if (now) (void)llmmem_pool_destroy(pool);
}

LLMMEM_API llmmem_status_t llmmem_pool_alloc(llmmem_pool_t *pool, size_t size, void *stream, void **out) {
  LLMMEM_CHECK_ARG(out != NULL, "llmmem_pool_alloc: out must not be NULL");
  *out = NULL;
  LLMMEM_CHECK_ARG(pool != NULL, "llmmem_pool_alloc: pool must not be NULL");
  LLMMEM_CHECK_ARG(size > 0, "llmmem_pool_alloc: size must be > 0 bytes");
  LLMMEM_CHECK_ARG(stream != ANY_STREAM, "llmmem_pool_alloc: stream %p is reserved", stream);
  if (size > SIZE_MAX / 2) {
    pthread_mutex_lock(&pool->lock);
    pool->st.num_ooms++;
    pthread_mutex_unlock(&pool->lock);
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "cannot allocate %zu bytes: larger than any address space", size);
  }
  size_t rsize = _llmmem_round_up(size, LLMMEM_POOL_GRANULARITY);
  pthread_mutex_lock(&pool->lock);
  pool_block_t *rest = block_new(pool);
  if (!rest) {
    pthread_mutex_unlock(&pool->lock);
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "pool: no host memory for block metadata");
  }
  if (pool->pending_head) poll_events(pool, POLL_ON_ALLOC);
  pool_block_t *b = NULL;
  llmmem_status_t why = LLMMEM_OK;
  if (rsize <= LLMMEM_POOL_SMALL_MAX) {
    b = _llmmem_heap_find(pool, &pool->small, rsize, stream, POOL_SCAN_LIMIT);
    if (!b && pool->pending_head) {
      poll_events(pool, 0);
      b = _llmmem_heap_find(pool, &pool->small, rsize, stream, 0);
    }
    if (b) {
      _llmmem_heap_remove(&pool->small, b);
      if (region_empty(b->region)) pool->empty_chunks--;
    } else {
      /* A large-heap remnant smaller than a chunk (the tail of a segment, say) cannot split any big
       * range, so it serves small requests before a new chunk is carved. */
      b = _llmmem_heap_find(pool, &pool->large, rsize, stream, POOL_SCAN_LIMIT);
      if (b && b->size < LLMMEM_POOL_CHUNK_SIZE) _llmmem_heap_remove(&pool->large, b);
      else b = new_chunk(pool);  /* NULL: no room for 2 MiB; the large heap may still fit this request */
    }
  }
  if (!b) b = large_take(pool, rsize, stream, &why);
  if (!b) {
    pool->st.num_ooms++;
    block_recycle(pool, rest);
    size_t reserved = (size_t)pool->st.reserved_bytes.current, allocated = (size_t)pool->st.allocated_bytes.current;
    size_t max = pool->options.max_size;
    char detail[256];
    snprintf(detail, sizeof detail, "%s", llmmem_last_error());
    pthread_mutex_unlock(&pool->lock);
    if (why != LLMMEM_ERR_NOMEM && why != LLMMEM_OK) return LLMMEM_FAIL(why, "allocating %zu bytes: %s", size, detail);
    char cap[64];
    if (max) snprintf(cap, sizeof cap, "max_size %zu", max);
    else snprintf(cap, sizeof cap, "no max_size");
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM,
                       "out of memory allocating %zu bytes (%zu rounded): %zu bytes allocated, %zu reserved, %s; %s",
                       size, rsize, allocated, reserved, cap, detail);
  }
  if (b->size - rsize >= LLMMEM_POOL_GRANULARITY) {
    split(pool, b, rsize, rest);
  } else {
    split(pool, b, b->size, NULL);
    block_recycle(pool, rest);
  }
  if (_llmmem_ptrmap_put(&pool->live, b->addr, b) != LLMMEM_OK) {
    b->is_free = 1;
    put_back(pool, b);
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
  update_active(pool);
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
  if (!ptr) return LLMMEM_OK;  /* like free(NULL) */
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
  attach_event(pool, b, ev);
  put_back(pool, b);
  update_active(pool);
  int destroy = pool->release_when_empty && pool->st.allocations.current == 0;
  pthread_mutex_unlock(&pool->lock);
  if (destroy) (void)llmmem_pool_destroy(pool);
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
  llmmem_status_t st = wait_all_events(pool);
  release_empty_chunks(pool);
  size_t total = 0;
  for (pool_region_t *r = pool->segments, *next; r; r = next) {
    next = r->next;
    if (!r->is_initial && region_empty(r) && !r->first->event) {
      total += r->size;
      release_segment(pool, r);
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
