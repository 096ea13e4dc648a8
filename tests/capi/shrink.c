/* SPDX-License-Identifier: Apache-2.0 */
/* gradsync_comm_shrink and gradsync_comm_member_id through the C ABI: on threads (a member's
 * thread frees its communicator and goes), twice in a row; on shm processes (a real SIGKILL of a
 * separate process), with a second member killed while the others wait for it in the shrink, and
 * a member that comes after the deadline and finds itself out. Every new group is checked: its
 * size, the failed set, dense ranks in the old order, the member ids, and a sum over it. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "gradsync/gradsync.h"

#define N 4

static void pause_ms(long ms) {
  struct timespec t;
  t.tv_sec = ms / 1000;
  t.tv_nsec = (ms % 1000) * 1000000L;
  nanosleep(&t, NULL);
}

static gradsync_comm* join(int32_t transport, const char* name, int32_t rank, int64_t timeout_ms) {
  gradsync_comm_options opts = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm* comm = NULL;
  opts.transport = transport;
  opts.rank = rank;
  opts.size = N;
  opts.timeout_ms = timeout_ms;
  snprintf(opts.name, sizeof opts.name, "%s", name);
  CHECK_STATUS(gradsync_comm_create(&comm, &opts), GRADSYNC_OK);
  return comm;
}

static double sum_of(gradsync_comm* c, double x, int* status) {
  double y = x;
  *status = gradsync_comm_allreduce(c, &y, &y, 1, GRADSYNC_F64, GRADSYNC_SUM);
  return y;
}

/* Shrinks c, checks the new group against the expected failed set (old ranks), frees c. */
static gradsync_comm* shrink_and_check(gradsync_comm* c, const int32_t* want_failed, int32_t want_count) {
  int32_t old_rank = -1, old_size = -1, failed[N], r = -1, s = -1, i, below = 0;
  int64_t id = -1, id_after = -1;
  gradsync_shrink_result res;
  gradsync_comm* next = NULL;
  int st;
  memset(&res, 0, sizeof res);
  res.struct_size = sizeof res;
  res.version = GRADSYNC_SHRINK_RESULT_VERSION;
  CHECK_STATUS(gradsync_comm_rank(c, &old_rank), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_size(c, &old_size), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_member_id(c, &id), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_shrink(c, &next, failed, N, &res), GRADSYNC_OK);
  gradsync_comm_free(c);
  if (next == NULL) return NULL;
  CHECK(res.failed_count == want_count && res.attempts >= 1);
  for (i = 0; i < want_count && i < res.failed_count; ++i) CHECK(failed[i] == want_failed[i]);
  for (i = 0; i < want_count; ++i) below += want_failed[i] < old_rank;
  CHECK_STATUS(gradsync_comm_rank(next, &r), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_size(next, &s), GRADSYNC_OK);
  CHECK(s == old_size - want_count);
  CHECK(r == old_rank - below); /* dense, in the old order */
  CHECK_STATUS(gradsync_comm_member_id(next, &id_after), GRADSYNC_OK);
  CHECK(id_after == id);
  /* The new group works: the sum of its member ids, against the ids that should be in it. */
  (void)sum_of(next, (double)id_after, &st);
  CHECK_STATUS(st, GRADSYNC_OK);
  return next;
}

/* ------------------------------------------------------------------ threads */

static void* thread_member(void* p) {
  const int32_t rank = (int32_t)(intptr_t)p;
  gradsync_comm* c = join(GRADSYNC_TRANSPORT_THREAD, "capi-shrink", rank, 20000);
  gradsync_comm* next;
  int st;
  double sum;
  int64_t id = -1;
  if (c == NULL) return NULL;
  CHECK_STATUS(gradsync_comm_member_id(c, &id), GRADSYNC_OK);
  CHECK(id == rank);
  sum = sum_of(c, 1.0, &st);
  CHECK(st == GRADSYNC_OK && sum == 4.0);
  if (rank == 2) { /* goes: its communicator is freed, its thread ends */
    gradsync_comm_free(c);
    return NULL;
  }
  /* The survivors' next call fails (rank 2 left), then they shrink. */
  sum = sum_of(c, 1.0, &st);
  CHECK(st != GRADSYNC_OK);
  {
    const int32_t lost[1] = {2};
    int32_t small[1];
    gradsync_comm* none = NULL;
    CHECK_STATUS_MSG(gradsync_comm_shrink(c, &none, small, 1, NULL), GRADSYNC_E_INVALID_ARG, "failed holds 1");
    CHECK(none == NULL);
    CHECK_STATUS(gradsync_comm_shrink(c, NULL, NULL, 0, NULL), GRADSYNC_E_INVALID_ARG);
    next = shrink_and_check(c, lost, 1);
  }
  if (next == NULL) return NULL;
  {
    double ids = sum_of(next, (double)rank, &st);
    CHECK(st == GRADSYNC_OK && ids == 0.0 + 1.0 + 3.0);
  }
  /* Twice in a row: new rank 0 (old 0) goes too; member ids 1 and 3 remain. */
  {
    int32_t r = -1;
    gradsync_comm_rank(next, &r);
    if (r == 0) {
      gradsync_comm_free(next);
      return NULL;
    }
    {
      const int32_t lost[1] = {0};
      gradsync_comm* last = shrink_and_check(next, lost, 1);
      int64_t id2 = -1;
      if (last == NULL) return NULL;
      gradsync_comm_member_id(last, &id2);
      CHECK(id2 == rank);
      {
        double ids = sum_of(last, (double)id2, &st);
        CHECK(st == GRADSYNC_OK && ids == 4.0);
      }
      gradsync_comm_free(last);
    }
  }
  return NULL;
}

