/*
 * test_pool_slots.c — the pluggable-allocator slots against concurrent destruction, under
 * ASan+UBSan: PyTorch calls llmmem_pool_alloc_<k>/free_<k> from its own threads with no lock of
 * ours, so a pool may be closed (llmmem_pool_destroy) or released by its last free while other
 * threads are inside slot calls. Every call must either complete on the live pool or fail cleanly
 * (NULL, the reason in llmmem_last_error()); a freed pool is never touched (ASan would report a
 * heap-use-after-free), and nothing deadlocks.
 */
#define _DEFAULT_SOURCE /* sched_yield */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include <llmmem/pool.h>

#include "testhelper.h"

#define MiB     ((size_t)1 << 20)
#define WORKERS 3
#ifndef ROUNDS
#define ROUNDS 300
#endif

typedef struct {
  int slot;
  atomic_int *stop;
  unsigned long long seed;
  long served, refused; /* allocations that got memory / came back NULL */
  int bad;              /* a refusal without a reason, or memory that was not ours */
  int bogus;            /* only frees of an address that is no block: calls that take no memory */
} worker_t;

/* Allocates through the slot, writes the block, frees it; like PyTorch, from a thread of its own. */
static void *worker(void *arg) {
  worker_t *w = arg;
  unsigned long long rng = w->seed;
  while (!atomic_load(w->stop)) {
    if (w->bogus) { /* a slot call into the pool that leaves no block out (refused as a bad free) */
      llmmem_pool_slot_free(w->slot, (void *)(uintptr_t)0x1000, 64, -1, NULL);
      w->served++;
      continue;
    }
    size_t size = 2 + (size_t)(th_rand(&rng) % (3 * MiB)); /* first and last byte differ */
    unsigned char *p = llmmem_pool_slot_alloc(w->slot, size, -1, NULL);
    if (!p) {
      w->refused++;
      const char *why = llmmem_last_error();
      if (!why || (!strstr(why, "no pool bound") && !strstr(why, "being closed"))) w->bad = 1;
      continue;
    }
    w->served++;
    p[0] = 0x5a;
    p[size - 1] = 0xa5;
    if (p[0] != 0x5a) w->bad = 1;
    llmmem_pool_slot_free(w->slot, p, size, -1, NULL);
  }
  return NULL;
}

static llmmem_pool_t *new_pool(void) {
  llmmem_pool_backend_t b;
  llmmem_pool_options_t o = {4 * MiB, 0, 0, 0};
  llmmem_pool_t *p = NULL;
  if (llmmem_pool_backend_host(0, &b) != LLMMEM_OK || llmmem_pool_create(&b, &o, &p) != LLMMEM_OK) return NULL;
  return p;
}

/* Unbinds the slot it is given, once the main thread is about to destroy the pool. */
typedef struct {
  int slot;
  atomic_int *go;
} unbinder_t;

static void *unbinder(void *arg) {
  unbinder_t *u = arg;
  while (!atomic_load(u->go)) sched_yield();
  (void)llmmem_pool_unbind_slot(u->slot);
  return NULL;
}

/* One round: workers hammer the pool's slot; the main thread destroys it (how = 0, retrying
 * while blocks are out, as MemoryPool.close() would), or drops it (how = 1: release when empty,
 * so the last free, inside a worker's slot call, destroys it), or destroys it while another
 * thread unbinds its slot (how = 2: the destroy finds the slot already cleared and must still
 * wait for the calls that read the pool before). Returns 1 when all went well. */
