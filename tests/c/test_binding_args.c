/*
 * test_binding_args.c — the binding's argument parsers (csrc/python/args.c) on chosen trees:
 * scalar bounds at the limits of C's integer types, the messages that name the argument, chains
 * read value by value, every malformed shape refused with nothing left allocated, modes and
 * regions, and the arena's budget. (tests/fuzz/fuzz_args.c throws arbitrary trees at them.)
 */
#include <math.h>
#include <string.h>

#include "testhelper.h"
#include "../../csrc/python/args.h"

static args_arena_t arena;

static args_value_t *node(void) { return _llmmem_args_nodes(&arena, 1); }

static args_value_t *int_v(int neg, uint64_t mag) {
  args_value_t *v = node();
  v->kind = ARGS_INT;
  v->neg = neg && mag;
  v->mag = mag;
  v->type_name = "int";
  return v;
}

static args_value_t *big_int(int neg, uint64_t bits) {
  args_value_t *v = int_v(neg, bits);
  v->neg = (uint8_t)neg;
  v->big = 1;
  return v;
}

static args_value_t *float_v(double f) {
  args_value_t *v = node();
  v->kind = ARGS_FLOAT;
  v->f = f;
  v->type_name = "float";
  return v;
}

static args_value_t *other_v(const char *type_name) {
  args_value_t *v = node();
  v->kind = ARGS_OTHER;
  v->type_name = type_name;
  return v;
}

static args_value_t *none_v(void) {
  args_value_t *v = node();
  v->kind = ARGS_NONE;
  v->type_name = "NoneType";
  return v;
}

static args_value_t *bool_v(int b) {
  args_value_t *v = node();
  v->kind = ARGS_BOOL;
  v->mag = (uint64_t)b;
  v->type_name = "bool";
  return v;
}

/* A list of n copies of the given nodes (n items, taken in order). */
static args_value_t *list_v(size_t n, args_value_t **items) {
  args_value_t *v = node();
  v->kind = ARGS_LIST;
  v->type_name = "list";
  v->seq.n = n;
  if (n) {
    v->seq.items = _llmmem_args_nodes(&arena, n);
    for (size_t i = 0; i < n; i++) v->seq.items[i] = *items[i];
  }
  return v;
}

/* rows x cols floats (value base + i) or ints (is_bytes). cols 0: a flat list. */
static args_value_t *table_v(size_t rows, size_t cols, int is_bytes, double base) {
  args_value_t *r[32];
  for (size_t i = 0; i < rows; i++) {
    if (!cols) {
      r[i] = is_bytes ? int_v(0, (uint64_t)base + i) : float_v(base + (double)i);
      continue;
    }
    args_value_t *c[16];
    for (size_t j = 0; j < cols; j++)
      c[j] = is_bytes ? int_v(0, (uint64_t)base + i * cols + j) : float_v(base + (double)(i * cols + j));
    r[i] = list_v(cols, c);
  }
  return list_v(rows, r);
}

typedef struct {
  const char *key;
  args_value_t *value;
} entry_t;

static args_value_t *dict_v(size_t n, const entry_t *e) {
  args_value_t *v = node();
  v->kind = ARGS_DICT;
  v->type_name = "dict";
  v->seq.n = n;
  v->seq.items = _llmmem_args_nodes(&arena, n);
  v->seq.keys = _llmmem_args_nodes(&arena, n);
  for (size_t i = 0; i < n; i++) {
    v->seq.keys[i].kind = ARGS_STR;
    v->seq.keys[i].type_name = "str";
    v->seq.keys[i].seq.n = strlen(e[i].key);
    v->seq.keys[i].seq.text = _llmmem_args_text(&arena, e[i].key, strlen(e[i].key));
    v->seq.items[i] = *e[i].value;
  }
  return v;
}

