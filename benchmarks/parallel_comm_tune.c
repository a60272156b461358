/*
 * parallel_comm_tune.c — which setting of a shared-memory all-reduce knob is fastest on this machine.
 *
 * Forks WORLD ranks that open one communicator and time llmmem_shm_all_reduce (fp32, in place,
 * 64-byte aligned like a torch tensor) of one message size with each value of one knob, the
 * values interleaved sample by sample (so a change of machine load hits them all alike): per
 * sample one untimed call (the ranks leave the previous call at different times) and 8 timed
 * ones; median and quartiles of 201 samples. Rank 0 prints. Knobs: "chunk" (two-shot chunk
 * bytes: TWO_SHOT_STEP_BYTES in csrc/parallel/shm_collectives.c), "spin" (pauses a waiting rank
 * spins before it yields) and "yield" (microseconds it yields before it sleeps; both in
 * csrc/parallel/shm_comm.c).
 *
 * Not built by setup.py (a profiling tool, not part of the package); build it -O3, as setup.py
 * builds the library (an -O2 build is markedly slower and would tune for the wrong code):
 *   cc -O3 -std=c11 -pthread -Icsrc/include -Icsrc/common -Icsrc/parallel -o build/parallel_comm_tune
 *      benchmarks/parallel_comm_tune.c $(find csrc/parallel csrc/common -name '*.c') -lm
 *   build/parallel_comm_tune WORLD MESSAGE_BYTES chunk|spin|yield VALUES...   e.g. build/parallel_comm_tune 2 1048576 chunk 65536 131072
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

enum { REPS = 201, INNER = 8, MAX_VARIANTS = 8 };

static double samples[MAX_VARIANTS][REPS];

enum { KNOB_CHUNK, KNOB_SPIN, KNOB_YIELD };

static void set_knob(int knob, size_t value) {
  if (knob == KNOB_SPIN)
    _llmmem_shm_force_spin((long)value);
  else if (knob == KNOB_YIELD)
    _llmmem_shm_force_yield_us((long)value);
  else
    _llmmem_shm_force_chunk_bytes(value);
}

static int run_rank(const char *name, int rank, int world, size_t nbytes, int knob, const size_t *values,
                    int nvalues) {
  llmmem_shm_comm_t *c;
  if (llmmem_shm_comm_open(name, rank, world, 0, 30.0, &c) != LLMMEM_OK) {
    fprintf(stderr, "rank %d: %s\n", rank, llmmem_last_error());
    return 1;
  }
  size_t n = nbytes / 4;
  float *x = aligned_alloc(64, (nbytes + 63) / 64 * 64);
  memset(x, 0, nbytes);
  for (int k = 0; k < REPS; k++)
    for (int v = 0; v < nvalues; v++) {
      set_knob(knob, values[v]);
      if (llmmem_shm_all_reduce(c, x, x, n, LLMMEM_COMM_F32) != LLMMEM_OK) return 1;
      double t0 = now_s();
      for (int j = 0; j < INNER; j++)
        if (llmmem_shm_all_reduce(c, x, x, n, LLMMEM_COMM_F32) != LLMMEM_OK) return 1;
      samples[v][k] = (now_s() - t0) / INNER;
    }
  if (rank == 0)
    for (int v = 0; v < nvalues; v++) {
      qsort(samples[v], REPS, sizeof(double), cmp_double);
      const char *what = knob == KNOB_SPIN ? "spin" : knob == KNOB_YIELD ? "yield us" : "chunk bytes";
      printf("%d ranks, %zu B, %s %7zu: median %7.1f us  (quartiles %.1f .. %.1f)\n", world, nbytes, what, values[v],
             samples[v][REPS / 2] * 1e6, samples[v][REPS / 4] * 1e6, samples[v][3 * REPS / 4] * 1e6);
    }
  fflush(stdout);
  free(x);
  llmmem_shm_comm_close(c);
  return 0;
}

int main(int argc, char **argv) {
  int knob = argc < 5                        ? -1
             : strcmp(argv[3], "chunk") == 0 ? KNOB_CHUNK
             : strcmp(argv[3], "spin") == 0  ? KNOB_SPIN
             : strcmp(argv[3], "yield") == 0 ? KNOB_YIELD
                                             : -1;
  if (knob < 0) {
    fprintf(stderr, "usage: %s WORLD MESSAGE_BYTES chunk|spin|yield VALUES...\n", argv[0]);
    return 2;
  }
  int world = atoi(argv[1]), nvalues = 0;
  size_t nbytes = (size_t)atol(argv[2]), values[MAX_VARIANTS];
  for (int i = 4; i < argc && nvalues < MAX_VARIANTS; i++) values[nvalues++] = (size_t)atol(argv[i]);
  if (world < 1 || world > LLMMEM_SHM_MAX_WORLD || nbytes < 4 || nbytes % 4 != 0 || nbytes > (64u << 20)) {
    fprintf(stderr, "world must be in 1..%d and the message a multiple of 4 bytes up to 64 MiB\n",
            LLMMEM_SHM_MAX_WORLD);
    return 2;
  }
  for (int v = 0; v < nvalues; v++)
    if (knob != KNOB_CHUNK ? values[v] > 1000000 : values[v] < 4096 || values[v] > (1u << 20)) {
      fprintf(stderr, "chunk sizes must be in 4 KiB .. 1 MiB (the slot), spins and yields at most 10^6, got %zu\n",
              values[v]);
      return 2;
    }
  char name[64];
  snprintf(name, sizeof name, "llmmem-tune-%d", (int)getpid());
  fflush(stdout);
  for (int r = 0; r < world; r++)
    if (fork() == 0) _exit(run_rank(name, r, world, nbytes, knob, values, nvalues));
  int status, failed = 0;
  while (wait(&status) > 0) failed |= !WIFEXITED(status) || WEXITSTATUS(status) != 0;
  return failed;
}
