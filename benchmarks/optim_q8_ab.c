/*
 * optim_q8_ab.c — the CPU 8-bit AdamW step of two builds of csrc/optim/adamw_cpu.c in one
 * process, A/B: 14 tensors of 600,000 fp32 elements (the 8m workload of bench_optim.py), int8
 * state, block 256, one thread. The two steps alternate tensor by tensor (about 1 ms each) and
 * are timed on this thread's CPU time, so a load that comes and goes on a small shared VM slows
 * both alike; prints the median and best of REPS (default 40) step times of each, the median
 * of the per-step ratios new/old, and whether both left the same bytes (they must when the
 * change keeps the results; not when it changes a random stream).
 *
 *   sh benchmarks/optim_q8_ab.sh OLD_REV   (builds and runs; START_STEP=20000 in the
 *                                           environment starts the step count there)
 *
 * Not a test and not part of the package build: a tool for changes to the quantized loops.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "llmmem/optim.h"

llmmem_status_t old_adamw_step(const llmmem_optim_tensor_t *, size_t, const llmmem_optim_adamw_config_t *, int);

#define NT  14
#define N   600000
#define BLK 256
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}
static uint64_t rs = 88172645463325252ull;
static float rnd_normal(void) {
  float s = 0;
  for (int k = 0; k < 4; k++) {
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    s += (float)(rs >> 40) * 0x1p-24f;
  }
  return (s - 2.0f) * 1.7f;
}
typedef struct {
  float *p, *ms, *vs, step[NT];
  uint8_t *m, *v;
  llmmem_optim_tensor_t t[NT];
} state_t;
static float *g;
static void mk(state_t *s) {
  s->p = malloc(sizeof(float) * NT * N);
  s->m = calloc(NT, N);
  s->v = calloc(NT, N);
  s->ms = calloc(NT * N / BLK, 4);
  s->vs = calloc(NT * N / BLK, 4);
  for (int i = 0; i < NT; i++) {
    s->step[i] = getenv("START_STEP") ? (float)atof(getenv("START_STEP")) : 0.0f;
    s->t[i] = (llmmem_optim_tensor_t){s->p + (size_t)i * N,
                                      g + (size_t)i * N,
                                      NULL,
                                      s->m + (size_t)i * N,
                                      s->v + (size_t)i * N,
                                      s->ms + (size_t)i * N / BLK,
                                      s->vs + (size_t)i * N / BLK,
                                      &s->step[i],
                                      N,
                                      1234 + i,
                                      LLMMEM_OPTIM_F32,
                                      LLMMEM_OPTIM_F32};
  }
}
static int cmpd(const void *a, const void *b) {
  double x = *(double *)a, y = *(double *)b;
  return x < y ? -1 : x > y;
}
int main(int argc, char **argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 40;
  g = malloc(sizeof(float) * NT * N);
  float *p0 = malloc(sizeof(float) * NT * N);
  for (size_t i = 0; i < (size_t)NT * N; i++) p0[i] = rnd_normal();
  state_t A, B;
  mk(&A);
  mk(&B);
  memcpy(A.p, p0, sizeof(float) * NT * N);
  memcpy(B.p, p0, sizeof(float) * NT * N);
  llmmem_optim_adamw_config_t cfg = {1e-3, 0.9, 0.999, 1e-8, 0.01, 1, 0, LLMMEM_OPTIM_STATE_Q8, BLK, 1};
  double *ta = malloc(8 * reps), *tb = malloc(8 * reps);
  for (int it = -3; it < reps; it++) {
    for (size_t i = 0; i < (size_t)NT * N; i++) g[i] = rnd_normal() * 1e-3f;
    /* alternate tensor by tensor (about 1 ms each), on this thread's CPU time: a load that comes
     * and goes on the 2-core VM then slows both alike */
    double sa = 0, sb = 0;
    for (int k = 0; k < NT; k++) {
      int ab = (it + k) & 1;
      for (int h = 0; h < 2; h++) {
        double t0 = now();
        if ((h ^ ab) == 0) {
          if (old_adamw_step(&A.t[k], 1, &cfg, 1)) return 1;
          sa += now() - t0;
        } else {
          if (llmmem_optim_adamw_step(&B.t[k], 1, &cfg, 1)) return 1;
          sb += now() - t0;
        }
      }
    }
    if (it >= 0) {
      ta[it] = sa;
      tb[it] = sb;
    }
  }
  int same = !memcmp(A.p, B.p, sizeof(float) * NT * N) && !memcmp(A.m, B.m, NT * N) && !memcmp(A.v, B.v, NT * N) &&
             !memcmp(A.ms, B.ms, 4 * NT * N / BLK) && !memcmp(A.vs, B.vs, 4 * NT * N / BLK);
  double ra[4096];
  for (int i = 0; i < reps; i++) ra[i] = tb[i] / ta[i];
  qsort(ta, reps, 8, cmpd);
  qsort(tb, reps, 8, cmpd);
  qsort(ra, reps, 8, cmpd);
  printf(
      "old: median %.2f ms best %.2f | new: median %.2f ms best %.2f | new/old: median-of-pair-ratios %.3f, best %.3f "
      "| identical %s\n",
      1e3 * ta[reps / 2], 1e3 * ta[0], 1e3 * tb[reps / 2], 1e3 * tb[0], ra[reps / 2], tb[0] / ta[0],
      same ? "yes" : "NO");
  return !same;
}
