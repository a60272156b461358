/*
 * backend_cuda_vmm.cu — device memory that grows in place: CUDA's virtual memory management
 * (cuMemAddressReserve + cuMemCreate/cuMemMap/cuMemSetAccess), the device counterpart of the
 * host backend's reserved address space, and what PyTorch calls expandable segments.
 *
 * Each region the pool reserves is the start of a virtual range as large as the device's memory;
 * physical memory is mapped into it one allocation granule (2 MiB on current GPUs) at a time, each
 * granule its own handle, so the pool can grow a region by mapping more granules at its end
 * (resize), give back its end (shrink), and give back whole pages inside free holes while keeping
 * their addresses (decommit; commit maps them again). It implements exactly the contract the host
 * backend does (llmmem_pool_backend_t: resize, decommit, commit).
 *
 * Unmapping does not wait for the GPU. The pool only gives back memory no queued work can use:
 * free blocks whose free event has completed (or that were never used). This is the same ordering
 * that makes reusing a block safe, so no device synchronisation is added (cudaFree would add one).
 *
 * The driver API is not linked (llmmem's CUDA part links only the static runtime, so importing
 * llmmem never needs libcuda): its entry points come from cudaGetDriverEntryPointByVersion
 * (cudaGetDriverEntryPoint before CUDA 12.5). A driver or device without virtual memory
 * management gets LLMMEM_ERR_NO_DEVICE with the reason, and callers fall back to cudaMalloc.
 *
 * Not yet run on a GPU (written and built without one). tests/c/test_pool_vmm.cc drives it, as
 * host C++, over a simulated driver (bookkeeping, rollback, nothing leaked or mapped twice);
 * tests/test_pool_cuda_vmm.py holds the checks that need the real device.
 */
#include <cuda.h> /* types and enums only: every driver call goes through a pointer below */
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <new>
#include <vector>

#include "backend_cuda_internal.h"
#include "cuda_check.h"

using llmmem_cuda::cuda_ctx;
using llmmem_cuda::device_guard;

namespace {

/* ---- driver entry points ------------------------------------------------------------------- */

struct driver_api {
  decltype(&::cuDeviceGet) DeviceGet;
  decltype(&::cuDeviceGetAttribute) DeviceGetAttribute;
  decltype(&::cuMemGetAllocationGranularity) MemGetAllocationGranularity;
  decltype(&::cuMemAddressReserve) MemAddressReserve;
  decltype(&::cuMemAddressFree) MemAddressFree;
  decltype(&::cuMemCreate) MemCreate;
  decltype(&::cuMemRelease) MemRelease;
  decltype(&::cuMemMap) MemMap;
  decltype(&::cuMemUnmap) MemUnmap;
  decltype(&::cuMemSetAccess) MemSetAccess;
  decltype(&::cuGetErrorName) GetErrorName;
};

driver_api drv;
std::once_flag drv_once;
char drv_missing[128]; /* the first symbol that could not be found, empty when all were */

/* The driver ABI of these functions has not changed since CUDA 10.2; ask for it as of 12.0, a
 * version every driver that runs this runtime knows. */
#define LLMMEM_DRIVER_ABI 12000

template <typename F>
bool lookup(const char *name, F *out) {
  void *fn = nullptr;
#if CUDART_VERSION >= 12050
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &fn, LLMMEM_DRIVER_ABI, cudaEnableDefault, &found);
  bool ok = err == cudaSuccess && found == cudaDriverEntryPointSuccess;
#elif CUDART_VERSION >= 12000
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found);
  bool ok = err == cudaSuccess && found == cudaDriverEntryPointSuccess;
#else /* CUDA 11: no query result */
  cudaError_t err = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault);
  bool ok = err == cudaSuccess;
#endif
  if (!ok || !fn) {
    (void)cudaGetLastError();
    return false;
  }
  *out = reinterpret_cast<F>(fn);
  return true;
}

