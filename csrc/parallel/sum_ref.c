/*
 * sum_ref.c — the reference of the reduction every llmmem collective does: the oracle of the
 * vectorised CPU sum (sum_cpu.c, used by the shared-memory engine) and of the CUDA kernel.
 *
 * out[i] = ((src0[i] + src1[i]) + src2[i]) + ... accumulated in fp32, rounded once to the
 * element type. The order is fixed (rank 0 first), so any rank that computes an element gets the
 * same bits. Work is done in blocks through a small fp32 buffer: sources are fully read before
 * the block of `out` is written, which makes aliasing `out` with a source safe, and the inner
 * loops are simple enough for the compiler to vectorise.
 */
#include <llmmem/parallel.h>

#include "half.h"
#include "internal.h"

enum { BLOCK = 512 }; /* elements per block: 2 KiB of fp32 accumulator, stays in L1 */

size_t llmmem_comm_dtype_size(llmmem_comm_dtype_t dtype) {
  switch (dtype) {
    case LLMMEM_COMM_F32: return 4;
    case LLMMEM_COMM_F16: return 2;
    case LLMMEM_COMM_BF16: return 2;
    default: return 0;
  }
}

static void load_block(float *acc, const void *src, size_t off, size_t n, llmmem_comm_dtype_t dtype, int add) {
  if (dtype == LLMMEM_COMM_F32) {
    const float *s = (const float *)src + off;
    if (add)
      for (size_t i = 0; i < n; i++) acc[i] += s[i];
    else
      for (size_t i = 0; i < n; i++) acc[i] = s[i];
  } else if (dtype == LLMMEM_COMM_BF16) {
    const uint16_t *s = (const uint16_t *)src + off;
    if (add)
      for (size_t i = 0; i < n; i++) acc[i] += llmmem_bf16_to_f32(s[i]);
    else
      for (size_t i = 0; i < n; i++) acc[i] = llmmem_bf16_to_f32(s[i]);
  } else {
    const uint16_t *s = (const uint16_t *)src + off;
    if (add)
      for (size_t i = 0; i < n; i++) acc[i] += llmmem_f16_to_f32(s[i]);
    else
      for (size_t i = 0; i < n; i++) acc[i] = llmmem_f16_to_f32(s[i]);
  }
}

static void store_block(void *dst, size_t off, const float *acc, size_t n, llmmem_comm_dtype_t dtype) {
  if (dtype == LLMMEM_COMM_F32) {
    memcpy((float *)dst + off, acc, n * sizeof(float));
  } else if (dtype == LLMMEM_COMM_BF16) {
    uint16_t *d = (uint16_t *)dst + off;
    for (size_t i = 0; i < n; i++) d[i] = llmmem_f32_to_bf16(acc[i]);
  } else {
    uint16_t *d = (uint16_t *)dst + off;
    for (size_t i = 0; i < n; i++) d[i] = llmmem_f32_to_f16(acc[i]);
  }
}

/* The plain reference: what every faster variant (sum_cpu.c, the CUDA kernel) must reproduce. */
static void sum_ref(const void *const *srcs, int nsrc, void *out, size_t count, llmmem_comm_dtype_t dtype) {
  float acc[BLOCK];
  for (size_t off = 0; off < count; off += BLOCK) {
    size_t n = count - off < BLOCK ? count - off : BLOCK;
    load_block(acc, srcs[0], off, n, dtype, 0);
    for (int r = 1; r < nsrc; r++) load_block(acc, srcs[r], off, n, dtype, 1);
    store_block(out, off, acc, n, dtype);
  }
}

llmmem_status_t llmmem_comm_sum_ref(const void *const *srcs, int nsrc, void *out, size_t count,
                                    llmmem_comm_dtype_t dtype) {
  LLMMEM_CHECK_ARG(llmmem_comm_dtype_size(dtype) != 0, "llmmem_comm_sum_ref: unknown dtype %d", (int)dtype);
  LLMMEM_CHECK_ARG(nsrc > 0, "llmmem_comm_sum_ref: nsrc must be > 0, got %d", nsrc);
  LLMMEM_CHECK_ARG(srcs != NULL, "llmmem_comm_sum_ref: srcs must not be NULL");
  LLMMEM_CHECK_ARG(count == 0 || out != NULL, "llmmem_comm_sum_ref: out must not be NULL");
  for (int r = 0; r < nsrc; r++)
    LLMMEM_CHECK_ARG(count == 0 || srcs[r] != NULL, "llmmem_comm_sum_ref: srcs[%d] must not be NULL", r);
  sum_ref(srcs, nsrc, out, count, dtype);
  return LLMMEM_OK;
}
