/*
 * pool_query.c — what a pool can tell about itself: statistics, peaks, a block-level snapshot,
 * and the invariant checker the tests (and debug builds) run.
 */
#include <stdio.h>
#include <string.h>

#include "pool_internal.h"

/* The longest stretch of free block b whose memory is committed: b less its decommitted pages. */
static size_t committed_run(const pool_region_t *r, const pool_block_t *b) {
  const size_t page = LLMMEM_POOL_CHUNK_SIZE;
  uintptr_t end = b->addr + b->size, run_start = b->addr;
  size_t best = 0, lo, hi;
  _llmmem_pages_inside(r, b->addr, b->size, &lo, &hi);
  for (size_t p = lo; p < hi; p++) {
    if (!_llmmem_page_decommitted(r, p)) continue;
    uintptr_t at = r->base + p * page;
    if (at - run_start > best) best = at - run_start;
    run_start = at + page;
  }
  if (end - run_start > best) best = end - run_start;
  return best;
}

/* The biggest free block's committed bytes. Without decommitted pages that is the top TLSF
 * class's biggest block; with them a free block may be mostly address space, so the blocks of
 * those segments are walked (stats are not on the hot path). */
size_t _llmmem_largest_free(llmmem_pool_t *pool) {
  size_t small = _llmmem_heap_largest(&pool->small), best = 0;
  int any = 0;
  for (const pool_region_t *r = pool->segments; r; r = r->next) any |= r->decommitted_pages != 0;
  if (!any)
    best = _llmmem_heap_largest(&pool->large);
  else
    for (const pool_region_t *r = pool->segments; r; r = r->next)
      for (const pool_block_t *b = r->first; b; b = b->next) {
        if (!b->is_free) continue;
        size_t run = r->decommitted_pages ? committed_run(r, b) : b->size;
        if (run > best) best = run;
      }
  return best > small ? best : small;
}

LLMMEM_API llmmem_status_t llmmem_pool_stats(llmmem_pool_t *pool, llmmem_pool_stats_t *out) {
  LLMMEM_CHECK_ARG(pool != NULL && out != NULL, "llmmem_pool_stats: pool and out must not be NULL");
  pthread_mutex_lock(&pool->lock);
  *out = pool->st;
  out->free_bytes = (size_t)(pool->st.reserved_bytes.current - pool->st.allocated_bytes.current);
  out->largest_free_block = _llmmem_largest_free(pool);
  out->decommitted_bytes = 0;
  for (const pool_region_t *r = pool->segments; r; r = r->next)
    out->decommitted_bytes += r->decommitted_pages * LLMMEM_POOL_CHUNK_SIZE;
  out->fragmentation = out->free_bytes ? 1.0 - (double)out->largest_free_block / (double)out->free_bytes : 0.0;
  pthread_mutex_unlock(&pool->lock);
  return LLMMEM_OK;
}

LLMMEM_API llmmem_status_t llmmem_pool_reset_peak_stats(llmmem_pool_t *pool) {
  LLMMEM_CHECK_ARG(pool != NULL, "llmmem_pool_reset_peak_stats: pool must not be NULL");
  pthread_mutex_lock(&pool->lock);
  llmmem_pool_stat_t *all[] = {&pool->st.allocated_bytes, &pool->st.requested_bytes, &pool->st.active_bytes,
                               &pool->st.reserved_bytes,  &pool->st.allocations,     &pool->st.segments};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) all[i]->peak = all[i]->current;
  pthread_mutex_unlock(&pool->lock);
  return LLMMEM_OK;
}

static void put_block(llmmem_pool_block_info_t *out, size_t capacity, size_t *n, const pool_region_t *seg,
                      const pool_block_t *b) {
  if (*n < capacity) {
    llmmem_pool_block_info_t *i = &out[*n];
    i->segment_base = seg->base;
    i->segment_size = seg->size;
    i->addr = b->addr;
    i->size = b->size;
    i->requested = b->requested;
    i->state = !b->is_free ? LLMMEM_POOL_BLOCK_ALLOCATED
               : b->event  ? LLMMEM_POOL_BLOCK_FREE_PENDING
                           : LLMMEM_POOL_BLOCK_FREE;
    i->small = b->small;
    i->stream = (uintptr_t)(b->is_free && !b->event ? NULL : b->stream);
  }
  (*n)++;
}

