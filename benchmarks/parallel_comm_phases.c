/*
 * parallel_comm_phases.c — where the time of a shared-memory all-reduce goes, phase by phase.
 *
 * Forks WORLD ranks that open one llmmem shared-memory communicator and replay, step for step,
 * the two algorithms of csrc/parallel/shm_collectives.c on one fp32 message (a single step, so the
 * message must fit the 1 MiB slot; the library cuts two-shot messages into 128 KiB chunks and
 * pipelines them, which benchmarks/parallel_comm_tune.c times), timing each phase on each rank:
 *   one-shot: copy-in (whole message -> own slot) | wait (barrier) | reduce (sum of all slots)
 *   two-shot: copy-in (the parts peers reduce) | wait | reduce (own part, into out and own slot)
 *             | wait | copy-out (the peers' reduced parts)
 * "wait" is time spent in the barrier: the peer's lag, not work. Medians of 300 repeats per rank,
 * plus the time of a local memcpy of the message and of a copy from a buffer another core just
 * wrote (the cross-core transfer every all-reduce needs), measured in the same run.
 *
 * Not built by setup.py (a profiling tool, not part of the package):
 *   cc -O3 -std=c11 -pthread -Icsrc/include -Icsrc/common -Icsrc/parallel -o build/parallel_comm_phases
 *      benchmarks/parallel_comm_phases.c $(find csrc -name '*.c' ! -path 'csrc/python*') -lm
 *   build/parallel_comm_phases [world=2] [sizes in bytes...]
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench_clock.h"
#include "shm_internal.h"

enum { REPS = 300, WARMUP = 20, MAX_SIZES = 16 };

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return v[n / 2];
}

/* as shm_collectives.c: world parts of [0, n), 64-byte aligned */
static void part(size_t n, size_t es, int world, int r, size_t *lo, size_t *hi) {
  size_t align = 64 / es, per = (n + (size_t)world - 1) / (size_t)world;
  per = (per + align - 1) / align * align;
  *lo = (size_t)r * per < n ? (size_t)r * per : n;
  *hi = *lo + per < n ? *lo + per : n;
}

static double phases[5][REPS];

