/*
 * comm_chunks.c — which two-shot chunk size makes the shared-memory all-reduce fastest here.
 *
 * Forks WORLD ranks that open one communicator and time llmmem_shm_all_reduce (fp32, in place,
 * 64-byte aligned like a torch tensor) of one message size with each chunk size given, the chunk
 * sizes interleaved sample by sample (so a change of machine load hits them all alike): per
 * sample one untimed call (the ranks leave the previous call at different times) and 8 timed
 * ones; median and quartiles of 201 samples. Rank 0 prints. Used to pick TWO_SHOT_STEP_BYTES in
 * csrc/comm/shm_collectives.c.
 *
 * Not built by setup.py (a profiling tool, not part of the package):
 *   cc -O2 -std=c11 -pthread -Icsrc/include -Icsrc/common -Icsrc/comm -o build/comm_chunks
 *      benchmarks/comm_chunks.c $(find csrc/comm csrc/common -name '*.c') -lm
 *   build/comm_chunks WORLD MESSAGE_BYTES CHUNK_BYTES...     e.g. build/comm_chunks 2 1048576 65536 131072 262144
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shm_internal.h"

enum { REPS = 201, INNER = 8, MAX_VARIANTS = 8 };

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double samples[MAX_VARIANTS][REPS];

static int run_rank(const char *name, int rank, int world, size_t nbytes, const size_t *chunks, int nchunks) {
  llmmem_shm_comm_t *c;
  if (llmmem_shm_comm_open(name, rank, world, 0, 30.0, &c) != LLMMEM_OK) {
    fprintf(stderr, "rank %d: %s\n", rank, llmmem_last_error());
    return 1;
  }
  size_t n = nbytes / 4;
  float *x = aligned_alloc(64, (nbytes + 63) / 64 * 64);
  memset(x, 0, nbytes);
  for (int k = 0; k < REPS; k++)
    for (int v = 0; v < nchunks; v++) {
      _llmmem_shm_force_chunk_bytes(chunks[v]);
      if (llmmem_shm_all_reduce(c, x, x, n, LLMMEM_COMM_F32) != LLMMEM_OK) return 1;
      double t0 = now_s();
      for (int j = 0; j < INNER; j++)
        if (llmmem_shm_all_reduce(c, x, x, n, LLMMEM_COMM_F32) != LLMMEM_OK) return 1;
      samples[v][k] = (now_s() - t0) / INNER;
    }
  if (rank == 0)
    for (int v = 0; v < nchunks; v++) {
      qsort(samples[v], REPS, sizeof(double), cmp_double);
      printf("%d ranks, %zu B, chunks of %7zu B: median %7.1f us  (quartiles %.1f .. %.1f)\n", world, nbytes,
             chunks[v], samples[v][REPS / 2] * 1e6, samples[v][REPS / 4] * 1e6, samples[v][3 * REPS / 4] * 1e6);
    }
  fflush(stdout);
  free(x);
  llmmem_shm_comm_close(c);
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s WORLD MESSAGE_BYTES CHUNK_BYTES...\n", argv[0]);
    return 2;
  }
  int world = atoi(argv[1]), nchunks = 0;
  size_t nbytes = (size_t)atol(argv[2]), chunks[MAX_VARIANTS];
  for (int i = 3; i < argc && nchunks < MAX_VARIANTS; i++) chunks[nchunks++] = (size_t)atol(argv[i]);
  if (world < 1 || world > LLMMEM_SHM_MAX_WORLD || nbytes < 4 || nbytes % 4 != 0 || nbytes > (64u << 20)) {
    fprintf(stderr, "world must be in 1..%d and the message a multiple of 4 bytes up to 64 MiB\n", LLMMEM_SHM_MAX_WORLD);
    return 2;
  }
  for (int v = 0; v < nchunks; v++)
    if (chunks[v] < 4096 || chunks[v] > (1u << 20)) {
      fprintf(stderr, "chunk sizes must be in 4 KiB .. 1 MiB (the slot), got %zu\n", chunks[v]);
      return 2;
    }
  char name[64];
  snprintf(name, sizeof name, "llmmem-chunks-%d", (int)getpid());
  fflush(stdout);
  for (int r = 0; r < world; r++)
    if (fork() == 0) _exit(run_rank(name, r, world, nbytes, chunks, nchunks));
  int status, failed = 0;
  while (wait(&status) > 0) failed |= !WIFEXITED(status) || WEXITSTATUS(status) != 0;
  return failed;
}
