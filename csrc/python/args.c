/*
 * args.c — the argument parsers of llmmem._C over snapshot trees (see args.h). Plain C: no
 * Python, so the sanitized C tests and the fuzz target run them as the module does.
 */
#include "args.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- arena ---------------------------------------------------------------------------------- */

struct args_chunk_s {
  args_chunk_t *next;
  size_t used, cap; /* bytes of the data that follows the (16-byte rounded) header */
};

#define CHUNK_HDR   ((sizeof(args_chunk_t) + 15) & ~(size_t)15)
#define CHUNK_BYTES ((size_t)64 << 10)

static void *arena_alloc(args_arena_t *a, size_t bytes) {
  bytes = (bytes + 15) & ~(size_t)15;
  args_chunk_t *c = a->chunks;
  if (!c || c->cap - c->used < bytes) {
    const size_t cap = bytes > CHUNK_BYTES ? bytes : CHUNK_BYTES;
    c = malloc(CHUNK_HDR + cap);
    if (!c) {
      a->out_of_memory = 1;
      return NULL;
    }
    c->next = a->chunks;
    c->used = 0;
    c->cap = cap;
    a->chunks = c;
  }
  void *p = (unsigned char *)c + CHUNK_HDR + c->used;
  c->used += bytes;
  return p;
}

args_value_t *_llmmem_args_nodes(args_arena_t *a, size_t n) {
  const size_t max = a->max_nodes ? a->max_nodes : ARGS_DEFAULT_MAX_NODES;
  if (n == 0 || n > max || a->nodes > max - n) return NULL;
  args_value_t *v = arena_alloc(a, n * sizeof *v);
  if (!v) return NULL;
  memset(v, 0, n * sizeof *v);
  a->nodes += n;
  return v;
}

const char *_llmmem_args_text(args_arena_t *a, const char *text, size_t len) {
  if (len >= SIZE_MAX - 16) {
    a->out_of_memory = 1;
    return NULL;
  }
  char *t = arena_alloc(a, len + 1);
  if (!t) return NULL;
  if (len) memcpy(t, text, len);
  t[len] = '\0';
  return t;
}

void _llmmem_args_arena_free(args_arena_t *a) {
  for (args_chunk_t *c = a->chunks, *next; c; c = next) {
    next = c->next;
    free(c);
  }
  a->chunks = NULL;
  a->nodes = 0;
}

const args_value_t *_llmmem_args_dict_get(const args_value_t *dict, const char *key) {
  if (!dict || dict->kind != ARGS_DICT || dict->big) return NULL;
  const size_t len = strlen(key);
  for (size_t i = 0; i < dict->seq.n; i++) {
    const args_value_t *k = &dict->seq.keys[i];
    if (k->kind == ARGS_STR && !k->big && k->seq.n == len && memcmp(k->seq.text, key, len) == 0)
      return &dict->seq.items[i];
  }
  return NULL;
}

/* ---- messages ------------------------------------------------------------------------------- */

static int fail(args_error_t *e, args_status_t status, const char *fmt, ...)
#if defined(__GNUC__) || defined(__clang__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static int fail(args_error_t *e, args_status_t status, const char *fmt, ...) {
  e->status = status;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->msg, sizeof e->msg, fmt, ap);
  va_end(ap);
  return -1;
}

static const char *name_of(const args_value_t *v) { return v->type_name ? v->type_name : "object"; }

const char *_llmmem_args_describe(const args_value_t *v, char *buf, size_t len) {
  if (!len) return buf;
  switch (v->kind) {
    case ARGS_NONE: snprintf(buf, len, "None"); break;
    case ARGS_BOOL: snprintf(buf, len, "%s", v->mag ? "True" : "False"); break;
    case ARGS_INT:
      if (v->big)
        snprintf(buf, len, "an int of %llu bits", (unsigned long long)v->mag);
      else
        snprintf(buf, len, "%s%llu", v->neg ? "-" : "", (unsigned long long)v->mag);
      break;
    case ARGS_FLOAT: {
      /* the shortest of 15 and 17 digits that reads back as the same double, as Python prints it */
      snprintf(buf, len, "%.15g", v->f);
      if (isfinite(v->f) && strtod(buf, NULL) != v->f) snprintf(buf, len, "%.17g", v->f);
      break;
    }
    case ARGS_STR:
      if (v->big)
        snprintf(buf, len, "a %s of %zu bytes", name_of(v), v->seq.n);
      else
        snprintf(buf, len, "'%.40s%s'", v->seq.text, v->seq.n > 40 ? "..." : "");
      break;
    case ARGS_LIST:
    case ARGS_DICT: snprintf(buf, len, "a %s of %zu items", name_of(v), v->seq.n); break;
    default: snprintf(buf, len, "a %s", name_of(v)); break;
  }
  return buf;
}