static int round_trip(int how, unsigned long long seed, long *served, long *refused) {
  llmmem_pool_t *p = new_pool();
  int slot = -1;
  if (!p || llmmem_pool_bind_slot(p, &slot) != LLMMEM_OK) return 0;
  atomic_int stop = 0;
  worker_t w[WORKERS];
  pthread_t t[WORKERS];
  for (int i = 0; i < WORKERS; i++) {
    /* how 2: blocks allocated before the unbind could never be freed through the slot again */
    w[i] = (worker_t){slot, &stop, seed * 7919 + (unsigned long long)i, 0, 0, 0, how == 2};
    pthread_create(&t[i], NULL, worker, &w[i]);
  }
  for (int spin = 0; spin < 50 * (int)(seed % 8); spin++) sched_yield(); /* let them get going */
  int ok = 1;
  if (how == 0 || how == 2) {
    atomic_int go = 0;
    unbinder_t u = {slot, &go};
    pthread_t ut;
    if (how == 2) pthread_create(&ut, NULL, unbinder, &u);
    atomic_store(&go, 1);
    llmmem_status_t st;
    while ((st = llmmem_pool_destroy(p)) == LLMMEM_ERR_STATE) sched_yield(); /* blocks still out */
    ok = st == LLMMEM_OK;
    if (how == 2) pthread_join(ut, NULL);
  } else {
    llmmem_pool_release_when_empty(p);
  }
  /* Once the pool is gone its slot refuses (the main thread is a caller too, now). */
  for (;;) {
    void *x = llmmem_pool_slot_alloc(slot, 512, -1, NULL);
    if (!x) break;
    llmmem_pool_slot_free(slot, x, 512, -1, NULL);
    sched_yield();
  }
  atomic_store(&stop, 1);
  for (int i = 0; i < WORKERS; i++) {
    pthread_join(t[i], NULL);
    ok = ok && !w[i].bad;
    *served += w[i].served;
    *refused += w[i].refused;
  }
  return ok;
}

int main(void) {
  TEST("slot calls racing llmmem_pool_destroy complete on the live pool or fail cleanly") {
    long served = 0, refused = 0;
    int ok = 1;
    for (int r = 0; r < ROUNDS && ok; r++) ok = round_trip(0, (unsigned long long)r + 1, &served, &refused);
    CHECK(ok);
    CHECK(served > 0 && refused > 0); /* both sides of the race were exercised */
  }

  TEST("slot calls racing the last free of a released pool (destroyed inside a slot call)") {
    long served = 0, refused = 0;
    int ok = 1;
    for (int r = 0; r < ROUNDS && ok; r++) ok = round_trip(1, (unsigned long long)r + 1, &served, &refused);
    CHECK(ok);
    CHECK(served > 0 && refused > 0);
  }

  TEST("slot calls racing llmmem_pool_destroy while another thread unbinds the slot") {
    long served = 0, refused = 0;
    int ok = 1;
    for (int r = 0; r < ROUNDS && ok; r++) ok = round_trip(2, (unsigned long long)r + 1, &served, &refused);
    CHECK(ok);
    CHECK(served > 0);
  }

  TEST("a closed pool's slot refuses with a reason; unbind waits for nothing and frees the slot") {
    llmmem_pool_t *p = new_pool();
    int slot = -1, again = -1;
    CHECK_OK(llmmem_pool_bind_slot(p, &slot));
    CHECK_OK(llmmem_pool_destroy(p));
    CHECK(llmmem_pool_slot_alloc(slot, 4096, -1, NULL) == NULL);
    CHECK(strstr(llmmem_last_error(), "no pool bound") != NULL);
    llmmem_pool_slot_free(slot, (void *)(uintptr_t)0x1000, 4096, -1, NULL); /* ignored, not a crash */
    CHECK_OK(llmmem_pool_unbind_slot(slot));
    llmmem_pool_t *q = new_pool();
    CHECK_OK(llmmem_pool_bind_slot(q, &again));
    CHECK(again == slot); /* the slot is usable again */
    void *x = llmmem_pool_slot_alloc(again, 4096, -1, NULL);
    CHECK(x != NULL);
    CHECK_STATUS(llmmem_pool_destroy(q), LLMMEM_ERR_STATE); /* a block is out: nothing changes */
    llmmem_pool_slot_free(again, x, 4096, -1, NULL);
    CHECK_OK(llmmem_pool_destroy(q));
  }

  return TEST_SUMMARY();
}
