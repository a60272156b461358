/*
 * shm_collectives.c — all-reduce, all-gather and reduce-scatter over the shared segment.
 *
 * Every collective is a sequence of steps ("chunks"), each moving at most one slot per rank:
 *   all-reduce, small message (one-shot): copy in -> my slot; barrier; every rank sums all slots.
 *   all-reduce, larger message (two-shot, chunks of <= TWO_SHOT_STEP_BYTES): copy the parts of
 *       in that peers reduce -> my slot; barrier; rank r sums part r (its own part read straight
 *       from `in`, the others' from their slots) into `out` and into part r of its slot; barrier;
 *       every rank copies the other parts out. Each rank reads the chunk about once instead of
 *       world times, which wins once the chunk outgrows caches; skipping its own part in the
 *       copies saves 1/world of the traffic. Chunks are pipelined: chunk k+1's copy-in shares
 *       the barrier that ends chunk k's reduce, so a message of m chunks needs m + 1 barriers.
 *   all-gather: copy in -> my slot; barrier; copy every slot out in rank order.
 *   reduce-scatter: copy the world blocks of in -> my slot; barrier; sum block r of every slot.
 * Sums go through _llmmem_comm_sum (fp32, rank order 0..n-1), so one-shot and two-shot give the
 * same bits and every rank gets the same result. The first step of a collective also checks that
 * every rank called the same collective with the same dtype and size.
 */
#include <stdio.h>
#include <string.h>

#include "shm_internal.h"

/* Messages up to this many bytes are reduced one-shot: one barrier instead of two, which is what
 * counts below a few tens of KiB. Above it two-shot wins, as one-shot reads world x the data
 * (measured: benchmarks/README.md). */
#define ONE_SHOT_MAX_BYTES (32u * 1024u)
/* Two-shot chunks move at most this many bytes (and at most a slot). With the chunks pipelined
 * (one barrier each), small chunks win or tie, most clearly when ranks share a core: a chunk's
 * slots stay in L2 and the next chunk's copy-in overlaps the peers' lag (benchmarks/README.md). */
#define TWO_SHOT_STEP_BYTES(world) ((world) <= 2 ? 128u * 1024u : 64u * 1024u)

static _Atomic size_t forced_chunk_bytes; /* 0: TWO_SHOT_STEP_BYTES; else a probe's choice */

size_t _llmmem_shm_force_chunk_bytes(size_t bytes) {
  forced_chunk_bytes = bytes;
  return bytes;
}

static const char *op_name(shm_op_t kind) {
  switch (kind) {
    case SHM_OP_ALL_REDUCE: return "all_reduce";
    case SHM_OP_ALL_GATHER: return "all_gather";
    default: return "reduce_scatter";
  }
}

_Static_assert(LLMMEM_SHM_MAX_WORLD * 64 <= 4096, "a 4 KiB slot must hold one cache line per rank");

static llmmem_status_t check_call(llmmem_shm_comm_t *c, const void *in, void *out, size_t count,
                                  llmmem_comm_dtype_t dtype, shm_op_t kind) {
  const char *what = op_name(kind);
  LLMMEM_CHECK_ARG(c != NULL, "llmmem_shm_%s: comm must not be NULL", what);
  LLMMEM_CHECK_ARG(llmmem_comm_dtype_size(dtype) != 0, "llmmem_shm_%s: unknown dtype %d", what, (int)dtype);
  LLMMEM_CHECK_ARG(count == 0 || (in != NULL && out != NULL), "llmmem_shm_%s: in and out must not be NULL", what);
  LLMMEM_CHECK_ARG(count <= ((size_t)1 << 48), "llmmem_shm_%s: count %zu is too large", what, count);
  if (c->broken)
    return LLMMEM_FAIL(LLMMEM_ERR_STATE,
                       "llmmem shm %s: the communicator is broken by an earlier failure; "
                       "set up a new one",
                       what);
  return LLMMEM_OK;
}

/* Publishes this rank's descriptor of collective `seq` (read by peers after the next barrier). */
static void post_desc(llmmem_shm_comm_t *c, shm_op_t kind, llmmem_comm_dtype_t dtype, size_t count) {
  shm_desc_t *d = &c->ctl[c->rank].desc[c->seq & 1u];
  d->seq = c->seq;
  d->kind = (uint32_t)kind;
  d->dtype = (uint32_t)dtype;
  d->count = count;
}

