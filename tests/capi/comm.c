// SPDX-License-Identifier: Apache-2.0
/* The communicator through the C ABI, as a C99 user with pthreads sees it: the seed's acceptance
 * cases, bad input at every entry point, versioned options, timeouts without end, and misuse
 * from two threads. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "gradsync/gradsync.h"
#include "two_threads.h"

static gradsync_comm* join(const char* name, int32_t rank, int32_t size, int64_t timeout_ms) {
  gradsync_comm_options opts = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm* comm = NULL;
  opts.rank = rank;
  opts.size = size;
  opts.timeout_ms = timeout_ms;
  strncpy(opts.name, name, sizeof opts.name - 1);
  if (gradsync_comm_create(&comm, &opts) != GRADSYNC_OK) {
    fprintf(stderr, "join %s rank %d: %s\n", name, (int)rank, gradsync_last_error_message());
    return NULL;
  }
  return comm;
}

/* ---- 2 ranks, [2,4] and [4,8], mean -> [3,6] on both */
typedef struct {
  int32_t rank;
  float data[2];
  int status;
} pair_arg;

static void* pair_worker(void* p) {
  pair_arg* a = (pair_arg*)p;
  gradsync_comm* comm = join("capi-pair", a->rank, 2, 20000);
  if (comm == NULL) {
    a->status = -1000;
    return NULL;
  }
  a->status = gradsync_comm_allreduce(comm, a->data, a->data, 2, GRADSYNC_F32, GRADSYNC_MEAN);
  gradsync_comm_free(comm);
  return NULL;
}

static void test_pair_mean(void) {
  pthread_t t[2];
  pair_arg args[2] = {{0, {2, 4}, 0}, {1, {4, 8}, 0}};
  int i;
  for (i = 0; i < 2; ++i) pthread_create(&t[i], NULL, pair_worker, &args[i]);
  for (i = 0; i < 2; ++i) pthread_join(t[i], NULL);
  for (i = 0; i < 2; ++i) {
    CHECK_STATUS(args[i].status, GRADSYNC_OK);
    CHECK(args[i].data[0] == 3.0f && args[i].data[1] == 6.0f);
  }
}

/* ---- alltoall over 2 ranks of 5 elements: parts [0, 3) and [3, 5); rank r sends 10r + i */
typedef struct {
  int32_t rank;
  int32_t recv[6];
  int status;
} alltoall_arg;

static void* alltoall_worker(void* p) {
  alltoall_arg* a = (alltoall_arg*)p;
  int32_t send[5];
  int i;
  gradsync_comm* comm = join("capi-alltoall", a->rank, 2, 20000);
  if (comm == NULL) {
    a->status = -1000;
    return NULL;
  }
  for (i = 0; i < 5; ++i) send[i] = 10 * a->rank + i;
  a->status = gradsync_comm_alltoall(comm, send, a->recv, 5, GRADSYNC_I32);
  gradsync_comm_free(comm);
  return NULL;
}

static void test_alltoall(void) {
  pthread_t t[2];
  alltoall_arg args[2] = {{0, {-1, -1, -1, -1, -1, -1}, 0}, {1, {-1, -1, -1, -1, -1, -1}, 0}};
  const int32_t want0[6] = {0, 1, 2, 10, 11, 12};  /* part 0 (3 elements) of rank 0, then of rank 1 */
  const int32_t want1[6] = {3, 4, 13, 14, -1, -1}; /* part 1 (2 elements) of each; the rest untouched */
  int i;
  for (i = 0; i < 2; ++i) pthread_create(&t[i], NULL, alltoall_worker, &args[i]);
  for (i = 0; i < 2; ++i) pthread_join(t[i], NULL);
  CHECK_STATUS(args[0].status, GRADSYNC_OK);
  CHECK_STATUS(args[1].status, GRADSYNC_OK);
  CHECK(memcmp(args[0].recv, want0, sizeof want0) == 0);
  CHECK(memcmp(args[1].recv, want1, sizeof want1) == 0);
}

