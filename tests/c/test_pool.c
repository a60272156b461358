/*
 * test_pool.c — the caching pool's C core under ASan+UBSan, with the host backend and a fake
 * stream/event backend: seeded random sequences against a model, coalescing, exact OOM at
 * max_size, misuse (double/foreign free, size 0), stream-ordered reuse, four threads, slots.
 */
#define _POSIX_C_SOURCE 200809L /* posix_memalign */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <llmmem/pool.h>

#include "../../csrc/pool/pool_internal.h"
#include "testhelper.h"

#define MiB ((size_t)1 << 20)

/* ---- a host backend with fake streams and events the test completes by hand ---------------- */

typedef struct {
  int done;
  int released;
  void *stream;
} fake_event_t;

typedef struct {
  fake_event_t *events[4096];
  int n_events;
  int fail_reserve; /* reserve returns NOMEM while set */
  size_t reserved;  /* bytes currently held */
  size_t capacity;  /* > 0: regions can grow in place (resize) up to this many bytes */
  int destroyed;
} fake_ctx_t;

static llmmem_status_t fake_reserve(void *ctx, size_t bytes, void **out) {
  fake_ctx_t *f = ctx;
  if (f->fail_reserve) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "fake: reserve refused");
  void *p = NULL;
  size_t room = f->capacity > bytes ? f->capacity : bytes; /* the "address space" behind the region */
  if (posix_memalign(&p, 4096, room) != 0) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "fake: no memory");
  f->reserved += bytes;
  *out = p;
  return LLMMEM_OK;
}
static void fake_release(void *ctx, void *ptr, size_t bytes) {
  ((fake_ctx_t *)ctx)->reserved -= bytes;
  free(ptr);
}
static llmmem_status_t fake_resize(void *ctx, void *ptr, size_t old_bytes, size_t new_bytes) {
  fake_ctx_t *f = ctx;
  (void)ptr;
  if (new_bytes > f->capacity || f->fail_reserve) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "fake: cannot grow in place");
  f->reserved = f->reserved - old_bytes + new_bytes;
  return LLMMEM_OK;
}
static llmmem_status_t fake_record(void *ctx, void *stream, void **out) {
  fake_ctx_t *f = ctx;
  if (f->n_events >= 4096) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "fake: too many events");
  fake_event_t *e = calloc(1, sizeof *e);
  e->stream = stream;
  f->events[f->n_events++] = e;
  *out = e;
  return LLMMEM_OK;
}
static int fake_done(void *ctx, void *ev) {
  (void)ctx;
  return ((fake_event_t *)ev)->done;
}
/* Like CUDA: once an event is waited for, every earlier event of its stream is complete too. */
static llmmem_status_t fake_wait(void *ctx, void *ev) {
  fake_ctx_t *f = ctx;
  fake_event_t *e = ev;
  for (int i = 0; i < f->n_events; i++) {
    if (f->events[i]->stream == e->stream) f->events[i]->done = 1;
    if (f->events[i] == e) break;
  }
  return LLMMEM_OK;
}
static void fake_event_release(void *ctx, void *ev) {
  (void)ctx;
  ((fake_event_t *)ev)->released++;
}
static void fake_destroy(void *ctx) { ((fake_ctx_t *)ctx)->destroyed = 1; }

static void fake_complete(fake_ctx_t *f, void *stream) {
  for (int i = 0; i < f->n_events; i++)
    if (f->events[i]->stream == stream) f->events[i]->done = 1;
}
static int fake_all_released_once(fake_ctx_t *f) {
  for (int i = 0; i < f->n_events; i++)
    if (f->events[i]->released != 1) return 0;
  return 1;
}
static void fake_free_events(fake_ctx_t *f) {
  for (int i = 0; i < f->n_events; i++) free(f->events[i]);
  f->n_events = 0;
}

static llmmem_pool_backend_t fake_backend(fake_ctx_t *f, int with_events) {
  llmmem_pool_backend_t b = {0};
  b.name = "fake";
  b.device = -1;
  b.ctx = f;
  b.reserve = fake_reserve;
  b.release = fake_release;
  if (f->capacity) b.resize = fake_resize;
  if (with_events) {
    b.event_record = fake_record;
    b.event_done = fake_done;
    b.event_wait = fake_wait;
    b.event_release = fake_event_release;
  }
  b.destroy = fake_destroy;
  return b;
}

/* fixed = 1: every growth is a separate segment (the policy with cudaMalloc, which cannot grow a
 * region in place); fixed = 0: the host backend's in-place growth. */
static llmmem_pool_t *host_pool_policy(size_t initial, size_t max, size_t growth, int fixed) {
  llmmem_pool_backend_t b;
  llmmem_pool_options_t o = {initial, max, growth, fixed};
  llmmem_pool_t *p = NULL;
  if (llmmem_pool_backend_host(0, &b) != LLMMEM_OK) return NULL;
  if (llmmem_pool_create(&b, &o, &p) != LLMMEM_OK) return NULL;
  return p;
}
static llmmem_pool_t *host_pool(size_t initial, size_t max, size_t growth) {
  return host_pool_policy(initial, max, growth, 1);
}
static llmmem_pool_t *grow_pool(size_t initial, size_t max, size_t growth) {
  return host_pool_policy(initial, max, growth, 0);
}

/* Every block of the snapshot: free or not, all in one piece per segment? */
static int segments_whole_and_free(llmmem_pool_t *p) {
  size_t n = 0;
  if (llmmem_pool_snapshot(p, NULL, 0, &n) != LLMMEM_OK) return 0;
  llmmem_pool_block_info_t *info = calloc(n ? n : 1, sizeof *info);
  size_t m = 0;
  int ok = llmmem_pool_snapshot(p, info, n, &m) == LLMMEM_OK && m == n;
  llmmem_pool_stats_t s;
  ok = ok && llmmem_pool_stats(p, &s) == LLMMEM_OK && (int64_t)n == s.segments.current;
  for (size_t i = 0; i < n; i++)
    ok = ok && info[i].state == LLMMEM_POOL_BLOCK_FREE && info[i].addr == info[i].segment_base &&
         info[i].size == info[i].segment_size;
  free(info);
  return ok;
}

/* ---- randomized sequences against a model ------------------------------------------------- */

typedef struct {
  unsigned char *ptr;
  size_t size;
  uint64_t tag;
} live_t;

/* Sizes from 1 B to 256 MiB, log-uniform, mostly small like a training step. */
static size_t random_size(unsigned long long *rng) {
  unsigned long long r = th_rand(rng);
  int big = (r % 100) < 3;
  int bits = big ? 20 + (int)((r >> 8) % 9) : (int)((r >> 8) % 21); /* 2^20..2^28 or 2^0..2^20 */
  size_t lo = (size_t)1 << bits;
  return lo + (size_t)((r >> 16) % lo);
}

