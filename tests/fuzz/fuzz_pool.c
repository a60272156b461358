/*
 * fuzz_pool.c — libFuzzer harness for the pool's C API (`make fuzz-pool`, FUZZ_SECONDS=30).
 *
 * Each input is a program: every byte pair is an operation (alloc of a size class on one of three
 * fake streams, free, double free, foreign/interior free, completing a stream's events,
 * empty_cache, reset_peak, stats) on a pool with fake stream events: with a 64 MiB cap and
 * separate segments, growing in place with the cap, or growing in place uncapped (where free
 * holes are decommitted on growth; the backend's room per region is 96 MiB). After each
 * step the invariants are checked; any violation — or memory handed to another stream before the
 * free's event completed — traps, and ASan/UBSan catch the rest.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <llmmem/pool.h>

#include "../../csrc/pool/pool_internal.h"

#define MAX_LIVE   64
#define MAX_EVENTS 8192
#define MiB        ((size_t)1 << 20)

typedef struct {
  int done;
  void *stream;
  uintptr_t addr; /* the block freed when this event was recorded */
  size_t size;
} ev_t;

static ev_t events[MAX_EVENTS];
static int n_events;

#define ROOM ((size_t)96 << 20) /* bytes behind each region a resizable backend can grow into */

static llmmem_status_t f_reserve(void *ctx, size_t bytes, void **out) {
  (void)ctx;
  void *p = NULL;
  if (posix_memalign(&p, 4096, bytes > ROOM ? bytes : ROOM) != 0)
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "fuzz: no memory");
  *out = p;
  return LLMMEM_OK;
}
static void f_release(void *ctx, void *ptr, size_t bytes) {
  (void)ctx;
  (void)bytes;
  free(ptr);
}
static llmmem_status_t f_resize(void *ctx, void *ptr, size_t old_bytes, size_t new_bytes) {
  (void)ctx;
  (void)ptr;
  (void)old_bytes;
  return new_bytes <= ROOM ? LLMMEM_OK : LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "fuzz: no room to grow");
}
/* The memory stays (it is ordinary heap memory); the pool's checker verifies that no live or
 * waiting block covers a decommitted page, and writes into new blocks run under ASan. */
static llmmem_status_t f_commit(void *ctx, void *ptr, size_t bytes) {
  (void)ctx;
  memset(ptr, 0, bytes < 64 ? bytes : 64);
  return LLMMEM_OK;
}
static llmmem_status_t f_record(void *ctx, void *stream, void **out) {
  (void)ctx;
  if (n_events >= MAX_EVENTS) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "fuzz: out of events");
  ev_t *e = &events[n_events++];
  memset(e, 0, sizeof *e);
  e->stream = stream;
  *out = e;
  return LLMMEM_OK;
}
static int f_done(void *ctx, void *ev) {
  (void)ctx;
  return ((ev_t *)ev)->done;
}
/* Like CUDA: waiting for an event means all work queued on its stream before it is done, so the
 * earlier events of that stream complete too. */
static llmmem_status_t f_wait(void *ctx, void *ev) {
  (void)ctx;
  ev_t *e = ev;
  for (ev_t *x = events; x <= e; x++)
    if (x->stream == e->stream) x->done = 1;
  return LLMMEM_OK;
}
static void f_event_release(void *ctx, void *ev) {
  (void)ctx;
  (void)ev;
}

