/*
 * ptrmap.c — address of a live block -> its metadata, so free() finds a block in O(1) and can tell
 * a double free or a foreign pointer from a real one without touching the (device) memory.
 *
 * Open addressing with linear probing at load <= 1/2 and backward-shift deletion (no tombstones,
 * so a long run of alloc/free pairs never degrades the probe length).
 */
#include <stdlib.h>

#include "pool_internal.h"

#define PTRMAP_MIN_CAPACITY 1024

static inline size_t slot_of(uintptr_t key, size_t capacity) {
  /* Block addresses are multiples of 512: drop those zero bits, then mix (Fibonacci hashing). */
  uint64_t h = (uint64_t)(key >> POOL_UNIT_SHIFT) * 0x9E3779B97F4A7C15ULL;
  return (size_t)(h >> 20) & (capacity - 1);
}

static llmmem_status_t alloc_arrays(pool_ptrmap_t *m, size_t capacity) {
  m->keys = calloc(capacity, sizeof *m->keys);
  m->vals = calloc(capacity, sizeof *m->vals);
  if (!m->keys || !m->vals) {
    free(m->keys);
    free(m->vals);
    m->keys = NULL;
    m->vals = NULL;
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "pool: no host memory for a pointer map of %zu entries", capacity);
  }
  m->capacity = capacity;
  m->count = 0;
  return LLMMEM_OK;
}

llmmem_status_t _llmmem_ptrmap_init(pool_ptrmap_t *m) { return alloc_arrays(m, PTRMAP_MIN_CAPACITY); }

void _llmmem_ptrmap_free(pool_ptrmap_t *m) {
  free(m->keys);
  free(m->vals);
  m->keys = NULL;
  m->vals = NULL;
  m->capacity = m->count = 0;
}

static void put_unchecked(pool_ptrmap_t *m, uintptr_t key, pool_block_t *val) {
  size_t i = slot_of(key, m->capacity);
  while (m->keys[i] != 0 && m->keys[i] != key) i = (i + 1) & (m->capacity - 1);
  if (m->keys[i] == 0) m->count++;
  m->keys[i] = key;
  m->vals[i] = val;
}

llmmem_status_t _llmmem_ptrmap_put(pool_ptrmap_t *m, uintptr_t key, pool_block_t *val) {
  if ((m->count + 1) * 2 > m->capacity) {
    pool_ptrmap_t bigger;
    LLMMEM_TRY(alloc_arrays(&bigger, m->capacity * 2));
    for (size_t i = 0; i < m->capacity; i++)
      if (m->keys[i]) put_unchecked(&bigger, m->keys[i], m->vals[i]);
    _llmmem_ptrmap_free(m);
    *m = bigger;
  }
  put_unchecked(m, key, val);
  return LLMMEM_OK;
}

pool_block_t *_llmmem_ptrmap_get(const pool_ptrmap_t *m, uintptr_t key) {
  if (key == 0) return NULL;
  for (size_t i = slot_of(key, m->capacity); m->keys[i] != 0; i = (i + 1) & (m->capacity - 1))
    if (m->keys[i] == key) return m->vals[i];
  return NULL;
}

pool_block_t *_llmmem_ptrmap_take(pool_ptrmap_t *m, uintptr_t key) {
  if (key == 0) return NULL;
  size_t mask = m->capacity - 1;
  size_t i = slot_of(key, m->capacity);
  while (m->keys[i] != key) {
    if (m->keys[i] == 0) return NULL;
    i = (i + 1) & mask;
  }
  pool_block_t *val = m->vals[i];
  /* Backward shift: move later entries of the probe run into the hole when their home slot
   * does not lie (cyclically) between the hole and their current slot. */
  size_t hole = i;
  for (size_t j = (i + 1) & mask; m->keys[j] != 0; j = (j + 1) & mask) {
    size_t home = slot_of(m->keys[j], m->capacity);
    int between = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (!between) {
      m->keys[hole] = m->keys[j];
      m->vals[hole] = m->vals[j];
      hole = j;
    }
  }
  m->keys[hole] = 0;
  m->vals[hole] = NULL;
  m->count--;
  return val;
}