/* After the first barrier: every rank sees the same descriptors, so all agree on a mismatch. */
static llmmem_status_t check_descs(llmmem_shm_comm_t *c) {
  const shm_desc_t *mine = &c->ctl[c->rank].desc[c->seq & 1u];
  for (int q = 0; q < c->world_size; q++) {
    const shm_desc_t *d = &c->ctl[q].desc[c->seq & 1u];
    if (d->seq != mine->seq || d->kind != mine->kind || d->dtype != mine->dtype || d->count != mine->count) {
      c->broken = 1;
      return LLMMEM_FAIL(LLMMEM_ERR_INVALID,
                         "llmmem shm %s: ranks disagree: rank %d called %s #%llu with dtype %u and %llu elements, "
                         "rank %d called %s #%llu with dtype %u and %llu elements",
                         op_name((shm_op_t)mine->kind), c->rank, op_name((shm_op_t)mine->kind),
                         (unsigned long long)mine->seq, mine->dtype, (unsigned long long)mine->count, q,
                         op_name((shm_op_t)d->kind), (unsigned long long)d->seq, d->dtype,
                         (unsigned long long)d->count);
    }
  }
  return LLMMEM_OK;
}

/* One barrier of step `first` of a collective: the first also validates the descriptors. */
static llmmem_status_t step_barrier(llmmem_shm_comm_t *c, shm_op_t kind, int first) {
  LLMMEM_TRY(_llmmem_shm_barrier(c, op_name(kind)));
  if (first) LLMMEM_TRY(check_descs(c));
  return LLMMEM_OK;
}

/* Splits [0, n) into world parts aligned to 64 bytes (whole cache lines per rank). */
static void part(size_t n, size_t esize, int world, int r, size_t *lo, size_t *hi) {
  size_t align = 64 / esize;
  size_t per = (n + (size_t)world - 1) / (size_t)world;
  per = _llmmem_round_up(per, align);
  *lo = (size_t)r * per < n ? (size_t)r * per : n;
  *hi = *lo + per < n ? *lo + per : n;
}

/* Two-shot all-reduce of chunk [off, off + n) through the slots of `step` (see the file header).
 * Part q of a chunk lives at element q * stride of a slot, whatever the chunk's length: a short
 * last chunk has shorter parts, but each stays inside its own fixed region, which the pipelining
 * below relies on. */
static void two_shot_copy_in(llmmem_shm_comm_t *c, const unsigned char *in, size_t off, size_t n, size_t es,
                             size_t stride, uint64_t step) {
  unsigned char *mine = shm_slot(c, c->rank, step);
  size_t lo, hi;
  for (int q = 0; q < c->world_size; q++) {
    if (q == c->rank) continue;
    part(n, es, c->world_size, q, &lo, &hi);
    memcpy(mine + (size_t)q * stride * es, in + (off + lo) * es, (hi - lo) * es);
  }
}

static void two_shot_reduce(llmmem_shm_comm_t *c, const unsigned char *in, unsigned char *out, size_t off, size_t n,
                            size_t es, size_t stride, llmmem_comm_dtype_t dtype, uint64_t step) {
  const void *srcs[LLMMEM_SHM_MAX_WORLD];
  size_t lo, hi;
  part(n, es, c->world_size, c->rank, &lo, &hi);
  const size_t at = (size_t)c->rank * stride * es; /* my part's region in every slot */
  /* Only this rank reads part `rank` of `in` and writes part `rank` of `out`, block by block
   * after reading, so in == out is safe; peers read our slot's part, written here too. */
  for (int q = 0; q < c->world_size; q++) srcs[q] = q == c->rank ? in + (off + lo) * es : shm_slot(c, q, step) + at;
  _llmmem_comm_sum2(srcs, c->world_size, out + (off + lo) * es, shm_slot(c, c->rank, step) + at, hi - lo, dtype);
}

static void two_shot_copy_out(llmmem_shm_comm_t *c, unsigned char *out, size_t off, size_t n, size_t es, size_t stride,
                              uint64_t step) {
  size_t lo, hi;
  for (int q = 0; q < c->world_size; q++) {
    if (q == c->rank) continue;
    part(n, es, c->world_size, q, &lo, &hi);
    memcpy(out + (off + lo) * es, shm_slot(c, q, step) + (size_t)q * stride * es, (hi - lo) * es);
  }
}

