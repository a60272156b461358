/*
 * test_parallel_shm.c — the shared-memory collectives: results against the C reference for every
 * dtype, sizes 0/1/odd/many chunks, bitwise agreement across ranks, in place; mismatched calls,
 * timeouts, a killed peer (fork), and no segment left behind. Ranks are threads (each maps the
 * segment itself, as a process would) except in the fork test.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <llmmem/parallel.h>

#include "half.h"
#include "testhelper.h"

#define MAXW 4

/* sum_cpu.c (not exported; the C tests link the sources) */
int _llmmem_comm_force_isa(int isa);
void _llmmem_comm_sum2(const void *const *srcs, int nsrc, void *out, void *out2, size_t count,
                       llmmem_comm_dtype_t dtype);

static int name_counter = 0;

static void make_name(char *out, size_t cap) {
  snprintf(out, cap, "llmmem-ctest-%d-%d", (int)getpid(), __atomic_fetch_add(&name_counter, 1, __ATOMIC_SEQ_CST));
}

static int segment_exists(const char *name) {
  char path[300];
  snprintf(path, sizeof path, "/dev/shm/%s", name);
  return access(path, F_OK) == 0;
}

/* Fills n elements of dtype with values v(rank, i) that are exact in every dtype's range. */
static void fill(void *buf, size_t n, llmmem_comm_dtype_t dt, int rank, unsigned long long seed) {
  unsigned long long s = seed * 1000003ULL + (unsigned long long)rank + 1;
  for (size_t i = 0; i < n; i++) {
    float v = (float)((double)(th_rand(&s) % 20001) / 1000.0 - 10.0); /* [-10, 10], not exact in halves */
    if (dt == LLMMEM_COMM_F32)
      ((float *)buf)[i] = v;
    else if (dt == LLMMEM_COMM_BF16)
      ((uint16_t *)buf)[i] = llmmem_f32_to_bf16(v);
    else
      ((uint16_t *)buf)[i] = llmmem_f32_to_f16(v);
  }
}

typedef struct {
  const char *name;
  int rank, world;
  size_t slot;
  double timeout;
  llmmem_status_t open_status;
  int (*body)(llmmem_shm_comm_t *, int rank, int world, void *arg);
  void *arg;
  int body_result; /* 0 = ok */
} rank_job_t;

static void *rank_thread(void *p) {
  rank_job_t *j = p;
  llmmem_shm_comm_t *c = NULL;
  j->open_status = llmmem_shm_comm_open(j->name, j->rank, j->world, j->slot, j->timeout, &c);
  if (j->open_status != LLMMEM_OK) {
    printf("  rank %d open failed: %s\n", j->rank, llmmem_last_error());
    j->body_result = -1;
    return NULL;
  }
  j->body_result = j->body(c, j->rank, j->world, j->arg);
  llmmem_shm_comm_close(c);
  return NULL;
}

/* Runs body on `world` threads over a fresh segment; 0 when every rank opened and its body returned 0. */
static int run_threads(int world, size_t slot, double timeout, int (*body)(llmmem_shm_comm_t *, int, int, void *),
                       void *arg, char *name_out) {
  char name[128];
  make_name(name, sizeof name);
  pthread_t t[MAXW];
  rank_job_t jobs[MAXW];
  for (int r = 0; r < world; r++) {
    jobs[r] = (rank_job_t){name, r, world, slot, timeout, LLMMEM_OK, body, arg, 0};
    pthread_create(&t[r], NULL, rank_thread, &jobs[r]);
  }
  int bad = 0;
  for (int r = 0; r < world; r++) {
    pthread_join(t[r], NULL);
    bad |= jobs[r].body_result != 0;
  }
  if (name_out) strcpy(name_out, name);
  return bad;
}

/* ------------------------------------------------------------------ correctness */

typedef struct {
  size_t count;
  llmmem_comm_dtype_t dtype;
  int in_place;
  unsigned char *results[MAXW]; /* each rank's output, compared across ranks afterwards */
} ar_case_t;

