/*
 * scaler_internal.h — what the files of csrc/scaler share (C and CUDA). Not part of the ABI.
 */
#ifndef LLMMEM_SCALER_INTERNAL_H
#define LLMMEM_SCALER_INTERNAL_H

#include <llmmem/scaler.h>

#ifdef __cplusplus
extern "C" {
#endif

/* unscale_cpu.c: checks the tensor list of `fn` (its name goes into the error detail); on success
 * *total_bytes is the bytes of all tensors together. Used by the CPU and the CUDA unscale. */
llmmem_status_t _llmmem_scaler_check_tensors(const char *fn, const llmmem_scaler_tensor_t *tensors, size_t count,
                                             const float *found_inf, const uint8_t *tensor_flags, size_t n_flags,
                                             size_t *total_bytes);

/* unscale_cpu.c test hook (not exported): 0 = plain C, 1 = AVX2+F16C, 2 = AVX-512, -1 = automatic.
 * Levels the CPU lacks fall back to the best it has. Returns the level that will run. */
int _llmmem_scaler_force_isa(int isa);

#ifdef __cplusplus
}
#endif

#endif /* LLMMEM_SCALER_INTERNAL_H */