llmmem_status_t llmmem_shm_all_reduce(llmmem_shm_comm_t *c, const void *in, void *out, size_t count,
                                      llmmem_comm_dtype_t dtype) {
  LLMMEM_TRY(check_call(c, in, out, count, dtype, SHM_OP_ALL_REDUCE));
  const size_t es = llmmem_comm_dtype_size(dtype);
  const unsigned char *src = in;
  unsigned char *dst = out;
  c->seq++;
  post_desc(c, SHM_OP_ALL_REDUCE, dtype, count);
  /* Every rank decides from (count, dtype, slot size, world), which are equal on all ranks. */
  if (count * es <= ONE_SHOT_MAX_BYTES || c->world_size == 1) {
    const size_t per_step = c->slot_bytes / es;
    const void *srcs[LLMMEM_SHM_MAX_WORLD];
    size_t off = 0;
    int first = 1;
    do {
      size_t n = count - off < per_step ? count - off : per_step;
      uint64_t step = c->step++;
      memcpy(shm_slot(c, c->rank, step), src + off * es, n * es);
      LLMMEM_TRY(step_barrier(c, SHM_OP_ALL_REDUCE, first));
      for (int q = 0; q < c->world_size; q++) srcs[q] = shm_slot(c, q, step);
      _llmmem_comm_sum(srcs, c->world_size, dst + off * es, n, dtype);
      first = 0;
      off += n;
    } while (off < count);
    return LLMMEM_OK;
  }
  /* Two-shot, pipelined: one barrier per chunk (plus one). After the barrier that ends chunk k's
   * reduce, a rank copies chunk k's reduced parts out and reduces chunk k+1, whose inputs the same
   * barrier published. Slots stay safe with two buffers: the parts a rank copies in for chunk
   * k+2 (buffer k & 1) were last read by the peers' reduce of chunk k, before the barrier that
   * ends chunk k+1; the part it reduces into was last read by the peers' copy-out of chunk k,
   * before the barrier that starts chunk k+2's reduce. */
  const size_t forced = forced_chunk_bytes;
  const size_t chunk_max = forced ? forced : TWO_SHOT_STEP_BYTES(c->world_size);
  const size_t step_bytes = c->slot_bytes < chunk_max ? c->slot_bytes : chunk_max;
  /* part regions: whole cache lines, world of them fit a step (slots are >= 4 KiB: >= 1 line each) */
  const size_t align = 64 / es, stride = step_bytes / es / (size_t)c->world_size / align * align;
  const size_t per_step = stride * (size_t)c->world_size;
  const uint64_t step0 = c->step;
  const size_t chunks = (count + per_step - 1) / per_step;
  c->step += chunks;
  two_shot_copy_in(c, src, 0, count < per_step ? count : per_step, es, stride, step0);
  LLMMEM_TRY(step_barrier(c, SHM_OP_ALL_REDUCE, 1));
  for (size_t k = 0; k < chunks; k++) {
    size_t off = k * per_step, n = count - off < per_step ? count - off : per_step;
    two_shot_reduce(c, src, dst, off, n, es, stride, dtype, step0 + k);
    if (k + 1 < chunks) {
      size_t off1 = off + n, n1 = count - off1 < per_step ? count - off1 : per_step;
      two_shot_copy_in(c, src, off1, n1, es, stride, step0 + k + 1);
    }
    LLMMEM_TRY(_llmmem_shm_barrier(c, "all_reduce"));
    two_shot_copy_out(c, dst, off, n, es, stride, step0 + k);
  }
  return LLMMEM_OK;
}

llmmem_status_t llmmem_shm_all_gather(llmmem_shm_comm_t *c, const void *in, void *out, size_t count,
                                      llmmem_comm_dtype_t dtype) {
  LLMMEM_TRY(check_call(c, in, out, count, dtype, SHM_OP_ALL_GATHER));
  const size_t es = llmmem_comm_dtype_size(dtype), per_step = c->slot_bytes / es;
  c->seq++;
  post_desc(c, SHM_OP_ALL_GATHER, dtype, count);
  size_t off = 0;
  int first = 1;
  do {
    size_t n = count - off < per_step ? count - off : per_step;
    uint64_t step = c->step++;
    memcpy(shm_slot(c, c->rank, step), (const unsigned char *)in + off * es, n * es);
    LLMMEM_TRY(step_barrier(c, SHM_OP_ALL_GATHER, first));
    first = 0;
    for (int q = 0; q < c->world_size; q++)
      memcpy((unsigned char *)out + ((size_t)q * count + off) * es, shm_slot(c, q, step), n * es);
    off += n;
  } while (off < count);
  return LLMMEM_OK;
}

llmmem_status_t llmmem_shm_reduce_scatter(llmmem_shm_comm_t *c, const void *in, void *out, size_t count,
                                          llmmem_comm_dtype_t dtype) {
  LLMMEM_TRY(check_call(c, in, out, count, dtype, SHM_OP_REDUCE_SCATTER));
  const size_t es = llmmem_comm_dtype_size(dtype), per_step = c->slot_bytes / es / (size_t)c->world_size;
  const void *srcs[LLMMEM_SHM_MAX_WORLD];
  c->seq++;
  post_desc(c, SHM_OP_REDUCE_SCATTER, dtype, count);
  size_t off = 0;
  int first = 1;
  do {
    size_t n = count - off < per_step ? count - off : per_step;
    uint64_t step = c->step++;
    unsigned char *mine = shm_slot(c, c->rank, step);
    /* slot layout for this step: world blocks of n elements, block d destined for rank d */
    for (int d = 0; d < c->world_size; d++)
      memcpy(mine + (size_t)d * n * es, (const unsigned char *)in + ((size_t)d * count + off) * es, n * es);
    LLMMEM_TRY(step_barrier(c, SHM_OP_REDUCE_SCATTER, first));
    first = 0;
    for (int q = 0; q < c->world_size; q++) srcs[q] = shm_slot(c, q, step) + (size_t)c->rank * n * es;
    _llmmem_comm_sum(srcs, c->world_size, (unsigned char *)out + off * es, n, dtype);
    off += n;
  } while (off < count);
  return LLMMEM_OK;
}
