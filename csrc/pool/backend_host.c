/*
 * backend_host.c — the host backend: ordinary memory from the C library (pinned = 0), or
 * page-locked memory from the CUDA runtime (pinned = 1, in backend_cuda.cu; stub without CUDA).
 *
 * Host memory is not stream-ordered from the pool's point of view, so this backend has no
 * events: a freed block is reusable at once.
 */
#define _POSIX_C_SOURCE 200809L /* posix_memalign */
#include <stdlib.h>

#include "pool_internal.h"

/* Regions are aligned to a page so that tensors carved from them are as aligned as malloc's big
 * allocations (and page-locking, when asked for, covers whole pages). */
#define HOST_ALIGNMENT ((size_t)4096)

static llmmem_status_t host_reserve(void *ctx, size_t bytes, void **out) {
  (void)ctx;
  void *p = NULL;
  if (posix_memalign(&p, HOST_ALIGNMENT, bytes) != 0 || !p)
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "host: posix_memalign of %zu bytes failed", bytes);
  *out = p;
  return LLMMEM_OK;
}

static void host_release(void *ctx, void *ptr, size_t bytes) {
  (void)ctx;
  (void)bytes;
  free(ptr);
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
  *out = b;
  return LLMMEM_OK;
}
