/*
 * adamw_cuda_stub.c — the CUDA entry point of the optimizer in a CPU-only build: it checks its
 * arguments like the real one, then says CUDA was not built. Compiled only when adamw.cu is not.
 */
#include <llmmem/optim.h>

#include "internal.h"
#include "optim_internal.h"

LLMMEM_API llmmem_status_t llmmem_optim_adamw_step_cuda(const llmmem_optim_tensor_t *tensors, size_t count,
                                                        const llmmem_optim_adamw_config_t *cfg, int device,
                                                        void *stream) {
  int64_t total;
  (void)device, (void)stream;
  LLMMEM_TRY(_llmmem_optim_check_step("llmmem_optim_adamw_step_cuda", tensors, count, cfg, &total));
  return LLMMEM_FAIL(LLMMEM_ERR_NOT_BUILT,
                     "llmmem_optim_adamw_step_cuda: llmmem was built without CUDA (LLMMEM_CUDA=0 or no nvcc found); "
                     "keep the parameters on the CPU or rebuild with nvcc");
}
