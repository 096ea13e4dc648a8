/* SPDX-License-Identifier: Apache-2.0 */
/* A communicator copied into a child by fork() is the parent's: in the child every call on it (and
 * on a request started before the fork, and on a shard made on it) fails at once with
 * GRADSYNC_E_MISUSE naming the parent's pid, and its free releases only the child's share; the
 * parent's group works on. On the thread transport and on the shm transport with a real second
 * process, with and without a progress thread, with a call in flight in the parent at the fork, and
 * with a subgroup (gradsync_comm_split). */
#define _POSIX_C_SOURCE 200809L
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "fork_helpers.h"
#include "gradsync/gradsync.h"
#include "two_threads.h"

/* In the child: every kind of call on comm is refused, naming the parent, and none waits (a hang is
 * the bug under test: the alarm turns one into a failure of the child). pending: a request of comm
 * started before the fork, or NULL; shard: one made on comm, or NULL; segment: the shm segment's
 * path (as mapped() takes it), which the free unmaps, or NULL. Frees them all. */
static void refused_in_child(gradsync_comm* comm, gradsync_request* pending, gradsync_shard* shard,
                             const char* segment) {
  char parent[64];
  int32_t v = 7, out = 0;
  void* p = &v;
  gradsync_request* r = (gradsync_request*)&v; /* must come back NULL */
  gradsync_comm_statistics stats = GRADSYNC_COMM_STATISTICS_INIT;
  float w[4] = {0};
  snprintf(parent, sizeof parent, "parent process (pid %d)", (int)getppid());
  alarm(60);
  CHECK_STATUS_MSG(gradsync_comm_allreduce(comm, &v, &v, 1, GRADSYNC_I32, GRADSYNC_SUM), GRADSYNC_E_MISUSE, parent);
  CHECK(v == 7);
  CHECK_STATUS_MSG(gradsync_comm_iallreduce(comm, &v, &v, 1, GRADSYNC_I32, GRADSYNC_SUM, &r), GRADSYNC_E_MISUSE,
                   parent);
  CHECK(r == NULL);
  CHECK_STATUS_MSG(gradsync_comm_broadcast(comm, &v, 1, GRADSYNC_I32, 0), GRADSYNC_E_MISUSE, parent);
  CHECK_STATUS_MSG(gradsync_comm_allgather(comm, &v, &out, 1, GRADSYNC_I32), GRADSYNC_E_MISUSE, parent);
  CHECK_STATUS_MSG(gradsync_comm_barrier(comm), GRADSYNC_E_MISUSE, parent);
  r = (gradsync_request*)&v;
  CHECK_STATUS_MSG(gradsync_comm_ibarrier(comm, &r), GRADSYNC_E_MISUSE, parent);
  CHECK(r == NULL);
  CHECK_STATUS_MSG(gradsync_comm_reset(comm), GRADSYNC_E_MISUSE, parent);
  CHECK_STATUS_MSG(gradsync_comm_abort(comm), GRADSYNC_E_MISUSE, parent);
  CHECK_STATUS_MSG(gradsync_comm_alloc(comm, 64, &p), GRADSYNC_E_MISUSE, parent);
  CHECK(p == NULL);
  CHECK_STATUS_MSG(gradsync_comm_free_buffer(comm, NULL), GRADSYNC_E_MISUSE, parent);
  CHECK_STATUS_MSG(gradsync_comm_rank(comm, &out), GRADSYNC_E_MISUSE, parent);
  CHECK_STATUS_MSG(gradsync_comm_get_async_error(comm, &out), GRADSYNC_E_MISUSE, parent);
  CHECK_STATUS_MSG(gradsync_comm_stats(comm, &stats, NULL, 0), GRADSYNC_E_MISUSE, parent);
  if (pending != NULL) {
    CHECK_STATUS_MSG(gradsync_request_wait(pending, -1), GRADSYNC_E_MISUSE, parent);
    CHECK_STATUS_MSG(gradsync_request_test(pending, &out), GRADSYNC_E_MISUSE, parent);
  }
  if (shard != NULL) {
    CHECK_STATUS_MSG(gradsync_shard_gather(shard, w, 4), GRADSYNC_E_MISUSE, parent);
    CHECK_STATUS_MSG(gradsync_shard_set_lr(shard, 0.5), GRADSYNC_E_MISUSE, parent);
    gradsync_shard_free(shard);
  }
  gradsync_request_free(pending);
  if (segment != NULL) CHECK(mapped(segment) == 1);
  gradsync_comm_free(comm);
  if (segment != NULL) CHECK(mapped(segment) == 0);
  alarm(0);
}