static int body_all_reduce(llmmem_shm_comm_t *c, int rank, int world, void *arg) {
  ar_case_t *k = arg;
  size_t es = llmmem_comm_dtype_size(k->dtype), n = k->count;
  unsigned char *in[MAXW];
  for (int q = 0; q < world; q++) {
    in[q] = malloc(n * es + 1);
    fill(in[q], n, k->dtype, q, n);
  }
  unsigned char *want = malloc(n * es + 1), *out = k->results[rank];
  llmmem_comm_sum_ref((const void *const *)in, world, want, n, k->dtype);
  memcpy(out, in[rank], n * es);
  llmmem_status_t st = llmmem_shm_all_reduce(c, k->in_place ? out : in[rank], out, n, k->dtype);
  int bad = st != LLMMEM_OK || memcmp(out, want, n * es) != 0;
  if (bad) printf("  all_reduce rank %d n=%zu dtype=%d: status %d, %s\n", rank, n, k->dtype, st, llmmem_last_error());
  for (int q = 0; q < world; q++) free(in[q]);
  free(want);
  return bad;
}

static int body_gather_scatter(llmmem_shm_comm_t *c, int rank, int world, void *arg) {
  ar_case_t *k = arg;
  size_t es = llmmem_comm_dtype_size(k->dtype), n = k->count;
  int bad = 0;
  /* all-gather: out = in_0 | in_1 | ... */
  unsigned char *mine = malloc(n * es + 1), *gathered = malloc(world * n * es + 1), *want = malloc(world * n * es + 1);
  for (int q = 0; q < world; q++) fill(want + (size_t)q * n * es, n, k->dtype, q, n + 77);
  memcpy(mine, want + (size_t)rank * n * es, n * es);
  llmmem_status_t st = llmmem_shm_all_gather(c, mine, gathered, n, k->dtype);
  if (st != LLMMEM_OK || memcmp(gathered, want, world * n * es) != 0) {
    printf("  all_gather rank %d n=%zu: status %d %s\n", rank, n, st, llmmem_last_error());
    bad = 1;
  }
  /* reduce-scatter: out = sum_q in_q[rank*n : (rank+1)*n] */
  unsigned char *ins[MAXW];
  const void *blocks[MAXW];
  for (int q = 0; q < world; q++) {
    ins[q] = malloc(world * n * es + 1);
    fill(ins[q], world * n, k->dtype, q, n + 99);
    blocks[q] = ins[q] + (size_t)rank * n * es;
  }
  unsigned char *rs_want = malloc(n * es + 1), *rs = malloc(n * es + 1);
  llmmem_comm_sum_ref(blocks, world, rs_want, n, k->dtype);
  st = llmmem_shm_reduce_scatter(c, ins[rank], rs, n, k->dtype);
  if (st != LLMMEM_OK || memcmp(rs, rs_want, n * es) != 0) {
    printf("  reduce_scatter rank %d n=%zu: status %d %s\n", rank, n, st, llmmem_last_error());
    bad = 1;
  }
  for (int q = 0; q < world; q++) free(ins[q]);
  free(mine), free(gathered), free(want), free(rs_want), free(rs);
  return bad;
}

typedef struct {
  int iters;
} many_t;

/* Many back-to-back small all-reduces: exercises buffer reuse (step parity) at full speed. */
static int body_many(llmmem_shm_comm_t *c, int rank, int world, void *arg) {
  many_t *m = arg;
  float x[5];
  for (int it = 0; it < m->iters; it++) {
    for (int i = 0; i < 5; i++) x[i] = (float)(rank + 1) * (float)(it + i);
    if (llmmem_shm_all_reduce(c, x, x, 5, LLMMEM_COMM_F32) != LLMMEM_OK) return 1;
    float s = (float)(world * (world + 1) / 2);
    for (int i = 0; i < 5; i++)
      if (x[i] != s * (float)(it + i)) return 1;
  }
  return 0;
}

/* ------------------------------------------------------------------ failures */

