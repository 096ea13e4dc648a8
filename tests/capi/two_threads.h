/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers of the C ABI tests that drive one communicator from two threads: both ranks of a group
 * as handles of this process, and a way to know, without sleeping or timing, that another thread
 * is inside a call on a handle. Include after check.h, in a file that defines _POSIX_C_SOURCE. */
#ifndef GRADSYNC_TESTS_CAPI_TWO_THREADS_H
#define GRADSYNC_TESTS_CAPI_TWO_THREADS_H

#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "gradsync/gradsync.h"

typedef struct {
  const char* name;
  int32_t rank;
  int64_t timeout_ms;
  gradsync_comm* comm;
} two_threads_joiner;

static inline void* two_threads_join(void* p) {
  two_threads_joiner* j = (two_threads_joiner*)p;
  gradsync_comm_options opts = GRADSYNC_COMM_OPTIONS_INIT;
  opts.rank = j->rank;
  opts.size = 2;
  opts.timeout_ms = j->timeout_ms;
  strncpy(opts.name, j->name, sizeof opts.name - 1);
  if (gradsync_comm_create(&j->comm, &opts) != GRADSYNC_OK)
    fprintf(stderr, "join %s rank %d: %s\n", j->name, (int)j->rank, gradsync_last_error_message());
  return NULL;
}

/* Both ranks of a fresh 2-rank thread group; 0 on success. */
static inline int join_pair(const char* name, int64_t timeout_ms, gradsync_comm* comms[2]) {
  two_threads_joiner j[2];
  pthread_t t;
  int i;
  for (i = 0; i < 2; ++i) {
    j[i].name = name;
    j[i].rank = i;
    j[i].timeout_ms = timeout_ms;
    j[i].comm = NULL;
  }
  pthread_create(&t, NULL, two_threads_join, &j[1]);
  two_threads_join(&j[0]);
  pthread_join(t, NULL);
  comms[0] = j[0].comm;
  comms[1] = j[1].comm;
  if (comms[0] != NULL && comms[1] != NULL) return 0;
  gradsync_comm_free(comms[0]);
  gradsync_comm_free(comms[1]);
  check_failed();
  return -1;
}

/* Returns 0 once another thread is inside a call on comm, which is exactly when gradsync_comm_alloc
 * on it is refused as a second caller. */
static inline int wait_until_in_call(gradsync_comm* comm) {
  for (;;) {
    void* p = NULL;
    const int status = gradsync_comm_alloc(comm, 64, &p);
    if (status == GRADSYNC_OK) {
      gradsync_comm_free_buffer(comm, p); /* (if refused, the communicator frees it at the end) */
      sched_yield();
      continue;
    }
    if (status == GRADSYNC_E_MISUSE && check_message_has("already in a call on another thread")) return 0;
    fprintf(stderr, "waiting for a call on another thread: %s: %s\n", gradsync_status_string(status),
            gradsync_last_error_message());
    check_failed();
    return -1;
  }
}

/* wait_until_in_call holds the handle for an instant: a call that meets it is refused untouched
 * and simply made again. */
#define RETRY_WHILE_PROBED(status, call) \
  do {                                   \
    (status) = (call);                   \
  } while ((status) == GRADSYNC_E_MISUSE && check_message_has("already in a call on another thread"))

/* Flags that one test thread sets and another reads. */
static pthread_mutex_t two_threads_flags_lock = PTHREAD_MUTEX_INITIALIZER;

static inline void set_flag(int* flag) {
  pthread_mutex_lock(&two_threads_flags_lock);
  *flag = 1;
  pthread_mutex_unlock(&two_threads_flags_lock);
}

static inline int get_flag(int* flag) {
  int v;
  pthread_mutex_lock(&two_threads_flags_lock);
  v = *flag;
  pthread_mutex_unlock(&two_threads_flags_lock);
  return v;
}

#endif