/* Forks a child that runs refused_in_child on each of n communicators (pending, shard and segment
 * go with the first) and exits with its verdict; returns once the child has, counting a failure
 * unless it exited with 0. */
static void fork_and_refuse(gradsync_comm** comms, int n, gradsync_request* pending, gradsync_shard* shard,
                            const char* segment) {
  int status = 0, i;
  pid_t child;
  wait_until_others_sleep();
  fflush(NULL);
  child = fork();
  if (child < 0) {
    perror("fork");
    check_failed();
    return;
  }
  if (child == 0) {
    int code;
    check_failures = 0; /* the child's verdict is its own */
    for (i = 0; i < n; ++i)
      refused_in_child(comms[i], i == 0 ? pending : NULL, i == 0 ? shard : NULL, i == 0 ? segment : NULL);
    /* Subgroups' segments too: nothing of the library's is mapped any more. */
    if (segment != NULL) CHECK(mapped("/dev/shm/gradsync.") == 0);
    code = check_report("forked child") == 0 ? 0 : 1;
    fflush(NULL);
    _exit(code);
  }
  CHECK(waitpid(child, &status, 0) == child);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "forked child: %s %d\n", WIFEXITED(status) ? "exit status" : "killed by signal",
            WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
    check_failed();
  }
}

/* ---------------------------------------------------------------- thread transport */

typedef struct {
  gradsync_comm* comm;
  int32_t value;
} one_call;

static void* allreduce_on(void* p) {
  one_call* c = (one_call*)p;
  int status;
  RETRY_WHILE_PROBED(status, gradsync_comm_allreduce(c->comm, &c->value, &c->value, 1, GRADSYNC_I32, GRADSYNC_SUM));
  CHECK_STATUS(status, GRADSYNC_OK);
  return NULL;
}

/* Both ranks allreduce 1 and 2 on two threads; each must get 3. */
static void thread_group_works(gradsync_comm* comms[2]) {
  pthread_t t;
  one_call c = {comms[1], 2};
  int32_t v = 1;
  pthread_create(&t, NULL, allreduce_on, &c);
  CHECK_STATUS(gradsync_comm_allreduce(comms[0], &v, &v, 1, GRADSYNC_I32, GRADSYNC_SUM), GRADSYNC_OK);
  pthread_join(t, NULL);
  CHECK(v == 3 && c.value == 3);
}

static void thread_transport(void) {
  gradsync_comm* comms[2];
  gradsync_request* req = NULL;
  pthread_t t;
  one_call c;
  int32_t v = 1;
  if (join_pair("fork.threads", 60000, comms) != 0) return;

  /* Idle group: both ranks' handles are refused in the child. */
  fork_and_refuse(comms, 2, NULL, NULL, NULL);
  thread_group_works(comms);

  /* A request pending on rank 0's progress thread at the fork (rank 1 has not called yet). */
  CHECK_STATUS(gradsync_comm_iallreduce(comms[0], &v, &v, 1, GRADSYNC_I32, GRADSYNC_SUM, &req), GRADSYNC_OK);
  fork_and_refuse(comms, 2, req, NULL, NULL);
  c.comm = comms[1];
  c.value = 2;
  pthread_create(&t, NULL, allreduce_on, &c);
  CHECK_STATUS(gradsync_request_wait(req, -1), GRADSYNC_OK);
  pthread_join(t, NULL);
  CHECK(v == 3 && c.value == 3);
  gradsync_request_free(req);

  /* A blocking call in flight on another thread at the fork: in the child the handle is the
   * parent's, not "in a call on another thread". */
  c.comm = comms[1];
  c.value = 2;
  pthread_create(&t, NULL, allreduce_on, &c);
  if (wait_until_in_call(comms[1]) == 0) fork_and_refuse(&comms[1], 1, NULL, NULL, NULL);
  v = 1;
  CHECK_STATUS(gradsync_comm_allreduce(comms[0], &v, &v, 1, GRADSYNC_I32, GRADSYNC_SUM), GRADSYNC_OK);
  pthread_join(t, NULL);
  CHECK(v == 3 && c.value == 3);

  thread_group_works(comms);
  gradsync_comm_free(comms[0]);
  gradsync_comm_free(comms[1]);
}

