/*
 * error.c — status names and the thread-local "last error" detail.
 *
 * The detail buffer is per thread so concurrent callers (e.g. a pool used from several
 * threads) never read each other's messages. Messages longer than the buffer are cut with "...".
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

#define LLMMEM_ERROR_DETAIL_BYTES 1024

static _Thread_local char last_error[LLMMEM_ERROR_DETAIL_BYTES];

static const char *const status_names[LLMMEM_STATUS_COUNT_] = {
    [LLMMEM_OK] = "success",
    [LLMMEM_ERR_INVALID] = "invalid argument",
    [LLMMEM_ERR_NOMEM] = "out of memory",
    [LLMMEM_ERR_CUDA] = "CUDA error",
    [LLMMEM_ERR_NO_DEVICE] = "no CUDA device",
    [LLMMEM_ERR_NOT_BUILT] = "not built with this capability",
    [LLMMEM_ERR_INFEASIBLE] = "infeasible request",
    [LLMMEM_ERR_STATE] = "invalid state",
    [LLMMEM_ERR_INTERNAL] = "internal error",
};

LLMMEM_API const char *llmmem_strerror(llmmem_status_t status) {
  if ((int)status < 0 || (int)status >= LLMMEM_STATUS_COUNT_) return "unknown status";
  return status_names[status];
}

LLMMEM_API const char *llmmem_last_error(void) { return last_error; }

LLMMEM_API void llmmem_clear_error(void) { last_error[0] = '\0'; }

llmmem_status_t _llmmem_set_error(llmmem_status_t status, const char *file, int line, const char *fmt, ...) {
  /* Keep only the file's base name: the build directory is noise for users. */
  const char *base = strrchr(file, '/');
  base = base ? base + 1 : file;
  int used = snprintf(last_error, sizeof last_error, "%s:%d: ", base, line);
  if (used < 0) used = 0;
  if ((size_t)used < sizeof last_error) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(last_error + used, sizeof last_error - (size_t)used, fmt, ap);
    va_end(ap);
    if (n >= 0 && (size_t)used + (size_t)n >= sizeof last_error) memcpy(last_error + sizeof last_error - 4, "...", 4);
  }
  return status;
}
