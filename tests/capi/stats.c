/* SPDX-License-Identifier: Apache-2.0 */
/* Statistics and the timeline through the C ABI, on a thread group of two: rank 1 comes late to
 * every call, and both ranks name it the straggler with the same figures; calls, failures and
 * bytes are counted per collective, non-blocking calls included; the statistics are read while a
 * call runs on another thread; bad arguments and an unwritable timeline get clear errors; the
 * timeline holds every call with its two phases. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "gradsync/gradsync.h"
#include "two_threads.h"

#define LATE_CALLS 3
#define LATE_MS 20

typedef struct {
  gradsync_comm* comm;
  gradsync_comm* peer; /* the other rank's handle */
  int32_t rank;
} rank_state;

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static int entering[LATE_CALLS];

/* Rank 1 enters each call LATE_MS after rank 0 starts it, and reads rank 0's statistics while
 * rank 0 runs its call. */
static void* late_calls(void* p) {
  rank_state* s = (rank_state*)p;
  int i;
  for (i = 0; i < LATE_CALLS; ++i) {
    float v = (float)(s->rank + i);
    if (s->rank == 1) {
      gradsync_comm_statistics st = GRADSYNC_COMM_STATISTICS_INIT;
      while (!get_flag(&entering[i])) sched_yield();
      CHECK_STATUS(gradsync_comm_stats(s->peer, &st, NULL, 0), GRADSYNC_OK);
      CHECK(st.collective[GRADSYNC_COLLECTIVE_ALLREDUCE].calls == (uint64_t)i);
      sleep_ms(LATE_MS);
    } else {
      set_flag(&entering[i]);
    }
    CHECK_STATUS(gradsync_comm_allreduce(s->comm, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_OK);
    CHECK(v == (float)(1 + 2 * i));
  }
  return NULL;
}

/* A mismatch (counted failed on both ranks), then non-blocking calls (counted as any call). */
static void* mismatch_then_requests(void* p) {
  rank_state* s = (rank_state*)p;
  int32_t v[4] = {1, 2, 3, 4};
  gradsync_request* r[2];
  CHECK_STATUS(gradsync_comm_allreduce(s->comm, v, v, (size_t)(1 + s->rank), GRADSYNC_I32, GRADSYNC_SUM),
               GRADSYNC_E_MISMATCH);
  CHECK_STATUS(gradsync_comm_ibroadcast(s->comm, v, 4, GRADSYNC_I32, 0, &r[0]), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_ibarrier(s->comm, &r[1]), GRADSYNC_OK);
  CHECK_STATUS(gradsync_request_wait(r[0], -1), GRADSYNC_OK);
  CHECK_STATUS(gradsync_request_wait(r[1], -1), GRADSYNC_OK);
  gradsync_request_free(r[0]);
  gradsync_request_free(r[1]);
  return NULL;
}

static void* two_calls(void* p) {
  rank_state* s = (rank_state*)p;
  double v[8] = {0};
  CHECK_STATUS(gradsync_comm_allreduce(s->comm, v, v, 8, GRADSYNC_F64, GRADSYNC_SUM), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_barrier(s->comm), GRADSYNC_OK);
  return NULL;
}

static void run_pair(void* (*body)(void*), void* a, void* b) {
  pthread_t t;
  pthread_create(&t, NULL, body, b);
  body(a);
  pthread_join(t, NULL);
}

static char* read_file(const char* path) {
  FILE* f = fopen(path, "rb");
  long n;
  char* text;
  if (f == NULL) return NULL;
  fseek(f, 0, SEEK_END);
  n = ftell(f);
  fseek(f, 0, SEEK_SET);
  text = (char*)calloc((size_t)n + 1, 1);
  if (fread(text, 1, (size_t)n, f) != (size_t)n) text[0] = '\0';
  fclose(f);
  return text;
}

static int count_of(const char* text, const char* needle) {
  int n = 0;
  for (text = strstr(text, needle); text != NULL; text = strstr(text + 1, needle)) ++n;
  return n;
}

int main(void) {
  gradsync_comm* c[2];
  rank_state s[2];
  gradsync_comm_statistics st[2] = {GRADSYNC_COMM_STATISTICS_INIT, GRADSYNC_COMM_STATISTICS_INIT};
  gradsync_comm_peer_stats peers[2][2];
  int i;
  if (join_pair("stats-late", 20000, c) != 0) return check_report("capi_stats");
  for (i = 0; i < 2; ++i) s[i].comm = c[i], s[i].peer = c[1 - i], s[i].rank = i;

  run_pair(late_calls, &s[0], &s[1]);
  for (i = 0; i < 2; ++i) CHECK_STATUS(gradsync_comm_stats(c[i], &st[i], peers[i], 2), GRADSYNC_OK);
  for (i = 0; i < 2; ++i) {
    const gradsync_comm_collective_stats* a = &st[i].collective[GRADSYNC_COLLECTIVE_ALLREDUCE];
    CHECK(st[i].version == GRADSYNC_COMM_STATISTICS_VERSION && st[i].rank == i && st[i].size == 2);
    CHECK(a->calls == LATE_CALLS && a->failed == 0 && a->bytes == LATE_CALLS * sizeof(float));
    CHECK(st[i].rounds == LATE_CALLS);
    /* Both ranks saw the same arrivals, so the same figures, and name the same straggler. */
    CHECK(st[i].straggler == 1);
  }
  CHECK(memcmp(peers[0], peers[1], sizeof peers[0]) == 0);
  CHECK(peers[0][0].late_ns == 0 && peers[0][0].last == 0);
  CHECK(peers[0][1].last == LATE_CALLS);
  /* Rank 1 came at least LATE_MS after rank 0 started the call; half of it as the bound leaves rank
   * 0 room to stamp its arrival late. */
  CHECK(peers[0][1].late_ns >= (uint64_t)LATE_CALLS * LATE_MS / 2 * 1000000u);
  CHECK(peers[0][1].max_late_ns >= (uint64_t)LATE_MS / 2 * 1000000u);
  /* Rank 0 waited for rank 1; rank 1 hardly waited at all. */
  CHECK(st[0].collective[GRADSYNC_COLLECTIVE_ALLREDUCE].wait_ns >= (uint64_t)LATE_CALLS * LATE_MS / 2 * 1000000u);
  CHECK(st[1].collective[GRADSYNC_COLLECTIVE_ALLREDUCE].wait_ns <
        st[0].collective[GRADSYNC_COLLECTIVE_ALLREDUCE].wait_ns);

  run_pair(mismatch_then_requests, &s[0], &s[1]);
  for (i = 0; i < 2; ++i) {
    CHECK_STATUS(gradsync_comm_stats(c[i], &st[i], NULL, 0), GRADSYNC_OK);
    CHECK(st[i].collective[GRADSYNC_COLLECTIVE_ALLREDUCE].failed == 1);
    CHECK(st[i].collective[GRADSYNC_COLLECTIVE_ALLREDUCE].calls == LATE_CALLS);
    CHECK(st[i].collective[GRADSYNC_COLLECTIVE_BROADCAST].calls == 1);
    CHECK(st[i].collective[GRADSYNC_COLLECTIVE_BROADCAST].bytes == 4 * sizeof(int32_t));
    CHECK(st[i].collective[GRADSYNC_COLLECTIVE_BARRIER].calls == 1);
    CHECK(st[i].collective[GRADSYNC_COLLECTIVE_ALLGATHER].calls == 0);
    CHECK(st[i].collective[0].calls == 0 && st[i].collective[0].failed == 0);
  }

  {
    /* Bad arguments. */
    gradsync_comm_statistics bad = GRADSYNC_COMM_STATISTICS_INIT;
    unsigned char newer[sizeof(gradsync_comm_statistics) + 16];
    gradsync_comm_peer_stats one[1];
    CHECK_STATUS_MSG(gradsync_comm_stats(c[0], NULL, NULL, 0), GRADSYNC_E_INVALID_ARG, "stats is NULL");
    bad.struct_size = 8;
    CHECK_STATUS_MSG(gradsync_comm_stats(c[0], &bad, NULL, 0), GRADSYNC_E_INVALID_ARG, "struct_size 8");
    bad.struct_size = sizeof bad;
    CHECK_STATUS_MSG(gradsync_comm_stats(c[0], &bad, NULL, 2), GRADSYNC_E_INVALID_ARG, "peers is NULL");
    CHECK_STATUS_MSG(gradsync_comm_stats(c[0], &bad, one, 1), GRADSYNC_E_BUFS, "2 ranks");
    CHECK(bad.size == 2 && bad.collective[GRADSYNC_COLLECTIVE_BARRIER].calls == 1);
    CHECK_STATUS(gradsync_comm_stats(NULL, &bad, NULL, 0), GRADSYNC_E_MISUSE);
    /* A newer caller's struct: the fields this library does not know read as 0. */
    memset(newer, 0xab, sizeof newer);
    ((gradsync_comm_statistics*)(void*)newer)->struct_size = (uint32_t)sizeof newer;
    CHECK_STATUS(gradsync_comm_stats(c[0], (gradsync_comm_statistics*)(void*)newer, NULL, 0), GRADSYNC_OK);
    CHECK(((gradsync_comm_statistics*)(void*)newer)->version == GRADSYNC_COMM_STATISTICS_VERSION);
    CHECK(newer[sizeof(gradsync_comm_statistics)] == 0 && newer[sizeof newer - 1] == 0);
    CHECK_STATUS_MSG(gradsync_comm_timeline(c[0], "/nonexistent-dir/timeline.json"), GRADSYNC_E_IO,
                     "/nonexistent-dir/timeline.json");
    CHECK_STATUS_MSG(gradsync_comm_timeline(c[0], ""), GRADSYNC_E_INVALID_ARG, "empty");
    CHECK_STATUS(gradsync_comm_timeline(c[0], NULL), GRADSYNC_OK); /* none open: nothing to do */
  }

  {
    /* The timeline: every call of each rank, each with its two phases, completed on stop. */
    char path[2][256];
    char* text;
    for (i = 0; i < 2; ++i) {
      snprintf(path[i], sizeof path[i], "/tmp/gradsync-capi-timeline-%ld.%d", (long)getpid(), i);
      CHECK_STATUS(gradsync_comm_timeline(c[i], path[i]), GRADSYNC_OK);
    }
    run_pair(two_calls, &s[0], &s[1]);
    for (i = 0; i < 2; ++i) {
      CHECK_STATUS(gradsync_comm_timeline(c[i], NULL), GRADSYNC_OK);
      text = read_file(path[i]);
      CHECK(text != NULL);
      if (text == NULL) continue;
      CHECK(strncmp(text, "{", 1) == 0 && strstr(text, "\n]}\n") != NULL);
      CHECK(count_of(text, "\"name\":\"allreduce\"") == 1 && count_of(text, "\"name\":\"barrier\"") == 1);
      CHECK(count_of(text, "\"name\":\"wait for peers\"") == 2 && count_of(text, "\"name\":\"data movement\"") == 2);
      CHECK(strstr(text, "\"bytes\":64") != NULL);
      free(text);
      remove(path[i]);
    }
  }
  gradsync_comm_free(c[0]);
  gradsync_comm_free(c[1]);
  return check_report("capi_stats");
}
