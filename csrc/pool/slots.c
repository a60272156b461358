/*
 * slots.c — the entry points PyTorch's CUDAPluggableAllocator loads by name.
 *
 * PyTorch stores two bare function pointers, alloc(size, device, stream) and
 * free(ptr, size, device, stream), with no user data, so one exported pair exists per slot and
 * a pool is bound to a slot. Failures cannot be returned through these signatures: alloc returns
 * NULL (PyTorch's caching allocator turns that into its out-of-memory error) and the detail stays
 * in llmmem_last_error(); a bad free is refused and counted in the pool's num_invalid_frees.
 */
#include <stdatomic.h>

#include "pool_internal.h"

static _Atomic(llmmem_pool_t *) slots[LLMMEM_POOL_SLOTS];
static pthread_mutex_t bind_lock = PTHREAD_MUTEX_INITIALIZER;

LLMMEM_API llmmem_status_t llmmem_pool_bind_slot(llmmem_pool_t *pool, int *slot) {
  LLMMEM_CHECK_ARG(pool != NULL && slot != NULL, "llmmem_pool_bind_slot: pool and slot must not be NULL");
  pthread_mutex_lock(&bind_lock);
  for (int k = 0; k < LLMMEM_POOL_SLOTS; k++) {
    if (atomic_load(&slots[k]) == pool) {
      pthread_mutex_unlock(&bind_lock);
      *slot = k;
      return LLMMEM_OK;
    }
  }
  for (int k = 0; k < LLMMEM_POOL_SLOTS; k++) {
    if (atomic_load(&slots[k]) == NULL) {
      atomic_store(&slots[k], pool);
      pthread_mutex_unlock(&bind_lock);
      *slot = k;
      return LLMMEM_OK;
    }
  }
  pthread_mutex_unlock(&bind_lock);
  return LLMMEM_FAIL(LLMMEM_ERR_STATE, "all %d pluggable-allocator slots are bound to live pools; close one first",
                     LLMMEM_POOL_SLOTS);
}

LLMMEM_API llmmem_status_t llmmem_pool_unbind_slot(int slot) {
  LLMMEM_CHECK_ARG(slot >= 0 && slot < LLMMEM_POOL_SLOTS, "slot must be in 0..%d, got %d", LLMMEM_POOL_SLOTS - 1, slot);
  atomic_store(&slots[slot], NULL);
  return LLMMEM_OK;
}

/* Called by llmmem_pool_destroy: no slot may point at a freed pool. */
void _llmmem_slots_forget(llmmem_pool_t *pool) {
  for (int k = 0; k < LLMMEM_POOL_SLOTS; k++) {
    llmmem_pool_t *expected = pool;
    atomic_compare_exchange_strong(&slots[k], &expected, NULL);
  }
}

static llmmem_pool_t *slot_pool(int slot, int device) {
  if (slot < 0 || slot >= LLMMEM_POOL_SLOTS) {
    (void)LLMMEM_FAIL(LLMMEM_ERR_INVALID, "pluggable allocator slot %d out of range", slot);
    return NULL;
  }
  llmmem_pool_t *pool = atomic_load(&slots[slot]);
  if (!pool) {
    (void)LLMMEM_FAIL(LLMMEM_ERR_STATE, "pluggable allocator slot %d has no pool bound", slot);
    return NULL;
  }
  if (pool->backend.device >= 0 && device != pool->backend.device) {
    (void)LLMMEM_FAIL(LLMMEM_ERR_INVALID, "pool of slot %d serves cuda:%d, asked for device %d", slot,
                      pool->backend.device, device);
    return NULL;
  }
  return pool;
}

LLMMEM_API void *llmmem_pool_slot_alloc(int slot, size_t size, int device, void *stream) {
  if (size == 0) return NULL;
  llmmem_pool_t *pool = slot_pool(slot, device);
  void *ptr = NULL;
  if (pool) (void)llmmem_pool_alloc(pool, size, stream, &ptr);
  return ptr;
}

LLMMEM_API void llmmem_pool_slot_free(int slot, void *ptr, size_t size, int device, void *stream) {
  (void)size;  /* PyTorch passes the size it asked for; the pool's own record is authoritative */
  llmmem_pool_t *pool = slot_pool(slot, device);
  if (pool) (void)llmmem_pool_free(pool, ptr, stream);
}

#define LLMMEM_SLOT_ENTRY(k)                                                                      \
  LLMMEM_API void *llmmem_pool_alloc_##k(size_t size, int device, void *stream);                  \
  LLMMEM_API void llmmem_pool_free_##k(void *ptr, size_t size, int device, void *stream);         \
  LLMMEM_API void *llmmem_pool_alloc_##k(size_t size, int device, void *stream) {                 \
    return llmmem_pool_slot_alloc(k, size, device, stream);                                       \
  }                                                                                               \
  LLMMEM_API void llmmem_pool_free_##k(void *ptr, size_t size, int device, void *stream) {        \
    llmmem_pool_slot_free(k, ptr, size, device, stream);                                          \
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
