/*
 * segment.c — the pool's regions: segments from the backend and the 2 MiB chunks for small
 * requests carved from them; growth up to max_size (and when growth folds free segments into a
 * new one); polling and waiting on stream events of free blocks.
 *
 * Growth, two ways. A backend that can resize regions in place (host memory over reserved
 * address space; CUDA VMM, backend_cuda_vmm.cu, the device counterpart) gets one contiguous
 * "top" segment that grows by what a request lacks, rounded to 2 MiB, merging with its free end
 * (PyTorch's expandable segments do the same with 20 MiB pages). When it must take memory beyond
 * what it has held, it first decommits the whole 2 MiB pages inside free holes (a hole too small
 * for what comes next, such as last step's activations when the sequence grows, then holds no
 * memory) and commits them again when a block over them is handed out: on the GPT traces of
 * benchmarks/traces the waste at the peak is otherwise free tails of many segments (fixed
 * segments) or, in one segment, holes of shorter steps' buffers. A backend that cannot
 * resize (cudaMalloc) gets separate segments, with fully free ones folded into the new one.
 *
 * Runs under the pool's mutex. Backend calls (cudaMalloc/cudaFree, event queries) happen here.
 */
#include <stdlib.h>
#include <string.h>

#include "pool_internal.h"

/* ---- regions ------------------------------------------------------------------------------- */

static void region_link(pool_region_t **list, pool_region_t *r) {
  r->prev = NULL;
  r->next = *list;
  if (*list) (*list)->prev = r;
  *list = r;
}

static void region_unlink(pool_region_t **list, pool_region_t *r) {
  if (r->prev)
    r->prev->next = r->next;
  else
    *list = r->next;
  if (r->next) r->next->prev = r->prev;
}

llmmem_status_t _llmmem_add_segment(llmmem_pool_t *pool, size_t bytes, int is_initial) {
  void *ptr = NULL;
  llmmem_status_t st = pool->backend.reserve(pool->backend.ctx, bytes, &ptr);
  if (st != LLMMEM_OK) return st;
  if (!ptr || ((uintptr_t)ptr & (LLMMEM_POOL_GRANULARITY - 1))) {
    if (ptr) pool->backend.release(pool->backend.ctx, ptr, bytes);
    return LLMMEM_FAIL(LLMMEM_ERR_INTERNAL, "pool: backend %s returned a region not aligned to 512 bytes",
                       pool->backend.name);
  }
  pool_region_t *r = calloc(1, sizeof *r);
  pool_block_t *b = _llmmem_block_new(pool);
  if (!r || !b) {
    free(r);
    if (b) _llmmem_block_recycle(pool, b);
    pool->backend.release(pool->backend.ctx, ptr, bytes);
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "pool: no host memory for segment metadata");
  }
  r->base = (uintptr_t)ptr;
  r->size = bytes;
  r->first = r->last = b;
  r->is_initial = (uint8_t)is_initial;
  region_link(&pool->segments, r);
  b->addr = r->base;
  b->size = bytes;
  b->region = r;
  b->is_free = 1;
  _llmmem_heap_insert(&pool->large, b);
  /* The newest segment is the one growth extends: its end is where the address space is free. */
  if (pool->backend.resize && !pool->options.fixed_segments) pool->top = r;
  pool->st.num_backend_reserves++;
  _llmmem_reserved_add(pool, (int64_t)bytes);
  _llmmem_stat_add(&pool->st.segments, 1);
  return LLMMEM_OK;
}

/* Gives a fully free, event-free segment back to the backend. Returns the bytes of memory that
 * came back: its size less the pages decommitted before (not in reserved_bytes any more). */