/* A valid chain of L blocks and K modes, with `extra` entries added (or replacing same keys). */
static args_value_t *chain_v(size_t L, size_t K, size_t n_extra, const entry_t *extra) {
  entry_t e[16] = {
      {"fwd_time", table_v(L, K, 0, 1.0)},
      {"bwd_time", table_v(L, K, 0, 2.0)},
      {"input_bytes", table_v(L + 1, 0, 1, 8)},
      {"saved_bytes", table_v(L, K, 1, 16)},
  };
  size_t n = 4;
  for (size_t x = 0; x < n_extra; x++) {
    size_t at = n;
    for (size_t i = 0; i < n; i++)
      if (strcmp(e[i].key, extra[x].key) == 0) at = i;
    e[at] = extra[x];
    if (at == n) n++;
  }
  return dict_v(n, e);
}

static int refused(const args_value_t *chain, args_status_t status, const char *needle) {
  args_chain_t cs;
  args_error_t e;
  memset(&e, 0, sizeof e);
  if (_llmmem_args_chain(chain, &cs, &e) == 0) {
    _llmmem_args_chain_free(&cs);
    printf("  accepted, expected a refusal naming %s\n", needle);
    return 0;
  }
  static const args_chain_t zero;
  if (memcmp(&cs, &zero, sizeof cs) != 0) return 0;
  if (e.status != status || !strstr(e.msg, needle)) {
    printf("  status %d message '%s', expected %d with '%s'\n", (int)e.status, e.msg, (int)status, needle);
    return 0;
  }
  return 1;
}

