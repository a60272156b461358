/*
 * head_check.c — what every entry point of the LM head's passes checks before it reads anything.
 */
#include <math.h>
#include <stdint.h>

#include "head_internal.h"
#include "internal.h"

size_t _llmmem_head_dtype_size(int32_t dtype) {
  switch (dtype) {
    case LLMMEM_HEAD_F32: return 4;
    case LLMMEM_HEAD_F16:
    case LLMMEM_HEAD_BF16: return 2;
    default: return 0;
  }
}

llmmem_status_t _llmmem_head_check(const char *fn, const llmmem_head_chunk_t *c, int check_labels) {
  LLMMEM_CHECK_ARG(c != NULL, "%s: chunk must not be NULL", fn);
  const size_t es = _llmmem_head_dtype_size(c->dtype);
  LLMMEM_CHECK_ARG(es != 0, "%s: dtype %d is not a logits dtype (0=f32 1=f16 2=bf16)", fn, (int)c->dtype);
  LLMMEM_CHECK_ARG(c->rows >= 0, "%s: rows is negative (%lld)", fn, (long long)c->rows);
  LLMMEM_CHECK_ARG(c->vocab >= 1, "%s: vocab must be >= 1, got %lld", fn, (long long)c->vocab);
  LLMMEM_CHECK_ARG(c->ld >= c->vocab, "%s: ld %lld is below vocab %lld", fn, (long long)c->ld, (long long)c->vocab);
  LLMMEM_CHECK_ARG(c->vocab_start >= 0 && c->vocab_total >= 1 && c->vocab_start <= c->vocab_total - c->vocab,
                   "%s: the shard [%lld, %lld + %lld) is not inside the vocabulary of %lld", fn,
                   (long long)c->vocab_start, (long long)c->vocab_start, (long long)c->vocab,
                   (long long)c->vocab_total);
  LLMMEM_CHECK_ARG(c->label_smoothing >= 0.0f && c->label_smoothing <= 1.0f,
                   "%s: label_smoothing must be in [0, 1], got %g", fn, (double)c->label_smoothing);
  LLMMEM_CHECK_ARG(c->softcap == 0.0f || (c->softcap > 0.0f && isfinite(c->softcap)),
                   "%s: softcap must be 0 (none) or a finite number > 0, got %g", fn, (double)c->softcap);
  if (c->rows == 0) return LLMMEM_OK;
  LLMMEM_CHECK_ARG(c->logits != NULL && c->labels != NULL, "%s: logits and labels must not be NULL", fn);
  LLMMEM_CHECK_ARG((uintptr_t)c->logits % es == 0, "%s: logits are not aligned to their %zu-byte elements", fn, es);
  LLMMEM_CHECK_ARG((uint64_t)c->rows <= (uint64_t)(INT64_MAX / c->ld), "%s: rows x ld overflows", fn);
  if (check_labels) {
    for (int64_t i = 0; i < c->rows; i++) {
      const int64_t t = c->labels[i];
      if (t != c->ignore_index && (t < 0 || t >= c->vocab_total))
        return LLMMEM_FAIL(LLMMEM_ERR_INVALID,
                           "%s: label %lld of row %lld is outside [0, %lld) and not ignore_index (%lld)", fn,
                           (long long)t, (long long)i, (long long)c->vocab_total, (long long)c->ignore_index);
    }
  }
  return LLMMEM_OK;
}

LLMMEM_API llmmem_status_t llmmem_head_check(const llmmem_head_chunk_t *chunk) {
  return _llmmem_head_check("llmmem_head_check", chunk, 1);
}
