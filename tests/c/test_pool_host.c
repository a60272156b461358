/*
 * test_pool_host.c — the host backend's promises, over a stand-in for what the system can give
 * (pool_host_limits_t): a pool refuses memory the system cannot back (naming both figures) and
 * keeps its statistics unchanged when it does; what it reserves is populated (resident before
 * anyone touches it) and given back when decommitted; address space is reserved no larger than a
 * region can hold, not at all past half the address-space limit, so any number of pools fit.
 */
#define _DEFAULT_SOURCE /* mincore */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <llmmem/pool.h>

#include "../../csrc/pool/pool_internal.h"
#include "testhelper.h"

#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

static pool_host_limits_t fake; /* what the stand-in probe reports */

static void fake_probe(pool_host_limits_t *out) { *out = fake; }

/* The real figures, with `available` and `total` replaced. */
static void use_fake(size_t available, size_t total) {
  _llmmem_pool_host_limits(&fake);
  fake.available = available;
  fake.total = total;
  fake.bound = "the test's limit";
  _llmmem_pool_host_probe = fake_probe;
}

static llmmem_pool_t *pool_with(size_t initial, size_t max, int fixed) {
  llmmem_pool_backend_t b;
  llmmem_pool_options_t o = {initial, max, 0, fixed};
  llmmem_pool_t *p = NULL;
  if (llmmem_pool_backend_host(0, &b) != LLMMEM_OK || llmmem_pool_create(&b, &o, &p) != LLMMEM_OK) return NULL;
  return p;
}

/* Bytes of address space this process maps (VmSize). */
static size_t mapped(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  unsigned long long pages = 0;
  if (f) {
    if (fscanf(f, "%llu", &pages) != 1) pages = 0;
    fclose(f);
  }
  return (size_t)pages * (size_t)sysconf(_SC_PAGESIZE);
}

/* Pages of [p, p + bytes) that are resident. */
static size_t resident_pages(void *p, size_t bytes) {
  const size_t ps = (size_t)sysconf(_SC_PAGESIZE), n = (bytes + ps - 1) / ps;
  unsigned char *vec = calloc(n, 1);
  size_t count = 0;
  if (vec && mincore(p, bytes, vec) == 0)
    for (size_t i = 0; i < n; i++) count += vec[i] & 1;
  free(vec);
  return count;
}

static int64_t reserved(llmmem_pool_t *p) {
  llmmem_pool_stats_t s;
  if (llmmem_pool_stats(p, &s) != LLMMEM_OK) return -1;
  return s.reserved_bytes.current;
}