static int body_mismatch(llmmem_shm_comm_t *c, int rank, int world, void *arg) {
  (void)world, (void)arg;
  float x[8] = {0};
  llmmem_status_t st = llmmem_shm_all_reduce(c, x, x, rank == 0 ? 7 : 8, LLMMEM_COMM_F32);
  int ok = st == LLMMEM_ERR_INVALID && strstr(llmmem_last_error(), "ranks disagree") != NULL;
  /* the communicator is now unusable on every rank */
  ok = ok && llmmem_shm_all_reduce(c, x, x, 8, LLMMEM_COMM_F32) == LLMMEM_ERR_STATE;
  return !ok;
}

static int body_timeout(llmmem_shm_comm_t *c, int rank, int world, void *arg) {
  (void)world, (void)arg;
  float x[4] = {0};
  if (rank == 1) {
    /* comes too late: rank 0 has given up and said so; this rank must fail too, not reduce stale data */
    struct timespec ts = {0, 700 * 1000 * 1000};
    nanosleep(&ts, NULL);
    llmmem_status_t st = llmmem_shm_all_reduce(c, x, x, 4, LLMMEM_COMM_F32);
    return !(st == LLMMEM_ERR_STATE && strstr(llmmem_last_error(), "rank 0 failed"));
  }
  llmmem_status_t st = llmmem_shm_all_reduce(c, x, x, 4, LLMMEM_COMM_F32);
  return !(st == LLMMEM_ERR_STATE && strstr(llmmem_last_error(), "timed out") &&
           strstr(llmmem_last_error(), "all_reduce"));
}

static int poll_calls = 0; /* per test; only the rank thread that set the poll calls it */

static int stop_on_third_poll(void *ctx) {
  (void)ctx;
  return ++poll_calls >= 3;
}

static int body_interrupted(llmmem_shm_comm_t *c, int rank, int world, void *arg) {
  (void)world, (void)arg;
  float x[4] = {0};
  if (rank == 1) {
    /* waits for rank 0, which is late; its poll asks to stop after ~100 ms */
    llmmem_comm_set_wait_poll(stop_on_third_poll, NULL);
    llmmem_status_t st = llmmem_shm_all_reduce(c, x, x, 4, LLMMEM_COMM_F32);
    llmmem_comm_set_wait_poll(NULL, NULL);
    return !(st == LLMMEM_ERR_STATE && strstr(llmmem_last_error(), "interrupted") &&
             strstr(llmmem_last_error(), "all_reduce"));
  }
  struct timespec ts = {0, 700 * 1000 * 1000};
  nanosleep(&ts, NULL);
  llmmem_status_t st = llmmem_shm_all_reduce(c, x, x, 4, LLMMEM_COMM_F32);
  return !(st == LLMMEM_ERR_STATE && strstr(llmmem_last_error(), "rank 1 failed") &&
           strstr(llmmem_last_error(), "interrupted"));
}

/* Forks a process that creates segment `name` as rank 0 of `world` and waits for the others,
 * then kills it (SIGKILL, no clean-up) once the name exists. Returns 0 when that happened. */
static int kill_creator_during_setup(const char *name, int world) {
  pid_t pid = fork();
  if (pid == 0) {
    llmmem_shm_comm_t *c = NULL;
    llmmem_shm_comm_open(name, 0, world, 4096, 30.0, &c);
    _exit(3);
  }
  for (int i = 0; i < 2000 && !segment_exists(name); i++) usleep(1000);
  int appeared = segment_exists(name);
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  return !(appeared && WIFSIGNALED(status));
}

