/*
 * fuzz_args.c — libFuzzer harness for the argument parsers of llmmem._C (csrc/python/args.c):
 * `make fuzz-args` (FUZZ_RUNS inputs from a fixed seed; FUZZ_SECONDS=N for a timed run).
 *
 * Each input decodes into snapshot trees like the ones args_py.c builds from Python values, either
 * shaped like a chain with a few nodes changed (so most inputs get deep into the parser) or
 * arbitrary, and runs every parser on them: the chain, modes and regions of the planner's entry
 * points, the scalar parsers of the pool and collectives. A parse that succeeds must agree with
 * the tree it read (shapes, values, limits) and is handed to the planner's core (simulate, and the
 * least budget for short chains); one that fails must leave a NUL-terminated message and nothing
 * allocated. Any violation traps; ASan and UBSan catch the rest.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <llmmem/checkpointing.h>

#include "../../csrc/python/args.h"

typedef struct {
  const uint8_t *p;
  size_t n;
} input_t;

static uint8_t byte(input_t *in) {
  if (!in->n) return 0;
  in->n--;
  return *in->p++;
}

static uint64_t bytes(input_t *in, int k) {
  uint64_t v = 0;
  for (int i = 0; i < k; i++) v = v << 8 | byte(in);
  return v;
}

static const char *const KEYS[] = {"fwd_time",
                                   "bwd_time",
                                   "input_bytes",
                                   "saved_bytes",
                                   "fwd_nostore_time",
                                   "fwd_tmp_bytes",
                                   "bwd_tmp_bytes",
                                   "mode_nestable",
                                   "output_kept",
                                   "host_bandwidth",
                                   "fwd_nostore_tmp_bytes",
                                   "fwd_tape_tmp_bytes",
                                   "fwd_time2",
                                   ""};
#define N_CHAIN_KEYS 12 /* the chain's keys, first in KEYS: 4 required, the rest optional */
#define N_KEYS       (sizeof KEYS / sizeof KEYS[0])

static void set_int(args_value_t *v, int neg, uint64_t mag) {
  memset(v, 0, sizeof *v);
  v->kind = ARGS_INT;
  v->neg = neg && mag;
  v->mag = mag;
  v->type_name = "int";
}

static void set_float(args_value_t *v, double f) {
  memset(v, 0, sizeof *v);
  v->kind = ARGS_FLOAT;
  v->f = f;
  v->type_name = "float";
}

/* A list of n nodes from the arena, or one recorded by length only when the budget is spent. */
static args_value_t *set_list(args_arena_t *a, args_value_t *v, size_t n) {
  memset(v, 0, sizeof *v);
  v->kind = ARGS_LIST;
  v->type_name = "list";
  v->seq.n = n;
  if (!n) return NULL;
  v->seq.items = _llmmem_args_nodes(a, n);
  if (!v->seq.items) v->big = 1;
  return v->seq.items;
}

static void set_str(args_arena_t *a, args_value_t *v, const char *s, size_t len) {
  memset(v, 0, sizeof *v);
  v->kind = ARGS_STR;
  v->type_name = "str";
  v->seq.n = len;
  v->seq.text = _llmmem_args_text(a, s, len);
  if (!v->seq.text) v->big = 1;
}

/* An arbitrary value, `depth` levels of containers at most. */
static void any_value(input_t *in, args_arena_t *a, args_value_t *v, int depth) {
  const uint8_t b = byte(in);
  memset(v, 0, sizeof *v);
  switch (b % 9) {
    case 0: v->kind = ARGS_NONE, v->type_name = "NoneType"; break;
    case 1: v->kind = ARGS_BOOL, v->type_name = "bool", v->mag = b >> 7; break;
    case 2: set_int(v, b & 0x80, bytes(in, 1 + (b >> 4) % 8)); break;
    case 3:
      set_int(v, b & 0x80, bytes(in, 2));
      if (b & 0x40) v->big = 1, v->mag = 64 + v->mag % 1000; /* beyond 64 bits: the bit count */
      break;
    case 4: {
      uint64_t raw = bytes(in, 8);
      double f;
      memcpy(&f, &raw, sizeof f); /* any double: NaN, infinities, subnormals */
      set_float(v, b & 0x80 ? f : (double)(raw % 100) / 4.0);
      break;
    }
    case 5: {
      const char *k = KEYS[byte(in) % N_KEYS];
      set_str(a, v, k, strlen(k));
      break;
    }
    case 6:
    case 7: {
      size_t n = byte(in) % (depth > 0 ? 12 : 3);
      if (b & 0x80) n = ARGS_MAX_ITEMS + n; /* recorded by length only */
      if (depth <= 0 || n > ARGS_MAX_ITEMS) {
        set_list(a, v, 0);
        v->seq.n = n, v->big = n > 0;
        break;
      }
      args_value_t *items = set_list(a, v, n);
      for (size_t i = 0; items && i < n; i++) any_value(in, a, &items[i], depth - 1);
      break;
    }
    default: v->kind = ARGS_OTHER, v->type_name = b & 1 ? "Decimal" : "object"; break;
  }
}

