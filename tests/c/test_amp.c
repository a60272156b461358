/*
 * test_amp.c — the CPU loss-scaler core: fp16/bf16 conversions, the threaded unscale + check
 * against the scalar reference (every dtype, many sizes, inf/NaN placed first/middle/last, many
 * thread counts), the scale-update rule (torch's rule, hysteresis, min_scale), argument misuse,
 * concurrent callers, and the CUDA entry points of a CPU-only build.
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <llmmem/amp.h>

#include "half.h"
#include "internal.h"
#include "testhelper.h"
#include "../../csrc/amp/scaler_internal.h" /* _llmmem_scaler_run_span (internal) */

#ifdef LLMMEM_TEST_OPENMP
#include <omp.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

int _llmmem_scaler_force_isa(int isa); /* unscale_cpu.c test hook */
int _llmmem_omp_team_usable(void);     /* omp_team.c: 1 = the threaded unscale runs on the OpenMP team */
int _llmmem_omp_team_runs(void);       /* omp_team.c: teams run so far */
int _llmmem_online_cpus(void);

static const int64_t SIZES[] = {0, 1, 7, 64, 65, 4097, 100003};
#define N_SIZES (sizeof SIZES / sizeof SIZES[0])

/* A random finite value of moderate magnitude, as a scaled gradient would be. */
static float rand_val(unsigned long long *rng) {
  double u = (double)(th_rand(rng) >> 11) / 9007199254740992.0; /* [0, 1) */
  double mag = pow(2.0, -20.0 + 30.0 * u);
  return (float)((th_rand(rng) & 1) ? mag : -mag);
}

static void fill(void *data, int32_t dtype, int64_t n, unsigned long long *rng) {
  for (int64_t i = 0; i < n; i++) {
    float v = rand_val(rng);
    switch (dtype) {
      case LLMMEM_SCALER_F32: ((float *)data)[i] = v; break;
      case LLMMEM_SCALER_F64: ((double *)data)[i] = (double)v * (1.0 + 1e-9); break;
      case LLMMEM_SCALER_BF16: ((uint16_t *)data)[i] = llmmem_f32_to_bf16(v); break;
      default: ((uint16_t *)data)[i] = llmmem_f32_to_f16(v); break;
    }
  }
}

static void put(void *data, int32_t dtype, int64_t i, double v) {
  switch (dtype) {
    case LLMMEM_SCALER_F32: ((float *)data)[i] = (float)v; break;
    case LLMMEM_SCALER_F64: ((double *)data)[i] = v; break;
    case LLMMEM_SCALER_BF16: ((uint16_t *)data)[i] = llmmem_f32_to_bf16((float)v); break;
    default: ((uint16_t *)data)[i] = llmmem_f32_to_f16((float)v); break;
  }
}

typedef struct {
  llmmem_scaler_tensor_t *t;
  void **copy; /* a second buffer per tensor, for the reference */
  size_t n;
} list_t;

static list_t make_list(size_t n, const int64_t *numels, const int32_t *dtypes, unsigned long long *rng) {
  list_t l = {calloc(n ? n : 1, sizeof(llmmem_scaler_tensor_t)), calloc(n ? n : 1, sizeof(void *)), n};
  for (size_t i = 0; i < n; i++) {
    size_t bytes = (size_t)numels[i] * llmmem_scaler_dtype_size(dtypes[i]);
    l.t[i].data = numels[i] ? malloc(bytes) : NULL;
    l.t[i].numel = numels[i];
    l.t[i].dtype = dtypes[i];
    l.t[i].flag = (int32_t)i;
    if (numels[i]) fill(l.t[i].data, dtypes[i], numels[i], rng);
    l.copy[i] = numels[i] ? malloc(bytes) : NULL;
    if (numels[i]) memcpy(l.copy[i], l.t[i].data, bytes);
  }
  return l;
}

static void free_list(list_t *l) {
  for (size_t i = 0; i < l->n; i++) {
    free(l->t[i].data);
    free(l->copy[i]);
  }
  free(l->t);
  free(l->copy);
}

/* Whether every tensor of l equals its copy bitwise (the first `done` were processed on both sides,
 * the others on neither); prints the first that does not. */
static int tensors_match_copies(const list_t *l, size_t done) {
  for (size_t i = 0; i < l->n; i++) {
    size_t bytes = (size_t)l->t[i].numel * llmmem_scaler_dtype_size(l->t[i].dtype);
    if (bytes && memcmp(l->t[i].data, l->copy[i], bytes) != 0) {
      printf("  tensor %zu (dtype %d, numel %lld, %s) differs from the reference\n", i, (int)l->t[i].dtype,
             (long long)l->t[i].numel, i < done ? "processed" : "not processed");
      return 0;
    }
  }
  return 1;
}

/* Runs the unscale on l and the reference on the copies; returns 1 when the results match bitwise.
 * pipe 0: llmmem_scaler_unscale_check on `threads` threads. pipe 1: the pipe with `threads`
 * workers besides the caller, published in random batches, stopped after the first `upto` tensors
 * (the reference runs on those only, and the rest must stay untouched). */
static int run_matches_ref(list_t *l, const float *scale, int pipe, int threads, size_t upto,
                           unsigned long long *rng) {
  llmmem_scaler_tensor_t *ref = calloc(l->n ? l->n : 1, sizeof *ref);
  for (size_t i = 0; i < l->n; i++) {
    ref[i] = l->t[i];
    ref[i].data = l->copy[i];
  }
  uint8_t *f1 = calloc(l->n + 1, 1), *f2 = calloc(l->n + 1, 1);
  float fi1 = 0.0f, fi2 = 0.0f;
  int ok;
  if (!pipe) {
    upto = l->n;
    ok = llmmem_scaler_unscale_check(l->t, l->n, scale, 0, &fi1, f1, l->n + 1, threads) == LLMMEM_OK;
  } else {
    llmmem_scaler_pipe_t *p = NULL;
    ok = llmmem_scaler_pipe_start(l->t, l->n, scale, 0, f1, l->n + 1, threads, &p) == LLMMEM_OK;
    for (size_t done = 0; ok && done < upto;) {
      done += 1 + th_rand(rng) % 64;
      if (done > upto) done = upto;
      ok = llmmem_scaler_pipe_publish(p, done, NULL) == LLMMEM_OK;
    }
    ok = p && llmmem_scaler_pipe_finish(p, &fi1) == LLMMEM_OK && ok;
  }
  ok = ok && llmmem_scaler_unscale_check_ref(ref, upto, scale, 0, &fi2, f2, l->n + 1) == LLMMEM_OK;
  ok = ok && fi1 == fi2 && memcmp(f1, f2, l->n + 1) == 0 && tensors_match_copies(l, upto);
  free(ref);
  free(f1);
  free(f2);
  return ok;
}