void load_driver() {
  struct {
    const char *name;
    bool ok;
  } r[] = {
      {"cuDeviceGet", lookup("cuDeviceGet", &drv.DeviceGet)},
      {"cuDeviceGetAttribute", lookup("cuDeviceGetAttribute", &drv.DeviceGetAttribute)},
      {"cuMemGetAllocationGranularity", lookup("cuMemGetAllocationGranularity", &drv.MemGetAllocationGranularity)},
      {"cuMemAddressReserve", lookup("cuMemAddressReserve", &drv.MemAddressReserve)},
      {"cuMemAddressFree", lookup("cuMemAddressFree", &drv.MemAddressFree)},
      {"cuMemCreate", lookup("cuMemCreate", &drv.MemCreate)},
      {"cuMemRelease", lookup("cuMemRelease", &drv.MemRelease)},
      {"cuMemMap", lookup("cuMemMap", &drv.MemMap)},
      {"cuMemUnmap", lookup("cuMemUnmap", &drv.MemUnmap)},
      {"cuMemSetAccess", lookup("cuMemSetAccess", &drv.MemSetAccess)},
      {"cuGetErrorName", lookup("cuGetErrorName", &drv.GetErrorName)},
  };
  for (const auto &e : r)
    if (!e.ok) {
      snprintf(drv_missing, sizeof drv_missing, "%s", e.name);
      return;
    }
}

const char *cu_name(CUresult r) {
  const char *name = nullptr;
  if (drv.GetErrorName && drv.GetErrorName(r, &name) == CUDA_SUCCESS && name) return name;
  return "CUDA driver error";
}

/* A failed driver call as a status: out of memory is NOMEM (the pool may then try elsewhere). */
llmmem_status_t cu_fail(CUresult r, const char *what, size_t bytes) {
  if (r == CUDA_ERROR_OUT_OF_MEMORY)
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "%s of %zu bytes: out of device memory (%s)", what, bytes, cu_name(r));
  return LLMMEM_FAIL(LLMMEM_ERR_CUDA, "%s of %zu bytes failed: %s (%d)", what, bytes, cu_name(r), (int)r);
}

/* ---- regions ----------------------------------------------------------------------------- */

/* One reserved virtual range; granule g is mapped when handles[g] != 0. */
struct vmm_region {
  CUdeviceptr base;
  size_t va_bytes; // the reservation: the most the region can grow to
  std::vector<CUmemGenericAllocationHandle> handles;
};

struct vmm_ctx : cuda_ctx {
  CUmemAllocationProp prop;
  CUmemAccessDesc access;
  size_t gran;     // bytes: physical memory is mapped in these units
  size_t va_bytes; // bytes of address space reserved behind each region
  std::vector<vmm_region *> regions;
};

vmm_ctx *ctx_of(void *vctx) { return static_cast<vmm_ctx *>(static_cast<cuda_ctx *>(vctx)); }

vmm_region *find(vmm_ctx *ctx, void *ptr) {
  for (vmm_region *r : ctx->regions)
    if (r->base == reinterpret_cast<CUdeviceptr>(ptr)) return r;
  return nullptr;
}

/* Unmaps granule g (mapped) and frees its memory. When the unmap fails the granule stays mapped
 * and recorded; once it is unmapped it is recorded as unmapped even if the driver then refuses to
 * free its memory (that handle is lost: nothing could free it later either, and a recorded handle
 * over an unmapped granule would make map_range skip a granule the pool then uses). */
CUresult unmap_granule(vmm_ctx *ctx, vmm_region *r, size_t g) {
  CUresult e = drv.MemUnmap(r->base + g * ctx->gran, ctx->gran);
  if (e != CUDA_SUCCESS) return e;
  CUmemGenericAllocationHandle h = r->handles[g];
  r->handles[g] = 0;
  return drv.MemRelease(h);
}

/* Gives back every mapped granule of a region that goes away. Errors do not stop it: the rest is
 * still given back. */
void unmap_all(vmm_ctx *ctx, vmm_region *r) {
  for (size_t g = 0; g < r->handles.size(); g++)
    if (r->handles[g]) (void)unmap_granule(ctx, r, g);
}

/* Room for n granule indices, taken before any driver call: push_back may then not throw, and no
 * C++ exception reaches the C callers. */
llmmem_status_t reserve_granules(std::vector<size_t> &v, size_t n, const char *what) {
  try {
    v.reserve(n);
  } catch (const std::bad_alloc &) {
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "cuda vmm: no host memory to %s %zu granules", what, n);
  }
  return LLMMEM_OK;
}

/* Maps fresh physical memory at every unmapped granule in [g0, g1) and makes it accessible from
 * the device. All or nothing: on failure what this call mapped is given back. */
