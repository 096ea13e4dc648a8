// SPDX-License-Identifier: Apache-2.0
/* Atomics through the C ABI: Caffe2's checksum with pthreads, the flag, the owned mutex, the
 * atomic float add, and bad input at every entry point. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "gradsync/gradsync.h"

/* ---- Caffe2's checksum: counter 20000, 100 threads x 200 fetch-adds of -1 ---- */
struct checksum_args {
  gradsync_counter32 *counter32, *checksum32;
  gradsync_counter64 *counter64, *checksum64;
  int errors;
};

static void* checksum_worker(void* p) {
  struct checksum_args* a = (struct checksum_args*)p;
  int i;
  for (i = 0; i < 200; ++i) {
    int32_t old32 = 0, new32 = 0;
    int64_t old64 = 0, new64 = 0;
    if (gradsync_counter32_fetch_add(a->counter32, -1, &old32, &new32) != GRADSYNC_OK || new32 != old32 - 1)
      a->errors++;
    if (gradsync_counter32_fetch_add(a->checksum32, old32, NULL, NULL) != GRADSYNC_OK) a->errors++;
    if (gradsync_counter64_fetch_add(a->counter64, -1, &old64, &new64) != GRADSYNC_OK || new64 != old64 - 1)
      a->errors++;
    if (gradsync_counter64_fetch_add(a->checksum64, old64, NULL, NULL) != GRADSYNC_OK) a->errors++;
  }
  return NULL;
}

static void test_caffe2_checksum(void) {
  int run;
  for (run = 0; run < 3; ++run) {
    enum { kThreads = 100 };
    pthread_t threads[kThreads];
    struct checksum_args args[kThreads];
    gradsync_counter32 *counter32 = NULL, *checksum32 = NULL;
    gradsync_counter64 *counter64 = NULL, *checksum64 = NULL;
    int32_t v32 = -1;
    int64_t v64 = -1;
    int t;
    CHECK_STATUS(gradsync_counter32_create(&counter32, 20000), GRADSYNC_OK);
    CHECK_STATUS(gradsync_counter32_create(&checksum32, 0), GRADSYNC_OK);
    CHECK_STATUS(gradsync_counter64_create(&counter64, 20000), GRADSYNC_OK);
    CHECK_STATUS(gradsync_counter64_create(&checksum64, 0), GRADSYNC_OK);
    for (t = 0; t < kThreads; ++t) {
      args[t].counter32 = counter32;
      args[t].checksum32 = checksum32;
      args[t].counter64 = counter64;
      args[t].checksum64 = checksum64;
      args[t].errors = 0;
      CHECK(pthread_create(&threads[t], NULL, checksum_worker, &args[t]) == 0);
    }
    for (t = 0; t < kThreads; ++t) {
      CHECK(pthread_join(threads[t], NULL) == 0);
      CHECK(args[t].errors == 0);
    }
    CHECK(gradsync_counter32_load(checksum32, &v32) == GRADSYNC_OK && v32 == 200010000);
    CHECK(gradsync_counter64_load(checksum64, &v64) == GRADSYNC_OK && v64 == 200010000);
    CHECK(gradsync_counter32_load(counter32, &v32) == GRADSYNC_OK && v32 == 0);
    CHECK(gradsync_counter64_load(counter64, &v64) == GRADSYNC_OK && v64 == 0);
    gradsync_counter32_free(counter32);
    gradsync_counter32_free(checksum32);
    gradsync_counter64_free(counter64);
    gradsync_counter64_free(checksum64);
  }
}

