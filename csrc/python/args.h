/*
 * args.h — the argument parsers of llmmem._C, in plain C: what each entry point accepts, checked.
 *
 * Python values reach them as a snapshot (args_py.c): a tree of args_value_t copied from the
 * objects while the binding holds references to them. Nothing here runs Python code, so a value
 * whose conversion (`__index__`, `__float__`, ...) mutates the caller's containers cannot make a
 * parser read freed memory: the conversions all ran during the snapshot, on objects it kept alive.
 * Each parser checks type, shape and range and either fills C values or describes the first
 * problem in an args_error_t whose message names the argument. tests/fuzz/fuzz_args.c drives them
 * with arbitrary trees; tests/c/test_binding_args.c with chosen ones.
 */
#ifndef LLMMEM_ARGS_H
#define LLMMEM_ARGS_H

#include <stddef.h>
#include <stdint.h>

#include <llmmem/checkpointing.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum args_kind_e {
  ARGS_NONE = 0, /* None (or an argument not given) */
  ARGS_BOOL,
  ARGS_INT,
  ARGS_FLOAT,
  ARGS_STR,
  ARGS_LIST, /* a list, a tuple, or another sized sequence */
  ARGS_DICT,
  ARGS_OTHER, /* anything else: only its type name is known */
} args_kind_t;

typedef struct args_value_s args_value_t;
struct args_value_s {
  uint8_t kind;          /* args_kind_t */
  uint8_t neg;           /* ARGS_INT: below 0 */
  uint8_t big;           /* ARGS_INT: |value| >= 2**64 and `mag` is its bit count. ARGS_LIST, ARGS_DICT,
                            ARGS_STR: the content was not copied (too long, nested too deep, or over the
                            snapshot's budget); `n` is still its length */
  const char *type_name; /* the Python type's name, for messages; never NULL */
  union {
    uint64_t mag; /* ARGS_INT: |value| (see big); ARGS_BOOL: 0 or 1 */
    double f;     /* ARGS_FLOAT */
    struct {
      size_t n;
      args_value_t *items; /* ARGS_LIST: [n] items; ARGS_DICT: [n] values */
      union {
        args_value_t *keys; /* ARGS_DICT: [n] keys */
        const char *text;   /* ARGS_STR: n bytes of UTF-8, NUL-terminated */
      };
    } seq;
  };
};

/* Nodes and text of one snapshot, freed together. `max_nodes` bounds what a snapshot may copy:
 * containers beyond it are recorded by length only (big), so a huge argument costs no memory. */
typedef struct args_chunk_s args_chunk_t;
typedef struct args_arena_s {
  args_chunk_t *chunks;
  size_t nodes;     /* handed out so far */
  size_t max_nodes; /* 0: ARGS_DEFAULT_MAX_NODES */
  int out_of_memory;
} args_arena_t;

/* Enough for the largest chain the planner takes (LLMMEM_PLAN_MAX_BLOCKS x LLMMEM_PLAN_MAX_MODES,
 * five such tables, about 0.8 M nodes); 40 bytes each. */
#define ARGS_DEFAULT_MAX_NODES ((size_t)1 << 20)
/* Longer lists are not copied: no argument of _C has more than 2 * LLMMEM_PLAN_MAX_BLOCKS + 1 entries. */
#define ARGS_MAX_ITEMS ((size_t)1 << 16)

/* n zeroed nodes, or NULL (out_of_memory set when malloc failed, not when over the budget). */
args_value_t *_llmmem_args_nodes(args_arena_t *a, size_t n);
/* A copy of text[0..len) with a NUL after it, or NULL when out of memory. */
const char *_llmmem_args_text(args_arena_t *a, const char *text, size_t len);
void _llmmem_args_arena_free(args_arena_t *a);

/* The value under `key` of an ARGS_DICT (string keys), or NULL when absent or not a dict. */
const args_value_t *_llmmem_args_dict_get(const args_value_t *dict, const char *key);

/* What went wrong, for the binding to raise: ARGS_TYPE -> TypeError, ARGS_VALUE -> ValueError,
 * ARGS_NOMEM -> MemoryError, ARGS_TOO_BIG -> llmmem.OutOfMemoryError (a size no memory holds). */
typedef enum args_status_e { ARGS_OK = 0, ARGS_TYPE, ARGS_VALUE, ARGS_NOMEM, ARGS_TOO_BIG } args_status_t;
typedef struct args_error_s {
  args_status_t status;
  char msg[400];
} args_error_t;

/* A short description of a value for messages: "-5", "2.5", "True", "None", "'abc'", "an int of
 * 71 bits", "a list of 3 items", "a str" ... Returns buf. */
const char *_llmmem_args_describe(const args_value_t *v, char *buf, size_t len);

/* ---- scalars: each returns 0, or -1 with *e filled. `what` names the argument in messages. */

/* An int (bool refused) in [lo, hi]. */
int _llmmem_args_uint(const args_value_t *v, const char *what, uint64_t lo, uint64_t hi, uint64_t *out,
                      args_error_t *e);
int _llmmem_args_int(const args_value_t *v, const char *what, int64_t lo, int64_t hi, int64_t *out, args_error_t *e);
/* A byte count >= min: ARGS_TOO_BIG beyond SIZE_MAX (no address space holds it). */
int _llmmem_args_size(const args_value_t *v, const char *what, size_t min, size_t *out, args_error_t *e);
/* An int or a float (bool refused); ints beyond a double's range are refused. */
int _llmmem_args_number(const args_value_t *v, const char *what, double *out, args_error_t *e);

/* ---- the recompute planner (checkpointing.c) ---------------------------------------------- */

/* A chain dict (see checkpointing.c for its keys) parsed into arrays owned by the store. */
typedef struct args_chain_s {
  llmmem_plan_chain_t chain;
  double *f, *fn, *b;
  uint64_t *x, *s, *ft, *fnt, *ftk, *bt;
  uint8_t *nest, *kept, *cut;
} args_chain_t;

/* On failure nothing stays allocated. Free a parsed store with _llmmem_args_chain_free. */
int _llmmem_args_chain(const args_value_t *dict, args_chain_t *out, args_error_t *e);
void _llmmem_args_chain_free(args_chain_t *c);
/* modes: a list of L ints >= 0 (values above 1000 become 1000: the core refuses modes >= K). */
int _llmmem_args_plan_modes(const args_value_t *v, int32_t L, int32_t *mode, args_error_t *e);
/* regions: a list of at most 2 * L (start, end) or (start, end, offload) tuples of ints; *out is
 * malloc'ed (free it), *count entries. */
int _llmmem_args_plan_regions(const args_value_t *v, int32_t L, llmmem_plan_region_t **out, int32_t *count,
                              args_error_t *e);

#ifdef __cplusplus
}
#endif

#endif /* LLMMEM_ARGS_H */
