/*
 * backend_host.c — the host backend: ordinary memory (pinned = 0), or page-locked memory from the
 * CUDA runtime (pinned = 1, in backend_cuda.cu; stub without CUDA).
 *
 * Ordinary memory: each region is the start of a virtual address reservation (mmap PROT_NONE:
 * address space only), of which the first bytes are made readable and writable. Growing the
 * region in place (resize) opens more of the reservation; shrinking drops the tail's pages and
 * closes it again. This is the host counterpart of CUDA's cuMemAddressReserve + cuMemMap
 * (PyTorch's expandable segments): the pool can grow one contiguous region instead of adding
 * separate ones whose free ends can never merge.
 *
 * Memory the pool counts as reserved exists: before bytes are opened the backend checks that the
 * system can give them (host_limits.c: MemAvailable + SwapFree, the cgroup's memory limit,
 * RLIMIT_DATA), then populates them (MADV_POPULATE_WRITE), as cudaMalloc backs what it returns.
 * What cannot be backed is refused with LLMMEM_ERR_NOMEM naming the bytes asked for and available,
 * where mapping it unbacked would let the process be killed by the kernel's OOM killer on first
 * touch. Populated pages show in the process's RSS from then on.
 *
 * Address space: a reservation is at most what its region can ever hold (the pool's max_size,
 * the memory of the machine or cgroup, and 64 GiB), and reservations stop while the process maps
 * more than half of its address-space limit (RLIMIT_AS, or x86-64's 128 TiB of user space): then,
 * or when mmap refuses the reservation, a region is mapped exactly and the pool grows by new
 * segments. So pools work under `ulimit -v` and a process can hold any number of them.
 *
 * Host memory is not stream-ordered from the pool's point of view, so this backend has no
 * events: a freed block is reusable at once.
 */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, madvise */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "pool_internal.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux >= 5.14; older kernels answer EINVAL and pages are touched instead */
#endif

/* bytes: the most address space reserved behind one region (a region can grow in place up to it;
 * beyond, the pool adds a region). */
#define HOST_VA_RESERVE ((size_t)64 << 30)

typedef struct host_region_s {
  uintptr_t base;
  size_t span; /* bytes of address space mapped at base (the region can grow up to it) */
  struct host_region_s *next;
} host_region_t;

typedef struct host_ctx_s {
  size_t max_size; /* the pool's cap (0: none): no reservation needs to be larger */
  int fixed;       /* the pool never resizes: reserve nothing beyond a region */
  host_region_t *regions;
} host_ctx_t;

static size_t page_size(void) {
  long p = sysconf(_SC_PAGESIZE);
  return p > 0 ? (size_t)p : 4096;
}

static double gib(size_t bytes) { return (double)bytes / (double)((size_t)1 << 30); }

static host_region_t *find_region(host_ctx_t *ctx, uintptr_t base) {
  for (host_region_t *r = ctx->regions; r; r = r->next)
    if (r->base == base) return r;
  return NULL;
}

/* Writes to every page (the fallback for kernels without MADV_POPULATE_WRITE): fresh anonymous
 * pages are zero, so writing zero changes nothing but makes the kernel back them. */
static void touch_pages(void *ptr, size_t bytes) {
  volatile char *p = ptr;
  for (size_t off = 0, ps = page_size(); off < bytes; off += ps) p[off] = 0;
}

int _llmmem_pool_host_populate = 1;

static int populate(void *ptr, size_t bytes) {
  if (!_llmmem_pool_host_populate) return 0;
  for (int tries = 0; tries < 4; tries++) {
    if (madvise(ptr, bytes, MADV_POPULATE_WRITE) == 0) return 0;
    if (errno == EINVAL) {
      touch_pages(ptr, bytes);
      return 0;
    }
    if (errno != EINTR && errno != EAGAIN) return -1;
  }
  return -1;
}

/* Maps fresh PROT_NONE pages over the range: its memory goes back to the system and any stray
 * access faults instead of reading stale data. */
static llmmem_status_t host_decommit(void *ctx, void *ptr, size_t bytes) {
  (void)ctx;
  if (mmap(ptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED)
    return LLMMEM_FAIL(LLMMEM_ERR_INTERNAL, "host: decommitting %zu bytes failed: %s", bytes, strerror(errno));
  return LLMMEM_OK;
}

/* LLMMEM_ERR_NOMEM, with both figures, when the system cannot back `bytes` more. */
static llmmem_status_t check_available(const pool_host_limits_t *lim, size_t bytes) {
  if (bytes <= lim->available) return LLMMEM_OK;
  return LLMMEM_FAIL(LLMMEM_ERR_NOMEM,
                     "host: %zu bytes (%.2f GiB) requested, %zu bytes (%.2f GiB) available (%s): the system cannot "
                     "back more",
                     bytes, gib(bytes), lim->available, gib(lim->available), lim->bound);
}

/* Opens [ptr, ptr + bytes) inside a reservation, if `lim` says the system can back it: read and
 * write, then populated. All or nothing. */
static llmmem_status_t commit_checked(const pool_host_limits_t *lim, void *ptr, size_t bytes) {
  LLMMEM_TRY(check_available(lim, bytes));
  if (mprotect(ptr, bytes, PROT_READ | PROT_WRITE) != 0)
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "host: the kernel refused to commit %zu bytes (%.2f GiB): %s", bytes,
                       gib(bytes), strerror(errno));
  if (populate(ptr, bytes) != 0) {
    const int err = errno;
    (void)host_decommit(NULL, ptr, bytes);
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "host: the kernel could not back %zu bytes (%.2f GiB): %s", bytes, gib(bytes),
                       strerror(err));
  }
  return LLMMEM_OK;
}

