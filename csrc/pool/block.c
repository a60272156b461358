/*
 * block.c — block metadata and what happens to one block: recycling its metadata, the stream
 * event a free block waits on, merging free neighbours, splitting a block for a request.
 *
 * Runs under the pool's mutex. Knows nothing of segments, chunks or growth (segment.c) nor of the
 * free-list index (tlsf.c) beyond filing blocks in it.
 */
#include <stdlib.h>
#include <string.h>

#include "pool_internal.h"

#define SLAB_BLOCKS 256 /* block descriptors allocated at a time: metadata never costs a malloc per block */

/* ---- block metadata ------------------------------------------------------------------------ */

pool_block_t *_llmmem_block_new(llmmem_pool_t *pool) {
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

void _llmmem_block_recycle(llmmem_pool_t *pool, pool_block_t *b) {
  b->free_next = pool->spare_blocks;
  pool->spare_blocks = b;
}

void _llmmem_update_active(llmmem_pool_t *pool) {
  int64_t active = pool->st.allocated_bytes.current + (int64_t)pool->pending_bytes;
  pool->st.active_bytes.current = active;
  if (active > pool->st.active_bytes.peak) pool->st.active_bytes.peak = active;
}

/* ---- events of free blocks ------------------------------------------------------------------ */

void _llmmem_attach_event(llmmem_pool_t *pool, pool_block_t *b, pool_event_t ev) {
  if (!ev.event) return;
  b->event = ev.event;
  b->stream = ev.stream;
  b->event_seq = ev.seq;
  b->pend_next = NULL;
  b->pend_prev = pool->pending_tail;
  if (pool->pending_tail)
    pool->pending_tail->pend_next = b;
  else
    pool->pending_head = b;
  pool->pending_tail = b;
  pool->pending_bytes += b->size;
}

/* Takes the event off `b` without releasing it. */
pool_event_t _llmmem_detach_event(llmmem_pool_t *pool, pool_block_t *b) {
  pool_event_t ev = {b->event, b->stream, b->event_seq};
  if (!b->event) return ev;
  if (b->pend_prev)
    b->pend_prev->pend_next = b->pend_next;
  else
    pool->pending_head = b->pend_next;
  if (b->pend_next)
    b->pend_next->pend_prev = b->pend_prev;
  else
    pool->pending_tail = b->pend_prev;
  b->pend_prev = b->pend_next = NULL;
  pool->pending_bytes -= b->size;
  b->event = NULL;
  return ev;
}

void _llmmem_release_event(llmmem_pool_t *pool, pool_event_t ev) {
  if (ev.event) pool->backend.event_release(pool->backend.ctx, ev.event);
}

void _llmmem_block_clear_event(llmmem_pool_t *pool, pool_block_t *b) {
  _llmmem_release_event(pool, _llmmem_detach_event(pool, b));
  _llmmem_update_active(pool);
}

int _llmmem_block_usable(llmmem_pool_t *pool, pool_block_t *b, void *stream) {
  if (!b->event) return 1;
  if (b->stream == stream) return 1; /* same stream: the queue orders our use after the free */
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
  pool_event_t a = _llmmem_detach_event(pool, lo), b = _llmmem_detach_event(pool, hi);
  pool_event_t keep = a, drop = b;
  if (!a.event || (b.event && b.seq > a.seq)) {
    keep = b;
    drop = a;
  }
  _llmmem_release_event(pool, drop);
  lo->size += hi->size;
  lo->next = hi->next;
  if (hi->next)
    hi->next->prev = lo;
  else
    lo->region->last = lo;
  _llmmem_block_recycle(pool, hi);
  _llmmem_attach_event(pool, lo, keep);
  return lo;
}

/* Merges free block b (not in a heap) with its free neighbours; returns the result, not in a heap.
 * An event-less b only absorbs event-less neighbours, which are never in the pending list, so
 * poll_events can call this while walking that list. */
pool_block_t *_llmmem_coalesce(llmmem_pool_t *pool, pool_block_t *b) {
  pool_block_t *n = b->next;
  if (mergeable(b, n)) {
    _llmmem_heap_remove(_llmmem_heap_of(pool, n), n);
    b = merge(pool, b, n);
  }
  pool_block_t *p = b->prev;
  if (mergeable(b, p)) {
    _llmmem_heap_remove(_llmmem_heap_of(pool, p), p);
    b = merge(pool, p, b);
  }
  _llmmem_update_active(pool);
  return b;
}

/* Splits free block b (not in a heap) so that it is `size` bytes; the rest goes back to b's heap
 * with b's event, if any (b itself is about to be used on the stream that event belongs to). */
void _llmmem_split(llmmem_pool_t *pool, pool_block_t *b, size_t size, pool_block_t *rest) {
  pool_event_t ev = _llmmem_detach_event(pool, b);
  if (rest) {
    rest->addr = b->addr + size;
    rest->size = b->size - size;
    rest->region = b->region;
    rest->small = b->small;
    rest->is_free = 1;
    rest->prev = b;
    rest->next = b->next;
    if (b->next)
      b->next->prev = rest;
    else
      b->region->last = rest;
    b->next = rest;
    b->size = size;
    _llmmem_attach_event(pool, rest, ev);
    _llmmem_heap_insert(_llmmem_heap_of(pool, rest), rest);
  } else {
    _llmmem_release_event(pool, ev);
  }
  _llmmem_update_active(pool);
}
