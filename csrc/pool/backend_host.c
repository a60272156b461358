/*
 * backend_host.c — the host backend: ordinary memory (pinned = 0), or page-locked memory from the
 * CUDA runtime (pinned = 1, in backend_cuda.cu; stub without CUDA).
 *
 * Ordinary memory: each region is the start of a large virtual address reservation (mmap
 * PROT_NONE, MAP_NORESERVE: address space only, no memory committed), of which the first bytes are
 * made readable and writable. Growing the region in place (resize) opens more of the reservation;
 * shrinking drops the tail's pages and closes it again. This is the host counterpart of CUDA's
 * cuMemAddressReserve + cuMemMap (PyTorch's expandable segments): the pool can grow one contiguous
 * region instead of adding separate ones whose free ends can never merge.
 *
 * Host memory is not stream-ordered from the pool's point of view, so this backend has no
 * events: a freed block is reusable at once.
 */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, MAP_NORESERVE */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "pool_internal.h"

/* bytes of address space reserved behind a region: a region of at most this size can grow in
 * place up to it (beyond, the pool adds a region). PROT_NONE MAP_NORESERVE pages are address
 * space only, not committed memory; 64 GiB each leaves room for 2000 regions in x86-64 Linux's
 * 128 TiB, and a pool that can resize rarely holds more than a few. A region asked bigger than
 * this is mapped exactly and never resized. */
#define HOST_VA_RESERVE ((size_t)64 << 30)

static size_t page_size(void) {
  long p = sysconf(_SC_PAGESIZE);
  return p > 0 ? (size_t)p : 4096;
}

/* The span reserved behind a region that currently has `bytes`: the fixed reservation for
 * resizable regions, the (page-rounded) region itself for oversized ones. resize keeps a region
 * on the side of HOST_VA_RESERVE it started on, so this is the same at release as at reserve. */
static size_t va_span(size_t bytes) {
  return bytes <= HOST_VA_RESERVE ? HOST_VA_RESERVE : _llmmem_round_up(bytes, page_size());
}

/* Pages inside a resizable region (page-aligned: the pool works in 2 MiB steps from the region's
 * page-aligned base). Decommit maps fresh PROT_NONE pages over the range, which drops its memory
 * and makes any stray access fault instead of reading stale data. */
static llmmem_status_t host_decommit(void *ctx, void *ptr, size_t bytes) {
  (void)ctx;
  if (mmap(ptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED)
    return LLMMEM_FAIL(LLMMEM_ERR_INTERNAL, "host: decommitting %zu bytes failed: %s", bytes, strerror(errno));
  return LLMMEM_OK;
}

static llmmem_status_t host_commit(void *ctx, void *ptr, size_t bytes) {
  (void)ctx;
  if (mprotect(ptr, bytes, PROT_READ | PROT_WRITE) != 0)
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "host: committing %zu bytes failed: %s", bytes, strerror(errno));
  return LLMMEM_OK;
}

static llmmem_status_t host_reserve(void *ctx, size_t bytes, void **out) {
  size_t span = va_span(bytes);
  void *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "host: reserving %zu bytes of address space failed: %s", span,
                       strerror(errno));
  llmmem_status_t st = host_commit(ctx, p, _llmmem_round_up(bytes, page_size()));
  if (st != LLMMEM_OK) {
    munmap(p, span);
    return st;
  }
  *out = p;
  return LLMMEM_OK;
}

static void host_release(void *ctx, void *ptr, size_t bytes) {
  (void)ctx;
  munmap(ptr, va_span(bytes));
}

static llmmem_status_t host_resize(void *ctx, void *ptr, size_t old_bytes, size_t new_bytes) {
  if (old_bytes > HOST_VA_RESERVE || new_bytes > HOST_VA_RESERVE)
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "host: region of %zu bytes cannot grow to %zu bytes in place", old_bytes,
                       new_bytes);
  size_t ps = page_size(), old_end = _llmmem_round_up(old_bytes, ps), new_end = _llmmem_round_up(new_bytes, ps);
  char *base = ptr;
  if (new_end > old_end) return host_commit(ctx, base + old_end, new_end - old_end);
  /* Decommitting the tail gives its memory back to the system and keeps the address space
   * reserved for a later growth. */
  if (new_end < old_end) return host_decommit(ctx, base + new_end, old_end - new_end);
  return LLMMEM_OK;
}

/* backend_cuda.cu (or backend_cuda_stub.c): fills a pinned-host backend. */
llmmem_status_t _llmmem_pool_backend_pinned(llmmem_pool_backend_t *out);

LLMMEM_API llmmem_status_t llmmem_pool_backend_host(int pinned, llmmem_pool_backend_t *out) {
  LLMMEM_CHECK_ARG(out != NULL, "llmmem_pool_backend_host: out must not be NULL");
  LLMMEM_CHECK_ARG(pinned == 0 || pinned == 1, "llmmem_pool_backend_host: pinned must be 0 or 1, got %d", pinned);
  llmmem_pool_backend_t b = {0};
  if (pinned) return _llmmem_pool_backend_pinned(out);
  b.name = "host";
  b.device = -1;
  b.reserve = host_reserve;
  b.release = host_release;
  b.resize = host_resize;
  b.decommit = host_decommit;
  b.commit = host_commit;
  *out = b;
  return LLMMEM_OK;
}