#define DESCRIBE(v) _llmmem_args_describe((v), desc, sizeof desc)

/* ---- scalars -------------------------------------------------------------------------------- */

int _llmmem_args_uint(const args_value_t *v, const char *what, uint64_t lo, uint64_t hi, uint64_t *out,
                      args_error_t *e) {
  char desc[64];
  if (v->kind != ARGS_INT) return fail(e, ARGS_TYPE, "%s must be an int, got %s", what, name_of(v));
  if (v->big || (v->neg && v->mag) || v->mag < lo || v->mag > hi)
    return fail(e, ARGS_VALUE, "%s must be an int in %llu..%llu, got %s", what, (unsigned long long)lo,
                (unsigned long long)hi, DESCRIBE(v));
  *out = v->mag;
  return 0;
}

int _llmmem_args_int(const args_value_t *v, const char *what, int64_t lo, int64_t hi, int64_t *out, args_error_t *e) {
  char desc[64];
  if (v->kind != ARGS_INT) return fail(e, ARGS_TYPE, "%s must be an int, got %s", what, name_of(v));
  int64_t x = 0;
  int fits = !v->big && (v->neg ? v->mag <= (uint64_t)INT64_MAX + 1 : v->mag <= (uint64_t)INT64_MAX);
  if (fits) x = v->neg ? (v->mag == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)v->mag) : (int64_t)v->mag;
  if (!fits || x < lo || x > hi)
    return fail(e, ARGS_VALUE, "%s must be an int in %lld..%lld, got %s", what, (long long)lo, (long long)hi,
                DESCRIBE(v));
  *out = x;
  return 0;
}

int _llmmem_args_size(const args_value_t *v, const char *what, size_t min, size_t *out, args_error_t *e) {
  char desc[64];
  if (v->kind != ARGS_INT) return fail(e, ARGS_TYPE, "%s must be an int number of bytes, got %s", what, name_of(v));
  if (v->neg && v->mag) return fail(e, ARGS_VALUE, "%s must be >= %zu bytes, got %s", what, min, DESCRIBE(v));
  if (v->big || v->mag > SIZE_MAX)
    return fail(e, ARGS_TOO_BIG, "%s must be at most %zu bytes (the address space), got %s", what, (size_t)SIZE_MAX,
                DESCRIBE(v));
  if (v->mag < min) return fail(e, ARGS_VALUE, "%s must be >= %zu bytes, got %s", what, min, DESCRIBE(v));
  *out = (size_t)v->mag;
  return 0;
}

/* An int's value as a double: exact up to 2**53, rounded beyond (at most 2**64 here). */
static double int_as_double(const args_value_t *v) { return v->neg ? -(double)v->mag : (double)v->mag; }

int _llmmem_args_number(const args_value_t *v, const char *what, double *out, args_error_t *e) {
  char desc[64];
  if (v->kind == ARGS_FLOAT) {
    *out = v->f;
    return 0;
  }
  if (v->kind != ARGS_INT) return fail(e, ARGS_TYPE, "%s must be a number, got %s", what, name_of(v));
  if (v->big) return fail(e, ARGS_VALUE, "%s must be a number a float can hold, got %s", what, DESCRIBE(v));
  *out = int_as_double(v);
  return 0;
}

/* ---- the recompute planner ------------------------------------------------------------------ */

static int too_large(args_error_t *e, const char *label) {
  return fail(e, ARGS_VALUE, "plan: %s is too large or nested too deeply to read", label);
}

/* Fills out[rows * max(cols, 1)] from a list (cols == 0) or a list of lists (cols >= 1) of
 * numbers: non-negative ints for bytes (is_bytes), ints or floats (bool too, as float() takes it)
 * for times. `label` names the value in messages ("chain['fwd_time']"). */