/* A table of rows x cols numbers (cols 0: a flat list), ints (is_bytes) or floats. */
static void table(input_t *in, args_arena_t *a, args_value_t *v, size_t rows, size_t cols, int is_bytes) {
  args_value_t *r = set_list(a, v, rows);
  for (size_t i = 0; r && i < rows; i++) {
    args_value_t *cells = &r[i];
    size_t n = 1;
    if (cols) cells = set_list(a, &r[i], cols), n = cols;
    for (size_t j = 0; cells && j < n; j++) {
      const uint8_t x = byte(in);
      if (is_bytes)
        set_int(&cells[j], 0, x % 16);
      else
        set_float(&cells[j], 0.25 + (double)(x % 16));
    }
  }
}

/* A 0/1 flag, now and then 2 (which the parser must refuse). */
static uint64_t flag(uint8_t x) { return x % 32 == 31 ? 2 : x % 3 == 0; }

/* A chain dict that is valid before its mutations: L blocks, K modes, some optional keys. */
static void chain_value(input_t *in, args_arena_t *a, args_value_t *v, size_t *L_out) {
  const size_t L = 1 + byte(in) % 9, K = 1 + byte(in) % 3;
  const uint8_t opt = byte(in);
  size_t n = 4;
  for (int i = 0; i < N_CHAIN_KEYS - 4; i++) n += (opt >> i) & 1;
  memset(v, 0, sizeof *v);
  v->kind = ARGS_DICT;
  v->type_name = "dict";
  v->seq.n = n;
  v->seq.items = _llmmem_args_nodes(a, n);
  v->seq.keys = _llmmem_args_nodes(a, n);
  if (!v->seq.items || !v->seq.keys) {
    v->big = 1;
    *L_out = L;
    return;
  }
  size_t at = 0;
  for (size_t k = 0; k < N_CHAIN_KEYS; k++) {
    if (k >= 4 && !((opt >> (k - 4)) & 1)) continue;
    set_str(a, &v->seq.keys[at], KEYS[k], strlen(KEYS[k]));
    args_value_t *val = &v->seq.items[at++];
    switch (k) {
      case 0:
      case 1: table(in, a, val, L, K, 0); break;
      case 2: table(in, a, val, L + 1, 0, 1); break;
      case 3:
      case 6:
      case 11: table(in, a, val, L, K, 1); break;
      case 4: table(in, a, val, L, 0, 0); break;
      case 5:
      case 10: table(in, a, val, L, 0, 1); break;
      case 7: {
        args_value_t *m = set_list(a, val, K);
        for (size_t j = 0; m && j < K; j++) set_int(&m[j], 0, flag(byte(in)));
        break;
      }
      case 8: {
        args_value_t *r = set_list(a, val, L);
        for (size_t i = 0; r && i < L; i++) {
          args_value_t *c = set_list(a, &r[i], K);
          for (size_t j = 0; c && j < K; j++) set_int(&c[j], 0, flag(byte(in)));
        }
        break;
      }
      default: set_float(val, byte(in) % 2 ? 0.0 : 1.0 + byte(in)); break;
    }
  }
  *L_out = L;
}

/* mag + 1..3, or a value next to the limits of C's integer types. */
static uint64_t near_limit(uint8_t x, uint64_t mag) {
  static const uint64_t limits[] = {(uint64_t)INT32_MAX, (uint64_t)UINT32_MAX, (uint64_t)INT64_MAX, UINT64_MAX - 2};
  return x % 2 ? mag + 1 + x % 3 : limits[(x >> 1) % 4] + (x >> 3) % 3;
}