/* Kills *(pid_t *)arg after 0.5 s: by then the forked rank has joined (it looks every 0.5 ms). */
static void *kill_after_half_a_second(void *arg) {
  struct timespec ts = {0, 500 * 1000 * 1000};
  nanosleep(&ts, NULL);
  kill(*(pid_t *)arg, SIGKILL);
  return NULL;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Raw bits of any float of dtype, special values included: random bit patterns, with one in 8
 * replaced by inf, NaN, a subnormal, zero or a value near the top of the range. */
static void fill_bits(void *buf, size_t n, llmmem_comm_dtype_t dt, unsigned long long *s) {
  for (size_t i = 0; i < n; i++) {
    unsigned long long r = th_rand(s);
    uint32_t special[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x00000001u,
                          0x80000000u, 0x7f7fffffu, 0x00800000u, 0x3f800000u};
    uint32_t f32 = (r & 7) == 0 ? special[(r >> 3) % 8] : (uint32_t)(r >> 16);
    if (dt == LLMMEM_COMM_F32) {
      /* keep most values in a range where sums do not all overflow: exponent 100..154 */
      if ((r & 7) != 0) f32 = (f32 & 0x807fffffu) | ((uint32_t)(100 + (r >> 40) % 55) << 23);
      ((uint32_t *)buf)[i] = f32;
    } else {
      uint16_t sp16[] = {0x7c00, 0xfc00, 0x7e00, 0x0001, 0x8000, 0x7bff, 0x0400, 0x3c00};
      uint16_t spb[] = {0x7f80, 0xff80, 0x7fc0, 0x0001, 0x8000, 0x7f7f, 0x0080, 0x3f80};
      uint16_t h = (r & 7) == 0 ? (dt == LLMMEM_COMM_F16 ? sp16 : spb)[(r >> 3) % 8] : (uint16_t)(r >> 24);
      ((uint16_t *)buf)[i] = h;
    }
  }
}

static int is_nan_bits(const unsigned char *p, llmmem_comm_dtype_t dt) {
  if (dt == LLMMEM_COMM_F32) {
    uint32_t u;
    memcpy(&u, p, 4);
    return (u & 0x7fffffffu) > 0x7f800000u;
  }
  uint16_t h;
  memcpy(&h, p, 2);
  return dt == LLMMEM_COMM_F16 ? (h & 0x7fffu) > 0x7c00u : (h & 0x7fffu) > 0x7f80u;
}

/* Element-wise: the same bits, or NaN where the reference has NaN (which NaN comes out of NaN + NaN
 * depends on operand order, which the compiler may swap; no parity promise covers NaN payloads). */
static size_t count_differences(const unsigned char *got, const unsigned char *want, size_t n,
                                llmmem_comm_dtype_t dt) {
  size_t es = llmmem_comm_dtype_size(dt), bad = 0;
  for (size_t i = 0; i < n; i++) {
    const unsigned char *g = got + i * es, *w = want + i * es;
    if (is_nan_bits(w, dt) ? !is_nan_bits(g, dt) : memcmp(g, w, es) != 0) bad++;
  }
  return bad;
}

/* Slot size for size index s: 4 KiB slots split the one-shot sizes (<= 32 KiB) into many steps;
 * 64 KiB slots split a two-shot message into slot-sized steps, 1 MiB slots into 256 KiB steps
 * with a partial last one. */
static size_t slot_for(size_t s) { return s == 2 || s == 3 ? 4096 : s == 4 ? 65536 : (1u << 20); }

int main(void) {
  const llmmem_comm_dtype_t dtypes[] = {LLMMEM_COMM_F32, LLMMEM_COMM_F16, LLMMEM_COMM_BF16};
  const size_t sizes[] = {0, 1, 7, 4097, 70003, 200002}; /* the last two also run two-shot */

  TEST("half conversions round to nearest even and keep special values") {
    CHECK(llmmem_f32_to_f16(1.0f) == 0x3c00 && llmmem_f16_to_f32(0x3c00) == 1.0f);
    CHECK(llmmem_f32_to_f16(65504.0f) == 0x7bff && llmmem_f32_to_f16(65520.0f) == 0x7c00);
    CHECK(llmmem_f32_to_f16(1.0f + 0x1p-11f) == 0x3c00);     /* tie -> even */
    CHECK(llmmem_f32_to_f16(1.0f + 3 * 0x1p-11f) == 0x3c02); /* tie -> even (up) */
    CHECK(llmmem_f16_to_f32(0x0001) == 0x1p-24f && llmmem_f32_to_f16(0x1p-24f) == 0x0001);
    CHECK(isnan(llmmem_f16_to_f32(llmmem_f32_to_f16(NAN))) && isinf(llmmem_f16_to_f32(0xfc00)));
    CHECK(llmmem_f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80 && llmmem_f32_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3f82);
    CHECK(isnan(llmmem_bf16_to_f32(llmmem_f32_to_bf16(NAN))));
    /* every fp16 value survives the round trip */
    int bad = 0;
    for (unsigned h = 0; h < 65536; h++) {
      float f = llmmem_f16_to_f32((uint16_t)h);
      if (!isnan(f) && llmmem_f32_to_f16(f) != h) bad++;
    }
    CHECK(bad == 0);
  }

  TEST("sum_ref rejects bad arguments") {
    const void *srcs[1] = {NULL};
    float out;
    CHECK_STATUS(llmmem_comm_sum_ref(srcs, 0, &out, 1, LLMMEM_COMM_F32), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_comm_sum_ref(srcs, 1, &out, 1, LLMMEM_COMM_F32), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_comm_sum_ref(srcs, 1, &out, 1, (llmmem_comm_dtype_t)9), LLMMEM_ERR_INVALID);
  }

  TEST("the vectorised sum gives the reference's bits on every instruction set, aliasing included") {
    const size_t counts[] = {0, 1, 7, 8, 15, 16, 17, 511, 512, 513, 1031, 4096 + 5};
    unsigned long long seed = 4242;
    for (int isa = 0; isa <= 2; isa++) {
      int level = _llmmem_comm_force_isa(isa);
      if (level != isa) continue; /* this CPU lacks it: nothing new to test */
      for (size_t d = 0; d < 3; d++)
        for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++)
          for (int nsrc = 1; nsrc <= MAXW; nsrc++)
            for (int alias = 0; alias < 3; alias++) { /* 0: none, 1: out == src 0, 2: out == last src */
              if (alias == 2 && nsrc == 1) continue;
              size_t n = counts[ci], es = llmmem_comm_dtype_size(dtypes[d]);
              unsigned char *src[MAXW], *want = malloc(n * es + 1), *out2 = malloc(n * es + 1);
              for (int r = 0; r < nsrc; r++) {
                src[r] = malloc(n * es + 1);
                fill_bits(src[r], n, dtypes[d], &seed);
              }
              CHECK_OK(llmmem_comm_sum_ref((const void *const *)src, nsrc, want, n, dtypes[d]));
              unsigned char *out = alias == 0 ? malloc(n * es + 1) : src[alias == 1 ? 0 : nsrc - 1];
              _llmmem_comm_sum2((const void *const *)src, nsrc, out, out2, n, dtypes[d]);
              size_t bad = count_differences(out, want, n, dtypes[d]) + count_differences(out2, want, n, dtypes[d]);
              if (bad)
                printf("  isa %d dtype %d n %zu nsrc %d alias %d: %zu differences\n", isa, (int)dtypes[d], n, nsrc,
                       alias, bad);
              CHECK(bad == 0);
              for (int r = 0; r < nsrc; r++) free(src[r]);
              if (alias == 0) free(out);
              free(want);
              free(out2);
            }
    }
    _llmmem_comm_force_isa(-1);
  }

  TEST("open rejects bad arguments") {
    llmmem_shm_comm_t *c = (llmmem_shm_comm_t *)1;
    CHECK_STATUS(llmmem_shm_comm_open("x", 2, 2, 0, 1.0, &c), LLMMEM_ERR_INVALID);
    CHECK(c == NULL);
    CHECK_STATUS(llmmem_shm_comm_open("a/b", 0, 1, 0, 1.0, &c), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_shm_comm_open("x", 0, 0, 0, 1.0, &c), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_shm_comm_open("x", 0, 1, 0, 0.0, &c), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_shm_comm_open(NULL, 0, 1, 0, 1.0, &c), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_shm_all_reduce(NULL, NULL, NULL, 0, LLMMEM_COMM_F32), LLMMEM_ERR_INVALID);
    CHECK_OK(llmmem_shm_comm_close(NULL));
  }

  TEST("all-reduce equals the reference, bitwise on every rank, all dtypes and sizes, world 1..4, each ISA") {
    for (int isa = 2; isa >= 0; isa--)
      for (int world = 1; world <= MAXW; world++)
        for (size_t d = 0; d < 3; d++)
          for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
            for (int in_place = 0; in_place < 2; in_place++) {
              if (world == 3 && d > 0 && in_place) continue;      /* keep the run short */
              if (isa != 2 && (world == 3 || in_place)) continue; /* the other levels: a subset */
              _llmmem_comm_force_isa(isa);
              ar_case_t k = {sizes[s], dtypes[d], in_place, {0}};
              size_t bytes = sizes[s] * llmmem_comm_dtype_size(dtypes[d]) + 1;
              for (int r = 0; r < world; r++) k.results[r] = calloc(1, bytes);
              size_t slot = slot_for(s);
              char name[128];
              CHECK(run_threads(world, slot, 10.0, body_all_reduce, &k, name) == 0);
              for (int r = 1; r < world; r++) CHECK(memcmp(k.results[0], k.results[r], bytes - 1) == 0);
              CHECK(!segment_exists(name));
              for (int r = 0; r < world; r++) free(k.results[r]);
            }
    _llmmem_comm_force_isa(-1);
  }

  TEST("all-gather and reduce-scatter equal the reference, chunked and not") {
    for (int world = 1; world <= MAXW; world++)
      for (size_t d = 0; d < 3; d++)
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
          ar_case_t k = {sizes[s], dtypes[d], 0, {0}};
          CHECK(run_threads(world, slot_for(s), 10.0, body_gather_scatter, &k, NULL) == 0);
        }
  }

  TEST("1000 small all-reduces in a row") {
    many_t m = {1000};
    CHECK(run_threads(3, 4096, 10.0, body_many, &m, NULL) == 0);
    CHECK(run_threads(2, 4096, 10.0, body_many, &m, NULL) == 0);
  }

  TEST("ranks calling with different sizes all get an error naming both") {
    CHECK(run_threads(2, 4096, 5.0, body_mismatch, NULL, NULL) == 0);
  }

  TEST("a late rank makes the other time out (naming the collective), then fails itself") {
    double t0 = now_s();
    CHECK(run_threads(2, 4096, 0.3, body_timeout, NULL, NULL) == 0);
    CHECK(now_s() - t0 < 5.0);
  }

  TEST("open times out when rank 0 never creates the segment") {
    llmmem_shm_comm_t *c = NULL;
    char name[128];
    make_name(name, sizeof name);
    CHECK_STATUS(llmmem_shm_comm_open(name, 1, 2, 0, 0.2, &c), LLMMEM_ERR_STATE);
    CHECK(strstr(llmmem_last_error(), "did not appear") != NULL);
    CHECK(c == NULL);
  }

  TEST("rank 0 alone times out waiting for the others to join, and removes the name") {
    llmmem_shm_comm_t *c = NULL;
    char name[128];
    make_name(name, sizeof name);
    CHECK_STATUS(llmmem_shm_comm_open(name, 0, 2, 4096, 0.2, &c), LLMMEM_ERR_STATE);
    CHECK(strstr(llmmem_last_error(), "joined") != NULL);
    CHECK(!segment_exists(name));
  }

  TEST("a killed peer process is reported quickly, and no segment is left") {
    char name[128];
    make_name(name, sizeof name);
    pid_t pid = fork();
    if (pid == 0) {
      llmmem_shm_comm_t *c = NULL;
      if (llmmem_shm_comm_open(name, 1, 2, 4096, 10.0, &c) == LLMMEM_OK) {
        float x[4] = {1, 2, 3, 4};
        llmmem_shm_all_reduce(c, x, x, 4, LLMMEM_COMM_F32); /* one collective succeeds ... */
      }
      raise(SIGKILL); /* ... then the process dies without a word */
      _exit(3);
    }
    llmmem_shm_comm_t *c = NULL;
    CHECK_OK(llmmem_shm_comm_open(name, 0, 2, 4096, 30.0, &c));
    CHECK(!segment_exists(name));
    if (c) {
      float x[4] = {1, 2, 3, 4};
      CHECK_OK(llmmem_shm_all_reduce(c, x, x, 4, LLMMEM_COMM_F32));
      CHECK(x[0] == 2.0f && x[3] == 8.0f);
      double t0 = now_s();
      CHECK_STATUS(llmmem_shm_all_reduce(c, x, x, 4, LLMMEM_COMM_F32), LLMMEM_ERR_STATE);
      CHECK(strstr(llmmem_last_error(), "exited") != NULL);
      CHECK(now_s() - t0 < 10.0); /* far below the 30 s timeout: death is detected, not waited out */
      llmmem_shm_comm_close(c);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  }

  TEST("rank 0 killed during set-up: a peer that comes later fails at once and removes the name") {
    char name[128];
    make_name(name, sizeof name);
    CHECK(kill_creator_during_setup(name, 2) == 0);
    CHECK(segment_exists(name)); /* what the crash leaves */
    llmmem_shm_comm_t *c = NULL;
    double t0 = now_s();
    CHECK_STATUS(llmmem_shm_comm_open(name, 1, 2, 4096, 30.0, &c), LLMMEM_ERR_STATE);
    CHECK(strstr(llmmem_last_error(), "rank 0") && strstr(llmmem_last_error(), "exited"));
    CHECK(now_s() - t0 < 5.0);
    CHECK(!segment_exists(name));
  }

  TEST("rank 0 killed during set-up with nobody left: the next set-up sweeps the name away") {
    char name[128], other[128];
    make_name(name, sizeof name);
    make_name(other, sizeof other);
    CHECK(kill_creator_during_setup(name, 2) == 0);
    CHECK(segment_exists(name));
    llmmem_shm_comm_t *c = NULL;
    CHECK_OK(llmmem_shm_comm_open(other, 0, 1, 4096, 5.0, &c));
    llmmem_shm_comm_close(c);
    CHECK(!segment_exists(name));
    CHECK(!segment_exists(other));
  }

  TEST("a joined peer killed during set-up fails the set-up at once, and no segment is left") {
    char name[128];
    make_name(name, sizeof name);
    pid_t pid = fork();
    if (pid == 0) {
      llmmem_shm_comm_t *c = NULL;
      llmmem_shm_comm_open(name, 1, 3, 4096, 30.0, &c); /* joins, then waits for rank 2: never comes */
      _exit(3);
    }
    pthread_t killer;
    pthread_create(&killer, NULL, kill_after_half_a_second, &pid);
    llmmem_shm_comm_t *c = NULL;
    double t0 = now_s();
    CHECK_STATUS(llmmem_shm_comm_open(name, 0, 3, 4096, 30.0, &c), LLMMEM_ERR_STATE);
    CHECK(strstr(llmmem_last_error(), "rank 1") && strstr(llmmem_last_error(), "exited during set-up"));
    CHECK(now_s() - t0 < 10.0); /* far below the 30 s timeout */
    pthread_join(killer, NULL);
    waitpid(pid, NULL, 0);
    CHECK(!segment_exists(name));
  }

  TEST("a wait poll that says stop interrupts set-up and collectives promptly, and the peers are told") {
    char name[128];
    make_name(name, sizeof name);
    llmmem_shm_comm_t *c = NULL;
    poll_calls = 0;
    llmmem_comm_set_wait_poll(stop_on_third_poll, NULL);
    double t0 = now_s();
    CHECK_STATUS(llmmem_shm_comm_open(name, 0, 2, 4096, 30.0, &c), LLMMEM_ERR_STATE);
    llmmem_comm_set_wait_poll(NULL, NULL);
    CHECK(strstr(llmmem_last_error(), "interrupted") != NULL);
    CHECK(now_s() - t0 < 5.0);
    CHECK(!segment_exists(name));
    poll_calls = 0;
    CHECK(run_threads(2, 4096, 30.0, body_interrupted, NULL, NULL) == 0);
  }

  return TEST_SUMMARY();
}
