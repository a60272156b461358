/*
 * pool.h — llmmem's caching memory pool: a device-agnostic allocator over a small backend contract.
 *
 * The pool reserves large regions ("segments") from a backend (host malloc, page-locked host
 * memory, cudaMalloc) and hands out blocks from them in O(1) with a two-level segregated-fit
 * (TLSF) index: every size is rounded up to 512 bytes, free neighbours are coalesced at once,
 * requests of at most 1 MiB are packed into 2 MiB chunks apart from the large blocks.
 *
 * Stream ordering (CUDA): a block freed on stream S can be handed out again at once on S (work on
 * one stream runs in order); on another stream only after an event recorded at the free has
 * completed. The backend supplies the streams and events, so the host backend — or a test with
 * fake events — exercises the same logic.
 *
 * Block metadata lives on the host: device memory never holds a header. All functions are
 * thread-safe (one mutex per pool) and return a status; none exits or aborts.
 */
#ifndef LLMMEM_POOL_H
#define LLMMEM_POOL_H

#include <stddef.h>
#include <stdint.h>

#include <llmmem/llmmem.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct llmmem_pool_s llmmem_pool_t;
struct llmmem_pool_options_s;

#define LLMMEM_POOL_GRANULARITY ((size_t)512)     /* bytes: every block size is a multiple */
#define LLMMEM_POOL_SMALL_MAX   ((size_t)1 << 20) /* bytes: requests up to this are "small" */
#define LLMMEM_POOL_CHUNK_SIZE  ((size_t)2 << 20) /* bytes: small requests are packed in chunks this big */

/* What a pool needs from the memory it manages. Called with the pool's lock held. `ctx` is the
 * backend's own state; `stream` and `event` are opaque (cudaStream_t / cudaEvent_t for CUDA). */
typedef struct llmmem_pool_backend_s {
  const char *name; /* "host", "pinned", "cuda": shown in summaries */
  int device;       /* CUDA device ordinal, or -1 for host memory */
  void *ctx;
  /* Reserve `bytes` (a multiple of 512) aligned to at least 512 bytes. LLMMEM_ERR_NOMEM when the
   * memory is not there; any other status is passed to the caller. */
  llmmem_status_t (*reserve)(void *ctx, size_t bytes, void **out_ptr);
  /* Give back a region obtained from reserve. */
  void (*release)(void *ctx, void *ptr, size_t bytes);
  /* Stream events, all four NULL when the memory is not stream-ordered (host memory): then a
   * freed block is reusable at once by anyone. */
  llmmem_status_t (*event_record)(void *ctx, void *stream, void **out_event);
  int (*event_done)(void *ctx, void *event);             /* 1 complete, 0 pending */
  llmmem_status_t (*event_wait)(void *ctx, void *event); /* block the host until complete */
  void (*event_release)(void *ctx, void *event);         /* the pool no longer needs it */
  /* Frees ctx; called once by llmmem_pool_destroy after every region is released. May be NULL. */
  void (*destroy)(void *ctx);
  /* Optional (NULL: regions keep the size they were reserved with). Grows or shrinks region `ptr`
   * from `old_bytes` to `new_bytes` in place, keeping its address (virtual address space reserved
   * behind it, physical memory committed or given back). LLMMEM_ERR_NOMEM when the region cannot
   * grow there; the pool then reserves a new region. A shrink gives the tail's memory back. With
   * it the pool grows one contiguous region by what a request lacks (like PyTorch's expandable
   * segments), so free space never strands at the ends of separate segments. All or nothing: a
   * failed resize leaves the region as it was (the pool keeps using its old size). */
  llmmem_status_t (*resize)(void *ctx, void *ptr, size_t old_bytes, size_t new_bytes);
  /* Optional, both or neither (needs resize): give back the memory under `bytes` at `ptr` inside a
   * region while keeping the addresses (decommit), and make it usable again (commit). The pool
   * decommits whole 2 MiB pages inside free holes when it must grow, so memory a hole holds is
   * not counted twice; it commits them again when a block over them is handed out. Both all or
   * nothing: after a failed decommit every byte of the range is still usable (the pool counts it
   * as committed and may hand it out), after a failed commit none of it needs to be. */
  llmmem_status_t (*decommit)(void *ctx, void *ptr, size_t bytes);
  llmmem_status_t (*commit)(void *ctx, void *ptr, size_t bytes);
  /* Optional: called once by llmmem_pool_create, before the first reserve, with the pool's
   * options, so that a backend sets aside no more than the pool can use (address space beyond
   * max_size, room to grow when the pool never resizes). */
  void (*configure)(void *ctx, const struct llmmem_pool_options_s *options);
} llmmem_pool_backend_t;