size_t _llmmem_release_segment(llmmem_pool_t *pool, pool_region_t *r) {
  pool_block_t *b = r->first;
  _llmmem_heap_remove(&pool->large, b);
  _llmmem_block_clear_event(pool, b);
  _llmmem_block_recycle(pool, b);
  region_unlink(&pool->segments, r);
  if (pool->top == r) pool->top = NULL; /* the next growth reserves a new one */
  pool->backend.release(pool->backend.ctx, (void *)r->base, r->size);
  pool->st.num_backend_releases++;
  size_t held = r->size - r->decommitted_pages * LLMMEM_POOL_CHUNK_SIZE;
  _llmmem_reserved_add(pool, -(int64_t)held);
  _llmmem_stat_add(&pool->st.segments, -1);
  free(r->decommitted);
  free(r);
  return held;
}

/* Frees the large block `lb` that backed chunk `c`; the chunk's single free block `sb` goes away
 * and its event (if any) moves to lb, which is merged with its neighbours into the large heap. */
static void release_chunk(llmmem_pool_t *pool, pool_region_t *c) {
  pool_block_t *sb = c->first, *lb = c->backing;
  _llmmem_heap_remove(&pool->small, sb);
  pool_event_t ev = _llmmem_detach_event(pool, sb);
  _llmmem_block_recycle(pool, sb);
  region_unlink(&pool->chunks, c);
  free(c);
  pool->st.small_chunks--;
  lb->chunk = NULL;
  lb->is_free = 1;
  _llmmem_attach_event(pool, lb, ev);
  lb = _llmmem_coalesce(pool, lb);
  _llmmem_heap_insert(&pool->large, lb);
}

/* A whole chunk just became free (block m covers it, not in a heap): keep one such chunk for the
 * next small request, give any other back to the large heap. */
static void chunk_became_empty(llmmem_pool_t *pool, pool_block_t *m) {
  _llmmem_heap_insert(&pool->small, m);
  if (pool->empty_chunks >= 1)
    release_chunk(pool, m->region);
  else
    pool->empty_chunks++;
}

void _llmmem_release_empty_chunks(llmmem_pool_t *pool) {
  pool_region_t *c = pool->chunks;
  while (c) {
    pool_region_t *next = c->next;
    if (_llmmem_region_empty(c)) {
      release_chunk(pool, c);
      pool->empty_chunks--;
    }
    c = next;
  }
}

/* A block that just became free (not in a heap): merge it, file it, and handle a chunk that is
 * now entirely free. */
void _llmmem_put_back(llmmem_pool_t *pool, pool_block_t *b) {
  pool_block_t *m = _llmmem_coalesce(pool, b);
  if (m->small && _llmmem_region_empty(m->region))
    chunk_became_empty(pool, m);
  else
    _llmmem_heap_insert(_llmmem_heap_of(pool, m), m);
}

/* ---- events: polling and waiting ---------------------------------------------------------- */

/* Clears completed events, oldest first, and coalesces what they freed. max_checks 0 = all. */
void _llmmem_poll_events(llmmem_pool_t *pool, int max_checks) {
  int checked = 0;
  pool_block_t *b = pool->pending_head;
  while (b && (max_checks == 0 || checked < max_checks)) {
    pool_block_t *next = b->pend_next;
    checked++;
    if (pool->backend.event_done(pool->backend.ctx, b->event) == 1) {
      int counted = b->small && _llmmem_region_empty(b->region); /* an empty chunk already counted */
      _llmmem_heap_remove(_llmmem_heap_of(pool, b), b);
      _llmmem_block_clear_event(pool, b);
      pool_block_t *m = _llmmem_coalesce(pool, b); /* event-less: `next` cannot be merged away */
      if (m->small && _llmmem_region_empty(m->region) && !counted)
        chunk_became_empty(pool, m);
      else
        _llmmem_heap_insert(_llmmem_heap_of(pool, m), m);
    }
    b = next;
  }
}

/* Waits for every outstanding event (the OOM path and empty_cache), then clears them. */
llmmem_status_t _llmmem_wait_all_events(llmmem_pool_t *pool) {
  for (pool_block_t *b = pool->pending_head; b; b = b->pend_next) {
    LLMMEM_TRY(pool->backend.event_wait(pool->backend.ctx, b->event));
    pool->st.num_event_waits++;
  }
  _llmmem_poll_events(pool, 0);
  return LLMMEM_OK;
}