static void stamp(live_t *l) {
  memcpy(l->ptr, &l->tag, l->size < 8 ? l->size : 8);
  if (l->size >= 16) memcpy(l->ptr + l->size - 8, &l->tag, 8);
}
static int stamp_ok(const live_t *l) {
  uint64_t a = 0, b = 0;
  memcpy(&a, l->ptr, l->size < 8 ? l->size : 8);
  uint64_t want = l->tag;
  if (l->size < 8) {
    uint64_t mask = ((uint64_t)1 << (8 * l->size)) - 1;
    return (a & mask) == (want & mask);
  }
  if (l->size >= 16) memcpy(&b, l->ptr + l->size - 8, 8);
  return a == want && (l->size < 16 || b == want);
}

static int random_run(llmmem_pool_t *p, unsigned long long seed, int ops, int max_live, int check_every) {
  live_t *live = calloc((size_t)max_live, sizeof *live);
  int n = 0, ok = 1;
  size_t model_alloc = 0, model_req = 0;
  unsigned long long rng = seed;
  for (int i = 0; i < ops && ok; i++) {
    int do_alloc = n == 0 || (n < max_live && th_rand(&rng) % 100 < 55);
    if (do_alloc) {
      size_t size = random_size(&rng);
      void *ptr = NULL;
      if (llmmem_pool_alloc(p, size, NULL, &ptr) != LLMMEM_OK) {
        ok = 0;
        break;
      }
      if (((uintptr_t)ptr & 511) != 0) ok = 0;
      live[n] = (live_t){ptr, size, th_rand(&rng)};
      stamp(&live[n]);
      model_alloc += (size + 511) / 512 * 512;
      model_req += size;
      n++;
    } else {
      int k = (int)(th_rand(&rng) % (unsigned long long)n);
      if (!stamp_ok(&live[k])) ok = 0; /* someone else wrote into this block: overlap */
      if (llmmem_pool_free(p, live[k].ptr, NULL) != LLMMEM_OK) ok = 0;
      model_alloc -= (live[k].size + 511) / 512 * 512;
      model_req -= live[k].size;
      live[k] = live[--n];
    }
    if (check_every && i % check_every == 0) {
      llmmem_pool_stats_t s;
      if (_llmmem_pool_check(p) != LLMMEM_OK) ok = 0;
      if (llmmem_pool_stats(p, &s) != LLMMEM_OK) ok = 0;
      if ((size_t)s.allocated_bytes.current != model_alloc || (size_t)s.requested_bytes.current != model_req ||
          s.allocations.current != n)
        ok = 0;
      if (s.free_bytes + (size_t)s.allocated_bytes.current != (size_t)s.reserved_bytes.current) ok = 0;
      if (s.largest_free_block > s.free_bytes) ok = 0;
    }
  }
  for (int k = 0; k < n; k++) {
    if (!stamp_ok(&live[k])) ok = 0;
    if (llmmem_pool_free(p, live[k].ptr, NULL) != LLMMEM_OK) ok = 0;
  }
  free(live);
  return ok;
}

/* ---- threads ------------------------------------------------------------------------------ */

typedef struct {
  llmmem_pool_t *pool;
  unsigned long long seed;
  int ok;
} thread_arg_t;

static void *thread_run(void *arg) {
  thread_arg_t *t = arg;
  live_t live[64];
  int n = 0;
  unsigned long long rng = t->seed;
  t->ok = 1;
  for (int i = 0; i < 20000; i++) {
    if (n == 0 || (n < 64 && th_rand(&rng) % 2)) {
      size_t size = 1 + th_rand(&rng) % (2 * MiB);
      void *ptr = NULL;
      if (llmmem_pool_alloc(t->pool, size, NULL, &ptr) != LLMMEM_OK) {
        t->ok = 0;
        break;
      }
      live[n] = (live_t){ptr, size, th_rand(&rng)};
      stamp(&live[n]);
      n++;
    } else {
      int k = (int)(th_rand(&rng) % (unsigned long long)n);
      if (!stamp_ok(&live[k])) t->ok = 0;
      if (llmmem_pool_free(t->pool, live[k].ptr, NULL) != LLMMEM_OK) t->ok = 0;
      live[k] = live[--n];
    }
  }
  for (int k = 0; k < n; k++) {
    if (!stamp_ok(&live[k])) t->ok = 0;
    (void)llmmem_pool_free(t->pool, live[k].ptr, NULL);
  }
  return NULL;
}

