// SPDX-License-Identifier: Apache-2.0
/* The core of the ABI from C: version, statuses, per-thread errors, logging, features, options. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "gradsync/gradsync.h"

static int log_lines = 0;
static void on_log(void* user, int32_t level, const char* message) {
  (void)level;
  (void)message;
  *(int*)user += 1;
  log_lines++;
}

static void* fail_on_other_thread(void* arg) {
  (void)arg;
  CHECK_STATUS(gradsync_comm_create(NULL, NULL), GRADSYNC_E_INVALID_ARG);
  CHECK_MESSAGE("NULL");
  return NULL;
}

int main(void) {
  const char* v = gradsync_version_string();
  char expected[32];
  pthread_t thread;
  gradsync_comm_options opts = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm_options from_fn;
  unsigned char big[sizeof(gradsync_comm_options) + 64];
  int user = 0;
  int s;

  /* version */
  snprintf(expected, sizeof expected, "%d.%d.%d", GRADSYNC_VERSION_MAJOR, GRADSYNC_VERSION_MINOR,
           GRADSYNC_VERSION_PATCH);
  CHECK(strcmp(v, expected) == 0);
  CHECK(strcmp(v, GRADSYNC_VERSION_STRING) == 0);
  CHECK(gradsync_version_number() == GRADSYNC_VERSION_NUMBER);
  CHECK(gradsync_abi_version() == GRADSYNC_ABI_VERSION);
  CHECK(GRADSYNC_VERSION_CHECK(0, 0, 1));

  /* statuses: pinned values, names first, unknown is never NULL */
  CHECK(GRADSYNC_OK == 0 && GRADSYNC_E_INVALID_ARG == -1 && GRADSYNC_E_MISUSE == -2 && GRADSYNC_E_TIMEOUT == -8);
  CHECK(strncmp(gradsync_status_string(GRADSYNC_E_TIMEOUT), "GRADSYNC_E_TIMEOUT:", 19) == 0);
  CHECK(strncmp(gradsync_status_string(GRADSYNC_E_ZERO_WEIGHT), "GRADSYNC_E_ZERO_WEIGHT:", 23) == 0);
  CHECK(strcmp(gradsync_status_string(12345), "unknown status") == 0);
  for (s = -120; s <= 1; ++s) CHECK(gradsync_status_string(s) != NULL);

  /* dtype sizes and features */
  CHECK(gradsync_dtype_size(GRADSYNC_F32) == 4 && gradsync_dtype_size(GRADSYNC_F64) == 8);
  CHECK(gradsync_dtype_size(GRADSYNC_BF16) == 2 && gradsync_dtype_size(99) == 0 && gradsync_dtype_size(-1) == 0);
  CHECK(gradsync_has_feature(GRADSYNC_FEATURE_THREAD_TRANSPORT) == 1);
  CHECK(gradsync_has_feature(777) == 0);

  /* last error: set by a failure, per thread */
  gradsync_last_error_clear();
  CHECK(strcmp(gradsync_last_error_message(), "") == 0);
  CHECK(pthread_create(&thread, NULL, fail_on_other_thread, NULL) == 0);
  pthread_join(thread, NULL);
  CHECK(strcmp(gradsync_last_error_message(), "") == 0);
  CHECK_STATUS(gradsync_comm_options_init(NULL, sizeof opts), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_last_error_status(), GRADSYNC_E_INVALID_ARG);
  CHECK_MESSAGE("gradsync_comm_options_init");

  /* options: the init function equals the macro; an older (smaller) struct is refused when it
   * lacks version-1 fields; a newer (larger) one is filled only up to what the library knows. */
  CHECK_STATUS(gradsync_comm_options_init(&from_fn, sizeof from_fn), GRADSYNC_OK);
  CHECK(memcmp(&from_fn, &opts, sizeof opts) == 0);
  CHECK_STATUS(gradsync_comm_options_init(&from_fn, 8), GRADSYNC_E_INVALID_ARG);
  memset(big, 0xAB, sizeof big);
  CHECK_STATUS(gradsync_comm_options_init((gradsync_comm_options*)(void*)big, sizeof big), GRADSYNC_OK);
  CHECK(((gradsync_comm_options*)(void*)big)->struct_size == sizeof(gradsync_comm_options));
  CHECK(big[sizeof big - 1] == 0); /* zeroed tail: no garbage reaches a newer library */

  /* logging */
  CHECK_STATUS(gradsync_set_log_level(7), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_set_log_level(GRADSYNC_LOG_ERROR), GRADSYNC_OK);
  CHECK(gradsync_get_log_level() == GRADSYNC_LOG_ERROR);
  CHECK_STATUS(gradsync_set_log_callback(on_log, &user, GRADSYNC_LOG_TRACE), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_options_init(NULL, 0), GRADSYNC_E_INVALID_ARG); /* failures log at debug */
  CHECK(user >= 1);
  CHECK_STATUS(gradsync_set_log_callback(NULL, NULL, GRADSYNC_LOG_WARN), GRADSYNC_OK);

  return check_report("core");
}