static void test_counters(void) {
  gradsync_counter32* c32 = (gradsync_counter32*)&check_failures; /* overwritten with NULL on failure */
  gradsync_counter64* c64 = NULL;
  gradsync_flag* flag = NULL;
  int32_t old32 = 0, new32 = 0, v32 = 0;
  int64_t old64 = 0, new64 = 0, v64 = 0;

  CHECK_STATUS_MSG(gradsync_counter32_create(NULL, 1), GRADSYNC_E_INVALID_ARG, "NULL");
  CHECK(gradsync_counter32_create(&c32, INT32_MAX) == GRADSYNC_OK && c32 != NULL);
  CHECK_STATUS(gradsync_counter32_fetch_add(c32, 1, &old32, &new32), GRADSYNC_OK);
  CHECK(old32 == INT32_MAX && new32 == INT32_MIN); /* wraps, defined */
  CHECK_STATUS(gradsync_counter32_store(c32, 7), GRADSYNC_OK);
  CHECK(gradsync_counter32_load(c32, &v32) == GRADSYNC_OK && v32 == 7);
  CHECK_STATUS_MSG(gradsync_counter32_load(c32, NULL), GRADSYNC_E_INVALID_ARG, "value out-parameter is NULL");

  CHECK_STATUS(gradsync_counter64_create(&c64, INT64_MIN), GRADSYNC_OK);
  CHECK_STATUS(gradsync_counter64_fetch_add(c64, -1, &old64, &new64), GRADSYNC_OK);
  CHECK(old64 == INT64_MIN && new64 == INT64_MAX);
  CHECK_STATUS(gradsync_counter64_store(c64, -5), GRADSYNC_OK);
  CHECK(gradsync_counter64_load(c64, &v64) == GRADSYNC_OK && v64 == -5);

  /* NULL and wrong-kind handles: MISUSE naming both kinds, never a crash */
  CHECK_STATUS_MSG(gradsync_counter32_fetch_add(NULL, 1, &old32, &new32), GRADSYNC_E_MISUSE, "NULL counter32 handle");
  CHECK_STATUS_MSG(gradsync_counter64_load(NULL, &v64), GRADSYNC_E_MISUSE, "NULL counter64 handle");
  CHECK_STATUS_MSG(gradsync_counter64_fetch_add((gradsync_counter64*)c32, 1, NULL, NULL), GRADSYNC_E_MISUSE,
                   "expected a counter64, got a counter32");
  CHECK_STATUS(gradsync_flag_create(&flag), GRADSYNC_OK);
  CHECK_STATUS_MSG(gradsync_counter32_store((gradsync_counter32*)flag, 1), GRADSYNC_E_MISUSE,
                   "expected a counter32, got a flag");
  CHECK_STATUS_MSG(gradsync_flag_reset((gradsync_flag*)c64), GRADSYNC_E_MISUSE, "expected a flag, got a counter64");
  /* The counters are unchanged by the rejected calls. */
  CHECK(gradsync_counter32_load(c32, &v32) == GRADSYNC_OK && v32 == 7);
  CHECK(gradsync_counter64_load(c64, &v64) == GRADSYNC_OK && v64 == -5);

  gradsync_counter32_free(NULL);
  gradsync_counter64_free(NULL);
  gradsync_counter32_free(c32);
  gradsync_counter64_free(c64);
  gradsync_flag_free(flag);
}

static void test_flag(void) {
  gradsync_flag* flag = NULL;
  int32_t set = -1;
  CHECK_STATUS_MSG(gradsync_flag_create(NULL), GRADSYNC_E_INVALID_ARG, "NULL");
  CHECK_STATUS(gradsync_flag_create(&flag), GRADSYNC_OK);
  CHECK(gradsync_flag_check(flag, &set) == GRADSYNC_OK && set == 0);
  CHECK(gradsync_flag_conditional_set(flag, 0, &set) == GRADSYNC_OK && set == 0);
  CHECK(gradsync_flag_conditional_set(flag, 42, &set) == GRADSYNC_OK && set == 1);
  CHECK(gradsync_flag_conditional_set(flag, 0, &set) == GRADSYNC_OK && set == 1); /* sticky */
  CHECK_STATUS(gradsync_flag_conditional_set(flag, 0, NULL), GRADSYNC_OK);
  CHECK(gradsync_flag_check(flag, &set) == GRADSYNC_OK && set == 1);
  CHECK_STATUS(gradsync_flag_reset(flag), GRADSYNC_OK);
  CHECK(gradsync_flag_check(flag, &set) == GRADSYNC_OK && set == 0);
  CHECK_STATUS_MSG(gradsync_flag_check(flag, NULL), GRADSYNC_E_INVALID_ARG, "is_set out-parameter is NULL");
  CHECK_STATUS_MSG(gradsync_flag_check(NULL, &set), GRADSYNC_E_MISUSE, "NULL flag handle");
  CHECK_STATUS_MSG(gradsync_flag_conditional_set(NULL, 1, &set), GRADSYNC_E_MISUSE, "NULL flag handle");
  gradsync_flag_free(NULL);
  gradsync_flag_free(flag);
}

/* ---- mutex ---- */
struct mutex_probe {
  gradsync_mutex* mutex;
  int32_t acquired;
  int try_status, timeout_status, unlock_status;
  char unlock_message[256];
};