LLMMEM_API llmmem_status_t llmmem_pool_snapshot(llmmem_pool_t *pool, llmmem_pool_block_info_t *out, size_t capacity,
                                                size_t *count) {
  LLMMEM_CHECK_ARG(pool != NULL && count != NULL, "llmmem_pool_snapshot: pool and count must not be NULL");
  LLMMEM_CHECK_ARG(out != NULL || capacity == 0, "llmmem_pool_snapshot: out is NULL but capacity is %zu", capacity);
  pthread_mutex_lock(&pool->lock);
  size_t n = 0;
  /* Oldest segment first (the list is newest first): walk to the tail, then back. */
  pool_region_t *seg = pool->segments;
  while (seg && seg->next) seg = seg->next;
  for (; seg; seg = seg->prev)
    for (const pool_block_t *b = seg->first; b; b = b->next) {
      if (b->chunk)
        for (const pool_block_t *s = b->chunk->first; s; s = s->next) put_block(out, capacity, &n, seg, s);
      else
        put_block(out, capacity, &n, seg, b);
    }
  pthread_mutex_unlock(&pool->lock);
  *count = n;
  return LLMMEM_OK;
}

#define CHECK_INV(cond, ...)                                                          \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      pthread_mutex_unlock(&pool->lock);                                              \
      return LLMMEM_FAIL(LLMMEM_ERR_INTERNAL, "pool invariant broken: " __VA_ARGS__); \
    }                                                                                 \
  } while (0)

/* Counts the blocks of one heap and checks each is a free block of that heap in the right list. */
static size_t heap_blocks(const pool_heap_t *h, int small, int *ok) {
  size_t n = 0;
  for (int f = 0; f < POOL_FL_COUNT; f++)
    for (int s = 0; s < POOL_SL_COUNT; s++) {
      int nonempty = h->heads[f][s] != NULL;
      if (nonempty != !!(h->sl_bitmap[f] & (1u << s))) *ok = 0;
      for (const pool_block_t *b = h->heads[f][s]; b; b = b->free_next) {
        if (!b->is_free || b->small != small || b->fl != f || b->sl != s) *ok = 0;
        n++;
      }
    }
  for (int f = 0; f < POOL_FL_COUNT; f++)
    if (!!h->sl_bitmap[f] != !!(h->fl_bitmap & ((uint64_t)1 << f))) *ok = 0;
  return n;
}