/* ---- 3 ranks with lengths 4, 7, 4: all get the mismatch error; then [2..], [3..], [4..] -> 3.0 */
typedef struct {
  int32_t rank;
  int first_status;
  char first_message[512];
  int second_status;
  float second[4];
} trio_arg;

static void* trio_worker(void* p) {
  trio_arg* a = (trio_arg*)p;
  float v[7];
  size_t len = a->rank == 1 ? 7 : 4;
  size_t i;
  gradsync_comm* comm = join("capi-trio", a->rank, 3, 20000);
  if (comm == NULL) {
    a->first_status = a->second_status = -1000;
    return NULL;
  }
  for (i = 0; i < 7; ++i) v[i] = 1.0f;
  a->first_status = gradsync_comm_allreduce(comm, v, v, len, GRADSYNC_F32, GRADSYNC_MEAN);
  strncpy(a->first_message, gradsync_last_error_message(), sizeof a->first_message - 1);
  for (i = 0; i < 4; ++i) a->second[i] = (float)(2 + a->rank);
  a->second_status = gradsync_comm_allreduce(comm, a->second, a->second, 4, GRADSYNC_F32, GRADSYNC_MEAN);
  gradsync_comm_free(comm);
  return NULL;
}

static void test_trio_mismatch(void) {
  pthread_t t[3];
  trio_arg args[3];
  int i, k;
  memset(args, 0, sizeof args);
  for (i = 0; i < 3; ++i) {
    args[i].rank = i;
    pthread_create(&t[i], NULL, trio_worker, &args[i]);
  }
  for (i = 0; i < 3; ++i) pthread_join(t[i], NULL);
  for (i = 0; i < 3; ++i) {
    CHECK_STATUS(args[i].first_status, GRADSYNC_E_MISMATCH);
    if (strstr(args[i].first_message,
               "rank 1 called allreduce of 7 f32 (mean) but rank 0 called allreduce of 4 f32 (mean)") == NULL) {
      fprintf(stderr, "rank %d: unexpected mismatch message: %s\n", i, args[i].first_message);
      check_failed();
    }
    CHECK_STATUS(args[i].second_status, GRADSYNC_OK);
    for (k = 0; k < 4; ++k) CHECK(args[i].second[k] == 3.0f);
  }
}