static int read_table(const args_value_t *v, const char *label, size_t rows, size_t cols, int is_bytes, void *out,
                      args_error_t *e) {
  char desc[64];
  if (v->kind != ARGS_LIST) return fail(e, ARGS_VALUE, "plan: %s must be a list, got %s", label, name_of(v));
  if (v->seq.n != rows) return fail(e, ARGS_VALUE, "plan: %s has %zu entries, expected %zu", label, v->seq.n, rows);
  if (v->big) return too_large(e, label);
  const size_t width = cols ? cols : 1;
  for (size_t i = 0; i < rows; i++) {
    const args_value_t *row = &v->seq.items[i];
    if (cols) {
      if (row->kind != ARGS_LIST || row->seq.n != cols)
        return fail(e, ARGS_VALUE, "plan: %s[%zu] must be a list of %zu numbers (one per mode)", label, i, cols);
      if (row->big) return too_large(e, label);
    }
    for (size_t j = 0; j < width; j++) {
      const args_value_t *item = cols ? &row->seq.items[j] : row;
      const size_t at = i * width + j;
      if (is_bytes) {
        if (item->kind != ARGS_INT)
          return fail(e, ARGS_VALUE, "plan: %s entry %zu must be an int number of bytes, got %s", label, at,
                      name_of(item));
        if (item->big || (item->neg && item->mag))
          return fail(e, ARGS_VALUE, "plan: %s entry %zu must be a byte count >= 0 and < 2**64, got %s", label, at,
                      DESCRIBE(item));
        ((uint64_t *)out)[at] = item->mag;
      } else {
        double x;
        if (item->kind == ARGS_FLOAT)
          x = item->f;
        else if ((item->kind == ARGS_INT && !item->big) || item->kind == ARGS_BOOL)
          x = int_as_double(item);
        else
          return fail(e, ARGS_VALUE, "plan: %s entry %zu must be a number, got %s", label, at,
                      item->kind == ARGS_INT ? DESCRIBE(item) : name_of(item));
        ((double *)out)[at] = x;
      }
    }
  }
  return 0;
}

/* The entry of the chain under `key`; None counts as absent. NULL with *e set when required. */
static const args_value_t *chain_key(const args_value_t *dict, const char *key, int required, args_error_t *e) {
  const args_value_t *v = _llmmem_args_dict_get(dict, key);
  if (v && v->kind == ARGS_NONE) v = NULL;
  if (!v && required) fail(e, ARGS_VALUE, "plan: chain['%s'] is required", key);
  return v;
}

/* read_table on chain[key] (label "chain['key']"). */
static int read_key(const args_value_t *v, const char *key, size_t rows, size_t cols, int is_bytes, void *out,
                    args_error_t *e) {
  char label[48];
  snprintf(label, sizeof label, "chain['%s']", key);
  return read_table(v, label, rows, cols, is_bytes, out, e);
}

void _llmmem_args_chain_free(args_chain_t *c) {
  free(c->f);
  free(c->fn);
  free(c->b);
  free(c->x);
  free(c->s);
  free(c->ft);
  free(c->fnt);
  free(c->ftk);
  free(c->bt);
  free(c->nest);
  free(c->kept);
  free(c->cut);
  memset(c, 0, sizeof *c);
}