/* ---- decommitted pages --------------------------------------------------------------------- */

#define PAGE LLMMEM_POOL_CHUNK_SIZE /* bytes: the unit pages are decommitted in */

static void page_mark(pool_region_t *r, size_t page, int on) {
  uint64_t bit = (uint64_t)1 << (page % 64);
  if (on)
    r->decommitted[page / 64] |= bit;
  else
    r->decommitted[page / 64] &= ~bit;
}

/* Commits the decommitted pages in [lo, hi) (page indices); reserved_bytes grows by them. */
static llmmem_status_t commit_pages(llmmem_pool_t *pool, pool_region_t *r, size_t lo, size_t hi) {
  size_t p = lo;
  while (p < hi) {
    while (p < hi && !_llmmem_page_decommitted(r, p)) p++;
    size_t q = p;
    while (q < hi && _llmmem_page_decommitted(r, q)) q++;
    if (q > p) {
      LLMMEM_TRY(pool->backend.commit(pool->backend.ctx, (void *)(r->base + p * PAGE), (q - p) * PAGE));
      for (size_t k = p; k < q; k++) page_mark(r, k, 0);
      r->decommitted_pages -= q - p;
      pool->st.num_backend_reserves++; /* a backend call that maps memory, like cuMemMap in PyTorch's count */
      _llmmem_reserved_add(pool, (int64_t)((q - p) * PAGE));
    }
    p = q;
  }
  return LLMMEM_OK;
}

/* Before the top segment grows: whole pages inside its free holes (event-less free blocks other
 * than the free end, which the growth extends) are decommitted, so reserved memory counts what
 * blocks use plus the hole edges, not the holes: a hole too small for the requests that come
 * (last step's activations when the sequence grows) no longer holds memory while the segment
 * grows past it. Pages come back when a block over them is handed out. Walks the segment's
 * blocks: growth path only, which also pays for a backend call; never on a steady loop. Off with
 * max_size, where committing a page again could fail at the cap after growth took its room. */
static void decommit_holes(llmmem_pool_t *pool) {
  pool_region_t *r = pool->top;
  if (!r || !pool->backend.decommit || pool->options.max_size) return;
  /* initial_size is kept until destroy, as promised: only pages beyond it are given back */
  size_t kept_pages = r->is_initial ? (pool->options.initial_size + PAGE - 1) / PAGE : 0;
  size_t words = (r->size / PAGE + 63) / 64;
  if (words > r->decommitted_words) {
    uint64_t *bits = realloc(r->decommitted, words * sizeof *bits);
    if (!bits) return; /* no host memory for the bitmap: just keep the pages */
    memset(bits + r->decommitted_words, 0, (words - r->decommitted_words) * sizeof *bits);
    r->decommitted = bits;
    r->decommitted_words = words;
  }
  for (pool_block_t *b = r->first; b; b = b->next) {
    if (!b->is_free || b->event || !b->next) continue;
    size_t lo, hi;
    _llmmem_pages_inside(r, b->addr, b->size, &lo, &hi);
    if (lo < kept_pages) lo = kept_pages;
    size_t p = lo;
    while (p < hi) {
      while (p < hi && _llmmem_page_decommitted(r, p)) p++;
      size_t q = p;
      while (q < hi && !_llmmem_page_decommitted(r, q)) q++;
      if (q > p &&
          pool->backend.decommit(pool->backend.ctx, (void *)(r->base + p * PAGE), (q - p) * PAGE) == LLMMEM_OK) {
        for (size_t k = p; k < q; k++) page_mark(r, k, 1);
        r->decommitted_pages += q - p;
        pool->st.num_backend_releases++;
        _llmmem_reserved_add(pool, -(int64_t)((q - p) * PAGE));
      }
      p = q;
    }
  }
}

