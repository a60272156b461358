/*
 * test_pool_vmm.cc — the CUDA VMM backend (csrc/pool/backend_cuda_vmm.cu, compiled here as
 * host C++) driven by the pool core over a simulated driver, under ASan+UBSan, with no GPU.
 *
 * The simulation stands in for the CUDA runtime calls the backend makes and for the driver entry
 * points it looks up: a virtual range is host address space (mmap PROT_NONE), a physical handle is
 * a record, cuMemMap + cuMemSetAccess make its granule readable and writable, cuMemUnmap drops the
 * pages. It refuses what the real driver refuses (mapping over a mapping, unmapping what is not
 * mapped, access to unmapped granules, freeing a range that still has mappings, releasing a
 * mapped handle) and counts every such misuse. With it the tests check the backend's bookkeeping:
 * growth in place keeps data and addresses, holes are unmapped and mapped again, the physical
 * memory held always equals the pool's reserved_bytes, failures roll back, and everything is
 * given back at the end. What only a GPU can check is in tests/test_pool_cuda_vmm.py.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <llmmem/pool.h>

#include "../../csrc/pool/backend_cuda_internal.h"
#include "testhelper.h"

static const size_t MiB = (size_t)1 << 20;
static const size_t GRAN = 2 * MiB;

/* ---- the simulated driver ------------------------------------------------------------------ */

struct fake_handle {
  size_t size;
  uintptr_t mapped_at; // 0 when not mapped
};

struct fake_state {
  int vmm_supported = 1;
  size_t capacity = 1024 * MiB;              // physical memory: cuMemCreate fails beyond it
  size_t physical = 0;                       // bytes of live handles
  int misuse = 0;                            // calls the real driver would refuse
  int fail_map_after = -1;                   // >= 0: that many more cuMemMap calls succeed, then one fails
  int fail_unmap_after = -1;                 // the same for cuMemUnmap (the failing call unmaps nothing)
  std::map<uintptr_t, size_t> ranges;        // reserved virtual ranges: base -> bytes
  std::map<uintptr_t, fake_handle *> mapped; // granule address -> handle
  std::map<uintptr_t, bool> accessible;      // granule address -> cuMemSetAccess done
  long handles_live = 0;
};

static fake_state F;

static bool in_range(uintptr_t p, size_t n) {
  for (auto &r : F.ranges)
    if (p >= r.first && p + n <= r.first + r.second) return true;
  return false;
}

