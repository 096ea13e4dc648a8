/* SPDX-License-Identifier: Apache-2.0 */
/* The non-blocking collectives through the C ABI, on a thread group of two: many requests in flight
 * give the blocking calls' results, in issue order, mixed with blocking calls; a mismatch fails the
 * request on both ranks and is the communicator's async error until reset; an abort fails every
 * pending request; a deadline fails the request; a free with requests pending fails them, and so
 * it does a blocking call queued behind them; bad arguments fail at once, without a request. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "gradsync/gradsync.h"
#include "two_threads.h"

#define REQS 24

typedef struct {
  gradsync_comm* comm;
  int32_t rank;
  int32_t* bufs[REQS];
  size_t counts[REQS];
  float order[2];
  int32_t gathered[5];
  uint64_t total;
} rank_state;

/* Requests of every kind in flight at once, a blocking call among them, then all waited for. */
static void* many_in_flight(void* p) {
  rank_state* s = (rank_state*)p;
  gradsync_request* reqs[REQS + 4];
  int32_t mine = s->rank + 1;
  float w = (float)(s->rank + 1), wout = 0;
  int i, n = 0;
  for (i = 0; i < REQS; ++i) {
    size_t j;
    s->counts[i] = (size_t)1 << (i % 18); /* 1 .. 128K elements: inline, direct paths */
    s->bufs[i] = (int32_t*)malloc(s->counts[i] * sizeof(int32_t));
    for (j = 0; j < s->counts[i]; ++j) s->bufs[i][j] = (int32_t)(j % 1000) * (s->rank + 1) + i;
    CHECK_STATUS(
        gradsync_comm_iallreduce(s->comm, s->bufs[i], s->bufs[i], s->counts[i], GRADSYNC_I32, GRADSYNC_SUM, &reqs[n++]),
        GRADSYNC_OK);
    if (i == REQS / 2) {
      /* A blocking call with requests pending runs after them: its result is its own. */
      int32_t b = s->rank;
      CHECK_STATUS(gradsync_comm_allreduce(s->comm, &b, &b, 1, GRADSYNC_I32, GRADSYNC_SUM), GRADSYNC_OK);
      CHECK(b == 1);
    }
  }
  /* Issue order: a sum then a max over the same buffer give 3, a max then a sum would give 4. */
  s->order[0] = (float)(s->rank + 1);
  CHECK_STATUS(gradsync_comm_iallreduce(s->comm, s->order, s->order, 1, GRADSYNC_F32, GRADSYNC_SUM, &reqs[n++]),
               GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_iallreduce(s->comm, s->order, s->order, 1, GRADSYNC_F32, GRADSYNC_MAX, &reqs[n++]),
               GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_iallgather(s->comm, &mine, s->gathered, 2, GRADSYNC_I32, &reqs[n++]), GRADSYNC_OK);
  CHECK_STATUS(
      gradsync_comm_iweighted_mean(s->comm, &w, &wout, 1, GRADSYNC_F32, (uint64_t)(s->rank + 1), &s->total, &reqs[n++]),
      GRADSYNC_OK);
  for (i = 0; i < n; ++i) {
    int32_t done = 0;
    if (i % 2 == 0) {
      CHECK_STATUS(gradsync_request_wait(reqs[i], -1), GRADSYNC_OK);
    } else {
      while (!done) CHECK_STATUS(gradsync_request_test(reqs[i], &done), GRADSYNC_OK);
    }
    gradsync_request_free(reqs[i]);
  }
  CHECK(s->order[0] == 3.0f);
  CHECK(s->gathered[0] == 1 && s->gathered[1] == 2);
  CHECK(s->total == 3 && wout == (1.0f * 1 + 2.0f * 2) / 3);
  return NULL;
}

typedef struct {
  gradsync_comm* comm;
  int32_t rank;
  int count;
  int expect;
  const char* needle;
} mismatch_state;

static void* mismatch(void* p) {
  mismatch_state* s = (mismatch_state*)p;
  float v[5] = {1, 2, 3, 4, 5};
  gradsync_request* req = NULL;
  int32_t err = 0;
  CHECK_STATUS(
      gradsync_comm_iallreduce(s->comm, v, v, (size_t)(s->rank == 0 ? 4 : 5), GRADSYNC_F32, GRADSYNC_SUM, &req),
      GRADSYNC_OK);
  CHECK_STATUS_MSG(gradsync_request_wait(req, -1), GRADSYNC_E_MISMATCH, "gradsync_comm_iallreduce: ");
  CHECK_MESSAGE("rank 1 called allreduce of 5 f32 (sum) but rank 0 called allreduce of 4 f32 (sum)");
  gradsync_request_free(req);
  CHECK_STATUS(gradsync_comm_get_async_error(s->comm, &err), GRADSYNC_OK);
  CHECK(err == GRADSYNC_E_MISMATCH);
  CHECK_MESSAGE("gradsync_comm_iallreduce: ");
  /* The next call works, and the async error stays until a reset. */
  CHECK_STATUS(gradsync_comm_ibarrier(s->comm, &req), GRADSYNC_OK);
  CHECK_STATUS(gradsync_request_wait(req, -1), GRADSYNC_OK);
  gradsync_request_free(req);
  CHECK_STATUS(gradsync_comm_reset(s->comm), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_get_async_error(s->comm, &err), GRADSYNC_OK);
  CHECK(err == GRADSYNC_OK);
  return NULL;
}