/* A large block being handed out (still flagged free, out of the heap): commits the decommitted
 * pages under it. When that would take reserved memory beyond its highest mark, idle holes are
 * decommitted first (not this block: it is flagged in use meanwhile): memory beyond what the pool
 * ever held is taken only once what sits idle is given back, as on growth. */
llmmem_status_t _llmmem_commit_block(llmmem_pool_t *pool, pool_block_t *b) {
  pool_region_t *r = b->region;
  if (!r->decommitted_pages) return LLMMEM_OK;
  size_t lo = (b->addr - r->base) / PAGE, hi = (b->addr + b->size - r->base + PAGE - 1) / PAGE;
  size_t need = 0;
  for (size_t p = lo; p < hi; p++) need += _llmmem_page_decommitted(r, p);
  if (pool->st.reserved_bytes.current + (int64_t)(need * PAGE) > pool->reserved_high) {
    uint8_t was_free = b->is_free;
    b->is_free = 0;
    decommit_holes(pool);
    b->is_free = was_free;
  }
  return commit_pages(pool, r, lo, hi);
}

/* ---- growth -------------------------------------------------------------------------------- */

/* The bytes to add for a growth that requires `need`: `need` rounded up to 2 MiB, at least
 * growth_size, capped to the room max_size leaves (whole 512-byte granules). LLMMEM_ERR_NOMEM
 * when not even `need` fits. */
static llmmem_status_t growth_step(llmmem_pool_t *pool, size_t need, size_t *add) {
  *add = _llmmem_round_up(need, LLMMEM_POOL_CHUNK_SIZE);
  if (pool->options.growth_size > *add) *add = pool->options.growth_size;
  size_t max = pool->options.max_size, reserved = (size_t)pool->st.reserved_bytes.current;
  if (!max) return LLMMEM_OK;
  size_t avail = max > reserved ? (max - reserved) / LLMMEM_POOL_GRANULARITY * LLMMEM_POOL_GRANULARITY : 0;
  if (avail < need)
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "max_size %zu bytes reached (%zu reserved, %zu more needed)", max, reserved,
                       need);
  if (*add > avail) *add = avail;
  return LLMMEM_OK;
}

static llmmem_status_t grow(llmmem_pool_t *pool, size_t need) {
  size_t seg;
  LLMMEM_TRY(growth_step(pool, need, &seg));
  llmmem_status_t st = _llmmem_add_segment(pool, seg, 0);
  if (st == LLMMEM_ERR_NOMEM && seg > need) st = _llmmem_add_segment(pool, need, 0); /* no slack then */
  return st;
}

#define POOL_MID_REQUEST       ((size_t)10 << 20) /* bytes: below this, a segment may hold several requests */
#define POOL_MAX_GROUP         4
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

/* Grows the top segment in place (backend resize) so that its free end holds `need` bytes: by what
 * the end lacks, rounded up to 2 MiB (the granularity cudaMalloc/cuMemMap work in; at least
 * growth_size). Free space then never strands at the end of a segment that cannot merge with the
 * next one: reserved memory grows only by what requests add. LLMMEM_ERR_NOMEM when max_size is
 * reached or the address space behind the segment is taken. */
static llmmem_status_t grow_in_place(llmmem_pool_t *pool, size_t need) {
  pool_region_t *r = pool->top;
  pool_block_t *end = r->last;
  size_t have = end->is_free && !end->event ? end->size : 0; /* only an event-less end merges */
  size_t lack = need > have ? need - have : 0;
  if (!lack) return LLMMEM_OK; /* fits already (a search skipped it as busy on another stream) */
  size_t add;
  LLMMEM_TRY(growth_step(pool, lack, &add));
  if (r->size > SIZE_MAX / 2 - add) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "pool: segment too large to grow");
  pool_block_t *nb = _llmmem_block_new(pool);
  if (!nb) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "pool: no host memory for block metadata");
  llmmem_status_t st = pool->backend.resize(pool->backend.ctx, (void *)r->base, r->size, r->size + add);
  if (st != LLMMEM_OK) {
    _llmmem_block_recycle(pool, nb);
    return st;
  }
  nb->addr = r->base + r->size;
  nb->size = add;
  nb->region = r;
  nb->is_free = 1;
  nb->prev = end;
  end->next = nb;
  r->last = nb;
  r->size += add;
  pool->st.num_backend_reserves++;
  _llmmem_reserved_add(pool, (int64_t)add);
  _llmmem_heap_insert(&pool->large, _llmmem_coalesce(pool, nb));
  return LLMMEM_OK;
}

