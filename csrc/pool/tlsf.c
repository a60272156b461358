/*
 * tlsf.c — the two-level segregated-fit index of free blocks: O(1) insert, remove and search.
 *
 * A free block of u 512-byte units sits in list (fl, sl): fl = floor(log2 u) (shifted so that
 * small sizes map linearly), sl = the next POOL_SL_BITS bits of u. Two bitmaps say which lists
 * are non-empty, so the first non-empty list at or above a class is found with two bit scans.
 *
 * Good fit, not first fit: the request's own class is scanned first for the tightest block that
 * fits (bounded by POOL_SCAN_LIMIT), which keeps big blocks whole; only then is the request
 * rounded up to the next class, where every block fits. This file does not split or coalesce
 * (block.c does); it knows nothing of segments or the backend.
 */
#include "pool_internal.h"

static inline int msb64(uint64_t x) { return 63 - __builtin_clzll(x); }

static void mapping_insert(size_t size, int *fl, int *sl) {
  uint64_t u = (uint64_t)size >> POOL_UNIT_SHIFT;
  if (u < POOL_SL_COUNT) {
    *fl = 0;
    *sl = (int)u;
  } else {
    int m = msb64(u);
    *fl = m - POOL_SL_BITS + 1;
    *sl = (int)((u >> (m - POOL_SL_BITS)) - POOL_SL_COUNT);
  }
}

/* The first class all of whose blocks are >= size. */
static void mapping_search(size_t size, int *fl, int *sl) {
  uint64_t u = (uint64_t)size >> POOL_UNIT_SHIFT;
  if (u >= POOL_SL_COUNT) u += ((uint64_t)1 << (msb64(u) - POOL_SL_BITS)) - 1;
  mapping_insert((size_t)u << POOL_UNIT_SHIFT, fl, sl);
}

void _llmmem_heap_insert(pool_heap_t *heap, pool_block_t *b) {
  int fl, sl;
  mapping_insert(b->size, &fl, &sl);
  b->fl = (uint8_t)fl;
  b->sl = (uint8_t)sl;
  pool_block_t *head = heap->heads[fl][sl];
  b->free_prev = NULL;
  b->free_next = head;
  if (head) head->free_prev = b;
  heap->heads[fl][sl] = b;
  heap->fl_bitmap |= (uint64_t)1 << fl;
  heap->sl_bitmap[fl] |= (uint32_t)1 << sl;
}

void _llmmem_heap_remove(pool_heap_t *heap, pool_block_t *b) {
  int fl = b->fl, sl = b->sl;
  if (b->free_prev)
    b->free_prev->free_next = b->free_next;
  else
    heap->heads[fl][sl] = b->free_next;
  if (b->free_next) b->free_next->free_prev = b->free_prev;
  b->free_prev = b->free_next = NULL;
  if (!heap->heads[fl][sl]) {
    heap->sl_bitmap[fl] &= ~((uint32_t)1 << sl);
    if (!heap->sl_bitmap[fl]) heap->fl_bitmap &= ~((uint64_t)1 << fl);
  }
}

/* The next non-empty list at or after (fl, sl), or 0 when there is none. */
static int next_list(const pool_heap_t *heap, int *fl, int *sl) {
  if (*sl < POOL_SL_COUNT) {
    uint32_t sl_map = heap->sl_bitmap[*fl] & (~(uint32_t)0 << *sl);
    if (sl_map) {
      *sl = __builtin_ctz(sl_map);
      return 1;
    }
  }
  if (*fl + 1 >= POOL_FL_COUNT) return 0;
  uint64_t fl_map = heap->fl_bitmap & (~(uint64_t)0 << (*fl + 1));
  if (!fl_map) return 0;
  *fl = __builtin_ctzll(fl_map);
  *sl = __builtin_ctz(heap->sl_bitmap[*fl]);
  return 1;
}

pool_block_t *_llmmem_heap_find(llmmem_pool_t *pool, pool_heap_t *heap, size_t size, void *stream, int limit) {
  int fl, sl;
  mapping_insert(size, &fl, &sl);
  /* 1. The tightest fit among the first blocks of the request's own class. */
  pool_block_t *best = NULL;
  int seen = 0;
  for (pool_block_t *b = heap->heads[fl][sl]; b && (limit == 0 || seen < limit); b = b->free_next, seen++) {
    if (b->size >= size && (!best || b->size < best->size) && _llmmem_block_usable(pool, b, stream)) {
      best = b;
      if (b->size == size) break;
    }
  }
  if (best) return best;
  /* 2. Any usable block of a class whose blocks all fit. */
  int own_fl = fl, own_sl = sl;
  mapping_search(size, &fl, &sl);
  if (fl == own_fl && sl == own_sl) sl++; /* already looked at */
  while (next_list(heap, &fl, &sl)) {
    seen = 0;
    for (pool_block_t *b = heap->heads[fl][sl]; b && (limit == 0 || seen < limit); b = b->free_next, seen++)
      if (_llmmem_block_usable(pool, b, stream)) return b;
    sl++;
  }
  return NULL;
}

size_t _llmmem_heap_largest(const pool_heap_t *heap) {
  if (!heap->fl_bitmap) return 0;
  int fl = msb64(heap->fl_bitmap);
  int sl = 31 - __builtin_clz(heap->sl_bitmap[fl]);
  size_t best = 0;
  for (const pool_block_t *b = heap->heads[fl][sl]; b; b = b->free_next)
    if (b->size > best) best = b->size;
  return best;
}