static void* probe_from_other_thread(void* p) {
  struct mutex_probe* probe = (struct mutex_probe*)p;
  probe->try_status = gradsync_mutex_try_lock(probe->mutex, &probe->acquired);
  probe->timeout_status = gradsync_mutex_lock_timeout(probe->mutex, 20);
  probe->unlock_status = gradsync_mutex_unlock(probe->mutex);
  strncpy(probe->unlock_message, gradsync_last_error_message(), sizeof probe->unlock_message - 1);
  return NULL;
}

static void* lock_and_unlock(void* p) {
  struct mutex_probe* probe = (struct mutex_probe*)p;
  probe->timeout_status = gradsync_mutex_lock_timeout(probe->mutex, 60000);
  if (probe->timeout_status == GRADSYNC_OK) probe->unlock_status = gradsync_mutex_unlock(probe->mutex);
  return NULL;
}

static void test_mutex(void) {
  gradsync_mutex* m = NULL;
  gradsync_counter32* counter = NULL;
  struct mutex_probe probe;
  pthread_t thread;
  int32_t acquired = -1;

  CHECK_STATUS_MSG(gradsync_mutex_create(NULL), GRADSYNC_E_INVALID_ARG, "NULL");
  CHECK_STATUS(gradsync_mutex_create(&m), GRADSYNC_OK);
  CHECK_STATUS_MSG(gradsync_mutex_unlock(m), GRADSYNC_E_NOT_OWNER, "not locked");
  CHECK(gradsync_mutex_try_lock(m, &acquired) == GRADSYNC_OK && acquired == 1);
  CHECK_STATUS_MSG(gradsync_mutex_lock(m), GRADSYNC_E_MISUSE, "already held by this thread");
  CHECK_STATUS_MSG(gradsync_mutex_try_lock(m, &acquired), GRADSYNC_E_MISUSE, "already held by this thread");
  CHECK_STATUS_MSG(gradsync_mutex_lock_timeout(m, 5), GRADSYNC_E_MISUSE, "already held by this thread");

  memset(&probe, 0, sizeof probe);
  probe.mutex = m;
  probe.acquired = -1;
  CHECK(pthread_create(&thread, NULL, probe_from_other_thread, &probe) == 0);
  CHECK(pthread_join(thread, NULL) == 0);
  CHECK(probe.try_status == GRADSYNC_OK && probe.acquired == 0); /* busy is not an error */
  CHECK_STATUS(probe.timeout_status, GRADSYNC_E_TIMEOUT);
  CHECK_STATUS(probe.unlock_status, GRADSYNC_E_NOT_OWNER);
  CHECK(strstr(probe.unlock_message, "held by thread") != NULL);

  CHECK_STATUS(gradsync_mutex_unlock(m), GRADSYNC_OK);
  CHECK_STATUS(gradsync_mutex_lock(m), GRADSYNC_OK);
  /* A waiter with a long timeout gets the lock once it is released. */
  memset(&probe, 0, sizeof probe);
  probe.mutex = m;
  probe.timeout_status = 1;
  CHECK(pthread_create(&thread, NULL, lock_and_unlock, &probe) == 0);
  CHECK_STATUS(gradsync_mutex_unlock(m), GRADSYNC_OK);
  CHECK(pthread_join(thread, NULL) == 0);
  CHECK(probe.timeout_status == GRADSYNC_OK && probe.unlock_status == GRADSYNC_OK);

  CHECK_STATUS(gradsync_mutex_lock_timeout(m, 0), GRADSYNC_OK); /* free: 0 ms suffices */
  CHECK_STATUS_MSG(gradsync_mutex_lock_timeout(m, -1), GRADSYNC_E_INVALID_ARG, "timeout_ms must be >= 0");
  CHECK_STATUS(gradsync_mutex_unlock(m), GRADSYNC_OK);
  CHECK_STATUS(gradsync_mutex_lock_timeout(m, INT64_MAX), GRADSYNC_OK); /* huge timeouts do not overflow */
  CHECK_STATUS(gradsync_mutex_unlock(m), GRADSYNC_OK);

  CHECK_STATUS_MSG(gradsync_mutex_lock(NULL), GRADSYNC_E_MISUSE, "NULL mutex handle");
  CHECK_STATUS_MSG(gradsync_mutex_try_lock(m, NULL), GRADSYNC_E_INVALID_ARG, "acquired out-parameter is NULL");
  CHECK_STATUS(gradsync_counter32_create(&counter, 0), GRADSYNC_OK);
  CHECK_STATUS_MSG(gradsync_mutex_lock((gradsync_mutex*)counter), GRADSYNC_E_MISUSE,
                   "expected a mutex, got a counter32");
  CHECK_STATUS_MSG(gradsync_mutex_unlock((gradsync_mutex*)counter), GRADSYNC_E_MISUSE,
                   "expected a mutex, got a counter32");
  gradsync_counter32_free(counter);

  /* Freeing a locked mutex is defined: the lock goes with it. */
  CHECK_STATUS(gradsync_mutex_lock(m), GRADSYNC_OK);
  gradsync_mutex_free(m);
  gradsync_mutex_free(NULL);
}