static CUresult f_DeviceGet(CUdevice *d, int ordinal) {
  *d = ordinal;
  return CUDA_SUCCESS;
}
static CUresult f_DeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice) {
  *v = a == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED ? F.vmm_supported : 0;
  return CUDA_SUCCESS;
}
static CUresult f_MemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *,
                                              CUmemAllocationGranularity_flags) {
  *g = GRAN;
  return CUDA_SUCCESS;
}
static CUresult f_MemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr, unsigned long long) {
  size_t span = size + align;
  void *raw = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  uintptr_t base = ((uintptr_t)raw + align - 1) / align * align;
  if (base > (uintptr_t)raw) munmap(raw, base - (uintptr_t)raw);
  uintptr_t end = (uintptr_t)raw + span;
  if (end > base + size) munmap((void *)(base + size), end - (base + size));
  F.ranges[base] = size;
  *p = (CUdeviceptr)base;
  return CUDA_SUCCESS;
}
static CUresult f_MemAddressFree(CUdeviceptr p, size_t size) {
  auto it = F.ranges.find((uintptr_t)p);
  if (it == F.ranges.end() || it->second != size) {
    F.misuse++;
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (auto &m : F.mapped)
    if (m.first >= (uintptr_t)p && m.first < (uintptr_t)p + size) F.misuse++; // still mapped
  munmap((void *)p, size);
  F.ranges.erase(it);
  return CUDA_SUCCESS;
}
static CUresult f_MemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long) {
  if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
      size % GRAN) {
    F.misuse++;
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (F.physical + size > F.capacity) return CUDA_ERROR_OUT_OF_MEMORY;
  fake_handle *x = new fake_handle{size, 0};
  F.physical += size;
  F.handles_live++;
  *h = (CUmemGenericAllocationHandle)(uintptr_t)x;
  return CUDA_SUCCESS;
}
static CUresult f_MemRelease(CUmemGenericAllocationHandle h) {
  fake_handle *x = (fake_handle *)(uintptr_t)h;
  if (x->mapped_at) F.misuse++; // the backend always unmaps first
  F.physical -= x->size;
  F.handles_live--;
  delete x;
  return CUDA_SUCCESS;
}
static CUresult f_MemMap(CUdeviceptr p, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                         unsigned long long) {
  fake_handle *x = (fake_handle *)(uintptr_t)h;
  if (F.fail_map_after == 0) {
    F.fail_map_after = -1;
    return CUDA_ERROR_UNKNOWN;
  }
  if (F.fail_map_after > 0) F.fail_map_after--;
  if (offset || size != x->size || x->mapped_at || (uintptr_t)p % GRAN || !in_range((uintptr_t)p, size) ||
      F.mapped.count((uintptr_t)p)) {
    F.misuse++;
    return CUDA_ERROR_INVALID_VALUE;
  }
  x->mapped_at = (uintptr_t)p;
  F.mapped[(uintptr_t)p] = x;
  F.accessible[(uintptr_t)p] = false;
  return CUDA_SUCCESS;
}
static CUresult f_MemUnmap(CUdeviceptr p, size_t size) {
  if (F.fail_unmap_after == 0) {
    F.fail_unmap_after = -1;
    return CUDA_ERROR_UNKNOWN;
  }
  if (F.fail_unmap_after > 0) F.fail_unmap_after--;
  for (uintptr_t a = (uintptr_t)p; a < (uintptr_t)p + size; a += GRAN) {
    auto it = F.mapped.find(a);
    if (it == F.mapped.end()) {
      F.misuse++;
      return CUDA_ERROR_INVALID_VALUE;
    }
    it->second->mapped_at = 0;
    F.mapped.erase(it);
    F.accessible.erase(a);
    /* the pages go: a later map of this granule sees fresh memory, a stray access faults */
    mmap((void *)a, GRAN, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  }
  return CUDA_SUCCESS;
}
static CUresult f_MemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc *desc, size_t count) {
  if (count != 1 || desc->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) F.misuse++;
  for (uintptr_t a = (uintptr_t)p; a < (uintptr_t)p + size; a += GRAN) {
    if (!F.mapped.count(a)) {
      F.misuse++;
      return CUDA_ERROR_INVALID_VALUE;
    }
    F.accessible[a] = true;
  }
  mprotect((void *)p, size, PROT_READ | PROT_WRITE);
  return CUDA_SUCCESS;
}
static CUresult f_GetErrorName(CUresult r, const char **s) {
  *s = r == CUDA_ERROR_OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY" : "CUDA_ERROR_FAKE";
  return CUDA_SUCCESS;
}

/* ---- the CUDA runtime calls the backend makes ---------------------------------------------- */