/* One change that keeps a value close to valid (a list one longer or shorter, a number of another
 * kind or sign) or makes it anything at all. */
static void mutate(input_t *in, args_arena_t *a, args_value_t *v) {
  const uint8_t how = byte(in) % 6;
  if (v->kind == ARGS_LIST && !v->big && how < 2) {
    if (how == 0 && v->seq.n > 0) {
      v->seq.n--;
    } else if (v->seq.n > 0) { /* the last item again */
      args_value_t *items = _llmmem_args_nodes(a, v->seq.n + 1);
      if (!items) return;
      memcpy(items, v->seq.items, v->seq.n * sizeof *items);
      items[v->seq.n] = items[v->seq.n - 1];
      v->seq.items = items;
      v->seq.n++;
    }
    return;
  }
  if ((v->kind == ARGS_INT || v->kind == ARGS_FLOAT) && how < 4) {
    switch (how) {
      case 0:
        v->kind == ARGS_INT ? set_float(v, (double)v->mag)
                            : set_int(v, 0, isfinite(v->f) ? (uint64_t)fabs(fmod(v->f, 1e6)) : 0);
        break;
      case 1: v->kind == ARGS_INT ? (void)(v->neg = v->mag != 0) : (void)(v->f = -v->f); break;
      case 2:
        v->kind == ARGS_INT ? (void)(v->mag = near_limit(byte(in), v->mag))
                            : (void)(v->f = byte(in) % 2 ? NAN : INFINITY);
        break;
      default: v->kind = ARGS_BOOL, v->type_name = "bool", v->mag = byte(in) % 2; break;
    }
    return;
  }
  any_value(in, a, v, 2);
}

/* Every node of a tree, pre-order, for the mutations. */
static void collect(args_value_t *v, args_value_t **out, size_t *n, size_t cap) {
  if (*n < cap) out[(*n)++] = v;
  if ((v->kind == ARGS_LIST || v->kind == ARGS_DICT) && !v->big)
    for (size_t i = 0; i < v->seq.n; i++) collect(&v->seq.items[i], out, n, cap);
}

static void check_error(const args_error_t *e) {
  if (e->status < ARGS_TYPE || e->status > ARGS_TOO_BIG) __builtin_trap();
  if (!memchr(e->msg, '\0', sizeof e->msg) || !e->msg[0]) __builtin_trap();
}

/* The double a number node holds, as the parser must have read it. */
static int number_of(const args_value_t *v, double *out) {
  if (v->kind == ARGS_FLOAT) return *out = v->f, 1;
  if ((v->kind == ARGS_INT && !v->big) || v->kind == ARGS_BOOL)
    return *out = v->neg ? -(double)v->mag : (double)v->mag, 1;
  return 0;
}

static int same_double(double a, double b) { return a == b || (isnan(a) && isnan(b)); }

