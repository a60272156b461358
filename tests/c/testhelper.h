/*
 * testhelper.h — a minimal harness for llmmem's C unit tests (header-only).
 *
 * A test program calls CHECK(...) as often as it likes inside TEST("name") { ... } blocks and
 * ends main() with `return TEST_SUMMARY();`, which prints the closing line "N passed, N failed"
 * that the test runner reads, and exits non-zero on any failure. Failures print file:line, the
 * failed expression, and llmmem's last error detail.
 */
#ifndef LLMMEM_TESTHELPER_H
#define LLMMEM_TESTHELPER_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <llmmem/llmmem.h>

static int th_passed = 0;
static int th_failed = 0;
static const char *th_current = "";
static int th_current_failed = 0;

static inline void th_begin(const char *name) {
  th_current = name;
  th_current_failed = 0;
}

static inline void th_end(void) {
  if (th_current_failed) {
    th_failed++;
    printf("FAIL %s\n", th_current);
  } else {
    th_passed++;
  }
  fflush(stdout);
}

/* TEST("name") { body } runs body once, counting the test as passed if no CHECK failed in it. */
#define TEST(name) for (int th_once_ = (th_begin(name), 1); th_once_; th_once_ = (th_end(), 0))

#define CHECK(cond)                                                                                           \
  do {                                                                                                        \
    if (!(cond)) {                                                                                            \
      th_current_failed = 1;                                                                                  \
      printf("  %s:%d: %s: CHECK(%s) failed; last llmmem error: %s\n", __FILE__, __LINE__, th_current, #cond, \
             llmmem_last_error());                                                                            \
    }                                                                                                         \
  } while (0)

/* CHECK_STATUS(expr, expected) compares llmmem_status_t values and prints both names. */
#define CHECK_STATUS(expr, expected)                                                                             \
  do {                                                                                                           \
    llmmem_status_t th_got_ = (expr), th_want_ = (expected);                                                     \
    if (th_got_ != th_want_) {                                                                                   \
      th_current_failed = 1;                                                                                     \
      printf("  %s:%d: %s: %s returned %d (%s), expected %d (%s); detail: %s\n", __FILE__, __LINE__, th_current, \
             #expr, (int)th_got_, llmmem_strerror(th_got_), (int)th_want_, llmmem_strerror(th_want_),            \
             llmmem_last_error());                                                                               \
    }                                                                                                            \
  } while (0)

#define CHECK_OK(expr) CHECK_STATUS(expr, LLMMEM_OK)

static inline int th_summary(void) {
  printf("%d passed, %d failed\n", th_passed, th_failed);
  return th_failed == 0 ? 0 : 1;
}

#define TEST_SUMMARY() th_summary()

/* A small deterministic generator (xorshift64*) so randomized tests are reproducible from a seed. */
static inline unsigned long long th_rand(unsigned long long *state) {
  unsigned long long x = *state;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *state = x;
  return x * 0x2545F4914F6CDD1DULL;
}

#endif /* LLMMEM_TESTHELPER_H */
