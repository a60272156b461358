/*
 * slots.c — the entry points PyTorch's CUDAPluggableAllocator loads by name.
 *
 * PyTorch stores two bare function pointers, alloc(size, device, stream) and
 * free(ptr, size, device, stream), with no user data, so one exported pair exists per slot and
 * a pool is bound to a slot. Failures cannot be returned through these signatures: alloc returns
 * NULL (PyTorch's caching allocator turns that into its out-of-memory error) and the detail stays
 * in llmmem_last_error(); a bad free is refused and counted in the pool's num_invalid_frees.
 */
#define _DEFAULT_SOURCE /* sched_yield */
#include <sched.h>
#include <stdatomic.h>

#include "pool_internal.h"

/* A slot: the pool bound to it and how many calls through it are running now.
 *
 * PyTorch calls the entry points from any thread, with no lock of ours held, so a pool can be
 * destroyed (MemoryPool.close(), or the last free of a pool whose owner is gone) while another
 * thread is inside a slot call. A call counts itself in `inflight` before it reads `pool`; the
 * destroyer clears `pool` and then waits until `inflight` drops to the calls of its own thread.
 * Both sides use sequentially consistent atomics, so either the call sees NULL (and fails cleanly:
 * alloc returns NULL, free does nothing) or the destroyer sees the call and waits for it. A call
 * costs two uncontended atomic adds next to the pool's mutex. */
typedef struct {
  _Atomic(llmmem_pool_t *) pool;
  atomic_int inflight;
  /* The pool whose calls are being waited out after it was unbound (NULL: none); set and
   * cleared under bind_lock, by the thread that unbound it. The slot is not bound again meanwhile,
   * and a destroy of that pool that finds it unbound already waits too. */
  _Atomic(llmmem_pool_t *) draining;
} slot_t;

static slot_t slots[LLMMEM_POOL_SLOTS];
static pthread_mutex_t bind_lock = PTHREAD_MUTEX_INITIALIZER;
/* Calls through each slot running on this thread: the last free of a pool whose owner is gone
 * destroys it from inside a slot call, and must not wait for itself. */
static _Thread_local int own_calls[LLMMEM_POOL_SLOTS];

LLMMEM_API llmmem_status_t llmmem_pool_bind_slot(llmmem_pool_t *pool, int *slot) {
  LLMMEM_CHECK_ARG(pool != NULL && slot != NULL, "llmmem_pool_bind_slot: pool and slot must not be NULL");
  pthread_mutex_lock(&bind_lock);
  for (int k = 0; k < LLMMEM_POOL_SLOTS; k++) {
    if (atomic_load(&slots[k].pool) == pool) {
      pthread_mutex_unlock(&bind_lock);
      *slot = k;
      return LLMMEM_OK;
    }
  }
  for (int k = 0; k < LLMMEM_POOL_SLOTS; k++) {
    if (atomic_load(&slots[k].pool) == NULL && !atomic_load(&slots[k].draining)) {
      atomic_store(&slots[k].pool, pool);
      pthread_mutex_unlock(&bind_lock);
      *slot = k;
      return LLMMEM_OK;
    }
  }
  pthread_mutex_unlock(&bind_lock);
  return LLMMEM_FAIL(LLMMEM_ERR_STATE, "all %d pluggable-allocator slots are bound to live pools; close one first",
                     LLMMEM_POOL_SLOTS);
}

/* Unbinds slot k if `pool` (NULL: whatever) is bound there, then waits until no call that may
 * have read the pool is still running. No lock is held while waiting: a call being waited for
 * may itself be destroying another pool, which takes bind_lock. When another thread unbound
 * `pool` from k just before (llmmem_pool_unbind_slot racing llmmem_pool_destroy) and is still
 * waiting out its calls, this waits too: returning at once would let destroy free the pool under
 * those calls. It stops when the calls have left or that thread is done waiting for them. */
static void unpublish(int k, llmmem_pool_t *pool) {
  pthread_mutex_lock(&bind_lock);
  llmmem_pool_t *expected = pool ? pool : atomic_load(&slots[k].pool);
  int cleared = expected && atomic_compare_exchange_strong(&slots[k].pool, &expected, NULL);
  int joined = !cleared && pool && atomic_load(&slots[k].draining) == pool;
  if (cleared) atomic_store(&slots[k].draining, expected);
  pthread_mutex_unlock(&bind_lock);
  if (!cleared && !joined) return;
  /* Calls are short (a pool operation, at worst a cudaMalloc): yield rather than block. */
  while (atomic_load(&slots[k].inflight) > own_calls[k] && (cleared || atomic_load(&slots[k].draining) == pool))
    sched_yield();
  if (!cleared) return;
  pthread_mutex_lock(&bind_lock);
  atomic_store(&slots[k].draining, NULL);
  pthread_mutex_unlock(&bind_lock);
}

