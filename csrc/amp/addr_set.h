/*
 * addr_set.h — a set of gradient addresses, to find a tensor listed twice (the same parameter
 * twice in an optimizer, or two parameters sharing one .grad). torch's CPU unscale handles such
 * a tensor once per listing, one after the other; two threads handling both listings at once
 * would lose one of the two multiplications. Internal to csrc/scaler; open addressing, fixed size.
 */
#ifndef LLMMEM_SCALER_ADDR_SET_H
#define LLMMEM_SCALER_ADDR_SET_H

#include <stdint.h>
#include <stdlib.h>

typedef struct {
  uintptr_t *keys; /* 0: empty */
  size_t mask;
} _llmmem_addr_set_t;

/* Room for `n` addresses at most half full. 0, or -1 when out of memory. */
static inline int _llmmem_addr_set_init(_llmmem_addr_set_t *s, size_t n) {
  size_t cap = 16;
  while (cap < 2 * n) cap *= 2;
  s->keys = calloc(cap, sizeof *s->keys);
  s->mask = cap - 1;
  return s->keys ? 0 : -1;
}

/* 1: added; 0: already there. NULL (an empty tensor's address) is never a repeat. The caller adds
 * at most the `n` given to init. */
static inline int _llmmem_addr_set_add(_llmmem_addr_set_t *s, const void *p) {
  uintptr_t key = (uintptr_t)p;
  if (!key) return 1;
  size_t i = (size_t)((key >> 4) * 0x9E3779B97F4A7C15ull >> 17) & s->mask;
  while (s->keys[i]) {
    if (s->keys[i] == key) return 0;
    i = (i + 1) & s->mask;
  }
  s->keys[i] = key;
  return 1;
}

static inline void _llmmem_addr_set_free(_llmmem_addr_set_t *s) {
  free(s->keys);
  s->keys = NULL;
}

#endif /* LLMMEM_SCALER_ADDR_SET_H */
