/*
 * build_info.c — version and what this binary was compiled with.
 *
 * The build system passes LLMMEM_CUDA_ARCHS and LLMMEM_NVCC_VERSION as string macros when it
 * compiles the CUDA part; the CUDA runtime version comes from cuda_info.cu itself, so a
 * CPU-only build never needs CUDA headers.
 */
#include "internal.h"

#ifndef LLMMEM_CUDA_ARCHS
#define LLMMEM_CUDA_ARCHS ""
#endif
#ifndef LLMMEM_NVCC_VERSION
#define LLMMEM_NVCC_VERSION ""
#endif

#if defined(__clang__)
#define LLMMEM_C_COMPILER "clang " __clang_version__
#elif defined(__GNUC__)
#define LLMMEM_C_COMPILER "gcc " __VERSION__
#else
#define LLMMEM_C_COMPILER "unknown"
#endif

/* Defined in cuda_info.cu when CUDA is compiled in, else in cuda_stub.c. */
int _llmmem_cuda_runtime_version_compiled(void);

LLMMEM_API llmmem_status_t llmmem_version(int *major, int *minor, int *patch) {
  LLMMEM_CHECK_ARG(major && minor && patch, "llmmem_version: major, minor and patch must not be NULL");
  *major = LLMMEM_VERSION_MAJOR;
  *minor = LLMMEM_VERSION_MINOR;
  *patch = LLMMEM_VERSION_PATCH;
  return LLMMEM_OK;
}

LLMMEM_API llmmem_status_t llmmem_build_info(llmmem_build_info_t *out) {
  LLMMEM_CHECK_ARG(out != NULL, "llmmem_build_info: out must not be NULL");
  int cudart = _llmmem_cuda_runtime_version_compiled();
  out->cuda_built = cudart > 0;
  out->cuda_runtime_version = cudart;
  out->cuda_archs = cudart > 0 ? LLMMEM_CUDA_ARCHS : "";
  out->c_compiler = LLMMEM_C_COMPILER;
  out->cuda_compiler = cudart > 0 ? LLMMEM_NVCC_VERSION : "";
  out->debug_level = LLMMEM_DEBUG;
  return LLMMEM_OK;
}
