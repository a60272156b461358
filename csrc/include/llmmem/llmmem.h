/*
 * llmmem.h — the public C ABI of llmmem: version, status codes, error reporting.
 *
 * Every exported function returns an llmmem_status_t and writes its results through
 * out-parameters. Nothing in the library exits, aborts or throws: on failure a function
 * returns a non-zero status and leaves a human-readable detail (with the C file and line
 * that detected it) in a thread-local buffer read by llmmem_last_error().
 *
 * This header has no Python and no PyTorch in it; it is plain C11.
 */
#ifndef LLMMEM_H
#define LLMMEM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LLMMEM_VERSION_MAJOR  0
#define LLMMEM_VERSION_MINOR  1
#define LLMMEM_VERSION_PATCH  0
#define LLMMEM_VERSION_STRING "0.1.0"

/* The library is built with -fvisibility=hidden; only names marked LLMMEM_API are exported. */
#if defined(__GNUC__) || defined(__clang__)
#define LLMMEM_API __attribute__((visibility("default")))
#else
#define LLMMEM_API
#endif

typedef enum llmmem_status_e {
  LLMMEM_OK = 0,
  LLMMEM_ERR_INVALID = 1,    /* an argument is out of range, NULL, or inconsistent */
  LLMMEM_ERR_NOMEM = 2,      /* host or device memory could not be obtained */
  LLMMEM_ERR_CUDA = 3,       /* a CUDA runtime call failed (detail names it) */
  LLMMEM_ERR_NO_DEVICE = 4,  /* built with CUDA, but no driver or no GPU at run time */
  LLMMEM_ERR_NOT_BUILT = 5,  /* the capability was not compiled into this build */
  LLMMEM_ERR_INFEASIBLE = 6, /* a request that cannot be met (e.g. a memory budget too small) */
  LLMMEM_ERR_STATE = 7,      /* a call made in the wrong order or on a destroyed object */
  LLMMEM_ERR_INTERNAL = 8,   /* a broken invariant inside llmmem: a bug, please report it */
  LLMMEM_STATUS_COUNT_ = 9
} llmmem_status_t;

/* A static, never-NULL name for a status ("invalid argument", ...). Unknown codes get "unknown status". */
LLMMEM_API const char *llmmem_strerror(llmmem_status_t status);

/* The detail of the last failure on the calling thread, or "" if none. The pointer stays valid
 * until the next llmmem call on this thread. */
LLMMEM_API const char *llmmem_last_error(void);

/* Forget the calling thread's last error detail. */
LLMMEM_API void llmmem_clear_error(void);

LLMMEM_API llmmem_status_t llmmem_version(int *major, int *minor, int *patch);

/* What this binary was built with. Strings are static. */
typedef struct llmmem_build_info_s {
  int cuda_built;            /* 1 when the CUDA kernels were compiled in */
  int cuda_runtime_version;  /* CUDART_VERSION the kernels were compiled against (e.g. 13000), 0 if none */
  const char *cuda_archs;    /* e.g. "sm_80,sm_90,compute_90", "" if none */
  const char *c_compiler;    /* compiler of the C core */
  const char *cuda_compiler; /* nvcc version line, "" if none */
  int debug_level;           /* LLMMEM_DEBUG the core was compiled with (0 = release) */
} llmmem_build_info_t;

LLMMEM_API llmmem_status_t llmmem_build_info(llmmem_build_info_t *out);

/* Number of CUDA devices visible to this process.
 * LLMMEM_ERR_NOT_BUILT without CUDA; LLMMEM_ERR_NO_DEVICE (with the driver's reason as detail)
 * when there is no driver or no GPU, in which case *count is set to 0. Never crashes without a driver. */
LLMMEM_API llmmem_status_t llmmem_cuda_device_count(int *count);

/* Version of the installed CUDA driver (e.g. 13000) or LLMMEM_ERR_NO_DEVICE when none is installed. */
LLMMEM_API llmmem_status_t llmmem_cuda_driver_version(int *version);

#ifdef __cplusplus
}
#endif

#endif /* LLMMEM_H */