static int fast_matches_ref(list_t *l, const float *scale, int threads) {
  return run_matches_ref(l, scale, 0, threads, l->n, NULL);
}

static int pipe_matches_ref(list_t *l, const float *scale, int workers, size_t upto, unsigned long long *rng) {
  return run_matches_ref(l, scale, 1, workers, upto, rng);
}

/* A numel near where the loops of unscale_cpu.c change course for `dtype`: their 256-byte blocks,
 * the 4 KiB they ask for ahead, the first block that asks (4 KiB + 256 B), or anywhere below 3
 * such spans. */
static int64_t numel_near_thresholds(int32_t dtype, unsigned long long *rng) {
  const int64_t es = (int64_t)llmmem_scaler_dtype_size(dtype), blk = 256 / es, ahead = 4096 / es;
  const int64_t marks[] = {0, 1, blk, ahead, ahead + blk, ahead + 2 * blk, 2 * ahead + 3 * blk};
  int64_t n = marks[th_rand(rng) % (sizeof marks / sizeof marks[0])] + (int64_t)(th_rand(rng) % 5) - 2;
  if (th_rand(rng) % 4 == 0) n = (int64_t)(th_rand(rng) % (uint64_t)(3 * (ahead + blk)));
  return n < 0 ? 0 : n;
}

/* An element index where a non-finite value tests the block and range edges of a tensor of n
 * elements (n > 0): either side of a block edge, of the first prefetching block's end, the last
 * element, or anywhere. */
static int64_t edge_index(int32_t dtype, int64_t n, unsigned long long *rng) {
  const int64_t es = (int64_t)llmmem_scaler_dtype_size(dtype), blk = 256 / es, ahead = 4096 / es;
  int64_t at;
  switch (th_rand(rng) % 5) {
    case 0: at = blk * (int64_t)(th_rand(rng) % (uint64_t)(n / blk + 1)) - (int64_t)(th_rand(rng) % 2); break;
    case 1: at = ahead + blk - 1 + (int64_t)(th_rand(rng) % 2); break;
    case 2: at = n - 1 - (int64_t)(th_rand(rng) % 3); break;
    default: at = (int64_t)(th_rand(rng) % (uint64_t)n); break;
  }
  return at < 0 ? 0 : at >= n ? n - 1 : at;
}

static llmmem_scaler_config_t torch_cfg(int64_t interval) {
  return (llmmem_scaler_config_t){2.0, 0.5, interval, 1, 0.0f};
}

typedef struct {
  unsigned long long seed;
  int ok;
} worker_arg_t;

static void *concurrent_worker(void *p) {
  worker_arg_t *a = p;
  unsigned long long rng = a->seed;
  int64_t numels[6] = {4097, 300000, 1, 0, 70000, 7};
  int32_t dtypes[6] = {0, 1, 2, 3, 0, 2};
  list_t l = make_list(6, numels, dtypes, &rng);
  put(l.t[1].data, 1, 123, INFINITY);
  put(l.copy[1], 1, 123, INFINITY);
  float scale = 1024.0f;
  a->ok = fast_matches_ref(&l, &scale, 2);
  free_list(&l);
  return NULL;
}

int main(void) {
  unsigned long long rng = 12345;

#ifdef LLMMEM_TEST_OPENMP
  /* Big enough (19 MB) for llmmem_scaler_unscale_check to use 2 threads. */
  static const int64_t big_numels[8] = {600000, 600001, 599999, 600000, 64, 600000, 1, 600000};
  static const int32_t big_dtypes[8] = {0, 0, 0, 0, 3, 0, 2, 0};
  TEST("a child forked after OpenMP ran but before llmmem first looked for it does not use the team") {
    /* first in the program: llmmem has not looked for the runtime yet (DataLoader workers and
     * fork-based pools start like this, after torch ops but before the first unscale) */
    int members = 0;
#pragma omp parallel num_threads(2)
    {
#pragma omp atomic
      members++;
    }
    list_t l = make_list(8, big_numels, big_dtypes, &rng);
    float scale = 2.0f;
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
      alarm(60); /* a hang fails the test instead of stalling it */
      _exit(_llmmem_omp_team_usable() == 0 && fast_matches_ref(&l, &scale, 2) ? 0 : 1);
    }
    int status = 0;
    CHECK(members >= 1 && child > 0 && waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    free_list(&l);
  }

  TEST("with an OpenMP runtime in the process the threaded unscale runs on its team") {
    CHECK(omp_get_max_threads() >= 1); /* also keeps the runtime linked */
    CHECK(_llmmem_omp_team_usable() == (omp_get_max_threads() >= 2));
    list_t l = make_list(8, big_numels, big_dtypes, &rng);
    put(l.t[5].data, 0, 599999, NAN);
    put(l.copy[5], 0, 599999, NAN);
    float scale = 512.0f;
    int runs = _llmmem_omp_team_runs();
    CHECK(fast_matches_ref(&l, &scale, 2));
    if (_llmmem_omp_team_usable() && _llmmem_online_cpus() >= 2)
      CHECK(_llmmem_omp_team_runs() == runs + 1); /* the team did run it */
    else
      printf("  (one CPU or no team here: the team path is not exercised)\n");
    free_list(&l);
  }

  TEST("called from inside a parallel region it uses threads of its own, correctly, on each thread") {
    /* threads the runtime did not give (OMP_THREAD_LIMIT, OMP_DYNAMIC) count as fine */
    int ok[2] = {1, 1}, usable[2] = {0, 0}, in_team = 1;
#pragma omp parallel num_threads(2)
    {
      int me = omp_get_thread_num();
      if (me == 0) in_team = omp_get_num_threads();
      unsigned long long my_rng = 77 + (unsigned long long)me;
      list_t l = make_list(8, big_numels, big_dtypes, &my_rng);
      float scale = 8.0f;
      usable[me] = _llmmem_omp_team_usable();
      ok[me] = fast_matches_ref(&l, &scale, 2);
      free_list(&l);
    }
    CHECK(ok[0] && ok[1]);
    CHECK(in_team < 2 || (usable[0] == 0 && usable[1] == 0)); /* an active region: never nested teams */
  }

  TEST("a child forked after the team ran unscales on threads of its own (the runtime does not survive fork)") {
    list_t l = make_list(8, big_numels, big_dtypes, &rng);
    float scale = 4.0f;
    CHECK(fast_matches_ref(&l, &scale, 2)); /* the team has run in this process */
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
      alarm(60); /* a hang fails the test instead of stalling it */
      int fine = _llmmem_omp_team_usable() == 0 && fast_matches_ref(&l, &scale, 2);
      _exit(fine ? 0 : 1);
    }
    int status = 0;
    CHECK(child > 0 && waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    free_list(&l);
  }
#else
  TEST("without an OpenMP runtime the threaded unscale uses threads of its own") {
    CHECK(_llmmem_omp_team_usable() == 0);
  }
#endif

  TEST("fp16 -> fp32 -> fp16 is the identity on every non-NaN pattern, NaN stays NaN") {
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
      float f = llmmem_f16_to_f32((uint16_t)h);
      uint16_t back = llmmem_f32_to_f16(f);
      int is_nan = (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu);
      if (is_nan ? !isnan(f) || (back & 0x7c00u) != 0x7c00u || !(back & 0x3ffu) : back != h) bad++;
    }
    CHECK(bad == 0);
  }