llmmem_status_t map_range(vmm_ctx *ctx, vmm_region *r, size_t g0, size_t g1) {
  std::vector<size_t> mapped;
  LLMMEM_TRY(reserve_granules(mapped, g1 - g0, "map"));
  llmmem_status_t st = LLMMEM_OK;
  for (size_t g = g0; g < g1 && st == LLMMEM_OK; g++) {
    if (r->handles[g]) continue;
    CUmemGenericAllocationHandle h = 0;
    CUresult e = drv.MemCreate(&h, ctx->gran, &ctx->prop, 0);
    if (e != CUDA_SUCCESS) {
      st = cu_fail(e, "cuMemCreate", ctx->gran);
      break;
    }
    e = drv.MemMap(r->base + g * ctx->gran, ctx->gran, 0, h, 0);
    if (e != CUDA_SUCCESS) {
      (void)drv.MemRelease(h);
      st = cu_fail(e, "cuMemMap", ctx->gran);
      break;
    }
    r->handles[g] = h;
    mapped.push_back(g); /* capacity reserved above: cannot throw */
  }
  /* Access is granted per run of granules mapped here (one call per contiguous run). */
  for (size_t i = 0; i < mapped.size() && st == LLMMEM_OK;) {
    size_t j = i + 1;
    while (j < mapped.size() && mapped[j] == mapped[j - 1] + 1) j++;
    size_t bytes = (j - i) * ctx->gran;
    CUresult e = drv.MemSetAccess(r->base + mapped[i] * ctx->gran, bytes, &ctx->access, 1);
    if (e != CUDA_SUCCESS) st = cu_fail(e, "cuMemSetAccess", bytes);
    i = j;
  }
  if (st != LLMMEM_OK)
    for (size_t g : mapped) (void)unmap_granule(ctx, r, g);
  return st;
}

/* Unmaps and frees the mapped granules in [g0, g1). All or nothing, as the pool relies on (a
 * failed decommit or shrink counts as nothing given back, and the pool may then hand out those
 * addresses): on failure the granules this call unmapped are mapped again (fresh memory; the pool
 * gives back only free memory, whose contents do not matter). */
llmmem_status_t unmap_range(vmm_ctx *ctx, vmm_region *r, size_t g0, size_t g1) {
  std::vector<size_t> unmapped;
  LLMMEM_TRY(reserve_granules(unmapped, g1 - g0, "unmap"));
  for (size_t g = g0; g < g1; g++) {
    if (!r->handles[g]) continue;
    CUresult e = unmap_granule(ctx, r, g);
    if (!r->handles[g]) unmapped.push_back(g); /* capacity reserved above: cannot throw */
    if (e == CUDA_SUCCESS) continue;
    llmmem_status_t st = cu_fail(e, "cuMemUnmap/cuMemRelease", ctx->gran);
    /* One map_range per run of granules unmapped here (it maps only unmapped granules). */
    for (size_t i = 0, j; i < unmapped.size(); i = j) {
      for (j = i + 1; j < unmapped.size() && unmapped[j] == unmapped[j - 1] + 1;) j++;
      if (map_range(ctx, r, unmapped[i], unmapped[j - 1] + 1) != LLMMEM_OK) {
        char why[256]; /* copied: the message below is written over llmmem_last_error()'s buffer */
        snprintf(why, sizeof why, "%s", llmmem_last_error());
        return LLMMEM_FAIL(LLMMEM_ERR_CUDA,
                           "cuda vmm: unmapping failed (%s) and mapping granules %zu..%zu "
                           "again failed too: %s",
                           cu_name(e), unmapped[i], unmapped[j - 1], why);
      }
    }
    return st;
  }
  return LLMMEM_OK;
}

size_t granules(const vmm_ctx *ctx, size_t bytes) { return (bytes + ctx->gran - 1) / ctx->gran; }

/* ---- the backend --------------------------------------------------------------------------- */