static llmmem_status_t host_commit(void *ctx, void *ptr, size_t bytes) {
  (void)ctx;
  pool_host_limits_t lim;
  _llmmem_pool_host_probe(&lim);
  return commit_checked(&lim, ptr, bytes);
}

/* The address space to reserve for a new region of `want` bytes (page-rounded): room to grow up
 * to what the region could ever hold, while the process stays below half its address-space limit. */
static size_t reservation(const host_ctx_t *ctx, const pool_host_limits_t *lim, size_t want, size_t ps) {
  if (ctx->fixed) return want;
  size_t cap = HOST_VA_RESERVE;
  if (ctx->max_size && ctx->max_size < cap) cap = ctx->max_size;
  if (lim->total < cap) cap = lim->total;
  cap = cap / ps * ps;
  if (cap <= want) return want;
  const size_t half = lim->va_limit / 2, room = half > lim->va_used ? (half - lim->va_used) / ps * ps : 0;
  return want + (cap - want < room ? cap - want : room);
}

static llmmem_status_t host_reserve(void *vctx, size_t bytes, void **out) {
  host_ctx_t *ctx = vctx;
  const size_t ps = page_size();
  if (bytes > SIZE_MAX - ps)
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "host: %zu bytes is more than any address space", bytes);
  const size_t want = _llmmem_round_up(bytes, ps);
  pool_host_limits_t lim;
  _llmmem_pool_host_probe(&lim);
  LLMMEM_TRY(check_available(&lim, want)); /* before any mapping */
  host_region_t *r = malloc(sizeof *r);
  if (!r) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "host: no memory for region metadata");
  size_t span = reservation(ctx, &lim, want, ps);
  void *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED && span > want) { /* refused (RLIMIT_AS, or the address space is full): exactly */
    span = want;
    p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  if (p == MAP_FAILED) {
    const int err = errno;
    free(r);
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "host: mapping %zu bytes (%.2f GiB) failed: %s (address space limit?)", want,
                       gib(want), strerror(err));
  }
  llmmem_status_t st = commit_checked(&lim, p, want);
  if (st != LLMMEM_OK) {
    munmap(p, span);
    free(r);
    return st;
  }
  r->base = (uintptr_t)p;
  r->span = span;
  r->next = ctx->regions;
  ctx->regions = r;
  *out = p;
  return LLMMEM_OK;
}

static void host_release(void *vctx, void *ptr, size_t bytes) {
  host_ctx_t *ctx = vctx;
  for (host_region_t **link = &ctx->regions; *link; link = &(*link)->next) {
    host_region_t *r = *link;
    if (r->base != (uintptr_t)ptr) continue;
    munmap(ptr, r->span);
    *link = r->next;
    free(r);
    return;
  }
  munmap(ptr, _llmmem_round_up(bytes, page_size())); /* not ours: cannot happen, but never leak a mapping */
}

static llmmem_status_t host_resize(void *vctx, void *ptr, size_t old_bytes, size_t new_bytes) {
  host_ctx_t *ctx = vctx;
  host_region_t *r = find_region(ctx, (uintptr_t)ptr);
  const size_t ps = page_size();
  if (!r) return LLMMEM_FAIL(LLMMEM_ERR_INTERNAL, "host: resize of %p, which is not a region of this pool", ptr);
  if (new_bytes > r->span || old_bytes > r->span)
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "host: region of %zu bytes cannot grow to %zu bytes in place (%zu reserved)",
                       old_bytes, new_bytes, r->span);
  size_t old_end = _llmmem_round_up(old_bytes, ps), new_end = _llmmem_round_up(new_bytes, ps);
  char *base = ptr;
  if (new_end > old_end) return host_commit(ctx, base + old_end, new_end - old_end);
  /* Decommitting the tail gives its memory back and keeps the address space for a later growth. */
  if (new_end < old_end) return host_decommit(ctx, base + new_end, old_end - new_end);
  return LLMMEM_OK;
}

static void host_configure(void *vctx, const llmmem_pool_options_t *options) {
  host_ctx_t *ctx = vctx;
  ctx->max_size = options->max_size;
  ctx->fixed = options->fixed_segments;
}

static void host_destroy(void *ctx) { free(ctx); } /* the pool released every region before */

/* backend_cuda.cu (or backend_cuda_stub.c): fills a pinned-host backend. */
llmmem_status_t _llmmem_pool_backend_pinned(llmmem_pool_backend_t *out);

LLMMEM_API llmmem_status_t llmmem_pool_backend_host(int pinned, llmmem_pool_backend_t *out) {
  LLMMEM_CHECK_ARG(out != NULL, "llmmem_pool_backend_host: out must not be NULL");
  LLMMEM_CHECK_ARG(pinned == 0 || pinned == 1, "llmmem_pool_backend_host: pinned must be 0 or 1, got %d", pinned);
  if (pinned) return _llmmem_pool_backend_pinned(out);
  host_ctx_t *ctx = calloc(1, sizeof *ctx);
  if (!ctx) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_pool_backend_host: no memory for the backend");
  llmmem_pool_backend_t b = {0};
  b.name = "host";
  b.device = -1;
  b.ctx = ctx;
  b.reserve = host_reserve;
  b.release = host_release;
  b.resize = host_resize;
  b.decommit = host_decommit;
  b.commit = host_commit;
  b.configure = host_configure;
  b.destroy = host_destroy;
  *out = b;
  return LLMMEM_OK;
}