static const size_t size_classes[] = {1,       100,     512,     513,     4096,    65536,
                                      1000000, 1048576, 1048577, 2 * MiB, 5 * MiB, 17 * MiB};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len) {
  llmmem_pool_backend_t b = {0};
  b.name = "fuzz";
  b.device = -1;
  b.reserve = f_reserve;
  b.release = f_release;
  b.event_record = f_record;
  b.event_done = f_done;
  b.event_wait = f_wait;
  b.event_release = f_event_release;
  int mode = (int)(len % 3); /* 0: fixed segments, 1: in place with the cap, 2: in place, uncapped */
  if (mode) {
    b.resize = f_resize;
    b.decommit = f_commit;
    b.commit = f_commit;
  }
  size_t cap = mode == 2 ? 0 : 64 * MiB;
  n_events = 0;
  llmmem_pool_options_t o = {len % 2 ? 4 * MiB : 0, cap, len % 5 == 0 ? 8 * MiB : 0};
  llmmem_pool_t *p = NULL;
  if (llmmem_pool_create(&b, &o, &p) != LLMMEM_OK) __builtin_trap();
  void *live[MAX_LIVE];
  size_t live_size[MAX_LIVE];
  void *live_stream[MAX_LIVE];
  int n = 0;
  void *last_freed = NULL;
  void *streams[3] = {(void *)0x1000, (void *)0x2000, (void *)0x3000};
  for (size_t i = 0; i + 1 < len && n_events < MAX_EVENTS - 4; i += 2) {
    uint8_t op = data[i] % 8, arg = data[i + 1];
    void *stream = streams[arg % 3];
    switch (op) {
      case 0:
      case 1:
      case 2: {
        if (n >= MAX_LIVE) break;
        size_t size = size_classes[(arg >> 2) % (sizeof size_classes / sizeof size_classes[0])] + (arg & 3) * 7;
        void *ptr = NULL;
        llmmem_status_t st = llmmem_pool_alloc(p, size, stream, &ptr);
        if (st == LLMMEM_OK) {
          uintptr_t lo = (uintptr_t)ptr;
          if (lo % 512) __builtin_trap();
          for (int e = 0; e < n_events; e++) /* never memory another stream may still be using */
            if (!events[e].done && events[e].stream != stream && events[e].size &&
                lo < events[e].addr + events[e].size && events[e].addr < lo + size)
              __builtin_trap();
          memset(ptr, 0xAB, size < 64 ? size : 64);
          live[n] = ptr;
          live_size[n] = size;
          live_stream[n++] = stream;
        } else if (st != LLMMEM_ERR_NOMEM) {
          __builtin_trap();
        }
        break;
      }
      case 3:
      case 4: {
        if (n == 0) break;
        int k = arg % n;
        int before = n_events;
        if (llmmem_pool_free(p, live[k], live_stream[k]) != LLMMEM_OK) __builtin_trap();
        if (n_events != before + 1) __builtin_trap();
        events[before].addr = (uintptr_t)live[k];
        events[before].size = live_size[k];
        last_freed = live[k];
        live[k] = live[n - 1];
        live_size[k] = live_size[n - 1];
        live_stream[k] = live_stream[--n];
        break;
      }
      case 5: { /* misuse: double free, interior pointer, foreign pointer */
        int local;
        void *bad = arg % 3 == 0 ? last_freed : arg % 3 == 1 && n ? (char *)live[0] + 512 : (void *)&local;
        if (bad == NULL) break;
        int still_live = 0;
        for (int k = 0; k < n; k++) still_live |= live[k] == bad;
        if (!still_live && llmmem_pool_free(p, bad, stream) != LLMMEM_ERR_INVALID) __builtin_trap();
        break;
      }
      case 6:
        for (int e = 0; e < n_events; e++)
          if (events[e].stream == stream) events[e].done = 1;
        break;
      case 7:
        if (arg % 4 == 0) {
          /* what empty_cache reports released is exactly what reserved_bytes dropped by */
          llmmem_pool_stats_t s0, s1;
          size_t released = 0;
          if (llmmem_pool_stats(p, &s0) != LLMMEM_OK) __builtin_trap();
          if (llmmem_pool_empty_cache(p, &released) == LLMMEM_OK) {
            if (llmmem_pool_stats(p, &s1) != LLMMEM_OK) __builtin_trap();
            if ((int64_t)released != s0.reserved_bytes.current - s1.reserved_bytes.current) __builtin_trap();
            if (s1.reserved_bytes.peak != s0.reserved_bytes.peak) __builtin_trap(); /* it took no memory */
          }
        } else if (arg % 4 == 1)
          (void)llmmem_pool_reset_peak_stats(p);
        else {
          llmmem_pool_stats_t s;
          if (llmmem_pool_stats(p, &s) != LLMMEM_OK) __builtin_trap();
          if (s.free_bytes + (size_t)s.allocated_bytes.current != (size_t)s.reserved_bytes.current) __builtin_trap();
          if ((cap && s.reserved_bytes.current > (int64_t)cap) || s.allocations.current != n) __builtin_trap();
          if (s.largest_free_block > s.free_bytes) __builtin_trap();
        }
        break;
    }
    if (_llmmem_pool_check(p) != LLMMEM_OK) __builtin_trap();
  }
  for (int k = 0; k < n; k++)
    if (llmmem_pool_free(p, live[k], live_stream[k]) != LLMMEM_OK) __builtin_trap();
  if (llmmem_pool_empty_cache(p, NULL) != LLMMEM_OK) __builtin_trap();
  if (_llmmem_pool_check(p) != LLMMEM_OK) __builtin_trap();
  llmmem_pool_stats_t s;
  if (llmmem_pool_stats(p, &s) != LLMMEM_OK || s.reserved_bytes.current != (int64_t)o.initial_size) __builtin_trap();
  if (llmmem_pool_destroy(p) != LLMMEM_OK) __builtin_trap();
  return 0;
}