llmmem_status_t vmm_reserve(void *vctx, size_t bytes, void **out) {
  vmm_ctx *ctx = ctx_of(vctx);
  device_guard g(ctx->device);
  LLMMEM_CUDA_TRY(g.err);
  size_t va = bytes <= ctx->va_bytes ? ctx->va_bytes : granules(ctx, bytes) * ctx->gran;
  vmm_region *r = new (std::nothrow) vmm_region{};
  if (!r) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "no host memory for a region's metadata");
  try {
    r->handles.assign(va / ctx->gran, 0);
    ctx->regions.reserve(ctx->regions.size() + 1);
  } catch (const std::bad_alloc &) {
    delete r;
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "no host memory for a region's metadata");
  }
  r->va_bytes = va;
  CUresult e = drv.MemAddressReserve(&r->base, va, ctx->gran, 0, 0);
  if (e != CUDA_SUCCESS) {
    delete r;
    return cu_fail(e, "cuMemAddressReserve", va);
  }
  llmmem_status_t st = map_range(ctx, r, 0, granules(ctx, bytes));
  if (st != LLMMEM_OK) {
    (void)drv.MemAddressFree(r->base, r->va_bytes);
    delete r;
    return st;
  }
  ctx->regions.push_back(r);
  *out = reinterpret_cast<void *>(r->base);
  return LLMMEM_OK;
}

void vmm_release(void *vctx, void *ptr, size_t bytes) {
  (void)bytes; /* every mapped granule goes, whatever the pool thinks the size is */
  vmm_ctx *ctx = ctx_of(vctx);
  vmm_region *r = find(ctx, ptr);
  if (!r) return;
  device_guard g(ctx->device);
  unmap_all(ctx, r);
  (void)drv.MemAddressFree(r->base, r->va_bytes);
  for (size_t i = 0; i < ctx->regions.size(); i++)
    if (ctx->regions[i] == r) {
      ctx->regions.erase(ctx->regions.begin() + (std::ptrdiff_t)i);
      break;
    }
  delete r;
}

llmmem_status_t vmm_resize(void *vctx, void *ptr, size_t old_bytes, size_t new_bytes) {
  vmm_ctx *ctx = ctx_of(vctx);
  vmm_region *r = find(ctx, ptr);
  if (!r) return LLMMEM_FAIL(LLMMEM_ERR_INVALID, "cuda vmm: %p is not a region of this backend", ptr);
  if (new_bytes > r->va_bytes)
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM,
                       "cuda vmm: region of %zu bytes cannot grow to %zu bytes in place "
                       "(%zu bytes of address space reserved)",
                       old_bytes, new_bytes, r->va_bytes);
  device_guard g(ctx->device);
  LLMMEM_CUDA_TRY(g.err);
  size_t old_g = granules(ctx, old_bytes), new_g = granules(ctx, new_bytes);
  if (new_g > old_g) return map_range(ctx, r, old_g, new_g);
  if (new_g < old_g) return unmap_range(ctx, r, new_g, old_g); /* skips granules decommitted before */
  return LLMMEM_OK;
}

/* [ptr, ptr + bytes) inside a region, in whole granules (the pool works in 2 MiB pages, which the
 * backend is only given when its granule divides 2 MiB). */
llmmem_status_t granule_span(vmm_ctx *ctx, void *ptr, size_t bytes, vmm_region **r, size_t *g0, size_t *g1) {
  CUdeviceptr p = reinterpret_cast<CUdeviceptr>(ptr);
  for (vmm_region *x : ctx->regions)
    if (p >= x->base && p + bytes <= x->base + x->va_bytes) {
      size_t off = (size_t)(p - x->base);
      if (off % ctx->gran || bytes % ctx->gran) break;
      *r = x;
      *g0 = off / ctx->gran;
      *g1 = (off + bytes) / ctx->gran;
      return LLMMEM_OK;
    }
  return LLMMEM_FAIL(LLMMEM_ERR_INVALID, "cuda vmm: [%p, +%zu) is not whole granules of a region", ptr, bytes);
}

/* Runs `op` (map_range or unmap_range) on the granules [ptr, ptr + bytes) of a region. */
llmmem_status_t on_granules(void *vctx, void *ptr, size_t bytes,
                            llmmem_status_t (*op)(vmm_ctx *, vmm_region *, size_t, size_t)) {
  vmm_ctx *ctx = ctx_of(vctx);
  vmm_region *r = nullptr;
  size_t g0 = 0, g1 = 0;
  LLMMEM_TRY(granule_span(ctx, ptr, bytes, &r, &g0, &g1));
  device_guard g(ctx->device);
  LLMMEM_CUDA_TRY(g.err);
  return op(ctx, r, g0, g1);
}