#if defined(__FLT16_MAX__)
  TEST("fp32 -> fp16 rounds like the compiler's _Float16 (nearest even, subnormals, overflow)") {
    int bad = 0;
    for (int k = 0; k < 2000000; k++) {
      uint32_t u = (uint32_t)th_rand(&rng);
      /* bias half of the samples towards the fp16 range, where rounding is interesting */
      if (k & 1) u = (u & 0x80000000u) | (0x30000000u + (u & 0x1fffffffu) % 0x18000000u);
      float f = llmmem_f32_from_bits(u);
      if (isnan(f)) continue;
      _Float16 h = (_Float16)f;
      uint16_t want;
      memcpy(&want, &h, 2);
      if (llmmem_f32_to_f16(f) != want) bad++;
    }
    CHECK(bad == 0);
  }
#endif

  TEST("fp32 -> bf16 rounds to nearest even, NaN -> 0x7fc0, inf kept") {
    CHECK(llmmem_f32_to_bf16(1.0f) == 0x3f80);
    CHECK(llmmem_f32_to_bf16(llmmem_f32_from_bits(0x3f808000u)) == 0x3f80); /* tie, even stays */
    CHECK(llmmem_f32_to_bf16(llmmem_f32_from_bits(0x3f818000u)) == 0x3f82); /* tie, odd rounds up */
    CHECK(llmmem_f32_to_bf16(llmmem_f32_from_bits(0x3f808001u)) == 0x3f81);
    CHECK(llmmem_f32_to_bf16(NAN) == 0x7fc0);
    CHECK(llmmem_f32_to_bf16(INFINITY) == 0x7f80);
    CHECK(llmmem_f32_to_bf16(-INFINITY) == 0xff80);
    CHECK(llmmem_f32_to_bf16(llmmem_f32_from_bits(0x7f7fffffu)) == 0x7f80); /* FLT_MAX rounds to inf */
  }

  TEST("inv_scale is the fp64 reciprocal rounded to fp32") {
    float inv = 0.0f;
    CHECK_OK(llmmem_scaler_inv_scale(65536.0f, &inv));
    CHECK(inv == 1.0f / 65536.0f);
    CHECK_OK(llmmem_scaler_inv_scale(3.0f, &inv));
    CHECK(inv == (float)(1.0 / 3.0));
    CHECK_STATUS(llmmem_scaler_inv_scale(3.0f, NULL), LLMMEM_ERR_INVALID);
  }

  /* Every instruction-set variant of the loops against the reference (levels the CPU lacks run
   * the best one it has). */
  for (int isa = 0; isa <= 2; isa++) {
    int level = _llmmem_scaler_force_isa(isa);
    printf("  loops at ISA level %d (asked %d)\n", level, isa);
    TEST("single tensors: every dtype and size, inf/NaN first/middle/last, fast == reference bitwise") {
      const double specials[3] = {INFINITY, -INFINITY, NAN};
      for (int32_t dt = 0; dt < LLMMEM_SCALER_DTYPE_COUNT_; dt++) {
        for (size_t s = 0; s < N_SIZES; s++) {
          int64_t n = SIZES[s];
          for (int where = -1; where < 3; where++) { /* -1: all finite; 0 first, 1 middle, 2 last */
            if (where >= 0 && n == 0) continue;
            list_t l = make_list(1, &n, &dt, &rng);
            int64_t at = where == 0 ? 0 : where == 1 ? n / 2 : n - 1;
            if (where >= 0) {
              put(l.t[0].data, dt, at, specials[(where + s) % 3]);
              put(l.copy[0], dt, at, specials[(where + s) % 3]);
            }
            float scale = 32768.0f;
            int ok = fast_matches_ref(&l, &scale, 3);
            if (!ok) printf("  dtype %d numel %lld where %d\n", (int)dt, (long long)n, where);
            CHECK(ok);
            free_list(&l);
          }
        }
      }
    }

    TEST("the reference flags exactly the tensors that hold a non-finite value and multiplies by inv") {
      int64_t numels[3] = {5, 5, 5};
      int32_t dtypes[3] = {0, 0, 0};
      list_t l = make_list(3, numels, dtypes, &rng);
      ((float *)l.t[1].data)[4] = NAN;
      float before = ((float *)l.t[0].data)[2];
      uint8_t flags[3] = {0, 0, 0};
      float found = 0.0f, scale = 4.0f;
      CHECK_OK(llmmem_scaler_unscale_check_ref(l.t, 3, &scale, 0, &found, flags, 3));
      CHECK(found == 1.0f);
      CHECK(flags[0] == 0 && flags[1] == 1 && flags[2] == 0);
      CHECK(((float *)l.t[0].data)[2] == before * 0.25f);
      free_list(&l);
    }

    TEST("many tensors (1..1000), mixed dtypes, 1..8 threads: fast == reference") {
      const size_t counts[] = {1, 2, 17, 1000};
      for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
        size_t n = counts[c];
        int64_t *numels = malloc(n * sizeof *numels);
        int32_t *dtypes = malloc(n * sizeof *dtypes);
        for (size_t i = 0; i < n; i++) {
          numels[i] = (int64_t)(th_rand(&rng) % (n > 100 ? 9000 : 300000));
          dtypes[i] = (int32_t)(th_rand(&rng) % 4);
        }
        for (int threads = 1; threads <= 8; threads += 3) {
          list_t l = make_list(n, numels, dtypes, &rng);
          size_t victim = n / 2;
          if (numels[victim] > 0) {
            put(l.t[victim].data, dtypes[victim], numels[victim] - 1, INFINITY);
            put(l.copy[victim], dtypes[victim], numels[victim] - 1, INFINITY);
          }
          float scale = 1.0f / 3.0f; /* inv > 1: fp16 may overflow to inf, both paths alike */
          CHECK(fast_matches_ref(&l, &scale, threads));
          free_list(&l);
        }
        free(numels);
        free(dtypes);
      }
    }

    TEST(
        "spans cut anywhere (odd offsets, mid-tensor ends, empty tensors, to.offset 0) == reference on their "
        "elements, every dtype, around the 256 B / 4 KiB loop thresholds, data off 64 B, write and check only") {
      /* The pipe only cuts large tensors at multiples of 64 elements; _llmmem_scaler_run_span takes
       * any span, and asks for memory ahead inside it (the tensors after the current one, and 4 KiB
       * ahead in each range): every element of the span exactly once, none outside, flags as the
       * reference on the same elements. */
      enum { MAXN = 12 };
      _llmmem_scaler_range_fn run = _llmmem_scaler_pick_range_fn();
      const double specials[3] = {INFINITY, -INFINITY, NAN};
      int ok = 1;
      for (int round = 0; round < 400 && ok; round++) {
        size_t n = 1 + th_rand(&rng) % MAXN;
        llmmem_scaler_tensor_t t[MAXN], ref[MAXN];
        void *base[MAXN], *copy[MAXN];
        size_t bytes[MAXN];
        for (size_t i = 0; i < n; i++) {
          int32_t dt = (int32_t)(th_rand(&rng) % LLMMEM_SCALER_DTYPE_COUNT_);
          int64_t numel = numel_near_thresholds(dt, &rng);
          size_t es = llmmem_scaler_dtype_size(dt);
          bytes[i] = (size_t)numel * es;
          /* element-aligned, but 1..15 elements past a 64-byte line */
          base[i] = aligned_alloc(64, (bytes[i] + 16 * es + 63) / 64 * 64); /* C11: a multiple of 64 */
          char *data = (char *)base[i] + es * (1 + th_rand(&rng) % 15);
          fill(data, dt, numel, &rng);
          if (numel && th_rand(&rng) % 3 == 0) put(data, dt, edge_index(dt, numel, &rng), specials[th_rand(&rng) % 3]);
          copy[i] = malloc(bytes[i] ? bytes[i] : 1);
          memcpy(copy[i], data, bytes[i]);
          t[i] = (llmmem_scaler_tensor_t){numel ? data : NULL, numel, dt, (int32_t)i}; /* empty: NULL, as the walk */
        }
        /* from <= to, each anywhere in [0, numel] of its tensor; to may be (n, 0) */
        size_t a = th_rand(&rng) % n, b = a + th_rand(&rng) % (n - a + 1);
        _llmmem_scaler_pos_t from = {a, (int64_t)(th_rand(&rng) % (uint64_t)(t[a].numel + 1))};
        _llmmem_scaler_pos_t to = {b, 0};
        if (b < n) {
          int64_t lo = b == a ? from.offset : 0;
          to.offset = lo + (int64_t)(th_rand(&rng) % (uint64_t)(t[b].numel - lo + 1));
          if (th_rand(&rng) % 4 == 0) to.offset = b == a ? lo : 0;
        }
        const int write = (int)(th_rand(&rng) % 3); /* 0: check only; 1: x 1/4096; 2: x 3 (fp16 may overflow) */
        const float inv = write == 0 ? 1.0f : write == 1 ? 1.0f / 4096.0f : 3.0f;
        /* the reference on the same elements: one tensor per part of the span */
        size_t nref = 0;
        for (size_t i = a; i < n && (i < b || (i == b && to.offset > 0)); i++) {
          int64_t lo = i == a ? from.offset : 0, hi = i == b ? to.offset : t[i].numel;
          size_t es = llmmem_scaler_dtype_size(t[i].dtype);
          ref[nref++] = (llmmem_scaler_tensor_t){hi > lo ? (char *)copy[i] + (size_t)lo * es : NULL,
                                                 hi > lo ? hi - lo : 0, t[i].dtype, (int32_t)i};
        }
        uint8_t f1[MAXN] = {0}, f2[MAXN] = {0};
        float fi2 = 0.0f;
        int found = _llmmem_scaler_run_span(t, from, to, inv, write != 0, f1, run);
        ok = llmmem_scaler_unscale_check_ref(ref, nref, &inv, 1, &fi2, f2, MAXN) == LLMMEM_OK;
        ok = ok && (found != 0) == (fi2 == 1.0f) && memcmp(f1, f2, MAXN) == 0;
        for (size_t i = 0; i < n; i++) {
          ok = ok && (!bytes[i] || memcmp(t[i].data, copy[i], bytes[i]) == 0);
          free(base[i]);
          free(copy[i]);
        }
        if (!ok)
          printf("  round %d: %zu tensors, span (%zu, %lld) -> (%zu, %lld), write %d\n", round, n, from.tensor,
                 (long long)from.offset, to.tensor, (long long)to.offset, write);
      }
      CHECK(ok);
    }
  }
  _llmmem_scaler_force_isa(-1);

  TEST("a large fp32 tensor over many threads: cut points never lose or repeat an element") {
    int64_t n = 3000017;
    int32_t dt = LLMMEM_SCALER_F32;
    list_t l = make_list(1, &n, &dt, &rng);
    put(l.t[0].data, dt, n - 1, NAN);
    put(l.copy[0], dt, n - 1, NAN);
    float scale = 8.0f;
    CHECK(fast_matches_ref(&l, &scale, 7));
    free_list(&l);
  }

  TEST("check only (scale NULL) and scale 1 write nothing, but still find inf") {
    int64_t n = 70001;
    int32_t dt = LLMMEM_SCALER_BF16;
    list_t l = make_list(1, &n, &dt, &rng);
    put(l.t[0].data, dt, 5, -INFINITY);
    memcpy(l.copy[0], l.t[0].data, (size_t)n * 2);
    float found = 0.0f, one = 1.0f;
    uint8_t flag = 0;
    CHECK_OK(llmmem_scaler_unscale_check(l.t, 1, NULL, 0, &found, &flag, 1, 2));
    CHECK(found == 1.0f && flag == 1);
    found = 0.0f;
    CHECK_OK(llmmem_scaler_unscale_check(l.t, 1, &one, 0, &found, NULL, 0, 2));
    CHECK(found == 1.0f);
    CHECK(memcmp(l.t[0].data, l.copy[0], (size_t)n * 2) == 0);
    free_list(&l);
  }

  TEST("scale_is_inverse multiplies by the given value itself") {
    int64_t n = 9;
    int32_t dt = LLMMEM_SCALER_F32;
    list_t l = make_list(1, &n, &dt, &rng);
    float inv = 0.125f, found = 0.0f, x = ((float *)l.t[0].data)[8];
    CHECK_OK(llmmem_scaler_unscale_check(l.t, 1, &inv, 1, &found, NULL, 0, 1));
    CHECK(((float *)l.t[0].data)[8] == x * 0.125f && found == 0.0f);
    free_list(&l);
  }

  TEST("found_inf is never cleared by a clean pass") {
    int64_t n = 10;
    int32_t dt = 0;
    list_t l = make_list(1, &n, &dt, &rng);
    float found = 1.0f, scale = 2.0f;
    CHECK_OK(llmmem_scaler_unscale_check(l.t, 1, &scale, 0, &found, NULL, 0, 1));
    CHECK(found == 1.0f);
    found = 0.0f;
    CHECK_OK(llmmem_scaler_unscale_check(l.t, 1, &scale, 0, &found, NULL, 0, 1));
    CHECK(found == 0.0f);
    free_list(&l);
  }

  TEST("misuse: bad arguments are refused before any element is touched") {
    float buf[4] = {1, 2, 3, 4}, found = 0.0f, scale = 2.0f;
    uint8_t flags[1] = {0};
    llmmem_scaler_tensor_t good = {buf, 4, LLMMEM_SCALER_F32, 0};
    llmmem_scaler_tensor_t two[2] = {good, {buf, 4, 7, 0}};
    CHECK_STATUS(llmmem_scaler_unscale_check(two, 2, &scale, 0, &found, NULL, 0, 1), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "tensors[1].dtype") != NULL);
    CHECK(buf[0] == 1.0f); /* the first, valid tensor was not unscaled either */
    CHECK_STATUS(llmmem_scaler_unscale_check(&good, 1, &scale, 0, NULL, NULL, 0, 1), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_scaler_unscale_check(NULL, 3, &scale, 0, &found, NULL, 0, 1), LLMMEM_ERR_INVALID);
    llmmem_scaler_tensor_t neg = {buf, -1, LLMMEM_SCALER_F32, 0};
    CHECK_STATUS(llmmem_scaler_unscale_check(&neg, 1, &scale, 0, &found, NULL, 0, 1), LLMMEM_ERR_INVALID);
    llmmem_scaler_tensor_t null_data = {NULL, 4, LLMMEM_SCALER_F32, 0};
    CHECK_STATUS(llmmem_scaler_unscale_check(&null_data, 1, &scale, 0, &found, NULL, 0, 1), LLMMEM_ERR_INVALID);
    llmmem_scaler_tensor_t bad_flag = {buf, 4, LLMMEM_SCALER_F32, 1};
    CHECK_STATUS(llmmem_scaler_unscale_check(&bad_flag, 1, &scale, 0, &found, flags, 1, 1), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "flag") != NULL);
    llmmem_scaler_tensor_t misaligned = {(char *)buf + 1, 2, LLMMEM_SCALER_F32, 0};
    CHECK_STATUS(llmmem_scaler_unscale_check(&misaligned, 1, &scale, 0, &found, NULL, 0, 1), LLMMEM_ERR_INVALID);
    llmmem_scaler_tensor_t huge = {buf, INT64_MAX, LLMMEM_SCALER_F64, 0};
    CHECK_STATUS(llmmem_scaler_unscale_check(&huge, 1, &scale, 0, &found, NULL, 0, 1), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_scaler_unscale_check(&good, 1, &scale, 0, &found, NULL, 0, -1), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_scaler_unscale_check_ref(two, 2, &scale, 0, &found, NULL, 0), LLMMEM_ERR_INVALID);
    CHECK(buf[0] == 1.0f && found == 0.0f);
    CHECK_OK(llmmem_scaler_unscale_check(NULL, 0, &scale, 0, &found, NULL, 0, 0)); /* an empty list is fine */
  }

  TEST("concurrent callers on separate lists get the reference result") {
    pthread_t th[4];
    worker_arg_t args[4];
    for (int i = 0; i < 4; i++) {
      args[i] = (worker_arg_t){1000u + (unsigned)i, 0};
      CHECK(pthread_create(&th[i], NULL, concurrent_worker, &args[i]) == 0);
    }
    for (int i = 0; i < 4; i++) {
      pthread_join(th[i], NULL);
      CHECK(args[i].ok);
    }
  }

  TEST("update: torch's rule (backoff on inf, growth after growth_interval finite steps, tracker reset)") {
    float scale = 65536.0f;
    int32_t growth = 0;
    int64_t stats[LLMMEM_SCALER_STAT_COUNT] = {0};
    float zero = 0.0f, one = 1.0f;
    const float *clean[1] = {&zero}, *dirty[2] = {&zero, &one};
    llmmem_scaler_config_t cfg = torch_cfg(3);
    CHECK_OK(llmmem_scaler_update(&scale, &growth, NULL, stats, clean, 1, &cfg));
    CHECK(scale == 65536.0f && growth == 1);
    CHECK_OK(llmmem_scaler_update(&scale, &growth, NULL, stats, clean, 1, &cfg));
    CHECK_OK(llmmem_scaler_update(&scale, &growth, NULL, stats, clean, 1, &cfg));
    CHECK(scale == 131072.0f && growth == 0);
    CHECK_OK(llmmem_scaler_update(&scale, &growth, NULL, stats, clean, 1, &cfg));
    CHECK_OK(llmmem_scaler_update(&scale, &growth, NULL, stats, dirty, 2, &cfg));
    CHECK(scale == 65536.0f && growth == 0);
    CHECK(stats[LLMMEM_SCALER_STAT_UPDATES] == 5 && stats[LLMMEM_SCALER_STAT_SKIPPED] == 1);
    CHECK(stats[LLMMEM_SCALER_STAT_LAST_SKIPPED] == 1 && stats[LLMMEM_SCALER_STAT_MIN_HITS] == 0);
    /* backoff is computed in double and rounded once: 3 * 0.1 as float */
    scale = 3.0f;
    cfg.backoff_factor = 0.1;
    CHECK_OK(llmmem_scaler_update(&scale, &growth, NULL, NULL, dirty, 2, &cfg));
    CHECK(scale == (float)(3.0 * 0.1));
  }

  TEST("update: never grows to inf; tracker past a lowered interval keeps counting, as torch") {
    float scale = 3.0e38f, zero = 0.0f;
    int32_t growth = 0;
    const float *clean[1] = {&zero};
    llmmem_scaler_config_t cfg = torch_cfg(1);
    CHECK_OK(llmmem_scaler_update(&scale, &growth, NULL, NULL, clean, 1, &cfg));
    CHECK(scale == 3.0e38f && growth == 0);
    growth = 5;
    cfg.growth_interval = 2;
    scale = 1.0f;
    CHECK_OK(llmmem_scaler_update(&scale, &growth, NULL, NULL, clean, 1, &cfg));
    CHECK(scale == 1.0f && growth == 6);
  }

  TEST("update: hysteresis backs off only after N consecutive overflows; a finite step refills it") {
    float scale = 1024.0f, zero = 0.0f, one = 1.0f;
    int32_t growth = 0, hyst = 3;
    const float *clean[1] = {&zero}, *dirty[1] = {&one};
    llmmem_scaler_config_t cfg = {2.0, 0.5, 1000, 3, 0.0f};
    CHECK_OK(llmmem_scaler_update(&scale, &growth, &hyst, NULL, dirty, 1, &cfg));
    CHECK_OK(llmmem_scaler_update(&scale, &growth, &hyst, NULL, dirty, 1, &cfg));
    CHECK(scale == 1024.0f && hyst == 1);
    CHECK_OK(llmmem_scaler_update(&scale, &growth, &hyst, NULL, clean, 1, &cfg));
    CHECK(hyst == 3 && growth == 1);
    for (int i = 0; i < 3; i++) CHECK_OK(llmmem_scaler_update(&scale, &growth, &hyst, NULL, dirty, 1, &cfg));
    CHECK(scale == 512.0f && hyst == 0 && growth == 0);
    CHECK_OK(llmmem_scaler_update(&scale, &growth, &hyst, NULL, dirty, 1, &cfg)); /* still exhausted */
    CHECK(scale == 256.0f && hyst == 0);
    CHECK_STATUS(llmmem_scaler_update(&scale, &growth, NULL, NULL, dirty, 1, &cfg), LLMMEM_ERR_INVALID);
  }

  TEST("update: hysteresis_on_growth refills the budget only when the scale grows (Megatron, DeepSpeed default)") {
    float scale = 1024.0f, zero = 0.0f, one = 1.0f;
    int32_t growth = 0, hyst = 2;
    const float *clean[1] = {&zero}, *dirty[1] = {&one};
    llmmem_scaler_config_t cfg = {2.0, 0.5, 3, 2, 0.0f, 1};
    CHECK_OK(llmmem_scaler_update(&scale, &growth, &hyst, NULL, dirty, 1, &cfg));
    CHECK_OK(llmmem_scaler_update(&scale, &growth, &hyst, NULL, clean, 1, &cfg));
    CHECK(scale == 1024.0f && hyst == 1 && growth == 1); /* the clean step did not refill */
    CHECK_OK(llmmem_scaler_update(&scale, &growth, &hyst, NULL, dirty, 1, &cfg));
    CHECK(scale == 512.0f && hyst == 0 && growth == 0); /* second overflow, not consecutive: back off */
    for (int i = 0; i < 3; i++) CHECK_OK(llmmem_scaler_update(&scale, &growth, &hyst, NULL, clean, 1, &cfg));
    CHECK(scale == 1024.0f && hyst == 2 && growth == 0); /* the growth refilled it */
    cfg.hysteresis_on_growth = 2;
    CHECK_STATUS(llmmem_scaler_update(&scale, &growth, &hyst, NULL, clean, 1, &cfg), LLMMEM_ERR_INVALID);
  }

  TEST("update: min_scale floors the backoff and counts the hits") {
    float scale = 4.0f, one = 1.0f;
    int32_t growth = 0;
    int64_t stats[LLMMEM_SCALER_STAT_COUNT] = {0};
    const float *dirty[1] = {&one};
    llmmem_scaler_config_t cfg = {2.0, 0.5, 1000, 1, 1.5f};
    CHECK_OK(llmmem_scaler_update(&scale, &growth, NULL, stats, dirty, 1, &cfg));
    CHECK(scale == 2.0f && stats[LLMMEM_SCALER_STAT_MIN_HITS] == 0);
    CHECK_OK(llmmem_scaler_update(&scale, &growth, NULL, stats, dirty, 1, &cfg));
    CHECK(scale == 1.5f && stats[LLMMEM_SCALER_STAT_MIN_HITS] == 1);
    CHECK_OK(llmmem_scaler_update(&scale, &growth, NULL, stats, dirty, 1, &cfg));
    CHECK(scale == 1.5f && stats[LLMMEM_SCALER_STAT_MIN_HITS] == 2);
  }

  TEST("update: bad configs and arguments are refused and leave the state alone") {
    float scale = 8.0f, zero = 0.0f;
    int32_t growth = 2;
    const float *clean[1] = {&zero};
    llmmem_scaler_config_t bad[] = {
        {1.0, 0.5, 10, 1, 0.0f}, {2.0, 1.0, 10, 1, 0.0f},  {2.0, 0.0, 10, 1, 0.0f}, {2.0, 0.5, 0, 1, 0.0f},
        {2.0, 0.5, 10, 0, 0.0f}, {2.0, 0.5, 10, 1, -1.0f}, {NAN, 0.5, 10, 1, 0.0f},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
      CHECK_STATUS(llmmem_scaler_update(&scale, &growth, NULL, NULL, clean, 1, &bad[i]), LLMMEM_ERR_INVALID);
    llmmem_scaler_config_t cfg = torch_cfg(10);
    CHECK_STATUS(llmmem_scaler_update(&scale, &growth, NULL, NULL, clean, 0, &cfg), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_scaler_update(NULL, &growth, NULL, NULL, clean, 1, &cfg), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_scaler_update(&scale, &growth, NULL, NULL, clean, 1, NULL), LLMMEM_ERR_INVALID);
    CHECK(scale == 8.0f && growth == 2);
  }

  TEST("randomised: 10000 updates follow an independent transcription of torch's rule") {
    float scale = 65536.0f, s2 = 65536.0f;
    int32_t growth = 0, g2 = 0;
    llmmem_scaler_config_t cfg = {2.0, 0.5, 7, 1, 0.0f};
    int ok = 1;
    for (int i = 0; i < 10000 && ok; i++) {
      float f = (th_rand(&rng) % 5 == 0) ? 1.0f : 0.0f;
      const float *fl[1] = {&f};
      ok = llmmem_scaler_update(&scale, &growth, NULL, NULL, fl, 1, &cfg) == LLMMEM_OK;
      if (f) {
        s2 = (float)(s2 * 0.5);
        g2 = 0;
      } else if (++g2 == 7) {
        float n = (float)(s2 * 2.0);
        if (isfinite(n)) s2 = n;
        g2 = 0;
      }
      ok = ok && scale == s2 && growth == g2;
    }
    CHECK(ok);
  }

  TEST("pipe: a list published in batches while workers run equals the reference (dtypes, slices, inf/NaN)") {
    /* 1500 small tensors (1 KiB..36 KiB, as biases and norms) around three large ones that are
     * claimed in 1 MiB slices; specials in small ones and in a late slice of a large one. */
    enum { N = 1503 };
    static int64_t numels[N];
    static int32_t dtypes[N];
    int ok = 1;
    for (int round = 0; round < 6 && ok; round++) {
      for (size_t i = 0; i < N; i++) {
        numels[i] = (int64_t)(th_rand(&rng) % 9000);
        dtypes[i] = (int32_t)(th_rand(&rng) % LLMMEM_SCALER_DTYPE_COUNT_);
      }
      numels[10] = 3000003;
      numels[700] = 1 << 20;
      numels[1502] = 777777;
      list_t l = make_list(N, numels, dtypes, &rng);
      const double specials[3] = {INFINITY, -INFINITY, NAN};
      for (int k = 0; k < 5; k++) {
        size_t i = round == 0 ? 0 : th_rand(&rng) % N;
        if (!numels[i]) continue;
        int64_t at = (int64_t)(th_rand(&rng) % (uint64_t)numels[i]);
        put(l.t[i].data, dtypes[i], at, specials[k % 3]);
        put(l.copy[i], dtypes[i], at, specials[k % 3]);
      }
      put(l.t[10].data, dtypes[10], 2900000, NAN); /* the third slice or later, whatever the dtype */
      put(l.copy[10], dtypes[10], 2900000, NAN);
      float scale = 4096.0f;
      ok = pipe_matches_ref(&l, &scale, round % 4, N, &rng);
      free_list(&l);
    }
    CHECK(ok);
  }

  TEST("pipe: a caller that stops early gets the published tensors done and the rest untouched") {
    int64_t numels[400];
    int32_t dtypes[400];
    for (size_t i = 0; i < 400; i++) {
      numels[i] = 4000 + (int64_t)i;
      dtypes[i] = (int32_t)(i % 4);
    }
    list_t l = make_list(400, numels, dtypes, &rng);
    put(l.t[350].data, dtypes[350], 5, INFINITY); /* never published: must not be seen */
    put(l.copy[350], dtypes[350], 5, INFINITY);
    float scale = 2.0f;
    CHECK(pipe_matches_ref(&l, &scale, 1, 217, &rng));
    free_list(&l);
  }

  TEST("pipe: check only (no scale) writes nothing; nothing published is a no-op") {
    int64_t numels[300];
    int32_t dtypes[300];
    for (size_t i = 0; i < 300; i++) {
      numels[i] = 3000;
      dtypes[i] = LLMMEM_SCALER_F32;
    }
    list_t l = make_list(300, numels, dtypes, &rng);
    put(l.t[299].data, 0, 2999, NAN);
    put(l.copy[299], 0, 2999, NAN);
    CHECK(pipe_matches_ref(&l, NULL, 2, 300, &rng));
    float found = 0.0f;
    llmmem_scaler_pipe_t *pipe = NULL;
    CHECK_OK(llmmem_scaler_pipe_start(l.t, 300, NULL, 0, NULL, 0, 3, &pipe));
    CHECK_OK(llmmem_scaler_pipe_finish(pipe, &found));
    CHECK(found == 0.0f);
    free_list(&l);
  }

  TEST("pipe: misuse is refused; the work already published still completes") {
    int64_t numels[4] = {100, 200, 300, 400};
    int32_t dtypes[4] = {0, 0, 0, 0};
    list_t l = make_list(4, numels, dtypes, &rng);
    float scale = 2.0f, found = 0.0f;
    llmmem_scaler_pipe_t *pipe = NULL;
    CHECK_STATUS(llmmem_scaler_pipe_start(l.t, 4, &scale, 0, NULL, 0, -1, &pipe), LLMMEM_ERR_INVALID);
    CHECK(pipe == NULL);
    CHECK_STATUS(llmmem_scaler_pipe_start(l.t, 4, &scale, 0, NULL, 0, 1, NULL), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_scaler_pipe_start(NULL, 4, &scale, 0, NULL, 0, 1, &pipe), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_scaler_pipe_publish(NULL, 1, NULL), LLMMEM_ERR_INVALID);
    CHECK_STATUS(llmmem_scaler_pipe_finish(NULL, &found), LLMMEM_ERR_INVALID);
    uint8_t flags[2] = {0, 0};
    CHECK_OK(llmmem_scaler_pipe_start(l.t, 4, &scale, 0, flags, 2, 1, &pipe));
    CHECK_OK(llmmem_scaler_pipe_publish(pipe, 2, NULL));                         /* flags 0, 1: fine */
    CHECK_STATUS(llmmem_scaler_pipe_publish(pipe, 1, NULL), LLMMEM_ERR_INVALID); /* going back */
    CHECK_STATUS(llmmem_scaler_pipe_publish(pipe, 5, NULL), LLMMEM_ERR_INVALID); /* past capacity */
    CHECK_STATUS(llmmem_scaler_pipe_publish(pipe, 3, NULL), LLMMEM_ERR_INVALID); /* flag 2 >= n_flags 2 */
    CHECK(strstr(llmmem_last_error(), "flag") != NULL);
    l.t[2].flag = 0;
    l.t[3].dtype = 9;
    CHECK_STATUS(llmmem_scaler_pipe_publish(pipe, 4, NULL), LLMMEM_ERR_INVALID); /* bad dtype: none of 2..3 */
    CHECK_STATUS(llmmem_scaler_pipe_finish(pipe, NULL), LLMMEM_ERR_INVALID);     /* frees it all the same */
    l.t[3].dtype = 0;
    /* tensors 0 and 1 were unscaled (x 0.5); 2 and 3 never published */
    int ok = 1;
    for (int i = 0; i < 4; i++) {
      const float *got = l.t[i].data, *orig = l.copy[i];
      for (int64_t k = 0; k < numels[i]; k++) ok = ok && got[k] == (i < 2 ? orig[k] * 0.5f : orig[k]);
    }
    CHECK(ok);
    free_list(&l);
  }

  TEST("a tensor listed twice is processed twice, in order, whatever the thread count (torch's CPU result)") {
    /* 17 MiB in all, so that four threads would be used; tensor 5 is tensor 1 again */
    int64_t numels[8] = {1000000, 1250001, 7, 1000000, 1, 0, 4097, 1000003};
    int32_t dtypes[8] = {0, 0, 2, 3, 1, 0, 0, 0};
    unsigned long long seed = rng;
    int ok = 1;
    for (int threads = 1; threads <= 4 && ok; threads++) {
      rng = seed;
      list_t l = make_list(8, numels, dtypes, &rng);
      void *own5 = l.t[5].data, *own5c = l.copy[5];
      l.t[5] = l.t[1];
      l.t[5].flag = 5;
      l.copy[5] = l.copy[1];
      float scale = 4.0f;
      ok = fast_matches_ref(&l, &scale, threads);
      l.copy[5] = own5c;
      l.t[5].data = own5;
      free_list(&l);
    }
    CHECK(ok);
  }

  TEST("pipe: a data pointer published again is refused with everything after it; the caller hands over") {
    int64_t numels[6] = {1000, 2000, 3000, 4000, 5000, 6000};
    int32_t dtypes[6] = {0, 0, 0, 0, 0, 0};
    list_t l = make_list(6, numels, dtypes, &rng);
    void *own = l.t[4].data;
    l.t[4].data = l.t[2].data;
    l.t[4].numel = l.t[2].numel;
    float scale = 2.0f, found = 0.0f;
    llmmem_scaler_pipe_t *pipe = NULL;
    size_t published = 99;
    CHECK_OK(llmmem_scaler_pipe_start(l.t, 6, &scale, 0, NULL, 0, 1, &pipe));
    CHECK_OK(llmmem_scaler_pipe_publish(pipe, 3, &published));
    CHECK(published == 3);
    CHECK_OK(llmmem_scaler_pipe_publish(pipe, 6, &published));
    CHECK(published == 4); /* tensor 4 repeats tensor 2: it and tensor 5 stay out */
    CHECK_OK(llmmem_scaler_pipe_finish(pipe, &found));
    int ok = 1;
    for (int i = 0; i < 6; i++) {
      const float *got = i == 4 ? own : l.t[i].data, *orig = l.copy[i];
      for (int64_t k = 0; k < numels[i]; k++) ok = ok && got[k] == (i < 4 ? orig[k] * 0.5f : orig[k]);
    }
    CHECK(ok);
    l.t[4].data = own;
    l.t[4].numel = numels[4];
    free_list(&l);
  }

  TEST("a CPU-only build's CUDA entry points say so") {
    float found = 0.0f;
    llmmem_status_t st = llmmem_scaler_unscale_check_cuda(NULL, 0, NULL, 0, &found, NULL, 0, 0, NULL);
    CHECK(st == LLMMEM_ERR_NOT_BUILT || st == LLMMEM_OK);
    CHECK(strstr(llmmem_last_error(), "without CUDA") != NULL || st == LLMMEM_OK);
  }

  return TEST_SUMMARY();
}