static void test_threads(void) {
  pthread_t t[N];
  int i;
  for (i = 0; i < N; ++i) pthread_create(&t[i], NULL, thread_member, (void*)(intptr_t)i);
  for (i = 0; i < N; ++i) pthread_join(t[i], NULL);
}

/* ------------------------------------------------------------------ shm processes */

/* Shared with the children: who has reached which point. */
typedef struct {
  volatile int32_t ready[N];     /* joined and summed once */
  volatile int32_t shrinking[N]; /* in gradsync_comm_shrink */
} board;

enum { SCENARIO_KILL_ONE, SCENARIO_KILL_IN_SHRINK, SCENARIO_LATE };

/* One member process. Exit status 0: everything it checked held. */
static int shm_member(board* b, const char* name, int32_t rank, int scenario) {
  const int64_t timeout = scenario == SCENARIO_LATE ? 600 : 20000;
  gradsync_comm* c = join(GRADSYNC_TRANSPORT_SHM, name, rank, timeout);
  gradsync_comm* next = NULL;
  int st, i;
  double sum;
  if (c == NULL) return 2;
  sum = sum_of(c, 1.0, &st);
  CHECK(st == GRADSYNC_OK && sum == 4.0);
  __atomic_store_n(&b->ready[rank], 1, __ATOMIC_SEQ_CST);
  /* Sum until the loss shows (the parent kills rank 1). */
  for (i = 0; i < 100000; ++i) {
    sum = sum_of(c, 1.0, &st);
    if (st != GRADSYNC_OK) break;
    CHECK(sum == 4.0);
  }
  CHECK(st != GRADSYNC_OK);
  if (scenario == SCENARIO_KILL_IN_SHRINK && rank == 3) {
    for (;;) pause_ms(1000); /* never shrinks: the parent kills it while the others wait */
  }
  if (scenario == SCENARIO_LATE && rank == 2) {
    /* Past the others' deadline: they have decided without this rank. */
    pause_ms(3 * timeout);
    CHECK_STATUS_MSG(gradsync_comm_shrink(c, &next, NULL, 0, NULL), GRADSYNC_E_REMOTE, "out of the group");
    CHECK(next == NULL);
    gradsync_comm_free(c);
    return check_failures == 0 ? 0 : 1;
  }
  __atomic_store_n(&b->shrinking[rank], 1, __ATOMIC_SEQ_CST);
  {
    const int32_t one[1] = {1}, two[2] = {1, 3}, late[2] = {1, 2};
    if (scenario == SCENARIO_KILL_ONE) next = shrink_and_check(c, one, 1);
    if (scenario == SCENARIO_KILL_IN_SHRINK) next = shrink_and_check(c, two, 2);
    if (scenario == SCENARIO_LATE) next = shrink_and_check(c, late, 2);
  }
  if (next != NULL) {
    int64_t ids = 0, id = -1;
    gradsync_comm_member_id(next, &id);
    ids = (int64_t)sum_of(next, (double)id, &st);
    CHECK(st == GRADSYNC_OK);
    if (scenario == SCENARIO_KILL_ONE)
      CHECK(ids == 0 + 2 + 3);
    else if (scenario == SCENARIO_KILL_IN_SHRINK)
      CHECK(ids == 0 + 2);
    else
      CHECK(ids == 0 + 3);
    gradsync_comm_free(next);
  } else {
    CHECK(next != NULL);
  }
  return check_failures == 0 ? 0 : 1;
}

static void test_shm(int scenario, const char* label) {
  board* b = mmap(NULL, sizeof(board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  char name[64];
  pid_t pids[N];
  int i, waited;
  if (b == MAP_FAILED) {
    CHECK(b != MAP_FAILED);
    return;
  }
  memset(b, 0, sizeof *b);
  snprintf(name, sizeof name, "capi-shrink-%ld-%d", (long)getpid(), scenario);
  for (i = 0; i < N; ++i) {
    pids[i] = fork();
    if (pids[i] == 0) _exit(shm_member(b, name, i, scenario));
  }
  for (waited = 0; waited < 60000; waited += 1) {
    int all = 1;
    for (i = 0; i < N; ++i) all &= __atomic_load_n(&b->ready[i], __ATOMIC_SEQ_CST);
    if (all) break;
    pause_ms(1);
  }
  kill(pids[1], SIGKILL);
  if (scenario == SCENARIO_KILL_IN_SHRINK) {
    /* Rank 3 is alive and never shrinks; once the others wait for it in the shrink, it dies. */
    for (waited = 0; waited < 60000; ++waited) {
      if (__atomic_load_n(&b->shrinking[0], __ATOMIC_SEQ_CST) && __atomic_load_n(&b->shrinking[2], __ATOMIC_SEQ_CST)) {
        break;
      }
      pause_ms(1);
    }
    pause_ms(30);
    kill(pids[3], SIGKILL);
  }
  for (i = 0; i < N; ++i) {
    int status = 0;
    waitpid(pids[i], &status, 0);
    if (i == 1 || (scenario == SCENARIO_KILL_IN_SHRINK && i == 3)) {
      CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      fprintf(stderr, "%s: member %d ended with status %#x\n", label, i, (unsigned)status);
      check_failed();
    }
  }
  munmap(b, sizeof *b);
}

int main(void) {
  test_threads();
  test_shm(SCENARIO_KILL_ONE, "kill one");
  test_shm(SCENARIO_KILL_IN_SHRINK, "a second death during the shrink");
  test_shm(SCENARIO_LATE, "a member after the deadline");
  return check_report("capi:shrink");
}