/* ---------------------------------------------------------------- shm transport */

static gradsync_comm* join_shm(const char* name, int32_t rank) {
  gradsync_comm* comm = NULL;
  gradsync_comm_options opts = GRADSYNC_COMM_OPTIONS_INIT;
  opts.transport = GRADSYNC_TRANSPORT_SHM;
  opts.rank = rank;
  opts.size = 2;
  opts.timeout_ms = 60000;
  strncpy(opts.name, name, sizeof opts.name - 1);
  CHECK_STATUS(gradsync_comm_create(&comm, &opts), GRADSYNC_OK);
  return comm;
}

/* Allreduce of rank + 1 over both ranks: 3. */
static void shm_step(gradsync_comm* comm, int32_t rank) {
  int32_t v = rank + 1;
  CHECK_STATUS(gradsync_comm_allreduce(comm, &v, &v, 1, GRADSYNC_I32, GRADSYNC_SUM), GRADSYNC_OK);
  CHECK(v == 3);
}

/* Rank 1, a process of its own: the same calls as rank 0, the second and later ones each after a
 * byte from `go` (so that rank 0's call is in flight while it forks). */
static int shm_rank1(const char* name, int go) {
  char byte;
  int i;
  gradsync_comm *comm = join_shm(name, 1), *sub = NULL;
  if (comm == NULL) return 1;
  shm_step(comm, 1);
  CHECK_STATUS(gradsync_comm_split(comm, 0, 1, &sub), GRADSYNC_OK);
  for (i = 0; i < 3; ++i) {
    if (read(go, &byte, 1) != 1) {
      check_failed();
      break;
    }
    shm_step(comm, 1);
  }
  shm_step(sub, 1);
  CHECK_STATUS(gradsync_comm_barrier(comm), GRADSYNC_OK);
  gradsync_comm_free(sub);
  gradsync_comm_free(comm);
  return check_report("shm rank 1") == 0 ? 0 : 1;
}

static void shm_transport(void) {
  char name[64], segment[96];
  int go[2], status = 0;
  int32_t v = 1;
  gradsync_comm *comm, *both[2];
  gradsync_request* req = NULL;
  gradsync_shard* shard = NULL;
  pid_t peer;
  snprintf(name, sizeof name, "fork.shm.%d", (int)getpid());
  snprintf(segment, sizeof segment, "/dev/shm/gradsync.%s\n", name); /* not its subgroups' */
  CHECK(pipe(go) == 0);
  fflush(NULL);
  peer = fork(); /* before this process has any thread or communicator */
  if (peer == 0) {
    close(go[1]);
    _exit(shm_rank1(name, go[0]));
  }
  close(go[0]);
  comm = join_shm(name, 0);
  if (comm == NULL) return;
  shm_step(comm, 0);
  both[0] = comm;
  CHECK_STATUS(gradsync_comm_split(comm, 0, 0, &both[1]), GRADSYNC_OK); /* a subgroup, its own segment */

  /* Idle, blocking calls only (no progress thread), with a shard and a subgroup: the child frees them. */
  CHECK_STATUS(gradsync_shard_create(&shard, comm, 8, NULL), GRADSYNC_OK);
  fork_and_refuse(both, 2, NULL, shard, segment);
  CHECK(write(go[1], "1", 1) == 1);
  shm_step(comm, 0);

  /* A request in flight on the progress thread at the fork: rank 1 joins the call only after the
   * child has freed everything. */
  CHECK_STATUS(gradsync_comm_iallreduce(comm, &v, &v, 1, GRADSYNC_I32, GRADSYNC_SUM, &req), GRADSYNC_OK);
  fork_and_refuse(both, 2, req, NULL, segment);
  CHECK(write(go[1], "2", 1) == 1);
  CHECK_STATUS(gradsync_request_wait(req, -1), GRADSYNC_OK);
  CHECK(v == 3);
  gradsync_request_free(req);

  /* The group carries on, progress thread and all. */
  CHECK(write(go[1], "3", 1) == 1);
  shm_step(comm, 0);
  shm_step(both[1], 0);
  CHECK_STATUS(gradsync_comm_barrier(comm), GRADSYNC_OK);
  gradsync_comm_free(both[1]);
  gradsync_shard_free(shard);
  gradsync_comm_free(comm);
  close(go[1]);
  CHECK(waitpid(peer, &status, 0) == peer);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

int main(void) {
  shm_transport();
  thread_transport();
  return check_report("fork");
}