/* ---- bad input at every entry point */
static void test_bad_input(void) {
  gradsync_comm_options opts;
  gradsync_comm* comm = NULL;
  float x[4] = {1, 2, 3, 4};
  int32_t v = 0;
  uint64_t total = 0;
  const void* sends[1];
  void* recvs[1];
  size_t counts[1];

  /* options */
  CHECK_STATUS(gradsync_comm_options_init(NULL, sizeof opts), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_comm_options_init(&opts, 4), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS_MSG(gradsync_comm_options_init(&opts, (size_t)-1), GRADSYNC_E_INVALID_ARG, "exceeds");
  CHECK_STATUS(gradsync_table_options_init(NULL, (size_t)-1), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_comm_options_init(&opts, sizeof opts), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_create(NULL, &opts), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_comm_create(&comm, NULL), GRADSYNC_E_INVALID_ARG);
  CHECK(comm == NULL);
  CHECK_STATUS(gradsync_comm_create(&comm, &opts), GRADSYNC_E_INVALID_ARG); /* size and rank unset */
  opts.size = 2;
  opts.rank = 2;
  strcpy(opts.name, "capi-bad");
  CHECK_STATUS(gradsync_comm_create(&comm, &opts), GRADSYNC_E_OUT_OF_RANGE);
  CHECK_MESSAGE("rank 2 out of range [0, 2)");
  opts.rank = 0;
  opts.size = 0;
  CHECK_STATUS(gradsync_comm_create(&comm, &opts), GRADSYNC_E_INVALID_ARG);
  opts.size = 1000000; /* refused before anything is allocated for it */
  CHECK_STATUS_MSG(gradsync_comm_create(&comm, &opts), GRADSYNC_E_INVALID_ARG, "exceeds the maximum 1024");
  opts.size = 1;
  opts.timeout_ms = 0;
  CHECK_STATUS(gradsync_comm_create(&comm, &opts), GRADSYNC_E_INVALID_ARG);
  opts.timeout_ms = 1000;
  opts.name[0] = '\0';
  CHECK_STATUS(gradsync_comm_create(&comm, &opts), GRADSYNC_E_INVALID_ARG);
  CHECK_MESSAGE("group name is empty");
  opts.transport = 7;
  strcpy(opts.name, "capi-bad");
  CHECK_STATUS(gradsync_comm_create(&comm, &opts), GRADSYNC_E_INVALID_ARG);
  opts.transport = GRADSYNC_TRANSPORT_THREAD;

  /* a size-1 group: returns at once */
  CHECK_STATUS(gradsync_comm_create(&comm, &opts), GRADSYNC_OK);
  CHECK(comm != NULL);
  CHECK(gradsync_comm_rank(comm, &v) == GRADSYNC_OK && v == 0);
  CHECK(gradsync_comm_size(comm, &v) == GRADSYNC_OK && v == 1);
  CHECK(gradsync_comm_transport(comm, &v) == GRADSYNC_OK && v == GRADSYNC_TRANSPORT_THREAD);
  CHECK_STATUS(gradsync_comm_allreduce(comm, x, x, 4, GRADSYNC_F32, GRADSYNC_MEAN), GRADSYNC_OK);
  CHECK(x[0] == 1 && x[3] == 4);

  /* NULL handles and out-parameters */
  CHECK_STATUS(gradsync_comm_allreduce(NULL, x, x, 4, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_MISUSE);
  CHECK_STATUS(gradsync_comm_barrier(NULL), GRADSYNC_E_MISUSE);
  CHECK_STATUS(gradsync_comm_abort(NULL), GRADSYNC_E_MISUSE);
  CHECK_STATUS(gradsync_comm_reset(NULL), GRADSYNC_E_MISUSE);
  CHECK_STATUS(gradsync_comm_rank(NULL, &v), GRADSYNC_E_MISUSE);
  CHECK_STATUS(gradsync_comm_rank(comm, NULL), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_comm_size(comm, NULL), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_comm_transport(comm, NULL), GRADSYNC_E_INVALID_ARG);
  /* the wrong kind of handle */
  {
    gradsync_counter32* counter = NULL;
    CHECK_STATUS(gradsync_counter32_create(&counter, 0), GRADSYNC_OK);
    CHECK_STATUS(gradsync_comm_barrier((gradsync_comm*)(void*)counter), GRADSYNC_E_MISUSE);
    gradsync_counter32_free(counter);
  }

  /* NULL buffers, bad dtype and op, root out of range, huge counts */
  CHECK_STATUS(gradsync_comm_allreduce(comm, NULL, x, 4, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_INVALID_ARG);
  CHECK_MESSAGE("send buffer is NULL for count 4");
  CHECK_STATUS(gradsync_comm_allreduce(comm, x, NULL, 4, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_comm_allreduce(comm, NULL, NULL, 0, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_reduce_scatter(comm, NULL, NULL, 0, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_allgather(comm, NULL, NULL, 0, GRADSYNC_F32), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_alltoall(comm, NULL, NULL, 0, GRADSYNC_F32), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_alltoall(NULL, x, x + 4, 4, GRADSYNC_F32), GRADSYNC_E_MISUSE);
  CHECK_STATUS(gradsync_comm_alltoall(comm, NULL, x, 4, GRADSYNC_F32), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_comm_alltoall(comm, x, NULL, 4, GRADSYNC_F32), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_comm_alltoall(comm, x, x + 2, 4, GRADSYNC_F32), GRADSYNC_E_INVALID_ARG);
  CHECK_MESSAGE("overlaps recv");
  CHECK_STATUS(gradsync_comm_broadcast(comm, NULL, 0, GRADSYNC_F32, 0), GRADSYNC_OK);
  CHECK(gradsync_comm_weighted_mean(comm, NULL, NULL, 0, GRADSYNC_F64, 1, &total) == GRADSYNC_OK && total == 1);
  CHECK_STATUS(gradsync_comm_allreduce(comm, x, x, 4, 99, GRADSYNC_SUM), GRADSYNC_E_INVALID_ARG);
  CHECK_MESSAGE("unknown dtype 99");
  CHECK_STATUS(gradsync_comm_allreduce(comm, x, x, 4, GRADSYNC_F32, -3), GRADSYNC_E_INVALID_ARG);
  CHECK_MESSAGE("unknown reduction op -3");
  CHECK_STATUS(gradsync_comm_allreduce(comm, x, x, SIZE_MAX / 2, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_INVALID_ARG);
  CHECK_MESSAGE("too large");
  CHECK_STATUS(gradsync_comm_broadcast(comm, x, 4, GRADSYNC_F32, 1), GRADSYNC_E_OUT_OF_RANGE);
  CHECK_MESSAGE("root 1 out of range [0, 1)");
  CHECK_STATUS(gradsync_comm_broadcast(comm, x, 4, GRADSYNC_F32, -1), GRADSYNC_E_OUT_OF_RANGE);
  CHECK_STATUS(gradsync_comm_broadcast(comm, NULL, 4, GRADSYNC_F32, 0), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_comm_allgather(comm, x, NULL, 4, GRADSYNC_F32), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_comm_reduce_scatter(comm, NULL, x, 4, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_comm_weighted_mean(comm, x, x, 4, GRADSYNC_I32, 1, &total), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_comm_weighted_mean(comm, x, x, 4, GRADSYNC_F32, 0, &total), GRADSYNC_E_ZERO_WEIGHT);
  CHECK(gradsync_comm_weighted_mean(comm, x, x, 4, GRADSYNC_F32, 5, &total) == GRADSYNC_OK && total == 5);
  CHECK(gradsync_comm_allreduce_many(comm, NULL, NULL, NULL, 1, GRADSYNC_F32, GRADSYNC_SUM) == GRADSYNC_E_INVALID_ARG);
  sends[0] = x;
  recvs[0] = x;
  counts[0] = 4;
  CHECK_STATUS(gradsync_comm_allreduce_many(comm, sends, recvs, counts, 1, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_OK);
  recvs[0] = NULL;
  CHECK(gradsync_comm_allreduce_many(comm, sends, recvs, counts, 1, GRADSYNC_F32, GRADSYNC_SUM) ==
        GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS_MSG(gradsync_comm_allreduce_many(comm, sends, recvs, counts, (size_t)-1, GRADSYNC_F32, GRADSYNC_SUM),
                   GRADSYNC_E_INVALID_ARG, "GRADSYNC_MAX_FUSED_BUFFERS");

  /* abort, fail fast, reset */
  CHECK_STATUS(gradsync_comm_abort(comm), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_barrier(comm), GRADSYNC_E_ABORTED);
  CHECK_MESSAGE("aborted");
  CHECK_STATUS(gradsync_comm_reset(comm), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_barrier(comm), GRADSYNC_OK);

  gradsync_comm_free(comm);
  gradsync_comm_free(NULL);
}

/* ---- a rank that never arrives: timeout on the waiter, within its deadline */
static void test_timeout(void) {
  gradsync_comm* a = NULL;
  gradsync_comm_options opts = GRADSYNC_COMM_OPTIONS_INIT;
  opts.rank = 0;
  opts.size = 2;
  opts.timeout_ms = 200;
  strcpy(opts.name, "capi-lonely");
  CHECK_STATUS(gradsync_comm_create(&a, &opts), GRADSYNC_E_TIMEOUT);
  CHECK(a == NULL);
  CHECK_MESSAGE("did not join within 200 ms");
}

/* ---- versioned options: struct_size and version are checked, garbage is refused by name */
static int create_alone(const void* opts) {
  gradsync_comm* comm = NULL;
  const int status = gradsync_comm_create(&comm, (const gradsync_comm_options*)opts);
  if (status == GRADSYNC_OK) {
    CHECK(comm != NULL);
    gradsync_comm_free(comm);
  } else {
    CHECK(comm == NULL);
  }
  return status;
}

/* Threads as ranks are the MPI and hierarchical transports' (tests/mpi/threads_program.c): the
 * thread and shm transports refuse them, and a thread index needs threads. */
static void test_threads_options(void) {
  const int32_t transports[] = {GRADSYNC_TRANSPORT_THREAD, GRADSYNC_TRANSPORT_SHM};
  for (size_t i = 0; i < sizeof transports / sizeof transports[0]; ++i) {
    gradsync_comm_options opts = GRADSYNC_COMM_OPTIONS_INIT;
    opts.transport = transports[i];
    opts.rank = 0;
    opts.size = 1;
    strcpy(opts.name, "capi-threads-options");
    opts.threads = 2;
    opts.thread = 0;
    CHECK_STATUS_MSG(create_alone(&opts), GRADSYNC_E_INVALID_ARG, "threads is for the MPI and hierarchical transports");
    opts.threads = GRADSYNC_UNSET_I32;
    opts.thread = 1;
    CHECK_STATUS_MSG(create_alone(&opts), GRADSYNC_E_OUT_OF_RANGE, "thread 1 out of range [0, 1)");
    opts.threads = 1;
    opts.thread = 0;
    CHECK_STATUS(create_alone(&opts), GRADSYNC_OK);
  }
}

static void test_options_versions(void) {
  gradsync_comm_options opts = GRADSYNC_COMM_OPTIONS_INIT;
  unsigned char *exact, *newer;
  const size_t extra = 16;
  char expected[128];
  opts.rank = 0;
  opts.size = 1;
  strcpy(opts.name, "capi-options-versions");
  CHECK_STATUS(create_alone(&opts), GRADSYNC_OK);

  opts.version = 0;
  CHECK_STATUS_MSG(create_alone(&opts), GRADSYNC_E_INVALID_ARG, "options.version 0");
  snprintf(expected, sizeof expected, "(accepted: 1 to %d, or later from a newer header)",
           GRADSYNC_COMM_OPTIONS_VERSION);
  CHECK_MESSAGE(expected);
  opts.version = GRADSYNC_COMM_OPTIONS_VERSION;

  opts.struct_size = 0;
  CHECK_STATUS_MSG(create_alone(&opts), GRADSYNC_E_INVALID_ARG, "options.struct_size 0");
  CHECK_MESSAGE("accepted: ");
  /* garbage far beyond the struct: refused before anything past the struct is read */
  opts.struct_size = 0xFFFFFFFFu;
  CHECK_STATUS_MSG(create_alone(&opts), GRADSYNC_E_INVALID_ARG, "options.struct_size 4294967295");
  /* a struct of this library's version cannot be larger than this library's */
  opts.struct_size = (uint32_t)(sizeof opts + extra);
  snprintf(expected, sizeof expected, "larger than version %d", GRADSYNC_COMM_OPTIONS_VERSION);
  CHECK_STATUS_MSG(create_alone(&opts), GRADSYNC_E_INVALID_ARG, expected);
  /* a version-2 struct (before threads as ranks): accepted, one rank per thread as ever */
  opts.struct_size = (uint32_t)offsetof(gradsync_comm_options, threads);
  opts.version = 2;
  opts.threads = 7;
  CHECK_STATUS(create_alone(&opts), GRADSYNC_OK);
  opts.threads = GRADSYNC_UNSET_I32;
  /* a version-1 struct (before the host label): accepted, the label left empty */
  opts.struct_size = (uint32_t)offsetof(gradsync_comm_options, host);
  opts.version = 1;
  strcpy(opts.host, "never read");
  CHECK_STATUS(create_alone(&opts), GRADSYNC_OK);
  memset(opts.host, 0, sizeof opts.host);
  opts.version = GRADSYNC_COMM_OPTIONS_VERSION;
  /* a newer version must have appended fields */
  opts.struct_size = (uint32_t)sizeof opts;
  opts.version = GRADSYNC_COMM_OPTIONS_VERSION + 1;
  CHECK_STATUS_MSG(create_alone(&opts), GRADSYNC_E_INVALID_ARG, "is newer than this library's");
  opts.version = GRADSYNC_COMM_OPTIONS_VERSION;

  /* the smallest struct the library accepts (version 1, today all of it) in memory of exactly that
   * size: nothing past it is read (AddressSanitizer builds would see it) */
  exact = (unsigned char*)malloc(sizeof opts);
  CHECK(exact != NULL);
  if (exact != NULL) {
    memcpy(exact, &opts, sizeof opts);
    CHECK_STATUS(create_alone(exact), GRADSYNC_OK);
    free(exact);
  }

  /* a newer header's struct: accepted while its unknown fields are 0, refused naming the byte once one is set */
  newer = (unsigned char*)calloc(1, sizeof opts + extra);
  CHECK(newer != NULL);
  if (newer != NULL) {
    gradsync_comm_options* n = (gradsync_comm_options*)(void*)newer;
    memcpy(newer, &opts, sizeof opts);
    n->struct_size = (uint32_t)(sizeof opts + extra);
    n->version = GRADSYNC_COMM_OPTIONS_VERSION + 1;
    CHECK_STATUS(create_alone(newer), GRADSYNC_OK);
    newer[sizeof opts + 3] = 1;
    CHECK_STATUS_MSG(create_alone(newer), GRADSYNC_E_INVALID_ARG, "does not know");
    sprintf(expected, "byte %u of %u is not 0", (unsigned)(sizeof opts + 3), (unsigned)(sizeof opts + extra));
    CHECK_MESSAGE(expected);
    free(newer);
  }
}

/* ---- timeout_ms = GRADSYNC_NO_TIMEOUT (INT64_MAX): joining and every collective work */
typedef struct {
  gradsync_comm** comms;
  int* late_started;
  int32_t rank;
  int allreduce_status, barrier_status, broadcast_status, late_status;
  double sum[3];
  int32_t bcast[4];
} forever_arg;

static void* forever_worker(void* p) {
  forever_arg* a = (forever_arg*)p;
  gradsync_comm* comm = a->comms[a->rank];
  int i;
  for (i = 0; i < 3; ++i) a->sum[i] = (double)(a->rank + 1) * (i + 1);
  for (i = 0; i < 4; ++i) a->bcast[i] = a->rank == 1 ? 40 + i : -1;
  a->allreduce_status = gradsync_comm_allreduce(comm, a->sum, a->sum, 3, GRADSYNC_F64, GRADSYNC_SUM);
  a->barrier_status = gradsync_comm_barrier(comm);
  a->broadcast_status = gradsync_comm_broadcast(comm, a->bcast, 4, GRADSYNC_I32, 1);
  /* a round where rank 0 surely waits, its deadline computed from INT64_MAX ms: rank 1 comes only
   * once rank 0 is inside that call (an overflowed deadline would lie in the past: E_TIMEOUT) */
  if (a->rank == 1) {
    while (!get_flag(a->late_started)) sched_yield();
    if (wait_until_in_call(a->comms[0]) != 0) {
      gradsync_comm_abort(comm); /* release rank 0 */
      return NULL;
    }
    /* lets rank 0 get past spinning to where its deadline counts; no outcome depends on it */
    {
      const struct timespec pause = {0, 20 * 1000 * 1000};
      nanosleep(&pause, NULL);
    }
  } else {
    set_flag(a->late_started);
  }
  RETRY_WHILE_PROBED(a->late_status, gradsync_comm_barrier(comm));
  return NULL;
}

static void test_no_timeout(void) {
  gradsync_comm* comms[2];
  forever_arg args[2];
  pthread_t t[2];
  int late_started = 0;
  int i;
  CHECK(GRADSYNC_NO_TIMEOUT == INT64_MAX);
  if (join_pair("capi-no-timeout", GRADSYNC_NO_TIMEOUT, comms) != 0) return;
  memset(args, 0, sizeof args);
  for (i = 0; i < 2; ++i) {
    args[i].comms = comms;
    args[i].late_started = &late_started;
    args[i].rank = i;
    pthread_create(&t[i], NULL, forever_worker, &args[i]);
  }
  for (i = 0; i < 2; ++i) pthread_join(t[i], NULL);
  for (i = 0; i < 2; ++i) {
    CHECK_STATUS(args[i].allreduce_status, GRADSYNC_OK);
    CHECK(args[i].sum[0] == 3.0 && args[i].sum[1] == 6.0 && args[i].sum[2] == 9.0);
    CHECK_STATUS(args[i].barrier_status, GRADSYNC_OK);
    CHECK_STATUS(args[i].broadcast_status, GRADSYNC_OK);
    CHECK(args[i].bcast[0] == 40 && args[i].bcast[3] == 43);
    CHECK_STATUS(args[i].late_status, GRADSYNC_OK);
  }
  gradsync_comm_free(comms[0]);
  gradsync_comm_free(comms[1]);
}

/* ---- one handle, two threads: the second caller is refused, the first is unaffected */
typedef struct {
  gradsync_comm* comm;
  float data[2];
  int status;
  int returned; /* a flag: set once the call has returned */
} caller_arg;

static void* caller_worker(void* p) {
  caller_arg* a = (caller_arg*)p;
  RETRY_WHILE_PROBED(a->status, gradsync_comm_allreduce(a->comm, a->data, a->data, 2, GRADSYNC_F32, GRADSYNC_SUM));
  set_flag(&a->returned);
  return NULL;
}

static void test_two_threads_one_handle(void) {
  gradsync_comm* comms[2];
  caller_arg first = {NULL, {1, 2}, -1000, 0};
  float mine[2] = {7, 7}, peer[2] = {10, 20};
  void* p = NULL;
  int32_t v = -1;
  pthread_t t;
  if (join_pair("capi-busy", 20000, comms) != 0) return;
  first.comm = comms[0];
  /* rank 0's allreduce on another thread waits for rank 1, which comes last, from this thread */
  pthread_create(&t, NULL, caller_worker, &first);
  if (wait_until_in_call(comms[0]) == 0) {
    CHECK_STATUS_MSG(
        gradsync_comm_barrier(comms[0]), GRADSYNC_E_MISUSE,
        "gradsync_comm_barrier: communicator 'capi-busy' (thread transport, rank 0 of 2) is already in a "
        "call on another thread (gradsync_comm_allreduce); a handle must not be used by two threads at once");
    CHECK_STATUS_MSG(gradsync_comm_allreduce(comms[0], mine, mine, 2, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_MISUSE,
                     "already in a call on another thread");
    CHECK(mine[0] == 7 && mine[1] == 7); /* refused untouched */
    CHECK_STATUS(gradsync_comm_reset(comms[0]), GRADSYNC_E_MISUSE);
    CHECK_STATUS(gradsync_comm_alloc(comms[0], 64, &p), GRADSYNC_E_MISUSE);
    CHECK(p == NULL);
    /* read-only getters stay available */
    CHECK(gradsync_comm_rank(comms[0], &v) == GRADSYNC_OK && v == 0);
    CHECK(gradsync_comm_size(comms[0], &v) == GRADSYNC_OK && v == 2);
    CHECK(!get_flag(&first.returned)); /* the refusals did not end (or fail) the running call */
  }
  CHECK_STATUS(gradsync_comm_allreduce(comms[1], peer, peer, 2, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_OK);
  pthread_join(t, NULL);
  CHECK_STATUS(first.status, GRADSYNC_OK);
  CHECK(first.data[0] == 11 && first.data[1] == 22 && peer[0] == 11 && peer[1] == 22);
  /* the handle is free again once the call returned, and the group was not disturbed */
  CHECK_STATUS(gradsync_comm_alloc(comms[0], 64, &p), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_free_buffer(comms[0], p), GRADSYNC_OK);
  first.data[0] = 1;
  first.data[1] = 2;
  first.returned = 0;
  pthread_create(&t, NULL, caller_worker, &first);
  peer[0] = 10;
  peer[1] = 20;
  CHECK_STATUS(gradsync_comm_allreduce(comms[1], peer, peer, 2, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_OK);
  pthread_join(t, NULL);
  CHECK_STATUS(first.status, GRADSYNC_OK);
  CHECK(first.data[0] == 11 && peer[1] == 22);
  gradsync_comm_free(comms[0]);
  gradsync_comm_free(comms[1]);
}

/* ---- free while another thread is inside a call: the call is aborted, free waits for it */
static void test_free_during_call(void) {
  gradsync_comm* comms[2];
  caller_arg blocked = {NULL, {1, 2}, -1000, 0};
  pthread_t t;
  if (join_pair("capi-free-busy", 20000, comms) != 0) return;
  blocked.comm = comms[0];
  pthread_create(&t, NULL, caller_worker, &blocked); /* waits for rank 1, which never calls */
  if (wait_until_in_call(comms[0]) != 0) {
    gradsync_comm_abort(comms[0]);
    pthread_join(t, NULL);
    gradsync_comm_free(comms[0]);
    gradsync_comm_free(comms[1]);
    return;
  }
  gradsync_comm_free(comms[0]); /* returns once the call has left the communicator */
  pthread_join(t, NULL);
  CHECK_STATUS(blocked.status, GRADSYNC_E_ABORTED);
  /* the peer learns of it at its next call, and does not hang */
  CHECK_STATUS(gradsync_comm_barrier(comms[1]), GRADSYNC_E_ABORTED);
  gradsync_comm_free(comms[1]);
}

static void* reset_worker(void* comm) {
  CHECK_STATUS(gradsync_comm_reset((gradsync_comm*)comm), GRADSYNC_OK);
  return NULL;
}

/* The host's interrupt check: says "out" on its 3rd call while rank 0 waits for a rank 1 that has
   not come; the wait ends with E_ABORTED (long before its 60 s deadline), rank 1's late call finds
   the group aborted, and a reset on both ranks recovers it. */
static int third_call(void* user) {
  int* calls = (int*)user;
  return ++*calls >= 3;
}

static void test_interrupt(void) {
  gradsync_comm* comms[2];
  float x[4] = {1, 1, 1, 1};
  int calls = 0;
  if (join_pair("capi-interrupt", 60000, comms) != 0) return;
  CHECK_STATUS(gradsync_comm_set_interrupt(NULL, third_call, &calls), GRADSYNC_E_MISUSE);
  CHECK_STATUS(gradsync_comm_set_interrupt(comms[0], third_call, &calls), GRADSYNC_OK);
  CHECK_STATUS_MSG(gradsync_comm_allreduce(comms[0], x, x, 4, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_ABORTED,
                   "abort() called on rank 0");
  CHECK(calls == 3);
  CHECK_STATUS(gradsync_comm_allreduce(comms[1], x, x, 4, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_ABORTED);
  CHECK_STATUS(gradsync_comm_set_interrupt(comms[0], NULL, NULL), GRADSYNC_OK);
  {
    pthread_t t;
    pthread_create(&t, NULL, reset_worker, comms[1]);
    CHECK_STATUS(gradsync_comm_reset(comms[0]), GRADSYNC_OK);
    pthread_join(t, NULL);
  }
  gradsync_comm_free(comms[0]);
  gradsync_comm_free(comms[1]);
}

int main(void) {
  test_pair_mean();
  test_alltoall();
  test_trio_mismatch();
  test_bad_input();
  test_timeout();
  test_options_versions();
  test_threads_options();
  test_no_timeout();
  test_two_threads_one_handle();
  test_free_during_call();
  test_interrupt();
  return check_report("comm C API");
}