typedef struct llmmem_pool_options_s {
  size_t initial_size; /* bytes reserved at creation in one segment, kept until destroy (0: none) */
  size_t max_size;     /* cap on reserved bytes; 0 = no cap beyond what the backend gives */
  size_t growth_size;  /* bytes: growth segments (or in-place growth steps) are at least this big
                           (0: just what the request lacks, rounded up to 2 MiB) */
  int fixed_segments;  /* 1: never resize regions even when the backend can (each growth is a new
                           segment, as with cudaMalloc); for comparisons and tests */
} llmmem_pool_options_t;

/* A statistic that goes up and down, with its high-water mark since creation or the last reset. */
typedef struct llmmem_pool_stat_s {
  int64_t current;
  int64_t peak;
} llmmem_pool_stat_t;

/* Statistics in PyTorch's vocabulary (torch.cuda.memory_stats). Bytes unless named otherwise. */
typedef struct llmmem_pool_stats_s {
  llmmem_pool_stat_t allocated_bytes; /* live blocks, sizes rounded to 512 B */
  llmmem_pool_stat_t requested_bytes; /* live blocks, sizes as asked for */
  llmmem_pool_stat_t active_bytes;    /* allocated + freed blocks still awaiting a stream event */
  llmmem_pool_stat_t reserved_bytes;  /* segments obtained from the backend */
  llmmem_pool_stat_t allocations;     /* number of live blocks */
  llmmem_pool_stat_t segments;        /* number of segments */
  uint64_t num_allocs;                /* successful allocations since creation */
  uint64_t num_frees;                 /* successful frees since creation */
  uint64_t num_ooms;                  /* allocations refused for lack of memory */
  uint64_t num_invalid_frees;         /* double frees and foreign pointers refused */
  uint64_t num_backend_reserves;      /* backend calls that take memory: reserve (cudaMalloc, ...),
                                          in-place growth, commit of decommitted pages */
  uint64_t num_backend_releases;      /* ... that give it back: release, shrink, decommit */
  uint64_t num_event_waits;           /* host waits on stream events (OOM path, empty_cache) */
  size_t free_bytes;                  /* reserved - allocated */
  size_t decommitted_bytes;           /* free address space inside segments whose memory was given
                                          back (pages of holes, see the backend's decommit); not in
                                          reserved_bytes, committed again when handed out */
  size_t largest_free_block;          /* the longest free stretch of reserved (committed) memory:
                                          decommitted pages inside a free block break it, so it is
                                          never more than free_bytes (a request may still get a
                                          bigger block by committing those pages again) */
  double fragmentation;               /* 1 - largest_free_block / free_bytes, 0 when nothing is free */
  size_t small_chunks;                /* 2 MiB chunks currently carved for small requests */
  size_t initial_size;
  size_t max_size; /* 0 = uncapped */
} llmmem_pool_stats_t;

typedef enum llmmem_pool_block_state_e {
  LLMMEM_POOL_BLOCK_FREE = 0,
  LLMMEM_POOL_BLOCK_ALLOCATED = 1,
  LLMMEM_POOL_BLOCK_FREE_PENDING = 2, /* free, but reusable on other streams only after its event */
} llmmem_pool_block_state_t;

/* One block of a snapshot, in address order within its segment. */
typedef struct llmmem_pool_block_info_s {
  uintptr_t segment_base;
  size_t segment_size;
  uintptr_t addr;
  size_t size;      /* bytes, multiple of 512 */
  size_t requested; /* bytes asked for (0 when free) */
  int state;        /* llmmem_pool_block_state_t */
  int small;        /* 1 when inside a 2 MiB chunk for small requests */
  uintptr_t stream; /* allocation stream (allocated) or stream freed on (pending) */
} llmmem_pool_block_info_t;