llmmem_status_t _llmmem_pool_check(llmmem_pool_t *pool) {
  pthread_mutex_lock(&pool->lock);
  size_t reserved = 0, allocated = 0, requested = 0, live = 0, free_large = 0, free_small = 0, pending = 0;
  size_t segments = 0, chunks = 0, empty_chunks = 0;
  for (const pool_region_t *seg = pool->segments; seg; seg = seg->next) {
    segments++;
    reserved += seg->size - seg->decommitted_pages * LLMMEM_POOL_CHUNK_SIZE;
    size_t marked = 0;
    for (size_t w = 0; w < seg->decommitted_words; w++) marked += (size_t)__builtin_popcountll(seg->decommitted[w]);
    CHECK_INV(marked == seg->decommitted_pages, "segment %p: %zu pages marked decommitted, counter %zu",
              (void *)seg->base, marked, seg->decommitted_pages);
    uintptr_t at = seg->base;
    for (const pool_block_t *b = seg->first; b; b = b->next) {
      CHECK_INV(b->addr == at, "segment %p: block at %p, expected %p", (void *)seg->base, (void *)b->addr, (void *)at);
      CHECK_INV(b->size > 0 && b->size % LLMMEM_POOL_GRANULARITY == 0, "block size %zu", b->size);
      CHECK_INV(b->region == seg && !b->small, "large block %p has the wrong region", (void *)b->addr);
      CHECK_INV(!b->next || b->next->prev == b, "broken neighbour links at %p", (void *)b->addr);
      CHECK_INV(!(b->is_free && b->next && b->next->is_free && !b->event && !b->next->event),
                "free neighbours %p and %p not coalesced", (void *)b->addr, (void *)b->next->addr);
      at += b->size;
      if (b->chunk) {
        chunks++;
        const pool_region_t *c = b->chunk;
        CHECK_INV(!b->is_free && c->base == b->addr && c->size == b->size && c->backing == b, "chunk header");
        if (c->first->is_free && c->first->size == c->size) empty_chunks++;
        uintptr_t cat = c->base;
        for (const pool_block_t *s = c->first; s; s = s->next) {
          CHECK_INV(s->addr == cat && s->small && s->region == c, "chunk %p: block %p", (void *)c->base,
                    (void *)s->addr);
          CHECK_INV(!(s->is_free && s->next && s->next->is_free && !s->event && !s->next->event),
                    "free chunk neighbours %p and %p not coalesced", (void *)s->addr, (void *)s->next->addr);
          cat += s->size;
          if (s->is_free) {
            free_small++;
            if (s->event) pending += s->size;
          } else {
            live++;
            allocated += s->size;
            requested += s->requested;
            CHECK_INV(_llmmem_ptrmap_get(&pool->live, s->addr) == s, "live block %p not in the map", (void *)s->addr);
          }
        }
        CHECK_INV(cat == c->base + c->size, "chunk %p is not tiled", (void *)c->base);
        CHECK_INV(c->last && !c->last->next && c->last->addr + c->last->size == cat, "chunk %p: last block wrong",
                  (void *)c->base);
      } else if (b->is_free) {
        free_large++;
        if (b->event) pending += b->size;
      } else {
        live++;
        allocated += b->size;
        requested += b->requested;
        CHECK_INV(_llmmem_ptrmap_get(&pool->live, b->addr) == b, "live block %p not in the map", (void *)b->addr);
      }
      if (!b->is_free || b->event) { /* only event-less free blocks may hold decommitted pages */
        size_t P = LLMMEM_POOL_CHUNK_SIZE;
        for (size_t pg = (b->addr - seg->base) / P; pg * P < b->addr + b->size - seg->base; pg++)
          CHECK_INV(!_llmmem_page_decommitted(seg, pg), "block %p (in use or waiting) covers a decommitted page",
                    (void *)b->addr);
      }
    }
    CHECK_INV(at == seg->base + seg->size, "segment %p is not tiled", (void *)seg->base);
    CHECK_INV(seg->last && !seg->last->next && seg->last->addr + seg->last->size == at, "segment %p: last block wrong",
              (void *)seg->base);
  }
  int ok = 1;
  size_t in_large = heap_blocks(&pool->large, 0, &ok), in_small = heap_blocks(&pool->small, 1, &ok);
  CHECK_INV(ok, "a TLSF list or bitmap is inconsistent");
  CHECK_INV(in_large == free_large && in_small == free_small, "heaps hold %zu+%zu blocks, segments %zu+%zu free",
            in_large, in_small, free_large, free_small);
  CHECK_INV(live == pool->live.count, "%zu live blocks, map holds %zu", live, pool->live.count);
  CHECK_INV((int64_t)live == pool->st.allocations.current, "allocations stat %lld, counted %zu",
            (long long)pool->st.allocations.current, live);
  CHECK_INV((int64_t)allocated == pool->st.allocated_bytes.current, "allocated_bytes stat %lld, counted %zu",
            (long long)pool->st.allocated_bytes.current, allocated);
  CHECK_INV((int64_t)requested == pool->st.requested_bytes.current, "requested_bytes stat wrong");
  CHECK_INV((int64_t)reserved == pool->st.reserved_bytes.current, "reserved_bytes stat %lld, counted %zu",
            (long long)pool->st.reserved_bytes.current, reserved);
  CHECK_INV((int64_t)segments == pool->st.segments.current, "segments stat wrong");
  CHECK_INV(chunks == pool->st.small_chunks && empty_chunks == pool->empty_chunks && empty_chunks <= 1,
            "chunks %zu (stat %zu), empty %zu (counter %zu)", chunks, pool->st.small_chunks, empty_chunks,
            pool->empty_chunks);
  CHECK_INV(pending == pool->pending_bytes, "pending bytes %zu, counter %zu", pending, pool->pending_bytes);
  size_t listed = 0;
  for (const pool_block_t *b = pool->pending_head; b; b = b->pend_next) {
    CHECK_INV(b->is_free && b->event, "pending list holds a block without an event");
    listed += b->size;
  }
  CHECK_INV(listed == pending, "pending list holds %zu bytes, blocks %zu", listed, pending);
  pthread_mutex_unlock(&pool->lock);
  return LLMMEM_OK;
}