int main(void) {
  args_error_t e;

  TEST("uint: the bounds are inclusive, bools and floats are type errors, messages name the argument") {
    uint64_t u = 0;
    CHECK(_llmmem_args_uint(int_v(0, 5), "x", 5, 5, &u, &e) == 0 && u == 5);
    CHECK(_llmmem_args_uint(int_v(0, UINT64_MAX), "x", 0, UINT64_MAX, &u, &e) == 0 && u == UINT64_MAX);
    CHECK(_llmmem_args_uint(int_v(0, 4), "pool_alloc: size", 5, 9, &u, &e) < 0 && e.status == ARGS_VALUE);
    CHECK(strstr(e.msg, "pool_alloc: size must be an int in 5..9, got 4") != NULL);
    CHECK(_llmmem_args_uint(int_v(1, 1), "x", 0, 9, &u, &e) < 0 && strstr(e.msg, "got -1"));
    CHECK(_llmmem_args_uint(big_int(0, 71), "x", 0, UINT64_MAX, &u, &e) < 0 && strstr(e.msg, "an int of 71 bits"));
    CHECK(_llmmem_args_uint(bool_v(1), "flag", 0, 1, &u, &e) < 0 && e.status == ARGS_TYPE && strstr(e.msg, "bool"));
    CHECK(_llmmem_args_uint(float_v(1.0), "x", 0, 1, &u, &e) < 0 && e.status == ARGS_TYPE);
  }

  TEST("int: INT64_MIN and INT64_MAX exactly, one beyond refused") {
    int64_t x = 0;
    CHECK(_llmmem_args_int(int_v(1, (uint64_t)INT64_MAX + 1), "x", INT64_MIN, INT64_MAX, &x, &e) == 0 &&
          x == INT64_MIN);
    CHECK(_llmmem_args_int(int_v(0, (uint64_t)INT64_MAX), "x", INT64_MIN, INT64_MAX, &x, &e) == 0 && x == INT64_MAX);
    CHECK(_llmmem_args_int(int_v(0, (uint64_t)INT64_MAX + 1), "x", INT64_MIN, INT64_MAX, &x, &e) < 0);
    CHECK(_llmmem_args_int(int_v(1, (uint64_t)INT64_MAX + 2), "x", INT64_MIN, INT64_MAX, &x, &e) < 0);
    CHECK(_llmmem_args_int(int_v(1, 2), "rank", -1, 7, &x, &e) < 0 && strstr(e.msg, "rank must be an int in -1..7"));
    CHECK(_llmmem_args_int(int_v(1, 1), "device", -1, 7, &x, &e) == 0 && x == -1);
  }

  TEST("size: negative is a value error, beyond 64 bits an out-of-memory one") {
    size_t z = 0;
    CHECK(_llmmem_args_size(int_v(0, 0), "n", 0, &z, &e) == 0 && z == 0);
    CHECK(_llmmem_args_size(int_v(0, 0), "nbytes", 1, &z, &e) < 0 && e.status == ARGS_VALUE);
    CHECK(_llmmem_args_size(int_v(1, 5), "nbytes", 1, &z, &e) < 0 && e.status == ARGS_VALUE &&
          strstr(e.msg, "got -5"));
    CHECK(_llmmem_args_size(big_int(0, 65), "nbytes", 1, &z, &e) < 0 && e.status == ARGS_TOO_BIG &&
          strstr(e.msg, "nbytes") && strstr(e.msg, "65 bits"));
    CHECK(_llmmem_args_size(other_v("str"), "size", 1, &z, &e) < 0 && e.status == ARGS_TYPE && strstr(e.msg, "str"));
  }

  TEST("number: ints and floats, not bools, not ints beyond 64 bits") {
    double d = 0;
    CHECK(_llmmem_args_number(float_v(NAN), "t", &d, &e) == 0 && isnan(d)); /* ranges are the core's */
    CHECK(_llmmem_args_number(int_v(1, 3), "t", &d, &e) == 0 && d == -3.0);
    CHECK(_llmmem_args_number(bool_v(1), "t", &d, &e) < 0 && e.status == ARGS_TYPE);
    CHECK(_llmmem_args_number(big_int(0, 1400), "timeout_s", &d, &e) < 0 && strstr(e.msg, "timeout_s"));
  }

  TEST("describe: short and NUL-terminated whatever the buffer") {
    char buf[8];
    CHECK(strcmp(_llmmem_args_describe(float_v(0.1), (char[32]){0}, 32), "0.1") == 0);
    CHECK(strcmp(_llmmem_args_describe(float_v(1.0 / 3.0), (char[32]){0}, 32), "0.33333333333333331") == 0);
    _llmmem_args_describe(big_int(1, 100), buf, sizeof buf);
    CHECK(memchr(buf, '\0', sizeof buf) != NULL);
    CHECK(strcmp(_llmmem_args_describe(none_v(), (char[32]){0}, 32), "None") == 0);
  }

  TEST("chain: a valid chain is read value by value, absent and None optional keys stay NULL") {
    args_value_t *c = chain_v(3, 2, 1, (entry_t[]){{"fwd_tmp_bytes", none_v()}});
    args_chain_t cs;
    CHECK(_llmmem_args_chain(c, &cs, &e) == 0);
    CHECK(cs.chain.n_blocks == 3 && cs.chain.n_modes == 2);
    CHECK(cs.chain.fwd_time[5] == 6.0 && cs.chain.bwd_time[0] == 2.0 && cs.chain.input_bytes[3] == 11);
    CHECK(cs.chain.saved_bytes[4] == 20);
    CHECK(!cs.chain.fwd_tmp_bytes && !cs.chain.fwd_nostore_time && !cs.chain.output_kept &&
          !cs.chain.fwd_nostore_tmp_bytes && !cs.chain.fwd_tape_tmp_bytes && cs.chain.host_bandwidth == 0.0);
    _llmmem_args_chain_free(&cs);
    entry_t all[] = {{"fwd_nostore_time", table_v(3, 0, 0, 0.5)},
                     {"fwd_tmp_bytes", table_v(3, 0, 1, 1)},
                     {"bwd_tmp_bytes", table_v(3, 2, 1, 0)},
                     {"mode_nestable", list_v(2, (args_value_t *[]){int_v(0, 1), int_v(0, 0)})},
                     {"output_kept", table_v(3, 2, 1, 0)},
                     {"host_bandwidth", int_v(0, 1000)},
                     {"fwd_nostore_tmp_bytes", table_v(3, 0, 1, 7)},
                     {"fwd_tape_tmp_bytes", table_v(3, 2, 1, 30)}};
    for (size_t i = 0; i < 6; i++) /* output_kept must be 0/1: make the table so */
      all[4].value->seq.items[i / 2].seq.items[i % 2].mag = i % 2;
    CHECK(_llmmem_args_chain(chain_v(3, 2, 8, all), &cs, &e) == 0);
    CHECK(cs.chain.fwd_nostore_time[2] == 2.5 && cs.chain.fwd_tmp_bytes[1] == 2 && cs.chain.bwd_tmp_bytes[5] == 5);
    CHECK(cs.chain.mode_nestable[0] == 1 && cs.chain.mode_nestable[1] == 0 && cs.chain.output_kept[1] == 1);
    CHECK(cs.chain.host_bandwidth == 1000.0);
    CHECK(cs.chain.fwd_nostore_tmp_bytes[0] == 7 && cs.chain.fwd_nostore_tmp_bytes[2] == 9);
    CHECK(cs.chain.fwd_tape_tmp_bytes[0] == 30 && cs.chain.fwd_tape_tmp_bytes[5] == 35);
    _llmmem_args_chain_free(&cs);
  }

  TEST("chain: every malformed shape is refused with the key, nothing left allocated") {
    CHECK(refused(list_v(0, NULL), ARGS_TYPE, "chain must be a dict, got list"));
    CHECK(refused(dict_v(1, (entry_t[]){{"fwd_time", table_v(2, 1, 0, 1)}}), ARGS_VALUE, "'bwd_time'] is required"));
    CHECK(refused(chain_v(2, 1, 1, (entry_t[]){{"fwd_time", list_v(0, NULL)}}), ARGS_VALUE, "1..16384 blocks"));
    CHECK(refused(chain_v(2, 9, 0, NULL), ARGS_VALUE, "1..8 modes"));
    CHECK(refused(chain_v(2, 1, 1, (entry_t[]){{"input_bytes", table_v(2, 0, 1, 1)}}), ARGS_VALUE,
                  "chain['input_bytes'] has 2 entries, expected 3"));
    CHECK(refused(chain_v(2, 1, 1, (entry_t[]){{"fwd_nostore_tmp_bytes", table_v(3, 0, 1, 1)}}), ARGS_VALUE,
                  "chain['fwd_nostore_tmp_bytes'] has 3 entries, expected 2"));
    CHECK(refused(chain_v(2, 1, 1, (entry_t[]){{"fwd_nostore_tmp_bytes", table_v(2, 0, 0, 1)}}), ARGS_VALUE,
                  "chain['fwd_nostore_tmp_bytes'] entry 0 must be an int number of bytes, got float"));
    CHECK(refused(chain_v(2, 2, 1, (entry_t[]){{"fwd_tape_tmp_bytes", table_v(2, 1, 1, 1)}}), ARGS_VALUE,
                  "chain['fwd_tape_tmp_bytes'][0] must be a list of 2 numbers"));
    CHECK(refused(chain_v(2, 2, 1, (entry_t[]){{"bwd_time", table_v(2, 1, 0, 1)}}), ARGS_VALUE,
                  "chain['bwd_time'][0] must be a list of 2 numbers"));
    args_value_t *s = table_v(2, 1, 1, 1);
    s->seq.items[1].seq.items[0] = *int_v(1, 5);
    CHECK(refused(chain_v(2, 1, 1, (entry_t[]){{"saved_bytes", s}}), ARGS_VALUE, "entry 1 must be a byte count"));
    s = table_v(2, 1, 1, 1);
    s->seq.items[0].seq.items[0] = *float_v(1.5);
    CHECK(refused(chain_v(2, 1, 1, (entry_t[]){{"saved_bytes", s}}), ARGS_VALUE, "must be an int number of bytes"));
    args_value_t *f = table_v(2, 1, 0, 1);
    f->seq.items[1].seq.items[0] = *other_v("str");
    CHECK(refused(chain_v(2, 1, 1, (entry_t[]){{"fwd_time", f}}), ARGS_VALUE, "entry 1 must be a number, got str"));
    f = table_v(2, 1, 0, 1);
    f->seq.items[0].seq.items[0] = *big_int(0, 2000);
    CHECK(refused(chain_v(2, 1, 1, (entry_t[]){{"fwd_time", f}}), ARGS_VALUE, "an int of 2000 bits"));
    CHECK(refused(chain_v(2, 1, 1, (entry_t[]){{"mode_nestable", table_v(1, 0, 1, 2)}}), ARGS_VALUE,
                  "mode_nestable'][0] must be 0 or 1"));
    args_value_t *kept = table_v(2, 2, 1, 0);
    for (size_t i = 0; i < 4; i++) kept->seq.items[i / 2].seq.items[i % 2].mag = i == 3 ? 2 : 0;
    CHECK(refused(chain_v(2, 2, 1, (entry_t[]){{"output_kept", kept}}), ARGS_VALUE, "output_kept'][1][1]"));
    CHECK(refused(chain_v(2, 1, 1, (entry_t[]){{"host_bandwidth", other_v("str")}}), ARGS_VALUE, "host_bandwidth"));
    args_value_t *huge = table_v(2, 1, 1, 1);
    huge->big = 1; /* recorded by length only (over the snapshot's budget) */
    CHECK(refused(chain_v(2, 1, 1, (entry_t[]){{"saved_bytes", huge}}), ARGS_VALUE, "too large"));
  }

  TEST("modes: L non-negative ints, clamped to 1000 (the core refuses modes >= K)") {
    int32_t mode[3] = {0};
    CHECK(_llmmem_args_plan_modes(table_v(3, 0, 1, 999), 3, mode, &e) == 0 && mode[0] == 999 && mode[2] == 1000);
    CHECK(_llmmem_args_plan_modes(table_v(2, 0, 1, 0), 3, mode, &e) < 0 && strstr(e.msg, "modes has 2 entries"));
  }

  TEST("regions: pairs and triples of ints in int32, at most 2 L of them") {
    llmmem_plan_region_t *r = NULL;
    int32_t n = -1;
    args_value_t *t2 = list_v(2, (args_value_t *[]){int_v(0, 0), int_v(0, 3)});
    args_value_t *t3 = list_v(3, (args_value_t *[]){int_v(0, 1), int_v(0, 2), int_v(0, 1)});
    CHECK(_llmmem_args_plan_regions(list_v(2, (args_value_t *[]){t2, t3}), 4, &r, &n, &e) == 0 && n == 2);
    CHECK(r && r[0].start == 0 && r[0].end == 3 && r[0].offload == 0 && r[1].offload == 1);
    free(r);
    CHECK(_llmmem_args_plan_regions(list_v(0, NULL), 4, &r, &n, &e) == 0 && n == 0 && r != NULL);
    free(r);
    args_value_t *wide = list_v(2, (args_value_t *[]){int_v(0, 0), int_v(0, (uint64_t)INT32_MAX + 1)});
    CHECK(_llmmem_args_plan_regions(list_v(1, &wide), 4, &r, &n, &e) < 0 && !r && n == 0 &&
          strstr(e.msg, "regions[0]"));
    args_value_t *one = list_v(1, (args_value_t *[]){int_v(0, 0)});
    CHECK(_llmmem_args_plan_regions(list_v(1, &one), 4, &r, &n, &e) < 0);
    args_value_t *many[5] = {t2, t2, t2, t2, t2};
    CHECK(_llmmem_args_plan_regions(list_v(5, many), 2, &r, &n, &e) < 0 && strstr(e.msg, "properly nested"));
    CHECK(_llmmem_args_plan_regions(int_v(0, 1), 2, &r, &n, &e) < 0 && e.status == ARGS_TYPE);
  }

  TEST("arena: the node budget refuses what would exceed it, text is NUL-terminated") {
    args_arena_t small = {0};
    small.max_nodes = 10;
    CHECK(_llmmem_args_nodes(&small, 8) != NULL);
    CHECK(_llmmem_args_nodes(&small, 3) == NULL && !small.out_of_memory);
    CHECK(_llmmem_args_nodes(&small, 2) != NULL);
    CHECK(_llmmem_args_nodes(&small, SIZE_MAX) == NULL);
    const char *t = _llmmem_args_text(&small, "abc", 2);
    CHECK(t && strcmp(t, "ab") == 0);
    _llmmem_args_arena_free(&small);
    CHECK(small.chunks == NULL && small.nodes == 0);
  }

  _llmmem_args_arena_free(&arena);
  return TEST_SUMMARY();
}