/* ---- atomic float add ---- */
struct add_args {
  float* dst;
  const float* src;
  size_t n;
  int reps, errors;
};

static void* add_worker(void* p) {
  struct add_args* a = (struct add_args*)p;
  int r;
  for (r = 0; r < a->reps; ++r)
    if (gradsync_atomic_add_f32(a->dst, a->src, a->n) != GRADSYNC_OK) a->errors++;
  return NULL;
}

static void test_atomic_add(void) {
  enum { kThreads = 4, kN = 10001, kReps = 100 };
  float* dst = (float*)calloc(kN, sizeof(float));
  float* src = (float*)malloc(kN * sizeof(float));
  double d64[4] = {1, 2, 3, 4}, s64[4] = {0.5, 0.5, 0.5, 0.5};
  char raw[64];
  pthread_t threads[kThreads];
  struct add_args args[kThreads];
  size_t i, wrong = 0;
  int t;
  for (i = 0; i < kN; ++i) src[i] = (float)(i % 4);
  for (t = 0; t < kThreads; ++t) {
    args[t].dst = dst;
    args[t].src = src;
    args[t].n = kN;
    args[t].reps = kReps;
    args[t].errors = 0;
    CHECK(pthread_create(&threads[t], NULL, add_worker, &args[t]) == 0);
  }
  for (t = 0; t < kThreads; ++t) {
    CHECK(pthread_join(threads[t], NULL) == 0);
    CHECK(args[t].errors == 0);
  }
  for (i = 0; i < kN; ++i) wrong += dst[i] != (float)(kThreads * kReps * (int)(i % 4));
  CHECK(wrong == 0);

  CHECK_STATUS(gradsync_atomic_add_f64(d64, s64, 4), GRADSYNC_OK);
  CHECK(d64[0] == 1.5 && d64[3] == 4.5);

  /* zero elements: nothing to touch, NULL allowed */
  CHECK_STATUS(gradsync_atomic_add_f32(NULL, NULL, 0), GRADSYNC_OK);
  CHECK_STATUS_MSG(gradsync_atomic_add_f32(NULL, src, 4), GRADSYNC_E_INVALID_ARG, "dst is NULL");
  CHECK_STATUS_MSG(gradsync_atomic_add_f32(dst, NULL, 4), GRADSYNC_E_INVALID_ARG, "src is NULL");
  CHECK_STATUS_MSG(gradsync_atomic_add_f32(dst, src, SIZE_MAX), GRADSYNC_E_INVALID_ARG, "does not fit");
  CHECK_STATUS_MSG(gradsync_atomic_add_f64(d64, s64, SIZE_MAX / 4), GRADSYNC_E_INVALID_ARG, "does not fit");
  CHECK_STATUS_MSG(gradsync_atomic_add_f32(dst + 1, dst, 4), GRADSYNC_E_INVALID_ARG, "overlaps");
  CHECK_STATUS_MSG(gradsync_atomic_add_f32(dst, dst, 4), GRADSYNC_E_INVALID_ARG, "overlaps");
  CHECK_STATUS(gradsync_atomic_add_f32(dst + 4, dst, 4), GRADSYNC_OK); /* adjacent is fine */
  CHECK_STATUS_MSG(gradsync_atomic_add_f32((float*)(raw + 1), src, 2), GRADSYNC_E_INVALID_ARG, "not aligned");
  CHECK_STATUS_MSG(gradsync_atomic_add_f64((double*)(raw + 4), s64, 2), GRADSYNC_E_INVALID_ARG, "not aligned to 8");
  free(dst);
  free(src);
}

int main(void) {
  test_caffe2_checksum();
  test_counters();
  test_flag();
  test_mutex();
  test_atomic_add();
  return check_report("atomics C API");
}