/* A parsed chain agrees with its tree: shapes and the required tables, value by value. */
static void check_chain(const args_value_t *dict, const args_chain_t *cs) {
  const llmmem_plan_chain_t *c = &cs->chain;
  if (c->n_blocks < 1 || c->n_blocks > LLMMEM_PLAN_MAX_BLOCKS || c->n_modes < 1 || c->n_modes > LLMMEM_PLAN_MAX_MODES)
    __builtin_trap();
  if (!c->fwd_time || !c->bwd_time || !c->input_bytes || !c->saved_bytes) __builtin_trap();
  const size_t L = (size_t)c->n_blocks, K = (size_t)c->n_modes;
  const args_value_t *f = _llmmem_args_dict_get(dict, "fwd_time"), *x = _llmmem_args_dict_get(dict, "input_bytes");
  const args_value_t *s = _llmmem_args_dict_get(dict, "saved_bytes");
  if (!f || !x || !s || f->seq.n != L || x->seq.n != L + 1 || s->seq.n != L) __builtin_trap();
  for (size_t i = 0; i < L; i++) {
    if (x->seq.items[i].kind != ARGS_INT || x->seq.items[i].mag != c->input_bytes[i]) __builtin_trap();
    for (size_t k = 0; k < K; k++) {
      double want;
      if (f->seq.items[i].seq.n != K || !number_of(&f->seq.items[i].seq.items[k], &want) ||
          !same_double(want, c->fwd_time[i * K + k]))
        __builtin_trap();
      if (s->seq.items[i].seq.items[k].mag != c->saved_bytes[i * K + k]) __builtin_trap();
    }
  }
  const args_value_t *fnt = _llmmem_args_dict_get(dict, "fwd_nostore_tmp_bytes");
  if (fnt && fnt->kind != ARGS_NONE) { /* optional: when given, read value by value */
    if (!c->fwd_nostore_tmp_bytes || fnt->seq.n != L) __builtin_trap();
    for (size_t i = 0; i < L; i++)
      if (fnt->seq.items[i].kind != ARGS_INT || fnt->seq.items[i].mag != c->fwd_nostore_tmp_bytes[i]) __builtin_trap();
  } else if (c->fwd_nostore_tmp_bytes) {
    __builtin_trap();
  }
  const args_value_t *ftk = _llmmem_args_dict_get(dict, "fwd_tape_tmp_bytes");
  if (ftk && ftk->kind != ARGS_NONE) {
    if (!c->fwd_tape_tmp_bytes || ftk->seq.n != L) __builtin_trap();
    for (size_t i = 0; i < L; i++)
      for (size_t k = 0; k < K; k++)
        if (ftk->seq.items[i].seq.items[k].mag != c->fwd_tape_tmp_bytes[i * K + k]) __builtin_trap();
  } else if (c->fwd_tape_tmp_bytes) {
    __builtin_trap();
  }
  if (c->mode_nestable)
    for (size_t k = 0; k < K; k++)
      if (c->mode_nestable[k] > 1) __builtin_trap();
  if (c->output_kept)
    for (size_t i = 0; i < L * K; i++)
      if (c->output_kept[i] > 1) __builtin_trap();
}