extern "C" {
cudaError_t cudaGetDeviceCount(int *n) {
  *n = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int *d) {
  *d = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaFree(void *p) { return p ? cudaErrorInvalidValue : cudaSuccess; }
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
  *total = 1024 * MiB; // the address space reserved behind each region
  *free_bytes = *total - F.physical;
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char *cudaGetErrorName(cudaError_t) { return "cudaErrorFake"; }
const char *cudaGetErrorString(cudaError_t) { return "fake"; }
cudaError_t cudaGetDriverEntryPointByVersion(const char *name, void **fn, unsigned int, unsigned long long,
                                             cudaDriverEntryPointQueryResult *found) {
  static const std::map<std::string, void *> table = {
      {"cuDeviceGet", (void *)f_DeviceGet},
      {"cuDeviceGetAttribute", (void *)f_DeviceGetAttribute},
      {"cuMemGetAllocationGranularity", (void *)f_MemGetAllocationGranularity},
      {"cuMemAddressReserve", (void *)f_MemAddressReserve},
      {"cuMemAddressFree", (void *)f_MemAddressFree},
      {"cuMemCreate", (void *)f_MemCreate},
      {"cuMemRelease", (void *)f_MemRelease},
      {"cuMemMap", (void *)f_MemMap},
      {"cuMemUnmap", (void *)f_MemUnmap},
      {"cuMemSetAccess", (void *)f_MemSetAccess},
      {"cuGetErrorName", (void *)f_GetErrorName},
  };
  auto it = table.find(name);
  *fn = it == table.end() ? nullptr : it->second;
  if (found) *found = it == table.end() ? cudaDriverEntryPointSymbolNotFound : cudaDriverEntryPointSuccess;
  return cudaSuccess;
}
}

/* Stream events: on this fake device all work is done, so an event is complete at once. */
namespace llmmem_cuda {
static int fake_event;
llmmem_status_t event_record(void *, void *, void **out) {
  *out = &fake_event;
  return LLMMEM_OK;
}
int event_done(void *, void *) { return 1; }
llmmem_status_t event_wait(void *, void *) { return LLMMEM_OK; }
void event_release(void *, void *) {}
void destroy_events(cuda_ctx *) {}
} // namespace llmmem_cuda

/* backend_host.c refers to the pinned backend, which lives in backend_cuda.cu (not built here). */
extern "C" llmmem_status_t _llmmem_pool_backend_pinned(llmmem_pool_backend_t *) { return LLMMEM_ERR_NOT_BUILT; }

/* ---- tests --------------------------------------------------------------------------------- */

static llmmem_pool_t *vmm_pool(size_t initial, size_t max) {
  llmmem_pool_backend_t b;
  if (llmmem_pool_backend_cuda_vmm(0, &b) != LLMMEM_OK) return nullptr;
  llmmem_pool_options_t o = {initial, max, 0, 0};
  llmmem_pool_t *p = nullptr;
  if (llmmem_pool_create(&b, &o, &p) != LLMMEM_OK) return nullptr;
  return p;
}

static llmmem_pool_stats_t stats(llmmem_pool_t *p) {
  llmmem_pool_stats_t s;
  memset(&s, 0, sizeof s);
  (void)llmmem_pool_stats(p, &s);
  return s;
}

/* Every byte the pool counts as reserved is mapped memory, and nothing else is. */
static bool physical_matches(llmmem_pool_t *p) { return (int64_t)F.physical == stats(p).reserved_bytes.current; }

static bool accessible(void *ptr, size_t n) {
  for (uintptr_t a = (uintptr_t)ptr / GRAN * GRAN; a < (uintptr_t)ptr + n; a += GRAN)
    if (!F.accessible.count(a) || !F.accessible[a]) return false;
  return true;
}

int main() {
  TEST("a device without virtual memory management is refused with a reason") {
    F.vmm_supported = 0;
    llmmem_pool_backend_t b;
    CHECK_STATUS(llmmem_pool_backend_cuda_vmm(0, &b), LLMMEM_ERR_NO_DEVICE);
    CHECK(strstr(llmmem_last_error(), "virtual memory management") != nullptr);
    CHECK_STATUS(llmmem_pool_backend_cuda_vmm(3, &b), LLMMEM_ERR_INVALID); // no such device
    F.vmm_supported = 1;
    CHECK_OK(llmmem_pool_backend_cuda_vmm(0, &b));
    CHECK(strcmp(b.name, "cuda_vmm") == 0 && b.resize && b.decommit && b.commit && b.event_record);
    b.destroy(b.ctx);
  }

  TEST("growth is in place: one region, addresses and data kept, memory mapped = reserved") {
    llmmem_pool_t *p = vmm_pool(0, 0);
    CHECK(p != nullptr);
    void *a = nullptr, *b = nullptr;
    CHECK_OK(llmmem_pool_alloc(p, 8 * MiB, nullptr, &a));
    memset(a, 7, 8 * MiB);
    CHECK_OK(llmmem_pool_alloc(p, 16 * MiB, nullptr, &b));
    CHECK((char *)b == (char *)a + 8 * MiB && accessible(b, 16 * MiB));
    memset(b, 9, 16 * MiB);
    CHECK(((unsigned char *)a)[0] == 7 && ((unsigned char *)a)[8 * MiB - 1] == 7);
    llmmem_pool_stats_t s = stats(p);
    CHECK(s.segments.current == 1 && s.reserved_bytes.current == (int64_t)(24 * MiB) && s.num_backend_reserves == 2);
    CHECK(physical_matches(p) && F.mapped.size() == 12);
    CHECK_OK(llmmem_pool_free(p, a, nullptr));
    CHECK_OK(llmmem_pool_free(p, b, nullptr));
    CHECK_OK(llmmem_pool_destroy(p));
    CHECK(F.physical == 0 && F.ranges.empty() && F.handles_live == 0 && F.misuse == 0);
  }

  TEST("holes are unmapped while growing past them and mapped again when reused") {
    llmmem_pool_t *p = vmm_pool(0, 0);
    void *a, *b, *c, *d;
    CHECK_OK(llmmem_pool_alloc(p, 8 * MiB, nullptr, &a));
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB / 2, nullptr, &b));
    CHECK_OK(llmmem_pool_free(p, a, nullptr));
    CHECK_OK(llmmem_pool_alloc(p, 10 * MiB, nullptr, &c));
    llmmem_pool_stats_t s = stats(p);
    CHECK(s.decommitted_bytes == 8 * MiB && s.reserved_bytes.current == (int64_t)(12 * MiB));
    CHECK(physical_matches(p) && !accessible(a, 2 * MiB));
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB, nullptr, &d));
    CHECK(d == a && accessible(d, 3 * MiB));
    memset(d, 5, 3 * MiB);
    CHECK(physical_matches(p) && stats(p).decommitted_bytes == 4 * MiB);
    CHECK_OK(_llmmem_pool_check(p));
    for (void *x : {b, c, d}) CHECK_OK(llmmem_pool_free(p, x, nullptr));
    size_t released = 0;
    int64_t before = stats(p).reserved_bytes.current;
    CHECK_OK(llmmem_pool_empty_cache(p, &released)); // a region with unmapped holes, released whole
    CHECK((int64_t)released == before && F.physical == 0 && stats(p).reserved_bytes.current == 0);
    CHECK_OK(llmmem_pool_destroy(p));
    CHECK(F.ranges.empty() && F.handles_live == 0 && F.misuse == 0);
  }

  TEST("empty_cache shrinks to initial_size over unmapped pages without mapping anything") {
    llmmem_pool_t *p = vmm_pool(MiB / 2, 0);
    void *a, *b, *c, *d;
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB / 2, nullptr, &a));
    CHECK_OK(llmmem_pool_alloc(p, 8 * MiB, nullptr, &b));
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB / 2, nullptr, &c));
    CHECK_OK(llmmem_pool_free(p, b, nullptr));
    CHECK_OK(llmmem_pool_alloc(p, 10 * MiB, nullptr, &d));
    CHECK_OK(llmmem_pool_free(p, d, nullptr));
    CHECK_OK(llmmem_pool_free(p, c, nullptr));
    /* region sizes of 0.5 MiB + 2k MiB map whole granules: one more granule than reserved counts */
    CHECK((int64_t)F.physical == stats(p).reserved_bytes.current + (int64_t)(3 * MiB / 2));
    size_t released = 0;
    size_t reserves = stats(p).num_backend_reserves;
    CHECK_OK(llmmem_pool_empty_cache(p, &released));
    CHECK(stats(p).num_backend_reserves == reserves && F.misuse == 0);
    CHECK(stats(p).reserved_bytes.current == (int64_t)(2 * MiB) && F.physical == 2 * MiB); // [0, 2): 1 granule
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_free(p, a, nullptr));
    CHECK_OK(llmmem_pool_destroy(p));
    CHECK(F.physical == 0 && F.ranges.empty() && F.misuse == 0);
  }

  TEST("a driver out of memory is the pool's OOM; a failed map rolls back what it mapped") {
    F.capacity = 16 * MiB;
    llmmem_pool_t *p = vmm_pool(0, 0);
    void *a = nullptr, *x = nullptr;
    CHECK_OK(llmmem_pool_alloc(p, 10 * MiB, nullptr, &a));
    CHECK_STATUS(llmmem_pool_alloc(p, 10 * MiB, nullptr, &x), LLMMEM_ERR_NOMEM);
    CHECK(x == nullptr && physical_matches(p) && stats(p).num_ooms == 1);
    F.capacity = 1024 * MiB;
    F.fail_map_after = 2; // growth by 8 MiB: two granules map, the third fails
    CHECK(llmmem_pool_alloc(p, 8 * MiB, nullptr, &x) != LLMMEM_OK);
    CHECK(physical_matches(p) && F.mapped.size() == 5 && F.misuse == 0);
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_alloc(p, 8 * MiB, nullptr, &x)); // works again afterwards
    memset(x, 1, 8 * MiB);
    CHECK_OK(llmmem_pool_free(p, x, nullptr));
    CHECK_OK(llmmem_pool_free(p, a, nullptr));
    CHECK_OK(llmmem_pool_destroy(p));
    CHECK(F.physical == 0 && F.ranges.empty() && F.misuse == 0);
  }

  TEST("a decommit that fails partway maps again what it unmapped: the pool's hole stays usable") {
    llmmem_pool_t *p = vmm_pool(0, 0);
    void *a, *b, *c, *d;
    CHECK_OK(llmmem_pool_alloc(p, 8 * MiB, nullptr, &a));
    CHECK_OK(llmmem_pool_alloc(p, 3 * MiB / 2, nullptr, &b));
    CHECK_OK(llmmem_pool_free(p, a, nullptr));
    F.fail_unmap_after = 2; // the hole's 4 granules: two unmap, the third fails
    CHECK_OK(llmmem_pool_alloc(p, 10 * MiB, nullptr, &c));
    CHECK(F.fail_unmap_after == -1);
    CHECK(stats(p).decommitted_bytes == 0 && physical_matches(p) && accessible(a, 8 * MiB) && F.misuse == 0);
    CHECK_OK(_llmmem_pool_check(p));
    CHECK_OK(llmmem_pool_alloc(p, 8 * MiB, nullptr, &d));
    CHECK(d == a);
    memset(d, 3, 8 * MiB); // faults if a granule the pool counts as committed were left unmapped
    for (void *x : {b, c, d}) CHECK_OK(llmmem_pool_free(p, x, nullptr));
    CHECK_OK(llmmem_pool_destroy(p));
    CHECK(F.physical == 0 && F.ranges.empty() && F.handles_live == 0 && F.misuse == 0);
  }

  TEST("seeded random sequences: data intact, mapped memory = reserved, all given back") {
    llmmem_pool_t *p = vmm_pool(0, 0);
    struct live_t {
      unsigned char *ptr;
      size_t size;
      unsigned char tag;
    };
    std::vector<live_t> live;
    unsigned long long rng = 12345;
    bool ok = true;
    for (int i = 0; i < 4000 && ok; i++) {
      unsigned long long r = th_rand(&rng);
      if (live.empty() || (live.size() < 40 && r % 100 < 55)) {
        size_t size = r % 8 == 0 ? 1 + (size_t)(r >> 8) % (24 * MiB) : 1 + (size_t)(r >> 8) % (2 * MiB);
        void *ptr = nullptr;
        if (llmmem_pool_alloc(p, size, nullptr, &ptr) != LLMMEM_OK) {
          ok = false;
          break;
        }
        unsigned char tag = (unsigned char)(r >> 40);
        ((unsigned char *)ptr)[0] = tag;
        ((unsigned char *)ptr)[size - 1] = tag;
        live.push_back({(unsigned char *)ptr, size, tag});
      } else {
        size_t k = (size_t)(r >> 16) % live.size();
        ok = ok && live[k].ptr[0] == live[k].tag && live[k].ptr[live[k].size - 1] == live[k].tag;
        ok = ok && llmmem_pool_free(p, live[k].ptr, nullptr) == LLMMEM_OK;
        live[k] = live.back();
        live.pop_back();
      }
      if (i % 97 == 0) ok = ok && llmmem_pool_empty_cache(p, nullptr) == LLMMEM_OK;
      if (i % 50 == 0) {
        llmmem_pool_stats_t s = stats(p);
        ok = ok && _llmmem_pool_check(p) == LLMMEM_OK && physical_matches(p) && s.largest_free_block <= s.free_bytes;
        for (auto &l : live) ok = ok && accessible(l.ptr, l.size);
      }
    }
    CHECK(ok);
    for (auto &l : live) CHECK_OK(llmmem_pool_free(p, l.ptr, nullptr));
    CHECK_OK(llmmem_pool_empty_cache(p, nullptr));
    CHECK(F.physical == 0 && stats(p).reserved_bytes.current == 0);
    CHECK(stats(p).decommitted_bytes > 0 || stats(p).num_backend_releases > 0);
    CHECK_OK(llmmem_pool_destroy(p));
    CHECK(F.ranges.empty() && F.handles_live == 0 && F.misuse == 0);
  }

  return TEST_SUMMARY();
}