int main(void) {
  TEST("memory the system cannot back is refused with both figures; the statistics stay as they were") {
    use_fake(64 * MiB, 16 * GiB);
    llmmem_pool_t *p = NULL;
    llmmem_pool_backend_t b;
    llmmem_pool_options_t o = {100 * MiB, 0, 0, 0};
    CHECK_OK(llmmem_pool_backend_host(0, &b));
    CHECK_STATUS(llmmem_pool_create(&b, &o, &p), LLMMEM_ERR_NOMEM);
    CHECK(strstr(llmmem_last_error(), "104857600 bytes (0.10 GiB) requested, 67108864 bytes (0.06 GiB) available") !=
          NULL);
    CHECK(strstr(llmmem_last_error(), "the test's limit") != NULL);
    p = pool_with(0, 0, 0);
    CHECK(p != NULL);
    void *a = NULL, *c = NULL;
    CHECK_OK(llmmem_pool_alloc(p, 32 * MiB, NULL, &a));
    CHECK(reserved(p) == (int64_t)(32 * MiB));
    fake.available = 16 * MiB; /* someone else took memory meanwhile */
    CHECK_STATUS(llmmem_pool_alloc(p, 32 * MiB, NULL, &c), LLMMEM_ERR_NOMEM);
    CHECK(strstr(llmmem_last_error(), "requested") && strstr(llmmem_last_error(), "16777216 bytes"));
    CHECK(reserved(p) == (int64_t)(32 * MiB) && c == NULL);
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.num_ooms >= 1 && s.allocations.current == 1);
    fake.available = 64 * MiB;
    CHECK_OK(llmmem_pool_alloc(p, 32 * MiB, NULL, &c)); /* and it works again once there is memory */
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_free(p, c, NULL));
    CHECK_OK(llmmem_pool_destroy(p));
    _llmmem_pool_host_probe = _llmmem_pool_host_limits;
  }

  TEST("a 'reserved' byte is a resident byte: populated when committed, given back when decommitted") {
    llmmem_pool_t *p = pool_with(8 * MiB, 0, 0);
    CHECK(p != NULL);
    void *a = NULL;
    CHECK_OK(llmmem_pool_alloc(p, 8 * MiB, NULL, &a));
    const size_t ps = (size_t)sysconf(_SC_PAGESIZE);
    CHECK(resident_pages(a, 8 * MiB) == 8 * MiB / ps); /* nobody touched it yet */
    void *g = NULL;
    CHECK_OK(llmmem_pool_alloc(p, 6 * MiB, NULL, &g)); /* grows the region in place */
    CHECK(resident_pages(g, 6 * MiB) == 6 * MiB / ps);
    CHECK_OK(llmmem_pool_free(p, g, NULL));
    size_t released = 0;
    CHECK_OK(llmmem_pool_empty_cache(p, &released));
    CHECK(released == 6 * MiB && reserved(p) == (int64_t)(8 * MiB));
    CHECK(resident_pages(g, 6 * MiB) == 0); /* the shrunk tail's memory went back */
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("address space: max_size bounds a reservation, fixed segments reserve nothing more") {
    size_t before = mapped();
    llmmem_pool_t *p = pool_with(2 * MiB, 64 * MiB, 0);
    CHECK(p != NULL);
    size_t grew = mapped() - before;
    CHECK(grew >= 64 * MiB && grew < 96 * MiB); /* not 64 GiB */
    void *a = NULL;
    CHECK_OK(llmmem_pool_alloc(p, 60 * MiB, NULL, &a)); /* grows in place inside it */
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.segments.current == 1);
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_destroy(p));
    before = mapped();
    p = pool_with(2 * MiB, 0, 1);
    grew = mapped() - before;
    CHECK(p && grew >= 2 * MiB && grew < 32 * MiB);
    CHECK_OK(llmmem_pool_destroy(p));
  }

  TEST("address space: no larger than the memory there is; none beyond half the limit, then exact") {
    use_fake(SIZE_MAX, 256 * MiB);
    size_t before = mapped();
    llmmem_pool_t *p = pool_with(2 * MiB, 0, 0);
    size_t grew = mapped() - before;
    CHECK(p && grew >= 256 * MiB && grew < 288 * MiB);
    CHECK_OK(llmmem_pool_destroy(p));
    fake.va_limit = 2 * mapped(); /* the process is at half its limit: no room to reserve */
    before = mapped();
    p = pool_with(2 * MiB, 0, 0);
    grew = mapped() - before;
    CHECK(p && grew >= 2 * MiB && grew < 32 * MiB);
    void *a = NULL, *c = NULL;
    CHECK_OK(llmmem_pool_alloc(p, 2 * MiB, NULL, &a));
    CHECK_OK(llmmem_pool_alloc(p, 4 * MiB, NULL, &c)); /* cannot grow in place: a second segment */
    llmmem_pool_stats_t s;
    CHECK_OK(llmmem_pool_stats(p, &s));
    CHECK(s.segments.current == 2);
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_free(p, a, NULL));
    CHECK_OK(llmmem_pool_free(p, c, NULL));
    CHECK_OK(llmmem_pool_destroy(p));
    _llmmem_pool_host_probe = _llmmem_pool_host_limits;
  }

  TEST("many pools: reservations stop at half the address space, every pool still works") {
    enum { N = 3000 };
    static llmmem_pool_t *pools[N];
    use_fake(SIZE_MAX, GiB);
    fake.va_limit = 2 * (mapped() + 512 * (size_t)GiB); /* room for about 512 reservations of 1 GiB */
    int made = 0, ok = 1;
    for (int i = 0; i < N; i++) {
      fake.va_used = mapped();
      pools[i] = pool_with(4096, 0, 0);
      if (!pools[i]) break;
      made++;
    }
    CHECK(made == N);
    CHECK(mapped() < fake.va_limit / 2 + 64 * MiB);
    for (int i = 0; i < made; i++) {
      void *a = NULL;
      ok &= llmmem_pool_alloc(pools[i], 100, NULL, &a) == LLMMEM_OK;
      if (a) memset(a, 1, 100);
      ok &= llmmem_pool_free(pools[i], a, NULL) == LLMMEM_OK;
      ok &= llmmem_pool_destroy(pools[i]) == LLMMEM_OK;
    }
    CHECK(ok);
    _llmmem_pool_host_probe = _llmmem_pool_host_limits;
  }

  TEST("the real limits of this machine are sane") {
    pool_host_limits_t l;
    _llmmem_pool_host_limits(&l);
    CHECK(l.available > 0 && l.total > 0 && l.bound != NULL);
    CHECK(l.va_limit >= l.va_used || l.va_limit < ((size_t)1 << 47));
    llmmem_pool_t *p = NULL;
    llmmem_pool_backend_t b;
    llmmem_pool_options_t o = {l.total > SIZE_MAX / 4 ? SIZE_MAX / 4 : 2 * l.total, 0, 0, 0};
    CHECK_OK(llmmem_pool_backend_host(0, &b));
    CHECK_STATUS(llmmem_pool_create(&b, &o, &p), LLMMEM_ERR_NOMEM); /* twice the machine: never */
  }

  TEST("llmmem_pool_host_memory reports what the backend checks; NULL out-parameters are skipped") {
    fake.available = 12345 * 4096;
    fake.total = 99999 * 4096;
    fake.bound = "RLIMIT_DATA";
    _llmmem_pool_host_probe = fake_probe;
    size_t available = 0, total = 0;
    const char *bound = NULL;
    CHECK_OK(llmmem_pool_host_memory(&available, &total, &bound));
    CHECK(available == fake.available && total == fake.total && strcmp(bound, "RLIMIT_DATA") == 0);
    CHECK_OK(llmmem_pool_host_memory(NULL, NULL, NULL));
    _llmmem_pool_host_probe = _llmmem_pool_host_limits;
    pool_host_limits_t l;
    _llmmem_pool_host_limits(&l);
    CHECK_OK(llmmem_pool_host_memory(NULL, &total, &bound));
    CHECK(total == l.total && bound != NULL);
  }

  return TEST_SUMMARY();
}