llmmem_status_t vmm_decommit(void *vctx, void *ptr, size_t bytes) {
  return on_granules(vctx, ptr, bytes, unmap_range);
}

llmmem_status_t vmm_commit(void *vctx, void *ptr, size_t bytes) { return on_granules(vctx, ptr, bytes, map_range); }

void vmm_destroy(void *vctx) {
  vmm_ctx *ctx = ctx_of(vctx);
  for (vmm_region *r : ctx->regions) { /* the pool released every region; this is a safety net */
    unmap_all(ctx, r);
    (void)drv.MemAddressFree(r->base, r->va_bytes);
    delete r;
  }
  llmmem_cuda::destroy_events(ctx);
  delete ctx;
}

} // namespace

extern "C" LLMMEM_API llmmem_status_t llmmem_pool_backend_cuda_vmm(int device, llmmem_pool_backend_t *out) {
  LLMMEM_CHECK_ARG(out != NULL, "llmmem_pool_backend_cuda_vmm: out must not be NULL");
  LLMMEM_CHECK_ARG(device >= 0, "llmmem_pool_backend_cuda_vmm: device must be >= 0, got %d", device);
  int n = 0;
  LLMMEM_CUDA_TRY(cudaGetDeviceCount(&n));
  if (device >= n) return LLMMEM_FAIL(LLMMEM_ERR_INVALID, "device cuda:%d does not exist (%d visible)", device, n);
  std::call_once(drv_once, load_driver);
  if (drv_missing[0])
    return LLMMEM_FAIL(LLMMEM_ERR_NO_DEVICE,
                       "cuda vmm: the CUDA driver has no %s (virtual memory management "
                       "needs a newer driver)",
                       drv_missing);
  size_t total = 0;
  {
    device_guard g(device);
    LLMMEM_CUDA_TRY(g.err);
    LLMMEM_CUDA_TRY(cudaFree(nullptr)); /* the primary context: driver calls below need one current */
    size_t free_bytes = 0;
    LLMMEM_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total));
  }
  CUdevice dev = 0;
  CUresult e = drv.DeviceGet(&dev, device);
  if (e != CUDA_SUCCESS) return cu_fail(e, "cuDeviceGet", 0);
  int vmm = 0;
  e = drv.DeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
  if (e != CUDA_SUCCESS || !vmm)
    return LLMMEM_FAIL(LLMMEM_ERR_NO_DEVICE, "cuda vmm: cuda:%d does not support virtual memory management%s%s",
                       device, e != CUDA_SUCCESS ? ": " : "", e != CUDA_SUCCESS ? cu_name(e) : "");
  vmm_ctx *ctx = new (std::nothrow) vmm_ctx{};
  if (!ctx) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "no host memory for the CUDA backend");
  ctx->device = device;
  ctx->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  ctx->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  ctx->prop.location.id = dev;
  ctx->access.location = ctx->prop.location;
  ctx->access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  e = drv.MemGetAllocationGranularity(&ctx->gran, &ctx->prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (e != CUDA_SUCCESS || ctx->gran == 0 || (ctx->gran & (ctx->gran - 1))) {
    delete ctx;
    return e != CUDA_SUCCESS ? cu_fail(e, "cuMemGetAllocationGranularity", 0)
                             : LLMMEM_FAIL(LLMMEM_ERR_NO_DEVICE, "cuda vmm: unusable allocation granularity");
  }
  /* Address space only: as large as the device, so one region can hold all of it. */
  ctx->va_bytes = _llmmem_round_up(total, ctx->gran);
  llmmem_pool_backend_t b = {};
  b.name = "cuda_vmm";
  b.device = device;
  b.ctx = static_cast<cuda_ctx *>(ctx);
  b.reserve = vmm_reserve;
  b.release = vmm_release;
  b.resize = vmm_resize;
  /* The pool decommits 2 MiB pages: only a granule that divides them can be unmapped alone. */
  if (LLMMEM_POOL_CHUNK_SIZE % ctx->gran == 0) {
    b.decommit = vmm_decommit;
    b.commit = vmm_commit;
  }
  b.event_record = llmmem_cuda::event_record;
  b.event_done = llmmem_cuda::event_done;
  b.event_wait = llmmem_cuda::event_wait;
  b.event_release = llmmem_cuda::event_release;
  b.destroy = vmm_destroy;
  *out = b;
  return LLMMEM_OK;
}