/* Scalars: the value a successful parse returns is the node's and inside the bounds. */
static void fuzz_scalars(input_t *in, const args_value_t *v) {
  args_error_t e;
  const uint64_t lo = bytes(in, 1), hi = lo + bytes(in, 1 + byte(in) % 8);
  uint64_t u;
  if (_llmmem_args_uint(v, "u", lo, hi, &u, &e) == 0) {
    if (u < lo || u > hi || v->kind != ARGS_INT || v->big || (v->neg && v->mag) || u != v->mag) __builtin_trap();
  } else {
    check_error(&e);
  }
  const int64_t slo = -(int64_t)bytes(in, 2), shi = (int64_t)bytes(in, 2);
  int64_t s;
  if (_llmmem_args_int(v, "i", slo, shi, &s, &e) == 0) {
    if (s < slo || s > shi || v->kind != ARGS_INT || (uint64_t)(s < 0 ? -s : s) != v->mag || (s < 0) != v->neg)
      __builtin_trap();
  } else {
    check_error(&e);
  }
  if (_llmmem_args_int(v, "i", INT64_MIN, INT64_MAX, &s, &e) != 0) check_error(&e);
  size_t z;
  const size_t zmin = byte(in);
  if (_llmmem_args_size(v, "z", zmin, &z, &e) == 0) {
    if (z < zmin || z != v->mag || v->neg) __builtin_trap();
  } else {
    check_error(&e);
    if (e.status == ARGS_TOO_BIG && !v->big) __builtin_trap(); /* only beyond 64 bits here */
  }
  double d;
  if (_llmmem_args_number(v, "d", &d, &e) == 0) {
    double want;
    if (v->kind == ARGS_BOOL || !number_of(v, &want) || !same_double(d, want)) __builtin_trap();
  } else {
    check_error(&e);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len) {
  input_t in = {data, len};
  args_arena_t a = {0};
  /* The choices come first (an input that runs out reads zeros: the most structured choices). */
  const uint8_t mode = byte(&in), shapes = byte(&in);
  if (mode & 0x80) a.max_nodes = 16 + byte(&in); /* a small budget: large values recorded by length */
  args_value_t root, modes, regions;
  size_t L = 1;
  if (mode % 3 != 2) {
    chain_value(&in, &a, &root, &L);
    /* a few nodes changed into arbitrary values (wrong kinds, shapes, signs, sizes) */
    args_value_t *nodes[512];
    size_t n = 0;
    collect(&root, nodes, &n, 512);
    for (int m = byte(&in) % 4; m > 0 && n; m--) {
      mutate(&in, &a, nodes[bytes(&in, 2) % n]);
      n = 0;
      collect(&root, nodes, &n, 512); /* the change may have replaced a subtree */
    }
  } else {
    any_value(&in, &a, &root, 4);
  }
  if (shapes % 4 != 3) { /* modes that mostly look like modes */
    args_value_t *m = set_list(&a, &modes, byte(&in) % 8 == 0 ? L + 1 : L);
    for (size_t i = 0; m && i < modes.seq.n; i++) set_int(&m[i], 0, byte(&in) % 4);
  } else {
    any_value(&in, &a, &modes, 1);
  }
  if ((shapes >> 2) % 4 != 3) { /* regions that mostly look like regions */
    args_value_t *r = set_list(&a, &regions, byte(&in) % 6);
    for (size_t i = 0; r && i < regions.seq.n; i++) {
      args_value_t *t = set_list(&a, &r[i], 2 + byte(&in) % 2);
      for (size_t j = 0; t && j < r[i].seq.n; j++) {
        const uint8_t x = byte(&in);
        set_int(&t[j], x % 32 == 0, x % 16 == 1 ? near_limit(byte(&in), 0) : x % (L + 2));
      }
    }
  } else {
    any_value(&in, &a, &regions, 2);
  }

  char desc[64];
  args_value_t *all[512];
  size_t n_all = 0;
  collect(&root, all, &n_all, 512);
  for (size_t i = 0; i < n_all; i++)
    if (!memchr(_llmmem_args_describe(all[i], desc, sizeof desc), '\0', sizeof desc)) __builtin_trap();

  args_error_t e;
  args_chain_t cs;
  if (_llmmem_args_chain(&root, &cs, &e) == 0) {
    check_chain(&root, &cs);
    const int32_t Lc = cs.chain.n_blocks;
    int32_t *mode_v = calloc((size_t)Lc, sizeof *mode_v);
    llmmem_plan_region_t *reg = NULL;
    int32_t n_reg = 0;
    if (!mode_v) __builtin_trap();
    llmmem_plan_prediction_t pred;
    llmmem_plan_t plan = {mode_v, NULL, 0, 0};
    (void)llmmem_plan_simulate(&cs.chain, &plan, &pred); /* the core's own checks, on parsed input */
    uint64_t least;
    if (Lc <= 12) (void)llmmem_plan_min_budget(&cs.chain, &least);
    if (_llmmem_args_plan_modes(&modes, Lc, mode_v, &e) == 0) {
      for (int32_t i = 0; i < Lc; i++)
        if (mode_v[i] < 0 || mode_v[i] > 1000) __builtin_trap();
      if (_llmmem_args_plan_regions(&regions, Lc, &reg, &n_reg, &e) == 0) {
        if (n_reg < 0 || n_reg > 2 * Lc || (n_reg && !reg) || (size_t)n_reg != regions.seq.n) __builtin_trap();
        for (int32_t r = 0; r < n_reg; r++) { /* each as the tree says, the offload flag 0 when left out */
          const args_value_t *t = regions.seq.items[r].seq.items;
          const int32_t got[3] = {reg[r].start, reg[r].end, reg[r].offload};
          for (size_t j = 0; j < 3; j++) {
            const int64_t want =
                j < regions.seq.items[r].seq.n ? (t[j].neg ? -(int64_t)t[j].mag : (int64_t)t[j].mag) : 0;
            if (want != got[j]) __builtin_trap();
          }
        }
        plan = (llmmem_plan_t){mode_v, reg, n_reg, n_reg};
        (void)llmmem_plan_simulate(&cs.chain, &plan, &pred);
      } else {
        check_error(&e);
        if (reg || n_reg) __builtin_trap(); /* nothing handed out on failure */
      }
    } else {
      check_error(&e);
    }
    free(reg);
    free(mode_v);
    _llmmem_args_chain_free(&cs);
  } else {
    check_error(&e);
    static const args_chain_t zero;
    if (memcmp(&cs, &zero, sizeof cs) != 0) __builtin_trap(); /* freed and cleared */
  }
  fuzz_scalars(&in, &root);
  fuzz_scalars(&in, &modes);
  if (!regions.big && regions.kind == ARGS_LIST && regions.seq.n) fuzz_scalars(&in, &regions.seq.items[0]);
  _llmmem_args_arena_free(&a);
  return 0;
}
