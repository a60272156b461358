/*
 * cuda_allreduce_stub.c — the CUDA IPC all-reduce entry points of a CPU-only build: not built.
 * Compiled only when cuda_allreduce.cu is not.
 */
#include <llmmem/parallel.h>

#include "internal.h"

#define NOT_BUILT() LLMMEM_FAIL(LLMMEM_ERR_NOT_BUILT, "llmmem was built without CUDA (LLMMEM_CUDA=0 or no nvcc found)")

llmmem_status_t llmmem_cuda_ar_create(int device, int rank, int world_size, size_t max_bytes, double timeout_s,
                                      llmmem_cuda_ar_t **out, void *handle_out) {
  (void)device, (void)rank, (void)world_size, (void)max_bytes, (void)timeout_s, (void)handle_out;
  LLMMEM_CHECK_ARG(out != NULL, "llmmem_cuda_ar_create: out must not be NULL");
  *out = NULL;
  return NOT_BUILT();
}

llmmem_status_t llmmem_cuda_ar_connect(llmmem_cuda_ar_t *ar, const void *handles) {
  (void)ar, (void)handles;
  return NOT_BUILT();
}

llmmem_status_t llmmem_cuda_ar_close(llmmem_cuda_ar_t *ar) {
  (void)ar;
  return LLMMEM_OK;
}

llmmem_status_t llmmem_cuda_ar_all_reduce(llmmem_cuda_ar_t *ar, const void *in, void *out, size_t count,
                                          llmmem_comm_dtype_t dtype, void *stream) {
  (void)ar, (void)in, (void)out, (void)count, (void)dtype, (void)stream;
  return NOT_BUILT();
}

llmmem_status_t llmmem_cuda_ar_check(llmmem_cuda_ar_t *ar, void *stream) {
  (void)ar, (void)stream;
  return NOT_BUILT();
}