/* Creates a pool over `backend` (copied; the pool owns backend->ctx from now on, even on failure).
 * Reserves options->initial_size at once. NULL options = all defaults. */
LLMMEM_API llmmem_status_t llmmem_pool_create(const llmmem_pool_backend_t *backend,
                                              const llmmem_pool_options_t *options, llmmem_pool_t **out);

/* Releases every segment and frees the pool. LLMMEM_ERR_STATE (and nothing done) while blocks are
 * still allocated, or while another thread is already destroying it. Safe against concurrent
 * calls through the pool's pluggable slots (see llmmem_pool_bind_slot); other concurrent calls on
 * the pool itself are the caller's bug, as with free(). */
LLMMEM_API llmmem_status_t llmmem_pool_destroy(llmmem_pool_t *pool);

/* For owners that go away while blocks are still out (a Python object collected while PyTorch
 * still holds segments): the pool destroys itself when its last block is freed, or now if none. */
LLMMEM_API void llmmem_pool_release_when_empty(llmmem_pool_t *pool);

/* A block of at least `size` bytes (> 0), 512-byte aligned, for use on `stream` (NULL for host
 * pools or CUDA's default stream). LLMMEM_ERR_NOMEM when max_size or the backend is exhausted. */
LLMMEM_API llmmem_status_t llmmem_pool_alloc(llmmem_pool_t *pool, size_t size, void *stream, void **out);

/* Returns a block, freed on `stream` (on CUDA an event is recorded there; other streams reuse the
 * block once it completes). A pointer the pool never handed out, a pointer inside a block, or a
 * second free: LLMMEM_ERR_INVALID, nothing changed. NULL: nothing to do. If the event cannot be
 * recorded (a CUDA error, or the stream is capturing a graph) the block stays allocated and the
 * backend's status is returned: memory is kept rather than risked. */
LLMMEM_API llmmem_status_t llmmem_pool_free(llmmem_pool_t *pool, void *ptr, void *stream);

/* Size asked for of a live block `ptr` (LLMMEM_ERR_INVALID when not live). */
LLMMEM_API llmmem_status_t llmmem_pool_block_size(llmmem_pool_t *pool, const void *ptr, size_t *requested);

/* Gives fully free growth segments back to the backend (the initial segment stays), and, where
 * the backend resizes, the free end of the others in 2 MiB steps. Waits for pending stream events
 * first. Never commits memory. *released (may be NULL) = bytes of memory given back, which is what
 * reserved_bytes drops by (pages decommitted earlier are not counted again). */
LLMMEM_API llmmem_status_t llmmem_pool_empty_cache(llmmem_pool_t *pool, size_t *released);

LLMMEM_API llmmem_status_t llmmem_pool_stats(llmmem_pool_t *pool, llmmem_pool_stats_t *out);

/* Sets every peak to its current value. */
LLMMEM_API llmmem_status_t llmmem_pool_reset_peak_stats(llmmem_pool_t *pool);

/* Fills up to `capacity` blocks (all segments, address order) and sets *count to the number of
 * blocks there are; call with capacity 0 first to size the array. */
LLMMEM_API llmmem_status_t llmmem_pool_snapshot(llmmem_pool_t *pool, llmmem_pool_block_info_t *out, size_t capacity,
                                                size_t *count);

/* The backend's name and device ("host"/-1, "pinned"/-1, "cuda"/ordinal). */
LLMMEM_API llmmem_status_t llmmem_pool_device(llmmem_pool_t *pool, const char **name, int *device);

/* ---- backends ---------------------------------------------------------------------------- */

/* Ordinary host memory (pinned = 0) or page-locked host memory through the CUDA runtime
 * (pinned = 1: LLMMEM_ERR_NOT_BUILT without CUDA, LLMMEM_ERR_NO_DEVICE without a driver).
 * Ordinary memory regions sit in a reserved virtual address range (mmap PROT_NONE) no larger than
 * they can ever hold, so they can grow in place (resize); page-locked ones cannot. Ordinary memory
 * is committed only when the system can back it (MemAvailable + SwapFree, the cgroup's limit,
 * RLIMIT_DATA; LLMMEM_ERR_NOMEM naming both figures otherwise) and populated when committed. */