int main(void) {
  /* These tests reserve gigabytes they never touch: the host backend's commit checks and
   * populating are tested in test_pool_host.c. */
  _llmmem_pool_host_populate = 0;
  TEST("create: bad arguments are refused with a reason") {
    llmmem_pool_backend_t b;
    llmmem_pool_t *p = (llmmem_pool_t *)0x1;
    CHECK_STATUS(llmmem_pool_create(NULL, NULL, &p), LLMMEM_ERR_INVALID);
    CHECK_OK(llmmem_pool_backend_host(0, &b));
    llmmem_pool_options_t o = {4 * MiB, 2 * MiB, 0};
    CHECK_STATUS(llmmem_pool_create(&b, &o, &p), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "max_size") != NULL);
    CHECK(p == NULL);
    CHECK_STATUS(llmmem_pool_backend_host(2, &b), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_pool_destroy(NULL), LLMMEM_ERR_INVALID);
    fake_ctx_t f = {0};
    f.fail_reserve = 1;
    llmmem_pool_backend_t fb = fake_backend(&f, 0);
    llmmem_pool_options_t o2 = {MiB, 0, 0};
    CHECK_STATUS(llmmem_pool_create(&fb, &o2, &p), LLMMEM_ERR_NOMEM);
    CHECK(strstr(llmmem_last_error(), "initial_size") != NULL);
    CHECK(f.destroyed == 1); /* the pool owned the backend even on failure */
  }

  TEST("initial_size is one segment; blocks are 512-aligned, rounded, counted") {
    llmmem_pool_t *p = host_pool(3 * MiB + 1, 0, 0);
    CHECK(p != NULL);
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.segments.current == 1 && s.reserved_bytes.current == (int64_t)(3 * MiB + 512));
    void *a = NULL, *b = NULL;
    CHECK_OK(llmmem_pool_alloc(p, 1, NULL, &a));
    CHECK_OK(llmmem_pool_alloc(p, 1000, NULL, &b));
    CHECK(((uintptr_t)a & 511) == 0 && ((uintptr_t)b & 511) == 0 && a != b);
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.allocated_bytes.current == 512 + 1024 && s.requested_bytes.current == 1001);
    CHECK(s.allocations.current == 2 && s.num_allocs == 2 && s.small_chunks == 1);
    CHECK(s.segments.current == 1); /* the chunk was carved out of the initial segment */
    size_t req = 0;
    CHECK_OK(llmmem_pool_block_size(p, b, &req));
    CHECK(req == 1000);
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_STATUS(llmmem_pool_destroy(p), LLMMEM_ERR_STATE); /* blocks still out */
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.small_chunks == 1); /* one empty chunk is kept for the next small request */
    CHECK_OK(llmmem_pool_empty_cache(p, NULL));
    CHECK(segments_whole_and_free(p));
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.allocated_bytes.current == 0 && s.allocated_bytes.peak == 1536 && s.num_frees == 2);
    CHECK(s.small_chunks == 0 && s.fragmentation == 0.0 && s.largest_free_block == 3 * MiB + 512);
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("misuse: size 0, double free, foreign and interior pointers are refused, nothing changes") {
    llmmem_pool_t *p = host_pool(4 * MiB, 0, 0);
    void *a = NULL, *x = (void *)0x1;
    CHECK_STATUS(llmmem_pool_alloc(p, 0, NULL, &x), LLMMEM_ERR_INVALID);
    CHECK(x == NULL);
    CHECK(strstr(llmmem_last_error(), "size") != NULL);
    CHECK_STATUS(llmmem_pool_alloc(p, 10, NULL, NULL), LLMMEM_ERR_INVALID);
    CHECK_OK(llmmem_pool_alloc(p, 2 * MiB, NULL, &a));
    CHECK_STATUS(llmmem_pool_free(p, (char *)a + 512, NULL), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "not a live block") != NULL);
    int local;
    CHECK_STATUS(llmmem_pool_free(p, &local, NULL), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "not allocated by this pool") != NULL);
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_STATUS(llmmem_pool_free(p, a, NULL), LLMMEM_ERR_INVALID);
    CHECK_OK(llmmem_pool_free(p, NULL, NULL));
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.num_invalid_frees == 3 && s.num_frees == 1 && s.allocations.current == 0);
    CHECK_STATUS(llmmem_pool_alloc(p, SIZE_MAX, NULL, &x), LLMMEM_ERR_NOMEM);
    CHECK_OK(_llmmem_pool_check(p));
    CHECK(segments_whole_and_free(p));
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("exact OOM at max_size, with growth and without") {
    llmmem_pool_t *p = host_pool(8 * MiB, 8 * MiB, 0);
    void *a = NULL, *b = NULL, *c = NULL;
    CHECK_OK(llmmem_pool_alloc(p, 8 * MiB, NULL, &a));
    CHECK_STATUS(llmmem_pool_alloc(p, 1, NULL, &b), LLMMEM_ERR_NOMEM);
    CHECK(strstr(llmmem_last_error(), "out of memory") != NULL);
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, NULL, &a));
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, NULL, &b));
    CHECK_STATUS(llmmem_pool_alloc(p, 512, NULL, &c), LLMMEM_ERR_NOMEM);
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.num_ooms == 2 && s.reserved_bytes.peak == (int64_t)(8 * MiB) && s.segments.current == 1);
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    CHECK_OK(llmmem_pool_destroy(p));

    p = host_pool(0, 10 * MiB, 0);
    CHECK_OK(llmmem_pool_alloc(p, 6 * MiB, NULL, &a));
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, NULL, &b));
    CHECK_STATUS(llmmem_pool_alloc(p, 1, NULL, &c), LLMMEM_ERR_NOMEM);
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.reserved_bytes.current == (int64_t)(10 * MiB) && s.segments.current == 2 && s.num_backend_reserves == 2);
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    /* 6 MiB free in one segment, 4 MiB live in the other: 7 MiB cannot fit, exactly */
    CHECK_STATUS(llmmem_pool_alloc(p, 7 * MiB, NULL, &c), LLMMEM_ERR_NOMEM);
    CHECK_OK(llmmem_pool_alloc(p, 6 * MiB, NULL, &c));
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    CHECK_OK(llmmem_pool_free(p, c, NULL));
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("the OOM path returns free growth segments and retries") {
    llmmem_pool_t *p = host_pool(0, 8 * MiB, 0);
    void *a = NULL, *b = NULL;
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, NULL, &a));
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, NULL, &b));
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    CHECK_OK(llmmem_pool_alloc(p, 8 * MiB, NULL, &a)); /* two 4 MiB segments cannot merge: release, regrow */
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.segments.current == 1 && s.num_backend_releases == 2 && s.num_ooms == 0);
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("splitting and immediate coalescing: a freed middle block merges both ways") {
    llmmem_pool_t *p = host_pool(16 * MiB, 0, 0);
    void *a, *b, *c, *d;
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, NULL, &a));
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, NULL, &b));
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, NULL, &c));
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_free(p, c, NULL));
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.free_bytes == 12 * MiB && s.largest_free_block == 8 * MiB);
    CHECK(s.fragmentation > 0.33 && s.fragmentation < 0.34);
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    CHECK(segments_whole_and_free(p));
    CHECK_OK(llmmem_pool_alloc(p, 16 * MiB, NULL, &d)); /* the whole segment is one block again */
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.segments.current == 1 && s.fragmentation == 0.0);
    CHECK_OK(llmmem_pool_free(p, d, NULL));
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("small requests stay in 2 MiB chunks, away from large blocks") {
    llmmem_pool_t *p = host_pool(64 * MiB, 0, 0);
    void *small[8], *big;
    for (int i = 0; i < 8; i++) CHECK_OK(llmmem_pool_alloc(p, 100 * 1024, NULL, &small[i]));
    CHECK_OK(llmmem_pool_alloc(p, 40 * MiB, NULL, &big));
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.small_chunks == 1);
    for (int i = 0; i < 8; i++) CHECK((uintptr_t)small[i] - (uintptr_t)small[0] < 2 * MiB);
    /* free every other small block: the holes cannot be used by a large request */
    for (int i = 0; i < 8; i += 2) CHECK_OK(llmmem_pool_free(p, small[i], NULL));
    CHECK_OK(_llmmem_pool_check(p));
    for (int i = 1; i < 8; i += 2) CHECK_OK(llmmem_pool_free(p, small[i], NULL));
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.small_chunks == 1); /* one empty chunk is kept for the next small request */
    CHECK_OK(llmmem_pool_free(p, big, NULL));
    size_t released = 99;
    CHECK_OK(llmmem_pool_empty_cache(p, &released));
    CHECK(released == 0); /* only the initial segment, which stays */
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.small_chunks == 0 && s.reserved_bytes.current == (int64_t)(64 * MiB));
    CHECK(segments_whole_and_free(p));
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("empty_cache gives back fully free growth segments only") {
    llmmem_pool_t *p = host_pool(2 * MiB, 0, 0);
    void *a, *b;
    CHECK_OK(llmmem_pool_alloc(p, 6 * MiB - 1000, NULL, &a));
    CHECK_OK(llmmem_pool_alloc(p, 10 * MiB, NULL, &b));
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    size_t released = 0;
    CHECK_OK(llmmem_pool_empty_cache(p, &released));
    CHECK(released == 6 * MiB); /* rounded up to the 2 MiB growth granularity */
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.segments.current == 2 && s.reserved_bytes.current == (int64_t)(12 * MiB));
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    CHECK_OK(llmmem_pool_empty_cache(p, &released));
    CHECK(released == 10 * MiB);
    CHECK_OK(llmmem_pool_reset_peak_stats(p));
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.reserved_bytes.peak == (int64_t)(2 * MiB) && s.allocated_bytes.peak == 0);
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("growth folds fully free segments into the new one instead of stranding them") {
    llmmem_pool_t *p = host_pool(0, 0, 0);
    void *a, *b, *c, *d;
    CHECK_OK(llmmem_pool_alloc(p, 12 * MiB, NULL, &a));
    CHECK_OK(llmmem_pool_alloc(p, 14 * MiB, NULL, &b));
    CHECK_OK(llmmem_pool_alloc(p, 2 * MiB, NULL, &c));
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    /* 26 MiB free in two segments, none fits 20 MiB: both go back, one 26 MiB segment comes */
    CHECK_OK(llmmem_pool_alloc(p, 20 * MiB, NULL, &d));
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.reserved_bytes.current == (int64_t)(28 * MiB) && s.reserved_bytes.peak == (int64_t)(28 * MiB));
    CHECK(s.segments.current == 2 && s.num_backend_releases == 2 && s.num_backend_reserves == 4);
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_free(p, c, NULL));
    CHECK_OK(llmmem_pool_free(p, d, NULL));
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("small requests use large-heap remnants before carving a new chunk") {
    llmmem_pool_t *p = host_pool(0, 0, 0);
    void *a, *b;
    CHECK_OK(llmmem_pool_alloc(p, 9 * MiB + 512 * 1024, NULL, &a)); /* a 10 MiB segment, 0.5 MiB tail */
    CHECK_OK(llmmem_pool_alloc(p, 100 * 1024, NULL, &b));
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.small_chunks == 0 && s.segments.current == 1 && (uintptr_t)b == (uintptr_t)a + 9 * MiB + 512 * 1024);
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    CHECK(segments_whole_and_free(p));
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("a mid-size request that must grow gets room for a few of its size when that wastes less") {
    llmmem_pool_t *p = host_pool(0, 0, 0);
    void *a[4];
    size_t r = 2 * MiB + MiB / 4; /* alone: a 4 MiB segment, 44% unused; four: 9 MiB in 10 MiB */
    for (int i = 0; i < 4; i++) CHECK_OK(llmmem_pool_alloc(p, r, NULL, &a[i]));
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.segments.current == 1 && s.reserved_bytes.current == (int64_t)(10 * MiB));
    for (int i = 0; i < 4; i++) CHECK_OK(llmmem_pool_free(p, a[i], NULL));
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("growth_size sets the minimum segment") {
    llmmem_pool_t *p = host_pool(0, 0, 32 * MiB);
    void *a;
    CHECK_OK(llmmem_pool_alloc(p, 1, NULL, &a));
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.reserved_bytes.current == (int64_t)(32 * MiB));
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("in-place growth: one segment grows by what a request lacks, rounded to 2 MiB") {
    llmmem_pool_t *p = grow_pool(0, 0, 0);
    void *a, *b, *c;
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB, NULL, &a));    /* 4 MiB, 1 MiB free at the end */
    CHECK_OK(llmmem_pool_alloc(p, 5 * MiB, NULL, &b));    /* lacks 4 MiB: the free end merges with the growth */
    CHECK_OK(llmmem_pool_alloc(p, 100 * 1024, NULL, &c)); /* a 2 MiB chunk: +2 MiB */
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.segments.current == 1 && s.reserved_bytes.current == (int64_t)(10 * MiB) && s.num_backend_reserves == 3);
    CHECK((uintptr_t)b == (uintptr_t)a + 3 * MiB);
    CHECK_OK(_llmmem_pool_check(p));
    memset(b, 0xab, 5 * MiB); /* the grown memory is there */
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_free(p, c, NULL));
    /* 3 MiB free at the start does not fit 4 MiB; the empty chunk at the end is given back and
     * merges with the growth: +2 MiB */
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, NULL, &a));
    CHECK((uintptr_t)a == (uintptr_t)b + 5 * MiB);
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    CHECK(segments_whole_and_free(p));
    /* the growth to 12 MiB gave back the whole page [0, 2) of the 3 MiB hole at the start */
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.reserved_bytes.current == (int64_t)(10 * MiB) && s.decommitted_bytes == 2 * MiB);
    size_t released = 0;
    CHECK_OK(llmmem_pool_empty_cache(p, &released));
    CHECK_OK(llmmem_pool_stats(p, &s));
    /* memory given back, not the segment's 12 MiB of address space */
    CHECK(released == 10 * MiB && s.reserved_bytes.current == 0 && s.segments.current == 0);
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("in-place growth: empty_cache gives back the free end in 2 MiB steps, never below initial_size") {
    llmmem_pool_t *p = grow_pool(3 * MiB, 0, 0);
    void *a, *b;
    CHECK_OK(llmmem_pool_alloc(p, 2 * MiB, NULL, &a));
    CHECK_OK(llmmem_pool_alloc(p, 9 * MiB, NULL, &b)); /* lacks 8 MiB: 11 MiB */
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.segments.current == 1 && s.reserved_bytes.current == (int64_t)(11 * MiB));
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    size_t released = 0;
    CHECK_OK(llmmem_pool_empty_cache(p, &released)); /* 9 MiB free end: 8 MiB go */
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(released == 8 * MiB && s.reserved_bytes.current == (int64_t)(3 * MiB));
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_empty_cache(p, &released));
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(released == 0 && s.reserved_bytes.current == (int64_t)(3 * MiB)); /* initial_size stays */
    CHECK(segments_whole_and_free(p));
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB, NULL, &a)); /* and grows again after a shrink */
    CHECK_OK(llmmem_pool_alloc(p, 1536 * 1024, NULL, &b));
    CHECK((uintptr_t)b == (uintptr_t)a + 3 * MiB);
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("in-place growth: exact OOM at max_size") {
    llmmem_pool_t *p = grow_pool(0, 10 * MiB, 0);
    void *a, *b, *c;
    CHECK_OK(llmmem_pool_alloc(p, 6 * MiB, NULL, &a));
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, NULL, &b));
    CHECK_STATUS(llmmem_pool_alloc(p, 1, NULL, &c), LLMMEM_ERR_NOMEM);
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.reserved_bytes.current == (int64_t)(10 * MiB) && s.segments.current == 1);
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_STATUS(llmmem_pool_alloc(p, 7 * MiB, NULL, &c), LLMMEM_ERR_NOMEM); /* 6 MiB free, 4 live */
    CHECK_OK(llmmem_pool_alloc(p, 6 * MiB, NULL, &c));
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    /* 4 MiB free at the end, 6 live: a 5 MiB request may grow by 1 MiB... rounded to 2, capped at max */
    CHECK_STATUS(llmmem_pool_alloc(p, 5 * MiB, NULL, &a), LLMMEM_ERR_NOMEM);
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, NULL, &a));
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_free(p, c, NULL));
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_destroy(p));

    p = grow_pool(0, 11 * MiB, 0);
    CHECK_OK(llmmem_pool_alloc(p, 6 * MiB, NULL, &a));
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB, NULL, &b)); /* lacks 3 MiB, rounded to 4: 10 MiB */
    CHECK_OK(llmmem_pool_alloc(p, 2 * MiB, NULL, &c)); /* 1 MiB free end + 1 MiB, capped at 11 MiB */
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.reserved_bytes.current == (int64_t)(11 * MiB) && s.segments.current == 1 && s.free_bytes == 0);
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    CHECK_OK(llmmem_pool_free(p, c, NULL));
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("in-place growth: whole pages of free holes are decommitted while growing, committed when reused") {
    for (int capped = 0; capped <= 1; capped++) {
      llmmem_pool_t *p = grow_pool(0, capped ? 64 * MiB : 0, 0);
      void *a, *b, *c, *d;
      CHECK_OK(llmmem_pool_alloc(p, 8 * MiB, NULL, &a));
      CHECK_OK(llmmem_pool_alloc(p, 3 * MiB / 2, NULL, &b)); /* 10 MiB, 0.5 MiB free end */
      CHECK_OK(llmmem_pool_free(p, a, NULL));                /* an 8 MiB hole: four whole pages */
      CHECK_OK(llmmem_pool_alloc(p, 10 * MiB, NULL, &c));    /* does not fit it: grows by 10 MiB */
      llmmem_pool_stats_t s;
      CHECK_OK(llmmem_pool_stats(p, &s));
      /* without a cap the hole's pages are given back while the segment grows past it */
      CHECK(s.segments.current == 1 && (uintptr_t)c == (uintptr_t)a + 19 * MiB / 2);
      CHECK(s.reserved_bytes.current == (int64_t)(capped ? 20 * MiB : 12 * MiB));
      CHECK(s.reserved_bytes.peak == (int64_t)(capped ? 20 * MiB : 12 * MiB));
      CHECK(s.decommitted_bytes == (capped ? 0 : 8 * MiB));
      /* largest_free_block counts committed memory: the decommitted hole holds none, the free end 0.5 MiB */
      CHECK(s.largest_free_block == (capped ? 8 * MiB : MiB / 2) && s.largest_free_block <= s.free_bytes);
      CHECK_OK(_llmmem_pool_check(p));
      CHECK_OK(llmmem_pool_alloc(p, 3 * MiB, NULL, &d)); /* into the hole: its first two pages come back */
      CHECK(d == a);
      memset(d, 0x5a, 3 * MiB);
      CHECK_OK(llmmem_pool_stats(p, &s));
      CHECK(s.reserved_bytes.current == (int64_t)(capped ? 20 * MiB : 16 * MiB));
      CHECK(s.decommitted_bytes == (capped ? 0 : 4 * MiB));
      CHECK_OK(_llmmem_pool_check(p));
      CHECK_OK(llmmem_pool_free(p, d, NULL));
      CHECK_OK(llmmem_pool_free(p, b, NULL));
      CHECK_OK(llmmem_pool_free(p, c, NULL));
      CHECK(segments_whole_and_free(p));
      size_t released = 0;
      CHECK_OK(llmmem_pool_empty_cache(p, &released));
      CHECK_OK(llmmem_pool_stats(p, &s));
      CHECK(s.reserved_bytes.current == 0 && s.segments.current == 0 && s.decommitted_bytes == 0);
      CHECK_OK(llmmem_pool_destroy(p));
    }
    /* the initial segment shrinks over decommitted pages without counting them twice */
    llmmem_pool_t *p = grow_pool(3 * MiB, 0, 0);
    void *a, *b, *c;
    CHECK_OK(llmmem_pool_alloc(p, 1536 * 1024, NULL, &a));
    CHECK_OK(llmmem_pool_alloc(p, 6 * MiB, NULL, &b));
    CHECK_OK(llmmem_pool_alloc(p, 1536 * 1024, NULL, &c));
    CHECK_OK(llmmem_pool_free(p, b, NULL)); /* 6 MiB hole */
    void *d;
    CHECK_OK(llmmem_pool_alloc(p, 7 * MiB, NULL, &d)); /* grows; the hole's whole pages go back */
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.decommitted_bytes > 0);
    CHECK_OK(llmmem_pool_free(p, d, NULL));
    CHECK_OK(llmmem_pool_free(p, c, NULL)); /* the hole merges into the free end */
    size_t released = 0;
    CHECK_OK(llmmem_pool_empty_cache(p, &released));
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.reserved_bytes.current == (int64_t)(3 * MiB) && s.decommitted_bytes == 0);
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB, NULL, &b));
    memset(b, 1, 3 * MiB);
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("in-place growth: empty_cache reports what reserved_bytes drops by, never commits, over decommitted pages") {
    /* a growth segment released whole while 6 of its 20 MiB were decommitted */
    llmmem_pool_t *p = grow_pool(0, 0, 0);
    void *a, *b, *c, *d;
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB / 2, NULL, &a)); /* [0, 1.5) */
    CHECK_OK(llmmem_pool_alloc(p, 8 * MiB, NULL, &b));     /* [1.5, 9.5) */
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB / 2, NULL, &c)); /* [9.5, 11): 12 MiB reserved */
    CHECK_OK(llmmem_pool_free(p, b, NULL));                /* hole [1.5, 9.5): pages 1..3 whole */
    CHECK_OK(llmmem_pool_alloc(p, 10 * MiB, NULL, &d));    /* grows; 3 pages (6 MiB) decommitted */
    llmmem_pool_stats_t s, s2;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.decommitted_bytes == 6 * MiB && s.reserved_bytes.current == (int64_t)(16 * MiB));
    /* committed free: hole edges [1.5, 2) and [8, 9.5), free end [21, 22) */
    CHECK(s.largest_free_block == 3 * MiB / 2 && s.free_bytes == 3 * MiB);
    CHECK_OK(llmmem_pool_free(p, d, NULL));
    CHECK_OK(llmmem_pool_free(p, c, NULL));
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_stats(p, &s));
    /* one free block of 22 MiB address space, 6 MiB of it decommitted: the longest committed
     * stretch is its tail after page 3, [8, 22) */
    CHECK(s.free_bytes == 16 * MiB && s.decommitted_bytes == 6 * MiB);
    CHECK(s.largest_free_block == 14 * MiB && s.largest_free_block <= s.free_bytes);
    CHECK(s.fragmentation > 0.124 && s.fragmentation < 0.126); /* 1 - 14/16 */
    size_t released = 0;
    CHECK_OK(llmmem_pool_empty_cache(p, &released));
    CHECK_OK(llmmem_pool_stats(p, &s2));
    CHECK(released == 16 * MiB && s2.reserved_bytes.current == 0); /* not the 22 MiB of address space */
    CHECK(s2.reserved_bytes.peak == s.reserved_bytes.peak);
    CHECK_OK(llmmem_pool_destroy(p));

    /* a segment that keeps initial_size shrinks over decommitted pages: it gives back only what it
     * held, and the cut stops short of a decommitted page rather than commit it again */
    p = grow_pool(3 * MiB, 0, 0);
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB / 2, NULL, &a)); /* [0, 1.5) */
    CHECK_OK(llmmem_pool_alloc(p, 8 * MiB, NULL, &b));     /* [1.5, 9.5) */
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB / 2, NULL, &c)); /* [9.5, 11) */
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    CHECK_OK(llmmem_pool_alloc(p, 10 * MiB, NULL, &d)); /* pages 2..3 decommitted (page 1 is initial_size) */
    CHECK_OK(llmmem_pool_stats(p, &s));
    int64_t peak = s.reserved_bytes.peak;
    size_t decommitted = s.decommitted_bytes;
    CHECK(decommitted == 4 * MiB);
    CHECK_OK(llmmem_pool_free(p, d, NULL));
    CHECK_OK(llmmem_pool_free(p, c, NULL)); /* free end [1.5, size) over the decommitted pages */
    CHECK_OK(llmmem_pool_stats(p, &s));
    int64_t before = s.reserved_bytes.current;
    CHECK_OK(llmmem_pool_empty_cache(p, &released));
    CHECK_OK(llmmem_pool_stats(p, &s2));
    CHECK((int64_t)released == before - s2.reserved_bytes.current);
    CHECK(s2.reserved_bytes.current >= (int64_t)(3 * MiB) && s2.reserved_bytes.peak == peak);
    CHECK(s2.largest_free_block <= s2.free_bytes);
    CHECK(s2.num_backend_reserves == s.num_backend_reserves); /* nothing was committed */
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_alloc(p, 20 * MiB, NULL, &b)); /* the rest still works */
    memset(b, 3, 20 * MiB);
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_empty_cache(p, &released));
    CHECK_OK(llmmem_pool_stats(p, &s2));
    CHECK(s2.reserved_bytes.current == (int64_t)(3 * MiB));
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_destroy(p));

    /* the new end would fall inside a decommitted page: the cut stops at that page's end */
    p = grow_pool(MiB / 2, 0, 0);
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB / 2, NULL, &a)); /* grows to 2.5: [0, 1.5) */
    CHECK_OK(llmmem_pool_alloc(p, 8 * MiB, NULL, &b));     /* 10.5: [1.5, 9.5) */
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB / 2, NULL, &c)); /* 12.5: [9.5, 11) */
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    CHECK_OK(llmmem_pool_alloc(p, 10 * MiB, NULL, &d)); /* 22.5; pages 1..3, [2, 8), decommitted */
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.decommitted_bytes == 6 * MiB && s.reserved_bytes.current == (int64_t)(33 * MiB / 2));
    CHECK_OK(llmmem_pool_free(p, d, NULL));
    CHECK_OK(llmmem_pool_free(p, c, NULL));          /* free end [1.5, 22.5): 21 MiB */
    CHECK_OK(llmmem_pool_empty_cache(p, &released)); /* a 20 MiB cut would end at 2.5, in page 1 */
    CHECK_OK(llmmem_pool_stats(p, &s2));
    CHECK(released == 29 * MiB / 2 && s2.reserved_bytes.current == (int64_t)(2 * MiB));
    CHECK(s2.decommitted_bytes == 2 * MiB && s2.num_backend_reserves == s.num_backend_reserves);
    CHECK(s2.largest_free_block == MiB / 2 && s2.free_bytes == MiB / 2);
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_alloc(p, 5 * MiB / 2, NULL, &b)); /* over the decommitted page: committed again */
    CHECK(b == (char *)a + 3 * MiB / 2);
    memset(b, 4, 5 * MiB / 2);
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("in-place growth: reusing a decommitted hole beyond the highest mark first gives back idle holes") {
    llmmem_pool_t *p = grow_pool(0, 0, 0);
    void *a, *b, *x, *y, *c, *d, *z;
    CHECK_OK(llmmem_pool_alloc(p, 8 * MiB, NULL, &a));     /* [0, 8) */
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB / 2, NULL, &b)); /* [8, 9.5) */
    CHECK_OK(llmmem_pool_alloc(p, 6 * MiB, NULL, &x));     /* [9.5, 15.5) */
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB / 2, NULL, &y)); /* [15.5, 17): 18 MiB reserved */
    CHECK_OK(llmmem_pool_free(p, a, NULL));                /* hole H1: 8 MiB, idle */
    CHECK_OK(llmmem_pool_alloc(p, 10 * MiB, NULL, &c));    /* grows; H1's 4 pages go back */
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.reserved_bytes.current == (int64_t)(20 * MiB) && s.decommitted_bytes == 8 * MiB);
    CHECK_OK(llmmem_pool_free(p, x, NULL)); /* hole H2: 6 MiB, committed, idle */
    /* 7 MiB fits only H1: its 4 pages come back, which would make 28 MiB, beyond the 20 MiB ever
     * held, so H2's two whole pages go back first: 24 MiB */
    CHECK_OK(llmmem_pool_alloc(p, 7 * MiB, NULL, &d));
    CHECK(d == a);
    memset(d, 7, 7 * MiB);
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.reserved_bytes.current == (int64_t)(24 * MiB) && s.reserved_bytes.peak == (int64_t)(24 * MiB));
    CHECK(s.decommitted_bytes == 4 * MiB);
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_alloc(p, 6 * MiB, NULL, &z)); /* into H2: its pages come back */
    CHECK(z == x);
    memset(z, 6, 6 * MiB);
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.reserved_bytes.current == (int64_t)(28 * MiB) && s.decommitted_bytes == 0);
    CHECK_OK(_llmmem_pool_check(p));
    void *all[] = {b, y, c, d, z};
    for (int i = 0; i < 5; i++) CHECK_OK(llmmem_pool_free(p, all[i], NULL));
    CHECK(segments_whole_and_free(p));
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("in-place growth: a backend that cannot grow further gets a new segment, which grows next") {
    fake_ctx_t f = {0};
    f.capacity = 8 * MiB;
    llmmem_pool_backend_t b = fake_backend(&f, 0);
    llmmem_pool_options_t o = {0, 0, 0};
    llmmem_pool_t *p = NULL;
    CHECK_OK(llmmem_pool_create(&b, &o, &p));
    void *x, *y, *z;
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, NULL, &x));
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, NULL, &y)); /* grows the first to its 8 MiB */
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB, NULL, &z)); /* no room behind it: a second segment */
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.segments.current == 2 && s.reserved_bytes.current == (int64_t)(12 * MiB) && f.reserved == 12 * MiB);
    CHECK((uintptr_t)y == (uintptr_t)x + 4 * MiB);
    void *w;
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB, NULL, &w)); /* the second grows in place: 1 MiB free end + 2 */
    CHECK((uintptr_t)w == (uintptr_t)z + 3 * MiB);
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.segments.current == 2 && s.reserved_bytes.current == (int64_t)(14 * MiB) && f.reserved == 14 * MiB);
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_free(p, x, NULL));
    CHECK_OK(llmmem_pool_free(p, y, NULL));
    CHECK_OK(llmmem_pool_free(p, z, NULL));
    CHECK_OK(llmmem_pool_free(p, w, NULL));
    CHECK_OK(llmmem_pool_empty_cache(p, NULL));
    CHECK(f.reserved == 0);
    CHECK_OK(llmmem_pool_destroy(p));
    CHECK(f.destroyed && f.reserved == 0);
  }

  TEST("in-place growth with streams: a free end waiting on another stream's event is not merged") {
    fake_ctx_t f = {0};
    f.capacity = 64 * MiB;
    llmmem_pool_backend_t b = fake_backend(&f, 1);
    llmmem_pool_options_t o = {0, 0, 0};
    llmmem_pool_t *p = NULL;
    CHECK_OK(llmmem_pool_create(&b, &o, &p));
    void *S1 = (void *)0x100, *S2 = (void *)0x200, *x, *y, *z;
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, S1, &x));
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, S1, &y));
    CHECK_OK(llmmem_pool_free(p, y, S1));            /* the free end waits on S1's event */
    CHECK_OK(llmmem_pool_alloc(p, 6 * MiB, S2, &z)); /* must not touch it: grows by 6 MiB after it */
    CHECK((uintptr_t)z == (uintptr_t)x + 8 * MiB);
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.segments.current == 1 && s.reserved_bytes.current == (int64_t)(14 * MiB));
    CHECK_OK(_llmmem_pool_check(p));
    fake_complete(&f, S1);
    CHECK_OK(llmmem_pool_free(p, x, S1));
    CHECK_OK(llmmem_pool_free(p, z, S2));
    fake_complete(&f, S2);
    CHECK_OK(llmmem_pool_empty_cache(p, NULL));
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.reserved_bytes.current == 0 && f.reserved == 0);
    CHECK_OK(llmmem_pool_destroy(p));
    CHECK(fake_all_released_once(&f));
    fake_free_events(&f);
  }

  TEST("stream-ordered reuse: same stream at once, other streams after the free's event") {
    fake_ctx_t f = {0};
    llmmem_pool_backend_t b = fake_backend(&f, 1);
    llmmem_pool_options_t o = {32 * MiB, 0, 0};
    llmmem_pool_t *p = NULL;
    CHECK_OK(llmmem_pool_create(&b, &o, &p));
    void *S1 = (void *)0x100, *S2 = (void *)0x200;
    void *a, *a2, *c, *d;
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, S1, &a));
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, S1, &d)); /* keeps a's block from merging into the tail */
    CHECK_OK(llmmem_pool_free(p, a, S1));
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.active_bytes.current == (int64_t)(4 * MiB + 4 * MiB)); /* d + a awaiting its event */
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, S1, &a2));
    CHECK(a2 == a);
    CHECK_OK(llmmem_pool_free(p, a2, S1));
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, S2, &c));
    CHECK(c != a); /* a's event on S1 has not completed */
    CHECK((uintptr_t)c >= (uintptr_t)d + 4 * MiB || (uintptr_t)c + 4 * MiB <= (uintptr_t)a);
    CHECK_OK(llmmem_pool_free(p, c, S2));
    fake_complete(&f, S1);
    void *e, *e2;
    CHECK_OK(llmmem_pool_stats(p, &s));
    int64_t reserved = s.reserved_bytes.current;
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, S2, &e));
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, S2, &e2));
    CHECK((e == a && e2 == c) || (e == c && e2 == a)); /* a is now reusable by S2, c always was */
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.reserved_bytes.current == reserved);
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_free(p, e, S2));
    CHECK_OK(llmmem_pool_free(p, e2, S2));
    CHECK_OK(llmmem_pool_free(p, d, S1));
    CHECK_OK(llmmem_pool_empty_cache(p, NULL)); /* waits every event */
    CHECK(segments_whole_and_free(p));
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.active_bytes.current == 0);
    CHECK_OK(llmmem_pool_destroy(p));
    CHECK(f.destroyed && f.reserved == 0 && fake_all_released_once(&f));
    fake_free_events(&f);
  }

  TEST("streams: a pending block is never handed to another stream, even under memory pressure") {
    fake_ctx_t f = {0};
    llmmem_pool_backend_t b = fake_backend(&f, 1);
    llmmem_pool_options_t o = {8 * MiB, 8 * MiB, 0};
    llmmem_pool_t *p = NULL;
    CHECK_OK(llmmem_pool_create(&b, &o, &p));
    void *S1 = (void *)0x100, *S2 = (void *)0x200, *a, *c;
    CHECK_OK(llmmem_pool_alloc(p, 8 * MiB, S1, &a));
    CHECK_OK(llmmem_pool_free(p, a, S1));
    /* S2 needs it: the OOM path waits for S1's event (a host sync), then reuses the block */
    CHECK_OK(llmmem_pool_alloc(p, 8 * MiB, S2, &c));
    CHECK(c == a);
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.num_event_waits == 1 && f.events[0]->done == 1);
    CHECK_OK(llmmem_pool_free(p, c, S2));
    CHECK_OK(llmmem_pool_destroy(p));
    CHECK(fake_all_released_once(&f));
    fake_free_events(&f);
  }

  TEST("streams: random multi-stream sequences keep every invariant") {
    fake_ctx_t f = {0};
    f.capacity = 48 * MiB; /* growth in place up to 48 MiB, then further segments */
    llmmem_pool_backend_t b = fake_backend(&f, 1);
    llmmem_pool_options_t o = {0, 0, 0};
    llmmem_pool_t *p = NULL;
    CHECK_OK(llmmem_pool_create(&b, &o, &p));
    unsigned long long rng = 7;
    void *streams[3] = {(void *)0x10, (void *)0x20, (void *)0x30};
    void *ptrs[32];
    void *on[32];
    size_t sizes[32];
    /* Model of the safety property: memory freed on stream S may go to another stream only once
     * the event recorded at that free has completed. */
    typedef struct {
      uintptr_t addr;
      size_t size;
      void *stream;
      fake_event_t *ev;
    } freed_t;
    static freed_t freed[4096];
    int n = 0, n_freed = 0, ok = 1, unsafe = 0;
    for (int i = 0; i < 3000 && ok; i++) {
      unsigned long long r = th_rand(&rng);
      if (f.n_events > 3500) break;
      if (n < 32 && (n == 0 || r % 2)) {
        on[n] = streams[r % 3];
        sizes[n] = 1 + (r >> 8) % (3 * MiB);
        if (llmmem_pool_alloc(p, sizes[n], on[n], &ptrs[n]) != LLMMEM_OK) ok = 0;
        uintptr_t lo = (uintptr_t)ptrs[n], hi = lo + sizes[n];
        for (int j = 0; j < n_freed; j++)
          if (freed[j].stream != on[n] && !freed[j].ev->done && lo < freed[j].addr + freed[j].size &&
              freed[j].addr < hi)
            unsafe++;
        n++;
      } else {
        int k = (int)((r >> 8) % (unsigned long long)n);
        if (llmmem_pool_free(p, ptrs[k], on[k]) != LLMMEM_OK) ok = 0;
        freed[n_freed++] = (freed_t){(uintptr_t)ptrs[k], sizes[k], on[k], f.events[f.n_events - 1]};
        ptrs[k] = ptrs[n - 1];
        sizes[k] = sizes[n - 1];
        on[k] = on[--n];
      }
      if (r % 7 == 0) fake_complete(&f, streams[(r >> 4) % 3]);
      if (i % 50 == 0 && _llmmem_pool_check(p) != LLMMEM_OK) ok = 0;
    }
    CHECK(ok);
    CHECK(unsafe == 0);
    CHECK(n_freed > 1000);
    for (n--; n >= 0; n--) CHECK_OK(llmmem_pool_free(p, ptrs[n], on[n]));
    CHECK_OK(llmmem_pool_empty_cache(p, NULL));
    CHECK_OK(_llmmem_pool_check(p));
    CHECK(segments_whole_and_free(p));
    CHECK_OK(llmmem_pool_destroy(p));
    CHECK(fake_all_released_once(&f));
    fake_free_events(&f);
  }

  TEST("10^5 seeded random allocations and frees, 1 B to 256 MiB, checked against a model") {
    for (unsigned long long seed = 1; seed <= 4; seed++) {
      /* seeds 1, 2: separate segments; 3, 4: one segment growing in place */
      llmmem_pool_t *p = host_pool_policy(seed % 2 == 1 ? 64 * MiB : 0, 0, 0, seed <= 2);
      CHECK(random_run(p, seed, 100000, 48, 997));
      CHECK_OK(_llmmem_pool_check(p));
      /* Complete coalescing: once the kept empty chunk is returned, every segment is one free
       * block — empty_cache releases only such segments, so nothing but the initial one stays. */
      llmmem_pool_stats_t s;
      CHECK_OK(llmmem_pool_stats(p, &s));
      CHECK(s.allocated_bytes.current == 0 && s.num_allocs == s.num_frees && s.num_allocs > 20000);
      CHECK_OK(llmmem_pool_empty_cache(p, NULL));
      CHECK(segments_whole_and_free(p));
      CHECK_OK(llmmem_pool_stats(p, &s));
      CHECK(s.reserved_bytes.current == (int64_t)(seed % 2 == 1 ? 64 * MiB : 0));
      CHECK_OK(llmmem_pool_destroy(p));
    }
  }

  TEST("four threads at once on one pool") {
    llmmem_pool_t *p = grow_pool(32 * MiB, 0, 0);
    pthread_t th[4];
    thread_arg_t args[4];
    for (int i = 0; i < 4; i++) {
      args[i] = (thread_arg_t){p, 100 + (unsigned long long)i, 0};
      CHECK(pthread_create(&th[i], NULL, thread_run, &args[i]) == 0);
    }
    for (int i = 0; i < 4; i++) {
      pthread_join(th[i], NULL);
      CHECK(args[i].ok);
    }
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_empty_cache(p, NULL));
    CHECK(segments_whole_and_free(p));
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.num_allocs == s.num_frees && s.allocations.current == 0);
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("snapshot lists every block in address order with its segment") {
    llmmem_pool_t *p = host_pool(4 * MiB, 0, 0);
    void *a, *b;
    CHECK_OK(llmmem_pool_alloc(p, 3000, NULL, &a));
    CHECK_OK(llmmem_pool_alloc(p, 2 * MiB - 1024, NULL, &b));
    size_t n = 0;
    CHECK_OK(llmmem_pool_snapshot(p, NULL, 0, &n));
    llmmem_pool_block_info_t info[16];
    size_t m = 0;
    CHECK(n <= 16);
    CHECK_OK(llmmem_pool_snapshot(p, info, 16, &m));
    CHECK(m == n);
    size_t live = 0, total = 0;
    for (size_t i = 0; i < n; i++) {
      total += info[i].size;
      if (info[i].state == LLMMEM_POOL_BLOCK_ALLOCATED) live++;
      if (i) CHECK(info[i].addr == info[i - 1].addr + info[i - 1].size);
    }
    CHECK(live == 2 && total == 4 * MiB);
    CHECK(info[0].small == 1 && info[0].requested == 3000);
    CHECK_STATUS(llmmem_pool_snapshot(p, NULL, 3, &m), LLMMEM_ERR_INVALID);
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_free(p, b, NULL));
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("pluggable slots: bind, alloc/free by slot, size 0, device check, release when empty") {
    llmmem_pool_t *p = host_pool(4 * MiB, 0, 0);
    int slot = -1, again = -1;
    CHECK_OK(llmmem_pool_bind_slot(p, &slot));
    CHECK_OK(llmmem_pool_bind_slot(p, &again));
    CHECK(slot >= 0 && slot == again);
    CHECK(llmmem_pool_slot_alloc(slot, 0, 0, NULL) == NULL);
    extern void *llmmem_pool_alloc_0(size_t, int, void *);
    extern void llmmem_pool_free_0(void *, size_t, int, void *);
    void *x = slot == 0 ? llmmem_pool_alloc_0(1000, 0, NULL) : llmmem_pool_slot_alloc(slot, 1000, 0, NULL);
    CHECK(x != NULL);
    llmmem_pool_slot_free(slot, (char *)x + 512, 1000, 0, NULL); /* refused, counted */
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.num_invalid_frees == 1 && s.allocations.current == 1);
    CHECK(llmmem_pool_slot_alloc(LLMMEM_POOL_SLOTS, 16, 0, NULL) == NULL);
    /* the owner goes away while a block is out: the pool lives until that block comes back */
    llmmem_pool_release_when_empty(p);
    if (slot == 0)
      llmmem_pool_free_0(x, 1000, 0, NULL);
    else
      llmmem_pool_slot_free(slot, x, 1000, 0, NULL);
    CHECK(llmmem_pool_slot_alloc(slot, 16, 0, NULL) == NULL); /* slot unbound by the destroy */
    CHECK_OK(llmmem_pool_unbind_slot(slot));
    CHECK_STATUS(llmmem_pool_unbind_slot(-1), LLMMEM_ERR_INVALID);

    fake_ctx_t f = {0};
    llmmem_pool_backend_t b = fake_backend(&f, 0);
    b.device = 1; /* pretends to be cuda:1 */
    llmmem_pool_t *q = NULL;
    CHECK_OK(llmmem_pool_create(&b, NULL, &q));
    CHECK_OK(llmmem_pool_bind_slot(q, &slot));
    CHECK(llmmem_pool_slot_alloc(slot, 4096, 0, NULL) == NULL);
    CHECK(strstr(llmmem_last_error(), "cuda:1") != NULL);
    x = llmmem_pool_slot_alloc(slot, 4096, 1, NULL);
    CHECK(x != NULL);
    llmmem_pool_slot_free(slot, x, 4096, 1, NULL);
    CHECK_OK(llmmem_pool_destroy(q));
    CHECK(llmmem_pool_slot_alloc(slot, 4096, 1, NULL) == NULL);
  }

  TEST("CUDA backends of this build either work or say why") {
    llmmem_pool_backend_t b;
    llmmem_status_t st = llmmem_pool_backend_cuda(0, &b);
    CHECK(st == LLMMEM_ERR_NOT_BUILT || st == LLMMEM_ERR_NO_DEVICE || st == LLMMEM_OK);
    CHECK_STATUS(llmmem_pool_backend_cuda(-1, &b), LLMMEM_ERR_INVALID);
    st = llmmem_pool_backend_cuda_vmm(0, &b);
    CHECK(st == LLMMEM_ERR_NOT_BUILT || st == LLMMEM_ERR_NO_DEVICE || st == LLMMEM_OK);
    if (st == LLMMEM_OK && b.destroy) b.destroy(b.ctx);
    CHECK_STATUS(llmmem_pool_backend_cuda_vmm(-1, &b), LLMMEM_ERR_INVALID);
    st = llmmem_pool_backend_host(1, &b);
    CHECK(st == LLMMEM_ERR_NOT_BUILT || st == LLMMEM_ERR_NO_DEVICE || st == LLMMEM_OK);
  }

  return TEST_SUMMARY();
}