int _llmmem_args_chain(const args_value_t *dict, args_chain_t *cs, args_error_t *e) {
  memset(cs, 0, sizeof *cs);
  if (dict->kind != ARGS_DICT) return fail(e, ARGS_TYPE, "plan: chain must be a dict, got %s", name_of(dict));
  if (dict->big) return too_large(e, "chain");
  const args_value_t *f = chain_key(dict, "fwd_time", 1, e), *b = NULL, *x = NULL, *s = NULL;
  if (!f || !(b = chain_key(dict, "bwd_time", 1, e)) || !(x = chain_key(dict, "input_bytes", 1, e)) ||
      !(s = chain_key(dict, "saved_bytes", 1, e)))
    return -1;
  if (f->kind != ARGS_LIST || f->seq.n < 1 || f->seq.n > LLMMEM_PLAN_MAX_BLOCKS)
    return fail(e, ARGS_VALUE, "plan: chain['fwd_time'] must list 1..%d blocks, got %s", LLMMEM_PLAN_MAX_BLOCKS,
                f->kind == ARGS_LIST ? "an empty list" : name_of(f));
  if (f->big) return too_large(e, "chain['fwd_time']");
  const args_value_t *row0 = &f->seq.items[0];
  if (row0->kind != ARGS_LIST || row0->seq.n < 1 || row0->seq.n > LLMMEM_PLAN_MAX_MODES)
    return fail(e, ARGS_VALUE, "plan: chain['fwd_time'][0] must list 1..%d modes", LLMMEM_PLAN_MAX_MODES);
  const size_t L = f->seq.n, K = row0->seq.n, LK = L * K;
  cs->f = malloc(LK * sizeof(double));
  cs->b = malloc(LK * sizeof(double));
  cs->x = malloc((L + 1) * sizeof(uint64_t));
  cs->s = malloc(LK * sizeof(uint64_t));
  if (!cs->f || !cs->b || !cs->x || !cs->s) goto nomem;
  if (read_key(f, "fwd_time", L, K, 0, cs->f, e) < 0 || read_key(b, "bwd_time", L, K, 0, cs->b, e) < 0 ||
      read_key(x, "input_bytes", L + 1, 0, 1, cs->x, e) < 0 || read_key(s, "saved_bytes", L, K, 1, cs->s, e) < 0)
    goto fail;
  const args_value_t *fn = chain_key(dict, "fwd_nostore_time", 0, e), *ft = chain_key(dict, "fwd_tmp_bytes", 0, e);
  const args_value_t *bt = chain_key(dict, "bwd_tmp_bytes", 0, e), *nest = chain_key(dict, "mode_nestable", 0, e);
  if (fn) {
    if (!(cs->fn = malloc(L * sizeof(double)))) goto nomem;
    if (read_key(fn, "fwd_nostore_time", L, 0, 0, cs->fn, e) < 0) goto fail;
  }
  if (ft) {
    if (!(cs->ft = malloc(L * sizeof(uint64_t)))) goto nomem;
    if (read_key(ft, "fwd_tmp_bytes", L, 0, 1, cs->ft, e) < 0) goto fail;
  }
  const args_value_t *fnt = chain_key(dict, "fwd_nostore_tmp_bytes", 0, e);
  if (fnt) {
    if (!(cs->fnt = malloc(L * sizeof(uint64_t)))) goto nomem;
    if (read_key(fnt, "fwd_nostore_tmp_bytes", L, 0, 1, cs->fnt, e) < 0) goto fail;
  }
  const args_value_t *ftk = chain_key(dict, "fwd_tape_tmp_bytes", 0, e);
  if (ftk) {
    if (!(cs->ftk = malloc(LK * sizeof(uint64_t)))) goto nomem;
    if (read_key(ftk, "fwd_tape_tmp_bytes", L, K, 1, cs->ftk, e) < 0) goto fail;
  }
  if (bt) {
    if (!(cs->bt = malloc(LK * sizeof(uint64_t)))) goto nomem;
    if (read_key(bt, "bwd_tmp_bytes", L, K, 1, cs->bt, e) < 0) goto fail;
  }
  if (nest) {
    uint64_t tmp[LLMMEM_PLAN_MAX_MODES];
    if (read_key(nest, "mode_nestable", K, 0, 1, tmp, e) < 0) goto fail;
    if (!(cs->nest = malloc(K))) goto nomem;
    for (size_t k = 0; k < K; k++) {
      if (tmp[k] > 1) {
        fail(e, ARGS_VALUE, "plan: chain['mode_nestable'][%zu] must be 0 or 1", k);
        goto fail;
      }
      cs->nest[k] = (uint8_t)tmp[k];
    }
  }
  const args_value_t *kept = chain_key(dict, "output_kept", 0, e), *bw = chain_key(dict, "host_bandwidth", 0, e);
  if (kept) {
    uint64_t *tmp = malloc(LK * sizeof *tmp);
    if (!tmp || !(cs->kept = malloc(LK))) {
      free(tmp);
      goto nomem;
    }
    const int bad = read_key(kept, "output_kept", L, K, 1, tmp, e);
    size_t at = LK;
    for (size_t i = 0; bad == 0 && i < LK; i++) {
      if (tmp[i] > 1 && at == LK) at = i;
      cs->kept[i] = (uint8_t)(tmp[i] != 0);
    }
    free(tmp);
    if (bad < 0) goto fail;
    if (at < LK) {
      fail(e, ARGS_VALUE, "plan: chain['output_kept'][%zu][%zu] must be 0 or 1", at / K, at % K);
      goto fail;
    }
  }
  const args_value_t *cut = chain_key(dict, "cut_before", 0, e);
  if (cut) {
    uint64_t *tmp = malloc(L * sizeof *tmp);
    if (!tmp || !(cs->cut = malloc(L))) {
      free(tmp);
      goto nomem;
    }
    const int bad = read_key(cut, "cut_before", L, 0, 1, tmp, e);
    size_t at = L;
    for (size_t i = 0; bad == 0 && i < L; i++) {
      if (tmp[i] > 1 && at == L) at = i;
      cs->cut[i] = (uint8_t)(tmp[i] != 0);
    }
    free(tmp);
    if (bad < 0) goto fail;
    if (at < L) {
      fail(e, ARGS_VALUE, "plan: chain['cut_before'][%zu] must be 0 or 1", at);
      goto fail;
    }
  }
  double host_bandwidth = 0.0;
  if (bw && _llmmem_args_number(bw, "plan: chain['host_bandwidth']", &host_bandwidth, e) < 0) {
    e->status = ARGS_VALUE; /* a malformed chain is a ValueError throughout */
    goto fail;
  }
  cs->chain = (llmmem_plan_chain_t){(int32_t)L, (int32_t)K, cs->f,    cs->fn,         cs->b,   cs->x,   cs->s,  cs->ft,
                                    cs->bt,     cs->nest,   cs->kept, host_bandwidth, cs->fnt, cs->ftk, cs->cut};
  return 0;
nomem:
  fail(e, ARGS_NOMEM, "plan: no memory for a chain of %zu blocks", L);
fail:
  _llmmem_args_chain_free(cs);
  return -1;
}

