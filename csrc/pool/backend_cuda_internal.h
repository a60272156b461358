/*
 * backend_cuda_internal.h — what the two CUDA device backends share (C++, .cu files only): the
 * device guard (cuda_device_guard.h), and stream events for stream-ordered reuse. backend_cuda.cu
 * defines the events and the cudaMalloc backend; backend_cuda_vmm.cu the backend that grows
 * regions in place.
 */
#ifndef LLMMEM_POOL_BACKEND_CUDA_INTERNAL_H
#define LLMMEM_POOL_BACKEND_CUDA_INTERNAL_H

#include <cuda_runtime_api.h>

#include <vector>

#include "cuda_device_guard.h"
#include "pool_internal.h"

namespace llmmem_cuda {

/* The state every CUDA device backend starts with; the event functions take a pointer to it. */
struct cuda_ctx {
  int device;
  std::vector<cudaEvent_t> spare_events; // recycled: creating events is far slower than recording them
};

/* The backend's event hooks (llmmem_pool_backend_t), for a ctx that is a cuda_ctx. */
llmmem_status_t event_record(void *vctx, void *stream, void **out);
int event_done(void *vctx, void *event);
llmmem_status_t event_wait(void *vctx, void *event);
void event_release(void *vctx, void *event);
/* Destroys the spare events (the caller then deletes its ctx). */
void destroy_events(cuda_ctx *ctx);

} // namespace llmmem_cuda

#endif /* LLMMEM_POOL_BACKEND_CUDA_INTERNAL_H */
