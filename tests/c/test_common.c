/*
 * test_common.c — the C ABI basics: version, status names, thread-local error details,
 * build info, and the CUDA probes of a CPU-only build.
 */
#include <pthread.h>
#include <string.h>

#include "internal.h"
#include "testhelper.h"

static void *set_error_in_thread(void *arg) {
  (void)arg;
  (void)LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "thread-local %d", 42);
  return NULL;
}

static llmmem_status_t checked_positive(int n) {
  LLMMEM_CHECK_ARG(n > 0, "n must be > 0, got %d", n);
  return LLMMEM_OK;
}

static llmmem_status_t propagates(int n) {
  LLMMEM_TRY(checked_positive(n));
  return LLMMEM_OK;
}

int main(void) {
  TEST("version matches the header") {
    int a = -1, b = -1, c = -1;
    CHECK_OK(llmmem_version(&a, &b, &c));
    CHECK(a == LLMMEM_VERSION_MAJOR && b == LLMMEM_VERSION_MINOR && c == LLMMEM_VERSION_PATCH);
    CHECK_STATUS(llmmem_version(NULL, &b, &c), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "must not be NULL") != NULL);
  }

  TEST("every status has a distinct name; unknown codes are named safely") {
    for (int i = 0; i < LLMMEM_STATUS_COUNT_; i++) {
      CHECK(llmmem_strerror((llmmem_status_t)i) != NULL);
      CHECK(strcmp(llmmem_strerror((llmmem_status_t)i), "unknown status") != 0);
      for (int j = 0; j < i; j++)
        CHECK(strcmp(llmmem_strerror((llmmem_status_t)i), llmmem_strerror((llmmem_status_t)j)) != 0);
    }
    CHECK(strcmp(llmmem_strerror((llmmem_status_t)-1), "unknown status") == 0);
    CHECK(strcmp(llmmem_strerror(LLMMEM_STATUS_COUNT_), "unknown status") == 0);
  }

  TEST("errors carry file:line and the formatted detail; clear_error empties it") {
    CHECK_STATUS(propagates(-3), LLMMEM_ERR_INVALID);
    CHECK(strstr(llmmem_last_error(), "test_common.c:") == llmmem_last_error());
    CHECK(strstr(llmmem_last_error(), "n must be > 0, got -3") != NULL);
    llmmem_clear_error();
    CHECK(llmmem_last_error()[0] == '\0');
    CHECK_OK(propagates(1));
  }

  TEST("an overlong detail is cut, NUL-terminated, and marked with ...") {
    char big[4096];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    (void)LLMMEM_FAIL(LLMMEM_ERR_INVALID, "%s", big);
    size_t len = strlen(llmmem_last_error());
    CHECK(len > 100 && len < sizeof big);
    CHECK(strcmp(llmmem_last_error() + len - 3, "...") == 0);
  }

  TEST("the last error is per thread") {
    llmmem_clear_error();
    pthread_t t;
    CHECK(pthread_create(&t, NULL, set_error_in_thread, NULL) == 0);
    pthread_join(t, NULL);
    CHECK(llmmem_last_error()[0] == '\0');
  }

  TEST("build info is filled and consistent") {
    llmmem_build_info_t info;
    memset(&info, 0xff, sizeof info);
    CHECK_OK(llmmem_build_info(&info));
    CHECK(info.cuda_built == 0 || info.cuda_built == 1);
    CHECK(info.c_compiler != NULL && info.c_compiler[0] != '\0');
    CHECK(info.cuda_archs != NULL && info.cuda_compiler != NULL);
    CHECK(info.cuda_built == (info.cuda_runtime_version > 0));
    CHECK_STATUS(llmmem_build_info(NULL), LLMMEM_ERR_INVALID);
  }

  TEST("CUDA probes of a CPU-only build say 'not built' and never crash") {
    int n = -1;
    llmmem_status_t st = llmmem_cuda_device_count(&n);
    CHECK(st == LLMMEM_ERR_NOT_BUILT || st == LLMMEM_ERR_NO_DEVICE || st == LLMMEM_OK);
    CHECK(n >= 0);
    CHECK_STATUS(llmmem_cuda_device_count(NULL), LLMMEM_ERR_INVALID);
    int v = -1;
    st = llmmem_cuda_driver_version(&v);
    CHECK(st != LLMMEM_ERR_INTERNAL);
  }

  return TEST_SUMMARY();
}