int _llmmem_args_plan_modes(const args_value_t *v, int32_t L, int32_t *mode, args_error_t *e) {
  uint64_t *tmp = malloc((size_t)L * sizeof *tmp);
  if (!tmp) return fail(e, ARGS_NOMEM, "plan: no memory for %d modes", L);
  const int st = read_table(v, "modes", (size_t)L, 0, 1, tmp, e);
  for (int32_t i = 0; st == 0 && i < L; i++) mode[i] = tmp[i] > 1000 ? 1000 : (int32_t)tmp[i];
  free(tmp);
  return st;
}

int _llmmem_args_plan_regions(const args_value_t *v, int32_t L, llmmem_plan_region_t **out, int32_t *count,
                              args_error_t *e) {
  *out = NULL;
  *count = 0;
  if (v->kind != ARGS_LIST)
    return fail(e, ARGS_TYPE, "plan: regions must be a list of (start, end) pairs, got %s", name_of(v));
  const size_t R = v->seq.n;
  if (R > 2 * (size_t)L) return fail(e, ARGS_VALUE, "plan: %zu regions for %d blocks cannot be properly nested", R, L);
  if (v->big) return too_large(e, "regions");
  llmmem_plan_region_t *regions = malloc((R + 1) * sizeof *regions);
  if (!regions) return fail(e, ARGS_NOMEM, "plan: no memory for %zu regions", R);
  for (size_t r = 0; r < R; r++) {
    const args_value_t *t = &v->seq.items[r];
    int64_t part[3] = {0, 0, 0};
    int ok = t->kind == ARGS_LIST && !t->big && (t->seq.n == 2 || t->seq.n == 3);
    for (size_t j = 0; ok && j < t->seq.n; j++) {
      const args_value_t *p = &t->seq.items[j];
      ok = p->kind == ARGS_INT && !p->big && (p->neg ? p->mag <= (uint64_t)INT32_MAX + 1 : p->mag <= INT32_MAX);
      if (ok) part[j] = p->neg ? -(int64_t)p->mag : (int64_t)p->mag;
    }
    if (!ok) {
      char desc[64];
      free(regions);
      return fail(e, ARGS_VALUE,
                  "plan: regions[%zu] must be a (start, end) or (start, end, offload) tuple of ints, got %s", r,
                  DESCRIBE(t));
    }
    regions[r] = (llmmem_plan_region_t){(int32_t)part[0], (int32_t)part[1], (int32_t)part[2]};
  }
  *out = regions;
  *count = (int32_t)R;
  return 0;
}