static void* reset_rank(void* p) {
  CHECK_STATUS(gradsync_comm_reset(((rank_state*)p)->comm), GRADSYNC_OK);
  return NULL;
}

/* A blocking call made on another thread while a request is pending, and what it returned. */
typedef struct {
  gradsync_comm* comm;
  int status;
  int freed_message;
} queued_call;

static void* queued_allreduce(void* p) {
  queued_call* q = (queued_call*)p;
  float v = 1;
  q->status = gradsync_comm_allreduce(q->comm, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM);
  q->freed_message = check_message_has("was freed");
  return NULL;
}

/* Set once the queued call says (at debug level) that it waits behind the pending requests: from
 * then on it no longer touches the handle, so the handle may be freed under it. */
static int call_queued;

static void watch_for_queued(void* user_data, int32_t level, const char* message) {
  (void)user_data;
  (void)level;
  if (strstr(message, "gradsync_comm_allreduce waits for the non-blocking calls made before it") != NULL)
    set_flag(&call_queued);
}

static void run_pair(void* (*body)(void*), void* a, void* b) {
  pthread_t t;
  pthread_create(&t, NULL, body, b);
  body(a);
  pthread_join(t, NULL);
}

int main(void) {
  gradsync_comm* c[2];
  int i;
  if (join_pair("async-many", 20000, c) != 0) return check_report("capi_async");
  {
    rank_state s[2];
    memset(s, 0, sizeof s);
    for (i = 0; i < 2; ++i) s[i].comm = c[i], s[i].rank = i;
    run_pair(many_in_flight, &s[0], &s[1]);
    for (i = 0; i < REQS; ++i) {
      size_t j;
      for (j = 0; j < s[0].counts[i]; ++j) {
        const int32_t want = (int32_t)(j % 1000) * 3 + 2 * i;
        if (s[0].bufs[i][j] != want || s[1].bufs[i][j] != want) {
          fprintf(stderr, "request %d element %zu: %d / %d, want %d\n", i, j, s[0].bufs[i][j], s[1].bufs[i][j], want);
          check_failed();
          break;
        }
      }
      free(s[0].bufs[i]);
      free(s[1].bufs[i]);
    }
  }
  {
    mismatch_state m[2] = {{c[0], 0, 0, 0, NULL}, {c[1], 1, 0, 0, NULL}};
    run_pair(mismatch, &m[0], &m[1]);
  }
  {
    /* Bad arguments fail at once, with no request; NULL out-parameter and handles are refused. */
    float v[2] = {0, 0};
    gradsync_request* req = (gradsync_request*)&v; /* overwritten with NULL */
    CHECK_STATUS_MSG(gradsync_comm_iallreduce(c[0], (char*)v + 1, v, 1, GRADSYNC_F32, GRADSYNC_SUM, &req),
                     GRADSYNC_E_INVALID_ARG, "not aligned");
    CHECK(req == NULL);
    CHECK_STATUS_MSG(gradsync_comm_iallreduce(c[0], v, v, 1, 99, GRADSYNC_SUM, &req), GRADSYNC_E_INVALID_ARG, "dtype");
    CHECK_STATUS_MSG(gradsync_comm_ibarrier(c[0], NULL), GRADSYNC_E_INVALID_ARG, "request out-parameter is NULL");
    CHECK_STATUS(gradsync_comm_ibarrier(NULL, &req), GRADSYNC_E_MISUSE);
    CHECK_STATUS(gradsync_request_wait(NULL, 0), GRADSYNC_E_MISUSE);
    CHECK_STATUS(gradsync_request_test(NULL, NULL), GRADSYNC_E_INVALID_ARG);
    gradsync_request_free(NULL);
  }
  {
    /* Rank 0 alone issues requests: the first waits for rank 1, which never comes. A wait of 0 ms
     * reports it pending; an abort then fails all three, and the next call fails fast until reset. */
    float v[3] = {1, 2, 3};
    gradsync_request* req[3];
    rank_state s[2];
    for (i = 0; i < 3; ++i)
      CHECK_STATUS(gradsync_comm_iallreduce(c[0], &v[i], &v[i], 1, GRADSYNC_F32, GRADSYNC_SUM, &req[i]), GRADSYNC_OK);
    CHECK_STATUS_MSG(gradsync_request_wait(req[2], 0), GRADSYNC_E_IN_PROGRESS, "still pending");
    CHECK_STATUS(gradsync_comm_abort(c[1]), GRADSYNC_OK);
    for (i = 0; i < 3; ++i) {
      CHECK_STATUS(gradsync_request_wait(req[i], -1), GRADSYNC_E_ABORTED);
      gradsync_request_free(req[i]);
    }
    CHECK_STATUS(gradsync_comm_ibarrier(c[1], &req[0]), GRADSYNC_OK);
    CHECK_STATUS(gradsync_request_wait(req[0], -1), GRADSYNC_E_ABORTED);
    gradsync_request_free(req[0]);
    for (i = 0; i < 2; ++i) s[i].comm = c[i];
    run_pair(reset_rank, &s[0], &s[1]);
  }
  for (i = 0; i < 2; ++i) gradsync_comm_free(c[i]);

  /* A deadline: rank 1 never calls, rank 0's request times out. */
  if (join_pair("async-timeout", 200, c) != 0) return check_report("capi_async");
  {
    float v = 1;
    gradsync_request* req;
    CHECK_STATUS(gradsync_comm_iallreduce(c[0], &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM, &req), GRADSYNC_OK);
    CHECK_STATUS_MSG(gradsync_request_wait(req, -1), GRADSYNC_E_TIMEOUT, "gradsync_comm_iallreduce");
    gradsync_request_free(req);
  }
  for (i = 0; i < 2; ++i) gradsync_comm_free(c[i]);

  /* A free with requests pending: the running one is aborted, those not started fail as freed;
   * their handles stay valid until freed. */
  if (join_pair("async-free", 20000, c) != 0) return check_report("capi_async");
  {
    float v[3] = {1, 2, 3};
    gradsync_request* req[3];
    for (i = 0; i < 3; ++i)
      CHECK_STATUS(gradsync_comm_iallreduce(c[0], &v[i], &v[i], 1, GRADSYNC_F32, GRADSYNC_SUM, &req[i]), GRADSYNC_OK);
    gradsync_comm_free(c[0]);
    {
      /* The first may have started before the free or not. */
      const int first = gradsync_request_wait(req[0], -1);
      CHECK(first == GRADSYNC_E_ABORTED || (first == GRADSYNC_E_MISUSE && check_message_has("was freed")));
    }
    for (i = 1; i < 3; ++i) CHECK_STATUS_MSG(gradsync_request_wait(req[i], -1), GRADSYNC_E_MISUSE, "was freed");
    for (i = 0; i < 3; ++i) gradsync_request_free(req[i]);
    gradsync_comm_free(c[1]);
  }

  /* A free while a blocking call on another thread waits behind a pending request: the request is
   * aborted (or fails as freed, if it had not started), the blocking call fails as freed, and
   * neither touches the freed handle (the sanitizer runs would see it). */
  if (join_pair("async-free-queued", 20000, c) != 0) return check_report("capi_async");
  {
    const int32_t level = gradsync_get_log_level();
    float v = 1;
    gradsync_request* req;
    queued_call q;
    pthread_t t;
    q.comm = c[0];
    q.status = GRADSYNC_OK;
    q.freed_message = 0;
    CHECK_STATUS(gradsync_set_log_callback(watch_for_queued, NULL, GRADSYNC_LOG_DEBUG), GRADSYNC_OK);
    CHECK_STATUS(gradsync_comm_iallreduce(c[0], &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM, &req), GRADSYNC_OK);
    pthread_create(&t, NULL, queued_allreduce, &q);
    {
      /* Bounded (the request's own deadline is 20 s): a call that never queues fails the test
       * rather than hanging it, and the handle is left alone then. */
      struct timespec start, now;
      clock_gettime(CLOCK_MONOTONIC, &start);
      while (!get_flag(&call_queued)) {
        sched_yield();
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec - start.tv_sec > 60) {
          fprintf(stderr, "the blocking call never said it was queued behind the request\n");
          check_failed();
          return check_report("capi_async");
        }
      }
    }
    gradsync_comm_free(c[0]);
    pthread_join(t, NULL);
    CHECK(q.status == GRADSYNC_E_MISUSE && q.freed_message);
    {
      const int first = gradsync_request_wait(req, -1);
      CHECK(first == GRADSYNC_E_ABORTED || (first == GRADSYNC_E_MISUSE && check_message_has("was freed")));
    }
    gradsync_request_free(req);
    CHECK_STATUS(gradsync_set_log_callback(NULL, NULL, level), GRADSYNC_OK);
    gradsync_comm_free(c[1]);
  }
  return check_report("capi_async");
}
