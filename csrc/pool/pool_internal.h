/*
 * pool_internal.h — data structures of the caching pool, shared by the files of csrc/pool/.
 * Not part of the ABI.
 *
 * Layout: the pool owns regions. A region is either a segment obtained from the backend, or a
 * 2 MiB chunk carved out of a segment for small requests (the chunk is itself one allocated block
 * of the large heap). The blocks of a region tile it exactly, linked in address order; free blocks
 * of large regions sit in the large TLSF heap, free blocks of chunks in the small heap, so a small
 * request can never split a big free range.
 */
#ifndef LLMMEM_POOL_INTERNAL_H
#define LLMMEM_POOL_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include <llmmem/pool.h>

#include "internal.h"

#ifdef __cplusplus
extern "C" { /* the CUDA backends (.cu) include this header too */
#endif

/* TLSF index: sizes are counted in 512-byte units u; first level = floor(log2 u), split into
 * 2^SL_BITS linear second-level classes. Sizes below 2^SL_BITS units map linearly into fl 0. */
#define POOL_SL_BITS    4
#define POOL_SL_COUNT   (1 << POOL_SL_BITS)
#define POOL_FL_COUNT   56 /* 512 B * 2^55 units: beyond any real address space */
#define POOL_UNIT_SHIFT 9  /* log2(LLMMEM_POOL_GRANULARITY) */
/* How many blocks of one free list a search looks at before trying the next list. Only blocks
 * that are waiting for another stream's event are skipped, so the first one nearly always fits. */
#define POOL_SCAN_LIMIT 8

typedef struct pool_region_s pool_region_t;

typedef struct pool_block_s {
  uintptr_t addr;
  size_t size;               /* bytes, multiple of 512 */
  size_t requested;          /* bytes asked for; 0 while free */
  struct pool_block_s *prev; /* neighbours in the same region, by address (NULL at the ends) */
  struct pool_block_s *next;
  struct pool_block_s *free_prev; /* links in a TLSF list while free; in the spare list when unused */
  struct pool_block_s *free_next;
  struct pool_block_s *pend_prev; /* links in the pending-event list while free with an event */
  struct pool_block_s *pend_next;
  pool_region_t *region; /* the region this block tiles */
  pool_region_t *chunk;  /* non-NULL when this large block backs a small-request chunk */
  void *stream;          /* allocated: allocation stream; free with event: stream freed on */
  void *event;           /* free only: event recorded at the free, NULL once complete */
  uint64_t event_seq;    /* order of event records: the later event on a stream covers earlier ones */
  uint8_t is_free;
  uint8_t small;  /* belongs to the small heap (lives in a chunk) */
  uint8_t fl, sl; /* TLSF list while free */
} pool_block_t;

struct pool_region_s {
  uintptr_t base;
  size_t size;
  pool_block_t *first;        /* lowest-address block */
  pool_block_t *last;         /* highest-address block (where in-place growth appends) */
  pool_block_t *backing;      /* chunks: the large block holding this chunk; segments: NULL */
  pool_region_t *prev, *next; /* in the pool's segment list or chunk list */
  uint8_t is_initial;         /* the initial_size segment, kept until destroy */
  /* Segments that can resize: bit p set = the 2 MiB page p (counted from base) is decommitted.
   * A decommitted page lies wholly inside one free block; reserved_bytes leaves it out. */
  uint64_t *decommitted;
  size_t decommitted_words; /* capacity of the bitmap */
  size_t decommitted_pages;
};

typedef struct pool_heap_s {
  uint64_t fl_bitmap;                /* bit f: some list in first level f is non-empty */
  uint32_t sl_bitmap[POOL_FL_COUNT]; /* bit s: list (f, s) is non-empty */
  pool_block_t *heads[POOL_FL_COUNT][POOL_SL_COUNT];
} pool_heap_t;

/* Open-addressing map from the address of a live block to its metadata (linear probing,
 * backward-shift deletion, so no tombstones). */
typedef struct pool_ptrmap_s {
  uintptr_t *keys; /* 0 = empty slot (no block starts at address 0) */
  pool_block_t **vals;
  size_t capacity; /* power of two */
  size_t count;
} pool_ptrmap_t;

typedef struct pool_slab_s {
  struct pool_slab_s *next;
  pool_block_t blocks[];
} pool_slab_t;

struct llmmem_pool_s {
  pthread_mutex_t lock;
  llmmem_pool_backend_t backend;
  llmmem_pool_options_t options;
  pool_heap_t large;
  pool_heap_t small;
  pool_ptrmap_t live;
  pool_region_t *segments; /* doubly linked, newest first */
  pool_region_t *chunks;
  pool_region_t *top;         /* the segment growth extends in place (backend resize), or NULL */
  pool_block_t *pending_head; /* free blocks with an outstanding event, oldest first */
  pool_block_t *pending_tail;
  pool_block_t *spare_blocks; /* recycled metadata */
  pool_slab_t *slabs;
  size_t empty_chunks; /* chunks that are entirely free (at most one is kept) */
  uint64_t event_seq;
  int release_when_empty;
  int closing;            /* destroy is under way: allocations are refused */
  llmmem_pool_stats_t st; /* counters kept up to date; derived fields filled by stats() */
  size_t pending_bytes;   /* free bytes still waiting for a stream event */
  int64_t reserved_high;  /* highest reserved_bytes ever (not reset with the peaks): taking
                                     memory beyond it first gives back idle holes (segment.c) */
};

/* tlsf.c */
void _llmmem_heap_insert(pool_heap_t *heap, pool_block_t *b);
void _llmmem_heap_remove(pool_heap_t *heap, pool_block_t *b);
/* A free block of at least `size` bytes usable on `stream`, or NULL. `limit` bounds the blocks
 * looked at per list (0 = no bound). Blocks whose event completed are cleared on the way. */
pool_block_t *_llmmem_heap_find(llmmem_pool_t *pool, pool_heap_t *heap, size_t size, void *stream, int limit);
size_t _llmmem_heap_largest(const pool_heap_t *heap);

/* ptrmap.c */
llmmem_status_t _llmmem_ptrmap_init(pool_ptrmap_t *m);
void _llmmem_ptrmap_free(pool_ptrmap_t *m);
llmmem_status_t _llmmem_ptrmap_put(pool_ptrmap_t *m, uintptr_t key, pool_block_t *val);
pool_block_t *_llmmem_ptrmap_get(const pool_ptrmap_t *m, uintptr_t key);
pool_block_t *_llmmem_ptrmap_take(pool_ptrmap_t *m, uintptr_t key);

/* A stream value no caller passes: "usable by every stream", for memory that stops being tied to
 * the stream that asks for it (a new chunk of small blocks). */
#define POOL_ANY_STREAM ((void *)UINTPTR_MAX)

/* The event recorded when a block was freed: until it completes, only `stream` may reuse it. */
typedef struct pool_event_s {
  void *event;
  void *stream;
  uint64_t seq;
} pool_event_t;

static inline pool_heap_t *_llmmem_heap_of(llmmem_pool_t *pool, const pool_block_t *b) {
  return b->small ? &pool->small : &pool->large;
}

/* A region whose blocks are one free block. */
static inline int _llmmem_region_empty(const pool_region_t *r) {
  return r->first->is_free && r->first->size == r->size;
}

/* A segment the pool may give back to the backend: wholly free, event-free, and not the initial
 * one (kept until destroy). */
static inline int _llmmem_segment_releasable(const pool_region_t *r) {
  return !r->is_initial && _llmmem_region_empty(r) && !r->first->event;
}

/* block.c: metadata, events of free blocks (keeping the pending list and pending_bytes
 * consistent), coalescing, splitting */
pool_block_t *_llmmem_block_new(llmmem_pool_t *pool);
void _llmmem_block_recycle(llmmem_pool_t *pool, pool_block_t *b);
void _llmmem_update_active(llmmem_pool_t *pool);
void _llmmem_attach_event(llmmem_pool_t *pool, pool_block_t *b, pool_event_t ev);
pool_event_t _llmmem_detach_event(llmmem_pool_t *pool, pool_block_t *b);
void _llmmem_release_event(llmmem_pool_t *pool, pool_event_t ev);
void _llmmem_block_clear_event(llmmem_pool_t *pool, pool_block_t *b);
/* Usable on `stream` now: no event, freed on that stream, or its event has completed. */
int _llmmem_block_usable(llmmem_pool_t *pool, pool_block_t *b, void *stream);
pool_block_t *_llmmem_coalesce(llmmem_pool_t *pool, pool_block_t *b);
void _llmmem_split(llmmem_pool_t *pool, pool_block_t *b, size_t size, pool_block_t *rest);

/* segment.c: segments, chunks, growth, event polling */
llmmem_status_t _llmmem_add_segment(llmmem_pool_t *pool, size_t bytes, int is_initial);
size_t _llmmem_release_segment(llmmem_pool_t *pool, pool_region_t *r);
void _llmmem_release_empty_chunks(llmmem_pool_t *pool);
void _llmmem_put_back(llmmem_pool_t *pool, pool_block_t *b);
void _llmmem_poll_events(llmmem_pool_t *pool, int max_checks);
llmmem_status_t _llmmem_wait_all_events(llmmem_pool_t *pool);
pool_block_t *_llmmem_large_take(llmmem_pool_t *pool, size_t size, void *stream, llmmem_status_t *why);
pool_block_t *_llmmem_new_chunk(llmmem_pool_t *pool);
size_t _llmmem_shrink_segment(llmmem_pool_t *pool, pool_region_t *r);
/* A large block just handed out: commits the decommitted pages under it. */
llmmem_status_t _llmmem_commit_block(llmmem_pool_t *pool, pool_block_t *b);
static inline int _llmmem_page_decommitted(const pool_region_t *r, size_t page) {
  return page / 64 < r->decommitted_words && (r->decommitted[page / 64] >> (page % 64)) & 1;
}
/* The 2 MiB pages (indices counted from r->base) lying wholly inside [addr, addr + bytes): [*lo,
 * *hi), empty when *lo >= *hi. Only those pages of a free block can be decommitted. */
static inline void _llmmem_pages_inside(const pool_region_t *r, uintptr_t addr, size_t bytes, size_t *lo, size_t *hi) {
  *lo = (addr - r->base + LLMMEM_POOL_CHUNK_SIZE - 1) / LLMMEM_POOL_CHUNK_SIZE;
  *hi = (addr + bytes - r->base) / LLMMEM_POOL_CHUNK_SIZE;
}

/* pool_query.c: the longest free stretch of committed memory (stats' largest_free_block). Lock held. */
size_t _llmmem_largest_free(llmmem_pool_t *pool);

/* host_limits.c: what the system can still give this process, for the host backend. */
typedef struct pool_host_limits_s {
  size_t available;  /* bytes that can still be committed (SIZE_MAX: nothing known bounds it) */
  const char *bound; /* what sets `available`, for messages: "MemAvailable + SwapFree", ... */
  size_t total;      /* the most memory the process could ever have (RAM + swap, cgroup limit,
                        RLIMIT_DATA, RLIMIT_AS): no region needs more address space */
  size_t va_limit;   /* bytes of address space the process may map (RLIMIT_AS, or the user space) */
  size_t va_used;    /* bytes of address space mapped now (VmSize) */
} pool_host_limits_t;
void _llmmem_pool_host_limits(pool_host_limits_t *out);
/* What the host backend calls: _llmmem_pool_host_limits, unless a test has put a stand-in here. */
extern void (*_llmmem_pool_host_probe)(pool_host_limits_t *out);
/* backend_host.c: 0 commits host memory without populating it. Only for tests of the pool's own
 * bookkeeping, which reserve gigabytes they never touch; everything else keeps 1. */
extern int _llmmem_pool_host_populate;

/* slots.c */
void _llmmem_slots_forget(llmmem_pool_t *pool);

/* pool_query.c: verifies every invariant (tiling, heaps, map, counters). LLMMEM_OK or
 * LLMMEM_ERR_INTERNAL naming the broken one. Takes the lock. For tests and debug builds. */
llmmem_status_t _llmmem_pool_check(llmmem_pool_t *pool);

static inline void _llmmem_stat_add(llmmem_pool_stat_t *s, int64_t delta) {
  s->current += delta;
  if (s->current > s->peak) s->peak = s->current;
}

static inline void _llmmem_reserved_add(llmmem_pool_t *pool, int64_t delta) {
  _llmmem_stat_add(&pool->st.reserved_bytes, delta);
  if (pool->st.reserved_bytes.current > pool->reserved_high) pool->reserved_high = pool->st.reserved_bytes.current;
}

#ifdef __cplusplus
}
#endif

#endif /* LLMMEM_POOL_INTERNAL_H */
