/*
 * pool_latency.c — host-side cost of llmmem's pool through its C API, against malloc/free,
 * measured in the same run. Built and run by bench_pool.py; prints one JSON object.
 *
 *   pool_latency TRACE [PAIRS]
 *
 * TRACE is a text file of "a ID SIZE" / "f ID" lines (an allocation trace). Two measurements:
 *   pairs:  PAIRS alloc+free pairs with sizes taken in turn from the trace's allocations, each
 *           pair timed alone (clock_gettime; the timer's own median cost is subtracted):
 *           median and p99 ns per pair, for the pool and for malloc/free.
 *   replay: the whole trace replayed (and everything left live freed) several times:
 *           ns per operation, for the pool and for malloc/free.
 * The pool is created with initial_size = 1 GiB so no measurement includes growth.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <llmmem/pool.h>

typedef struct {
  int alloc;
  int id;
  size_t size;
} op_t;

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double percentile(double *v, size_t n, double q) {
  qsort(v, n, sizeof *v, cmp_double);
  size_t i = (size_t)(q * (double)(n - 1));
  return v[i];
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s TRACE [PAIRS]\n", argv[0]);
    return 2;
  }
  size_t pairs = argc > 2 ? (size_t)atol(argv[2]) : 200000;
  FILE *f = fopen(argv[1], "r");
  if (!f) {
    perror(argv[1]);
    return 2;
  }
  size_t cap = 1 << 16, n = 0;
  op_t *ops = malloc(cap * sizeof *ops);
  char kind;
  int id;
  size_t size;
  int max_id = 0;
  while (fscanf(f, " %c %d", &kind, &id) == 2) {
    size = 0;
    if (kind == 'a' && fscanf(f, " %zu", &size) != 1) break;
    if (n == cap) ops = realloc(ops, (cap *= 2) * sizeof *ops);
    ops[n++] = (op_t){kind == 'a', id, size};
    if (id > max_id) max_id = id;
  }
  fclose(f);
  size_t *sizes = malloc(n * sizeof *sizes), n_sizes = 0;
  for (size_t i = 0; i < n; i++)
    if (ops[i].alloc) sizes[n_sizes++] = ops[i].size;

  llmmem_pool_backend_t backend;
  llmmem_pool_options_t opt = {(size_t)1 << 30, 0, 0};
  llmmem_pool_t *pool = NULL;
  if (llmmem_pool_backend_host(0, &backend) != LLMMEM_OK || llmmem_pool_create(&backend, &opt, &pool) != LLMMEM_OK) {
    fprintf(stderr, "pool: %s\n", llmmem_last_error());
    return 1;
  }
  double *t = malloc(pairs * sizeof *t);
  /* the timer's own cost */
  for (size_t i = 0; i < pairs; i++) {
    double a = now_ns();
    t[i] = now_ns() - a;
  }
  double timer = percentile(t, pairs, 0.5);
  double res[2][2];
  for (int which = 0; which < 2; which++) {
    for (size_t i = 0; i < pairs; i++) {
      size_t s = sizes[i % n_sizes];
      double a = now_ns();
      if (which == 0) {
        void *p = NULL;
        llmmem_pool_alloc(pool, s, NULL, &p);
        llmmem_pool_free(pool, p, NULL);
      } else {
        void *p = malloc(s);
        *(volatile char *)p = 0; /* keep the pair from being optimised away */
        free(p);
      }
      t[i] = now_ns() - a - timer;
    }
    res[which][0] = percentile(t, pairs, 0.5);
    res[which][1] = percentile(t, pairs, 0.99);
  }
  /* replay */
  void **live = calloc((size_t)max_id + 1, sizeof *live);
  int reps = 5;
  double replay[2];
  for (int which = 0; which < 2; which++) {
    double best = 1e300;
    for (int r = 0; r < reps; r++) {
      double a = now_ns();
      for (size_t i = 0; i < n; i++) {
        if (ops[i].alloc) {
          if (which == 0)
            llmmem_pool_alloc(pool, ops[i].size, NULL, &live[ops[i].id]);
          else
            live[ops[i].id] = malloc(ops[i].size);
        } else if (live[ops[i].id]) {
          if (which == 0)
            llmmem_pool_free(pool, live[ops[i].id], NULL);
          else
            free(live[ops[i].id]);
          live[ops[i].id] = NULL;
        }
      }
      for (int k = 0; k <= max_id; k++)
        if (live[k]) {
          if (which == 0)
            llmmem_pool_free(pool, live[k], NULL);
          else
            free(live[k]);
          live[k] = NULL;
        }
      double el = (now_ns() - a) / (double)n;
      if (el < best) best = el;
    }
    replay[which] = best;
  }
  llmmem_pool_stats_t st;
  llmmem_pool_stats(pool, &st);
  printf(
      "{\"pairs\": %zu, \"timer_ns\": %.1f, \"pool_pair_median_ns\": %.1f, \"pool_pair_p99_ns\": %.1f, "
      "\"malloc_pair_median_ns\": %.1f, \"malloc_pair_p99_ns\": %.1f, \"trace_ops\": %zu, "
      "\"pool_replay_ns_per_op\": %.1f, \"malloc_replay_ns_per_op\": %.1f, \"pool_ooms\": %llu}\n",
      pairs, timer, res[0][0], res[0][1], res[1][0], res[1][1], n, replay[0], replay[1],
      (unsigned long long)st.num_ooms);
  llmmem_pool_destroy(pool);
  free(live);
  free(t);
  free(sizes);
  free(ops);
  return 0;
}