/* Gives back the free end of segment r beyond whole 2 MiB steps (keeping initial_size of the
 * initial segment), when the pool resizes segments. Any segment may have grown: the top changes
 * when the address space behind one runs out. Returns the bytes of memory given back: what
 * reserved_bytes drops by, which leaves out pages of the cut that were decommitted already.
 *
 * Never commits memory (empty_cache must not take any): when the new end would fall inside a
 * decommitted page, the cut stops at that page's upper boundary instead, so the page stays whole
 * inside the region and stays decommitted. Decommitted pages inside the cut are forgotten (the
 * backend's resize gives back what is still committed there). */
size_t _llmmem_shrink_segment(llmmem_pool_t *pool, pool_region_t *r) {
  if (!pool->backend.resize || pool->options.fixed_segments) return 0;
  pool_block_t *end = r->last;
  if (!end->is_free || end->event) return 0;
  size_t keep = r->is_initial ? pool->options.initial_size : 0;
  size_t cut = end->size / LLMMEM_POOL_CHUNK_SIZE * LLMMEM_POOL_CHUNK_SIZE;
  if (r->size - cut < keep) cut = (r->size - keep) / LLMMEM_POOL_GRANULARITY * LLMMEM_POOL_GRANULARITY;
  if (cut == 0 || cut == r->size) return 0; /* a wholly free segment is released, not shrunk */
  size_t new_size = r->size - cut;
  if (new_size % PAGE && _llmmem_page_decommitted(r, new_size / PAGE)) {
    /* A decommitted page lies wholly inside a free block, so its end is inside the region. */
    new_size = (new_size / PAGE + 1) * PAGE;
    cut = r->size - new_size;
    if (cut == 0) return 0;
  }
  if (pool->backend.resize(pool->backend.ctx, (void *)r->base, r->size, new_size) != LLMMEM_OK) return 0;
  size_t dropped = 0, lo, hi; /* decommitted pages wholly inside the cut, forgotten with it */
  _llmmem_pages_inside(r, r->base + new_size, r->size - new_size, &lo, &hi);
  for (size_t p = lo; p < hi; p++)
    if (_llmmem_page_decommitted(r, p)) {
      page_mark(r, p, 0);
      dropped++;
    }
  r->decommitted_pages -= dropped;
  _llmmem_heap_remove(&pool->large, end);
  if (cut == end->size) {
    r->last = end->prev;
    end->prev->next = NULL;
    _llmmem_block_recycle(pool, end);
  } else {
    end->size -= cut;
    _llmmem_heap_insert(&pool->large, end);
  }
  r->size = new_size;
  pool->st.num_backend_releases++;
  size_t released = cut - dropped * PAGE;
  _llmmem_reserved_add(pool, -(int64_t)released);
  return released;
}

/* Gives back the empty chunks, then every releasable segment but `keep` (may be NULL). Returns
 * the bytes of memory that came back from the segments. */
static size_t release_free_segments(llmmem_pool_t *pool, const pool_region_t *keep) {
  size_t freed = 0;
  _llmmem_release_empty_chunks(pool);
  for (pool_region_t *r = pool->segments, *next; r; r = next) {
    next = r->next;
    if (r != keep && _llmmem_segment_releasable(r)) freed += _llmmem_release_segment(pool, r);
  }
  return freed;
}