LLMMEM_API llmmem_status_t llmmem_pool_backend_host(int pinned, llmmem_pool_backend_t *out);

/* Device memory of CUDA device `device` through cudaMalloc/cudaFree, with cudaEvents for stream
 * ordering. Regions cannot grow in place: the pool grows by separate segments. LLMMEM_ERR_NOT_BUILT
 * in a CPU-only build. */
LLMMEM_API llmmem_status_t llmmem_pool_backend_cuda(int device, llmmem_pool_backend_t *out);

/* Device memory that grows in place (name "cuda_vmm"): each region reserves virtual address space
 * as large as the device (cuMemAddressReserve) and maps physical memory into it in allocation
 * granules (cuMemCreate + cuMemMap + cuMemSetAccess), so it has resize, decommit and commit like
 * the host backend. cudaEvents for stream ordering. Physical memory is mapped in whole granules
 * (2 MiB on current GPUs): a region whose size is not a multiple of it maps up to one granule more
 * than reserved_bytes counts, as cudaMalloc rounds too. LLMMEM_ERR_NO_DEVICE (the reason in the
 * detail) when the driver or device lacks virtual memory management: use llmmem_pool_backend_cuda
 * then. LLMMEM_ERR_NOT_BUILT in a CPU-only build. Not yet validated on a GPU. */
LLMMEM_API llmmem_status_t llmmem_pool_backend_cuda_vmm(int device, llmmem_pool_backend_t *out);

/* How much host memory this process can still commit, as the host backend sees it before it
 * commits: `available` (bytes; SIZE_MAX when nothing known bounds it), `bound` (what sets it, a
 * static string: "MemAvailable + SwapFree", "the cgroup's memory limit", "RLIMIT_DATA" or "no limit
 * known") and `total` (the most the process could ever have: RAM + swap, the cgroup's limit,
 * RLIMIT_DATA, RLIMIT_AS). Reads a few small files under /proc and /sys (tens of microseconds).
 * Any out-parameter may be NULL. Always LLMMEM_OK. */
LLMMEM_API llmmem_status_t llmmem_pool_host_memory(size_t *available, size_t *total, const char **bound);

/* ---- PyTorch's pluggable-allocator entry points ------------------------------------------ */

/* torch.cuda.memory.CUDAPluggableAllocator takes two exported C functions by name and no user
 * pointer, so pools are bound to numbered slots, each with its own pair of entry points:
 *   void *llmmem_pool_alloc_<k>(size_t size, int device, cudaStream_t stream);   size 0 -> NULL
 *   void  llmmem_pool_free_<k>(void *ptr, size_t size, int device, cudaStream_t stream);
 * An alloc that fails returns NULL (PyTorch's caching allocator then raises its OOM error). */
#define LLMMEM_POOL_SLOTS 16

/* Binds `pool` to a free slot. LLMMEM_ERR_STATE when all slots are taken.
 *
 * Slot calls may run on any thread at any time, concurrently with llmmem_pool_destroy (PyTorch
 * holds no lock of ours): destroy first refuses new allocations, unbinds the pool and waits for
 * the calls already inside it, so a call either completes on the live pool or fails cleanly (alloc
 * NULL, free ignored, the reason in llmmem_last_error()). unbind_slot also waits for the calls
 * running through that slot. */
LLMMEM_API llmmem_status_t llmmem_pool_bind_slot(llmmem_pool_t *pool, int *slot);
LLMMEM_API llmmem_status_t llmmem_pool_unbind_slot(int slot);
/* Calls through slot `slot` exactly as PyTorch does (for tests and for languages without dlsym). */
LLMMEM_API void *llmmem_pool_slot_alloc(int slot, size_t size, int device, void *stream);
LLMMEM_API void llmmem_pool_slot_free(int slot, void *ptr, size_t size, int device, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* LLMMEM_POOL_H */
