/*
 * internal.h — private helpers shared by the C core: error recording, checks, compiler hints.
 * Not installed, not part of the ABI. Include it after <llmmem/llmmem.h>.
 */
#ifndef LLMMEM_INTERNAL_H
#define LLMMEM_INTERNAL_H

#include <llmmem/llmmem.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__) || defined(__clang__)
#define LLMMEM_LIKELY(x)                __builtin_expect(!!(x), 1)
#define LLMMEM_UNLIKELY(x)              __builtin_expect(!!(x), 0)
#define LLMMEM_PRINTF(fmt_idx, arg_idx) __attribute__((format(printf, fmt_idx, arg_idx)))
#else
#define LLMMEM_LIKELY(x)   (x)
#define LLMMEM_UNLIKELY(x) (x)
#define LLMMEM_PRINTF(fmt_idx, arg_idx)
#endif

#ifndef LLMMEM_DEBUG
#define LLMMEM_DEBUG 0
#endif

/* Records "file:line: message" as the calling thread's last error and returns `status`,
 * so a failing path reads `return LLMMEM_FAIL(LLMMEM_ERR_INVALID, "n must be > 0, got %d", n);`. */
llmmem_status_t _llmmem_set_error(llmmem_status_t status, const char *file, int line, const char *fmt, ...)
    LLMMEM_PRINTF(4, 5);

#define LLMMEM_FAIL(status, ...) _llmmem_set_error((status), __FILE__, __LINE__, __VA_ARGS__)

/* Argument check: on failure records which argument and why, then returns LLMMEM_ERR_INVALID. */
#define LLMMEM_CHECK_ARG(cond, ...)                                                    \
  do {                                                                                 \
    if (LLMMEM_UNLIKELY(!(cond))) return LLMMEM_FAIL(LLMMEM_ERR_INVALID, __VA_ARGS__); \
  } while (0)

/* Propagates a non-OK status (its detail is already recorded by the callee). */
#define LLMMEM_TRY(expr)                                                             \
  do {                                                                               \
    llmmem_status_t llmmem_try_status_ = (expr);                                     \
    if (LLMMEM_UNLIKELY(llmmem_try_status_ != LLMMEM_OK)) return llmmem_try_status_; \
  } while (0)

/* An invariant of llmmem itself; checked only in debug builds (LLMMEM_DEBUG >= 1). On failure it
 * returns LLMMEM_ERR_INTERNAL from the enclosing function instead of aborting the user's run. */
#if LLMMEM_DEBUG >= 1
#define LLMMEM_ASSERT_INTERNAL(cond)                                                               \
  do {                                                                                             \
    if (LLMMEM_UNLIKELY(!(cond)))                                                                  \
      return LLMMEM_FAIL(LLMMEM_ERR_INTERNAL, "internal check failed: %s (please report)", #cond); \
  } while (0)
#else
#define LLMMEM_ASSERT_INTERNAL(cond) ((void)0)
#endif

/* n rounded up to a multiple of `to` (> 0). */
static inline size_t _llmmem_round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

#ifdef __cplusplus
}
#endif

#endif /* LLMMEM_INTERNAL_H */