static int run_rank(const char *name, int rank, int world, const size_t *sizes, int nsizes) {
  llmmem_shm_comm_t *c;
  if (llmmem_shm_comm_open(name, rank, world, 1u << 20, 30.0, &c) != LLMMEM_OK) {
    fprintf(stderr, "rank %d: %s\n", rank, llmmem_last_error());
    return 1;
  }
  const void *srcs[LLMMEM_SHM_MAX_WORLD];
  for (int si = 0; si < nsizes; si++) {
    const size_t nb = sizes[si], n = nb / 4, es = 4;
    float *x = calloc(n + 16, 4), *y = calloc(n + 16, 4);
    for (int two_shot = 0; two_shot < 2; two_shot++) {
      for (int k = 0; k < REPS + WARMUP; k++) {
        double t[6];
        t[0] = now_s();
        uint64_t step = c->step++;
        unsigned char *mine = shm_slot(c, c->rank, step), *buf = (unsigned char *)x;
        size_t lo, hi;
        if (!two_shot) {
          memcpy(mine, buf, nb);
          t[1] = now_s();
          if (_llmmem_shm_barrier(c, "profile") != LLMMEM_OK) return 1;
          t[2] = now_s();
          for (int q = 0; q < world; q++) srcs[q] = shm_slot(c, q, step);
          _llmmem_comm_sum(srcs, world, buf, n, LLMMEM_COMM_F32);
          t[3] = t[4] = t[5] = now_s();
        } else {
          for (int q = 0; q < world; q++) {
            if (q == rank) continue;
            part(n, es, world, q, &lo, &hi);
            memcpy(mine + lo * es, buf + lo * es, (hi - lo) * es);
          }
          t[1] = now_s();
          if (_llmmem_shm_barrier(c, "profile") != LLMMEM_OK) return 1;
          t[2] = now_s();
          part(n, es, world, rank, &lo, &hi);
          for (int q = 0; q < world; q++) srcs[q] = (q == rank ? buf : shm_slot(c, q, step)) + lo * es;
          _llmmem_comm_sum2(srcs, world, buf + lo * es, mine + lo * es, hi - lo, LLMMEM_COMM_F32);
          t[3] = now_s();
          if (_llmmem_shm_barrier(c, "profile") != LLMMEM_OK) return 1;
          t[4] = now_s();
          for (int q = 0; q < world; q++) {
            if (q == rank) continue;
            part(n, es, world, q, &lo, &hi);
            memcpy(buf + lo * es, shm_slot(c, q, step) + lo * es, (hi - lo) * es);
          }
          t[5] = now_s();
        }
        if (k >= WARMUP)
          for (int i = 0; i < 5; i++) phases[i][k - WARMUP] = t[i + 1] - t[i];
      }
      double total[REPS];
      for (int k = 0; k < REPS; k++)
        total[k] = phases[0][k] + phases[1][k] + phases[2][k] + phases[3][k] + phases[4][k];
      double m[5];
      for (int i = 0; i < 5; i++) m[i] = median(phases[i], REPS) * 1e6;
      printf(
          "rank %d %s %8zu B: copy-in %6.1f  wait %6.1f  reduce %6.1f  wait %6.1f  copy-out %6.1f  | total %6.1f us\n",
          rank, two_shot ? "two-shot" : "one-shot", nb, m[0], m[1], m[2], m[3], m[4], median(total, REPS) * 1e6);
    }
    /* the physical references, same run: a local copy, and a copy of what the next rank just wrote */
    double local[REPS], cross[REPS];
    for (int k = 0; k < REPS; k++) {
      double t0 = now_s();
      memcpy(y, x, nb);
      local[k] = now_s() - t0;
    }
    for (int k = 0; k < REPS; k++) {
      uint64_t step = c->step++;
      memset(shm_slot(c, rank, step), k, nb);
      if (_llmmem_shm_barrier(c, "profile") != LLMMEM_OK) return 1;
      double t0 = now_s();
      memcpy(y, shm_slot(c, (rank + 1) % world, step), nb);
      cross[k] = now_s() - t0;
      if (_llmmem_shm_barrier(c, "profile") != LLMMEM_OK) return 1;
    }
    double ml = median(local, REPS), mc = median(cross, REPS);
    printf("rank %d references %8zu B: local memcpy %6.1f us (%.1f GB/s r+w)  cross-core copy %6.1f us (%.1f GB/s)\n",
           rank, nb, ml * 1e6, 2 * nb / ml / 1e9, mc * 1e6, nb / mc / 1e9);
    fflush(stdout);
    free(x);
    free(y);
  }
  llmmem_shm_comm_close(c);
  return 0;
}

int main(int argc, char **argv) {
  int world = argc > 1 ? atoi(argv[1]) : 2;
  size_t sizes[MAX_SIZES] = {64u << 10, 256u << 10, 512u << 10, 1u << 20};
  int nsizes = 4;
  if (argc > 2) {
    nsizes = 0;
    for (int i = 2; i < argc && nsizes < MAX_SIZES; i++) sizes[nsizes++] = (size_t)atol(argv[i]);
  }
  for (int i = 0; i < nsizes; i++)
    if (sizes[i] == 0 || sizes[i] > (1u << 20) || sizes[i] % 64 != 0) {
      fprintf(stderr, "sizes must be multiples of 64 bytes in (0, 1 MiB], got %zu\n", sizes[i]);
      return 2;
    }
  if (world < 1 || world > LLMMEM_SHM_MAX_WORLD) {
    fprintf(stderr, "world must be in 1..%d\n", LLMMEM_SHM_MAX_WORLD);
    return 2;
  }
  char name[64];
  snprintf(name, sizeof name, "llmmem-phases-%d", (int)getpid());
  fflush(stdout);
  for (int r = 0; r < world; r++)
    if (fork() == 0) _exit(run_rank(name, r, world, sizes, nsizes));
  int status, failed = 0;
  while (wait(&status) > 0) failed |= !WIFEXITED(status) || WEXITSTATUS(status) != 0;
  return failed;
}