LLMMEM_API llmmem_status_t llmmem_pool_unbind_slot(int slot) {
  LLMMEM_CHECK_ARG(slot >= 0 && slot < LLMMEM_POOL_SLOTS, "slot must be in 0..%d, got %d", LLMMEM_POOL_SLOTS - 1,
                   slot);
  unpublish(slot, NULL);
  return LLMMEM_OK;
}

/* Called by llmmem_pool_destroy before it frees anything: once this returns no slot points at
 * the pool and no call through a slot is still inside it (except this thread's own). */
void _llmmem_slots_forget(llmmem_pool_t *pool) {
  for (int k = 0; k < LLMMEM_POOL_SLOTS; k++) unpublish(k, pool);
}

static void slot_leave(int slot) {
  own_calls[slot]--;
  atomic_fetch_sub(&slots[slot].inflight, 1);
}

/* The pool of `slot`, counted as in use until slot_leave(slot); NULL (nothing to leave) when
 * there is none, with the reason in llmmem_last_error(). */
static llmmem_pool_t *slot_enter(int slot, int device) {
  if (slot < 0 || slot >= LLMMEM_POOL_SLOTS) {
    (void)LLMMEM_FAIL(LLMMEM_ERR_INVALID, "pluggable allocator slot %d out of range", slot);
    return NULL;
  }
  atomic_fetch_add(&slots[slot].inflight, 1);
  own_calls[slot]++;
  llmmem_pool_t *pool = atomic_load(&slots[slot].pool);
  if (!pool) {
    slot_leave(slot);
    (void)LLMMEM_FAIL(LLMMEM_ERR_STATE, "pluggable allocator slot %d has no pool bound (closed?)", slot);
    return NULL;
  }
  if (pool->backend.device >= 0 && device != pool->backend.device) {
    int served = pool->backend.device;
    slot_leave(slot);
    (void)LLMMEM_FAIL(LLMMEM_ERR_INVALID, "pool of slot %d serves cuda:%d, asked for device %d", slot, served, device);
    return NULL;
  }
  return pool;
}

LLMMEM_API void *llmmem_pool_slot_alloc(int slot, size_t size, int device, void *stream) {
  if (size == 0) return NULL;
  llmmem_pool_t *pool = slot_enter(slot, device);
  if (!pool) return NULL;
  void *ptr = NULL;
  (void)llmmem_pool_alloc(pool, size, stream, &ptr);
  slot_leave(slot);
  return ptr;
}

LLMMEM_API void llmmem_pool_slot_free(int slot, void *ptr, size_t size, int device, void *stream) {
  (void)size; /* PyTorch passes the size it asked for; the pool's own record is authoritative */
  llmmem_pool_t *pool = slot_enter(slot, device);
  if (!pool) return;
  (void)llmmem_pool_free(pool, ptr, stream); /* may destroy the pool (release_when_empty): own call */
  slot_leave(slot);
}

#define LLMMEM_SLOT_ENTRY(k)                                                               \
  LLMMEM_API void *llmmem_pool_alloc_##k(size_t size, int device, void *stream);           \
  LLMMEM_API void llmmem_pool_free_##k(void *ptr, size_t size, int device, void *stream);  \
  LLMMEM_API void *llmmem_pool_alloc_##k(size_t size, int device, void *stream) {          \
    return llmmem_pool_slot_alloc(k, size, device, stream);                                \
  }                                                                                        \
  LLMMEM_API void llmmem_pool_free_##k(void *ptr, size_t size, int device, void *stream) { \
    llmmem_pool_slot_free(k, ptr, size, device, stream);                                   \
  }

LLMMEM_SLOT_ENTRY(0)
LLMMEM_SLOT_ENTRY(1)
LLMMEM_SLOT_ENTRY(2)
LLMMEM_SLOT_ENTRY(3)
LLMMEM_SLOT_ENTRY(4)
LLMMEM_SLOT_ENTRY(5)
LLMMEM_SLOT_ENTRY(6)
LLMMEM_SLOT_ENTRY(7)
LLMMEM_SLOT_ENTRY(8)
LLMMEM_SLOT_ENTRY(9)
LLMMEM_SLOT_ENTRY(10)
LLMMEM_SLOT_ENTRY(11)
LLMMEM_SLOT_ENTRY(12)
LLMMEM_SLOT_ENTRY(13)
LLMMEM_SLOT_ENTRY(14)
LLMMEM_SLOT_ENTRY(15)
