/* SPDX-License-Identifier: Apache-2.0 */
/* Subgroups (gradsync_comm_split) and topology (gradsync_comm_topology) through the C ABI, on a
 * group of four threads: MPI_Comm_split's ordering, no-color ranks, a bad color judged by every
 * rank, subgroups of subgroups, non-blocking calls, abort and reset on a subgroup without touching
 * its parent, a subgroup outliving its parent, and host labels giving hosts. The collective
 * semantics on subgroups are the conformance suite's (its /split modes). */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "gradsync/gradsync.h"

#define N 4

static pthread_barrier_t g_barrier;

static gradsync_comm* join(const char* name, int32_t rank, const char* host) {
  gradsync_comm_options opts = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm* comm = NULL;
  opts.rank = rank;
  opts.size = N;
  opts.timeout_ms = 20000;
  snprintf(opts.name, sizeof opts.name, "%s", name);
  if (host != NULL) snprintf(opts.host, sizeof opts.host, "%s", host);
  CHECK_STATUS(gradsync_comm_create(&comm, &opts), GRADSYNC_OK);
  return comm;
}

static float sum_of(gradsync_comm* c, float x) {
  float y = x;
  CHECK_STATUS(gradsync_comm_allreduce(c, &y, &y, 1, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_OK);
  return y;
}

static void* worker(void* p) {
  const int32_t rank = (int32_t)(intptr_t)p;
  static const char* labels[N] = {"rack-a", "rack-b", "rack-a", "rack-b"};
  gradsync_comm* world = join("capi-split", rank, labels[rank]);
  gradsync_comm *sub = NULL, *subsub = NULL, *none = NULL;
  int32_t host = -1, local_rank = -1, local_size = -1, hosts = -1, rank_hosts[N], r = -1, s = -1, i;
  gradsync_request* req = NULL;
  float x;
  if (world == NULL) return NULL;

  /* Labels rack-a / rack-b: hosts numbered by lowest rank, local ranks in rank order. */
  CHECK_STATUS(gradsync_comm_topology(world, &host, &local_rank, &local_size, &hosts, rank_hosts, N), GRADSYNC_OK);
  CHECK(hosts == 2 && host == rank % 2 && local_rank == rank / 2 && local_size == 2);
  for (i = 0; i < N; ++i) CHECK(rank_hosts[i] == i % 2);
  CHECK_STATUS(gradsync_comm_topology(world, NULL, NULL, NULL, NULL, rank_hosts, N - 1), GRADSYNC_E_INVALID_ARG);

  /* Color rank % 2, key -rank: {0, 2} as [2, 0] and {1, 3} as [3, 1]. */
  CHECK_STATUS(gradsync_comm_split(world, rank % 2, -rank, &sub), GRADSYNC_OK);
  CHECK(sub != NULL);
  if (sub != NULL) {
    int32_t order[2] = {-1, -1};
    CHECK_STATUS(gradsync_comm_rank(sub, &r), GRADSYNC_OK);
    CHECK_STATUS(gradsync_comm_size(sub, &s), GRADSYNC_OK);
    CHECK(s == 2 && r == (rank < 2 ? 1 : 0));
    CHECK(sum_of(sub, (float)(rank + 1)) == (rank % 2 == 0 ? 4.0f : 6.0f));
    CHECK_STATUS(gradsync_comm_allgather(sub, &rank, order, 2, GRADSYNC_I32), GRADSYNC_OK);
    CHECK(order[0] == (rank % 2 == 0 ? 2 : 3) && order[1] == (rank % 2 == 0 ? 0 : 1));
    /* Both members are on one labelled host. */
    CHECK_STATUS(gradsync_comm_topology(sub, &host, &local_rank, &local_size, &hosts, NULL, 0), GRADSYNC_OK);
    CHECK(hosts == 1 && host == 0 && local_size == 2 && local_rank == r);

    /* A subgroup of the subgroup: one rank each. */
    CHECK_STATUS(gradsync_comm_split(sub, r, 0, &subsub), GRADSYNC_OK);
    CHECK(subsub != NULL);
    if (subsub != NULL) {
      CHECK_STATUS(gradsync_comm_size(subsub, &s), GRADSYNC_OK);
      CHECK(s == 1 && sum_of(subsub, 2.5f) == 2.5f);
    }

    /* Non-blocking on the subgroup. */
    x = (float)rank;
    CHECK_STATUS(gradsync_comm_iallreduce(sub, &x, &x, 1, GRADSYNC_F32, GRADSYNC_MAX, &req), GRADSYNC_OK);
    CHECK_STATUS(gradsync_request_wait(req, -1), GRADSYNC_OK);
    gradsync_request_free(req);
    CHECK(x == (rank % 2 == 0 ? 2.0f : 3.0f));

    /* An abort of the subgroup stops it, not its parent; a reset brings it back. */
    if (r == 0) CHECK_STATUS(gradsync_comm_abort(sub), GRADSYNC_OK);
    pthread_barrier_wait(&g_barrier);
    x = 1.0f;
    CHECK_STATUS(gradsync_comm_allreduce(sub, &x, &x, 1, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_ABORTED);
    CHECK(sum_of(world, 1.0f) == 4.0f);
    CHECK_STATUS(gradsync_comm_reset(sub), GRADSYNC_OK);
    CHECK(sum_of(sub, 1.0f) == 2.0f);
  }

  /* Rank 3 joins no subgroup; the others form one of three, ranks by key then rank. */
  CHECK_STATUS(gradsync_comm_split(world, rank == 3 ? GRADSYNC_SPLIT_NONE : 7, 0, &none), GRADSYNC_OK);
  if (rank == 3) {
    CHECK(none == NULL);
  } else {
    CHECK(none != NULL);
    if (none != NULL) {
      CHECK_STATUS(gradsync_comm_size(none, &s), GRADSYNC_OK);
      CHECK_STATUS(gradsync_comm_rank(none, &r), GRADSYNC_OK);
      CHECK(s == 3 && r == rank && sum_of(none, 1.0f) == 3.0f);
      /* Ranks 0, 1, 2 are on rack-a, rack-b, rack-a: hosts renumbered by lowest rank. */
      CHECK_STATUS(gradsync_comm_topology(none, &host, &local_rank, &local_size, &hosts, rank_hosts, 3), GRADSYNC_OK);
      CHECK(hosts == 2 && rank_hosts[0] == 0 && rank_hosts[1] == 1 && rank_hosts[2] == 0);
    }
  }

  /* A color below GRADSYNC_SPLIT_NONE on rank 1 fails every rank, naming rank 1. */
  {
    gradsync_comm* bad = (gradsync_comm*)&g_barrier; /* must come back NULL */
    CHECK_STATUS(gradsync_comm_split(world, rank == 1 ? -5 : 0, 0, &bad), GRADSYNC_E_INVALID_ARG);
    CHECK_MESSAGE("rank 1");
    CHECK(bad == NULL);
  }
  CHECK_STATUS(gradsync_comm_split(world, 0, 0, NULL), GRADSYNC_E_INVALID_ARG);
  CHECK(sum_of(world, 1.0f) == 4.0f);

  /* A subgroup outlives its parent. */
  gradsync_comm_free(world);
  if (subsub != NULL) CHECK(sum_of(subsub, 1.0f) == 1.0f);
  if (sub != NULL) CHECK(sum_of(sub, 1.0f) == 2.0f);
  if (none != NULL) CHECK(sum_of(none, 2.0f) == 6.0f);
  gradsync_comm_free(subsub);
  gradsync_comm_free(sub);
  gradsync_comm_free(none);
  return NULL;
}

/* Without labels, threads of one process are one host. */
static void* unlabelled(void* p) {
  const int32_t rank = (int32_t)(intptr_t)p;
  gradsync_comm* c = join("capi-split-one-host", rank, NULL);
  int32_t host = -1, local_rank = -1, local_size = -1, hosts = -1;
  if (c == NULL) return NULL;
  CHECK_STATUS(gradsync_comm_topology(c, &host, &local_rank, &local_size, &hosts, NULL, 0), GRADSYNC_OK);
  CHECK(hosts == 1 && host == 0 && local_rank == rank && local_size == N);
  gradsync_comm_free(c);
  return NULL;
}

static void run(void* (*fn)(void*)) {
  pthread_t t[N];
  intptr_t i;
  for (i = 0; i < N; ++i) pthread_create(&t[i], NULL, fn, (void*)i);
  for (i = 0; i < N; ++i) pthread_join(t[i], NULL);
}

int main(void) {
  pthread_barrier_init(&g_barrier, NULL, N);
  run(worker);
  run(unlabelled);
  pthread_barrier_destroy(&g_barrier);
  return check_report("capi:split");
}
