/*
 * backend_cuda.cu — the CUDA backends of the pool: device memory (cudaMalloc/cudaFree, with
 * cudaEvents for stream-ordered reuse) and page-locked host memory (cudaHostAlloc).
 *
 * Also the "throwing" pluggable entry points used by install_allocator: there PyTorch does not
 * check the pointer alloc returns (torch 2.11's CUDAPluggableAllocator::malloc stores whatever
 * comes back), so an exhausted pool must not return NULL; it throws a C++ exception, which
 * PyTorch's Python bindings turn into a plain Python RuntimeError carrying our message. They map
 * only c10::OutOfMemoryError to torch.OutOfMemoryError, and throwing that type would tie this
 * library to one torch build's C++ ABI (its class layout and constructors): the Python layer
 * offers llmmem.torch_oom_errors() to convert instead.
 *
 * Every CUDA call runs on the pool's device and restores the caller's current device.
 */
#include <cuda_runtime_api.h>

#include <cstdio>
#include <new>
#include <stdexcept>
#include <vector>

#include "backend_cuda_internal.h"
#include "cuda_check.h"

using llmmem_cuda::cuda_ctx;
using llmmem_cuda::device_guard;

namespace llmmem_cuda {

llmmem_status_t event_record(void *vctx, void *stream, void **out) {
  cuda_ctx *ctx = static_cast<cuda_ctx *>(vctx);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  LLMMEM_CUDA_TRY(cudaStreamIsCapturing(s, &capture));
  if (capture != cudaStreamCaptureStatusNone)
    return LLMMEM_FAIL(LLMMEM_ERR_STATE,
                       "a pool block was freed on a stream that is capturing a CUDA graph; the pool cannot "
                       "order its reuse (the block stays allocated). Free it after the capture ends.");
  device_guard g(ctx->device);
  LLMMEM_CUDA_TRY(g.err);
  cudaEvent_t ev;
  if (!ctx->spare_events.empty()) {
    ev = ctx->spare_events.back();
    ctx->spare_events.pop_back();
  } else {
    LLMMEM_CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  }
  cudaError_t err = cudaEventRecord(ev, s);
  if (err != cudaSuccess) {
    ctx->spare_events.push_back(ev);
    LLMMEM_CUDA_TRY(err);
  }
  *out = static_cast<void *>(ev);
  return LLMMEM_OK;
}

int event_done(void *vctx, void *event) {
  (void)vctx;
  cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaSuccess) return 1;
  /* Not ready, or an error: either way the block is not known to be safe to hand out. */
  (void)cudaGetLastError();
  return 0;
}

llmmem_status_t event_wait(void *vctx, void *event) {
  (void)vctx;
  LLMMEM_CUDA_TRY(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  return LLMMEM_OK;
}

void event_release(void *vctx, void *event) {
  static_cast<cuda_ctx *>(vctx)->spare_events.push_back(static_cast<cudaEvent_t>(event));
}

void destroy_events(cuda_ctx *ctx) {
  device_guard g(ctx->device);
  for (cudaEvent_t ev : ctx->spare_events) (void)cudaEventDestroy(ev);
  ctx->spare_events.clear();
}

} // namespace llmmem_cuda

namespace {

llmmem_status_t cuda_reserve(void *vctx, size_t bytes, void **out) {
  cuda_ctx *ctx = static_cast<cuda_ctx *>(vctx);
  device_guard g(ctx->device);
  LLMMEM_CUDA_TRY(g.err);
  void *p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "cudaMalloc of %zu bytes on cuda:%d: out of device memory", bytes,
                       ctx->device);
  }
  LLMMEM_CUDA_TRY(err);
  *out = p;
  return LLMMEM_OK;
}

void cuda_release(void *vctx, void *ptr, size_t bytes) {
  (void)bytes;
  cuda_ctx *ctx = static_cast<cuda_ctx *>(vctx);
  device_guard g(ctx->device);
  if (cudaFree(ptr) != cudaSuccess) (void)cudaGetLastError();
}

void cuda_destroy(void *vctx) {
  cuda_ctx *ctx = static_cast<cuda_ctx *>(vctx);
  llmmem_cuda::destroy_events(ctx);
  delete ctx;
}