/* Growth that does not strand memory: fully free growth segments are given back first. With a
 * resizable backend the top segment then grows in place by what the request lacks. Otherwise
 * the released bytes are re-reserved inside the one new segment, so free space that was scattered
 * over segments (which can never merge with each other) becomes contiguous; reserved memory grows
 * only by what the request adds. The release costs a backend free (cudaFree synchronizes the
 * device), but only on the growth path, which already pays for a cudaMalloc; a steady training
 * loop never gets here. */
static llmmem_status_t grow_consolidating(llmmem_pool_t *pool, size_t need) {
  const size_t freed = release_free_segments(pool, pool->top);
  if (pool->top) {
    decommit_holes(pool);
    llmmem_status_t st = grow_in_place(pool, need);
    if (st != LLMMEM_ERR_NOMEM) return st;
    /* The address space behind the top is exhausted (or max_size reached, and then so will be a
     * new segment): a new segment, which becomes the top. */
    return grow(pool, need);
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
pool_block_t *_llmmem_large_take(llmmem_pool_t *pool, size_t size, void *stream, llmmem_status_t *why) {
  pool_block_t *b = _llmmem_heap_find(pool, &pool->large, size, stream, POOL_SCAN_LIMIT);
  if (!b && pool->pending_head) {
    _llmmem_poll_events(pool, 0);
    b = _llmmem_heap_find(pool, &pool->large, size, stream, 0);
  }
  if (!b) {
    *why = grow_consolidating(pool, size);
    if (*why == LLMMEM_OK) b = _llmmem_heap_find(pool, &pool->large, size, stream, 0);
  }
  if (!b && *why != LLMMEM_OK && *why != LLMMEM_ERR_NOMEM) return NULL; /* a backend error, not OOM */
  if (!b) {
    /* Last resort, as PyTorch does: wait for other streams, return cached memory, try again. */
    if (pool->pending_head && _llmmem_wait_all_events(pool) == LLMMEM_OK)
      b = _llmmem_heap_find(pool, &pool->large, size, stream, 0);
    if (!b) {
      release_free_segments(pool, NULL);
      b = _llmmem_heap_find(pool, &pool->large, size, stream, 0);
      if (!b) {
        /* events waited for: the top's end may have become mergeable, so it may need less now */
        *why = pool->top ? grow_consolidating(pool, size) : grow(pool, size);
        if (*why == LLMMEM_OK) b = _llmmem_heap_find(pool, &pool->large, size, stream, 0);
      }
    }
  }
  if (b) _llmmem_heap_remove(&pool->large, b);
  return b;
}

/* A fresh 2 MiB chunk for small requests; returns its single free block (not in a heap). */
pool_block_t *_llmmem_new_chunk(llmmem_pool_t *pool) {
  pool_region_t *c = calloc(1, sizeof *c);
  pool_block_t *sb = _llmmem_block_new(pool), *rest = _llmmem_block_new(pool);
  llmmem_status_t why = LLMMEM_OK;
  pool_block_t *lb = c && sb && rest ? _llmmem_large_take(pool, LLMMEM_POOL_CHUNK_SIZE, POOL_ANY_STREAM, &why) : NULL;
  if (!lb) {
    free(c);
    if (sb) _llmmem_block_recycle(pool, sb);
    if (rest) _llmmem_block_recycle(pool, rest);
    return NULL;
  }
  if (lb->size - LLMMEM_POOL_CHUNK_SIZE >= LLMMEM_POOL_GRANULARITY) {
    _llmmem_split(pool, lb, LLMMEM_POOL_CHUNK_SIZE, rest);
  } else {
    _llmmem_split(pool, lb, lb->size, NULL);
    _llmmem_block_recycle(pool, rest);
  }
  if (_llmmem_commit_block(pool, lb) != LLMMEM_OK) {
    _llmmem_put_back(pool, lb);
    free(c);
    _llmmem_block_recycle(pool, sb);
    return NULL;
  }
  lb->is_free = 0;
  lb->chunk = c;
  c->base = lb->addr;
  c->size = lb->size;
  c->first = c->last = sb;
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
