/*
 * head_internal.h — what the files of csrc/head share. Not part of the ABI.
 */
#ifndef LLMMEM_HEAD_INTERNAL_H
#define LLMMEM_HEAD_INTERNAL_H

#include <llmmem/head.h>

#include "head_math.h"

#ifdef __cplusplus
extern "C" {
#endif

/* head_check.c: the chunk's description checked (`labels` too when check_labels); `fn` names the
 * entry point in the detail. */
llmmem_status_t _llmmem_head_check(const char *fn, const llmmem_head_chunk_t *c, int check_labels);

/* head_check.c: bytes per logit of `dtype`, 0 for an unknown code. */
size_t _llmmem_head_dtype_size(int32_t dtype);

#ifdef __cplusplus
}
#endif

#endif /* LLMMEM_HEAD_INTERNAL_H */