llmmem_status_t pinned_reserve(void *ctx, size_t bytes, void **out) {
  (void)ctx;
  void *p = nullptr;
  cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "cudaHostAlloc of %zu bytes: out of page-locked host memory", bytes);
  }
  LLMMEM_CUDA_TRY(err);
  *out = p;
  return LLMMEM_OK;
}

void pinned_release(void *ctx, void *ptr, size_t bytes) {
  (void)ctx;
  (void)bytes;
  if (cudaFreeHost(ptr) != cudaSuccess) (void)cudaGetLastError();
}

} // namespace

extern "C" llmmem_status_t _llmmem_pool_backend_pinned(llmmem_pool_backend_t *out) {
  int n = 0;
  LLMMEM_CUDA_TRY(cudaGetDeviceCount(&n)); /* page-locking needs a driver: say so now, not at first use */
  llmmem_pool_backend_t b = {};
  b.name = "pinned";
  b.device = -1;
  b.reserve = pinned_reserve;
  b.release = pinned_release;
  *out = b;
  return LLMMEM_OK;
}

extern "C" LLMMEM_API llmmem_status_t llmmem_pool_backend_cuda(int device, llmmem_pool_backend_t *out) {
  LLMMEM_CHECK_ARG(out != NULL, "llmmem_pool_backend_cuda: out must not be NULL");
  LLMMEM_CHECK_ARG(device >= 0, "llmmem_pool_backend_cuda: device must be >= 0, got %d", device);
  int n = 0;
  LLMMEM_CUDA_TRY(cudaGetDeviceCount(&n));
  if (device >= n) return LLMMEM_FAIL(LLMMEM_ERR_INVALID, "device cuda:%d does not exist (%d visible)", device, n);
  cuda_ctx *ctx = new (std::nothrow) cuda_ctx{device, {}};
  if (!ctx) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "no host memory for the CUDA backend");
  llmmem_pool_backend_t b = {};
  b.name = "cuda";
  b.device = device;
  b.ctx = ctx;
  b.reserve = cuda_reserve;
  b.release = cuda_release;
  b.event_record = llmmem_cuda::event_record;
  b.event_done = llmmem_cuda::event_done;
  b.event_wait = llmmem_cuda::event_wait;
  b.event_release = llmmem_cuda::event_release;
  b.destroy = cuda_destroy;
  *out = b;
  return LLMMEM_OK;
}

/* install_allocator's entry points: like llmmem_pool_alloc_<k>, but an allocation that fails
 * throws instead of returning NULL (see the file comment). */
static void *alloc_or_throw(int slot, size_t size, int device, void *stream) {
  void *p = llmmem_pool_slot_alloc(slot, size, device, stream);
  if (!p && size > 0) {
    /* A plain char buffer: std::string helpers would be instantiated here with default visibility
     * and exported from llmmem._C, where only llmmem's ABI belongs. */
    char msg[1024];
    snprintf(msg, sizeof msg, "CUDA out of memory (llmmem pool, slot %d): %s", slot, llmmem_last_error());
    /* The prefix above is what llmmem.torch_oom_errors() recognises: keep the two in step. */
    throw std::runtime_error(msg);
  }
  return p;
}

#define LLMMEM_XSLOT_ENTRY(k)                                                                 \
  extern "C" LLMMEM_API void *llmmem_pool_xalloc_##k(size_t size, int device, void *stream) { \
    return alloc_or_throw(k, size, device, stream);                                           \
  }

LLMMEM_XSLOT_ENTRY(0)
LLMMEM_XSLOT_ENTRY(1)
LLMMEM_XSLOT_ENTRY(2)
LLMMEM_XSLOT_ENTRY(3)
LLMMEM_XSLOT_ENTRY(4)
LLMMEM_XSLOT_ENTRY(5)
LLMMEM_XSLOT_ENTRY(6)
LLMMEM_XSLOT_ENTRY(7)
LLMMEM_XSLOT_ENTRY(8)
LLMMEM_XSLOT_ENTRY(9)
LLMMEM_XSLOT_ENTRY(10)
LLMMEM_XSLOT_ENTRY(11)
LLMMEM_XSLOT_ENTRY(12)
LLMMEM_XSLOT_ENTRY(13)
LLMMEM_XSLOT_ENTRY(14)
LLMMEM_XSLOT_ENTRY(15)
