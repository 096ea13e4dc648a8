/* SPDX-License-Identifier: Apache-2.0 */
/* The checks every C ABI test shares. Header-only with static state: each C ABI test is its
 * own executable, and this file is not globbed as a test. Failures are counted under a mutex
 * because several tests check from worker threads. */
#ifndef GRADSYNC_TESTS_CAPI_CHECK_H
#define GRADSYNC_TESTS_CAPI_CHECK_H

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "gradsync/gradsync.h"

static int check_failures = 0;
static pthread_mutex_t check_failures_lock = PTHREAD_MUTEX_INITIALIZER;

/* Counts one failure; for hand-written checks that print their own diagnosis. */
static inline void check_failed(void) {
  pthread_mutex_lock(&check_failures_lock);
  check_failures++;
  pthread_mutex_unlock(&check_failures_lock);
}

/* Whether this thread's last error message contains needle. */
static inline int check_message_has(const char* needle) {
  return strstr(gradsync_last_error_message(), needle) != NULL;
}

static inline void check_status_is(int status, int expected, const char* call, const char* file, int line) {
  if (status != expected) {
    fprintf(stderr, "%s:%d: %s returned %s, expected %s (last error: %s)\n", file, line, call,
            gradsync_status_string(status), gradsync_status_string(expected), gradsync_last_error_message());
    check_failed();
  }
}

static inline void check_message_contains(const char* needle, const char* file, int line) {
  if (!check_message_has(needle)) {
    fprintf(stderr, "%s:%d: message \"%s\" lacks \"%s\"\n", file, line, gradsync_last_error_message(), needle);
    check_failed();
  }
}

/* The exit code of main: 0 when every check passed. */
static inline int check_report(const char* name) {
  int failures;
  pthread_mutex_lock(&check_failures_lock);
  failures = check_failures;
  pthread_mutex_unlock(&check_failures_lock);
  if (failures != 0) {
    fprintf(stderr, "%s: %d check(s) failed\n", name, failures);
    return 1;
  }
  printf("%s: all checks passed\n", name);
  return 0;
}

#define CHECK(cond)                                                                            \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      fprintf(stderr, "%s:%d: CHECK(%s) failed (last error: %s)\n", __FILE__, __LINE__, #cond, \
              gradsync_last_error_message());                                                  \
      check_failed();                                                                          \
    }                                                                                          \
  } while (0)

/* call must return expected; on failure prints both status strings and the last error message. */
#define CHECK_STATUS(call, expected) check_status_is((int)(call), (int)(expected), #call, __FILE__, __LINE__)

/* As CHECK_STATUS, and the last error message must contain needle. */
#define CHECK_STATUS_MSG(call, expected, needle)          \
  do {                                                    \
    CHECK_STATUS(call, expected);                         \
    check_message_contains((needle), __FILE__, __LINE__); \
  } while (0)

/* The last error message (of the call just checked) must contain needle. */
#define CHECK_MESSAGE(needle) check_message_contains((needle), __FILE__, __LINE__)

#endif
