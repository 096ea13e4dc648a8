// SPDX-License-Identifier: Apache-2.0
/* The MPI transport through the C API of the shared library, as a C99 MPI program would use it:
 * the host initialises MPI itself, hands over a communicator of its own as its Fortran handle
 * (MPI_Comm_c2f), keeps using MPI beside us, and finalises MPI itself (the library must not).
 * A child forked from a rank is refused the rank's communicator, and its free there leaves the
 * group alone. */
#define _POSIX_C_SOURCE 200809L
#include <mpi.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../capi/fork_helpers.h"
#include "gradsync/gradsync.h"

static int failures = 0;
static int world_rank = 0;

#define EXPECT(cond)                                                                                                \
  do {                                                                                                              \
    if (!(cond)) {                                                                                                  \
      ++failures;                                                                                                   \
      fprintf(stderr, "rank %d: %s:%d: EXPECT(%s) failed; last error: %s\n", world_rank, __FILE__, __LINE__, #cond, \
              gradsync_last_error_message());                                                                       \
    }                                                                                                               \
  } while (0)

static gradsync_comm* create(int64_t fcomm, int32_t deterministic) {
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm* c = NULL;
  o.transport = GRADSYNC_TRANSPORT_MPI;
  o.mpi_fcomm = fcomm;
  o.deterministic = deterministic;
  o.timeout_ms = 20000;
  EXPECT(gradsync_comm_create(&c, &o) == GRADSYNC_OK);
  return c;
}

/* Forks a child that finds c, h (hierarchical) and the request (started before the fork) refused
 * as the parent's, and frees them (h's shared-memory level unmapped); then the parent's groups
 * work on. */
static void forked_child_leaves_the_group_alone(gradsync_comm* c, gradsync_comm* h, int size) {
  char parent[64];
  float v = 1.0f, x = 1.0f;
  int32_t done = 0;
  int status = -1;
  gradsync_request* req = NULL;
  pid_t child;
  EXPECT(gradsync_comm_iallreduce(c, &x, &x, 1, GRADSYNC_F32, GRADSYNC_SUM, &req) == GRADSYNC_OK);
  wait_until_others_sleep();
  fflush(NULL);
  child = fork();
  if (child == 0) {
    int bad = 0;
    alarm(60); /* a hang is the bug under test */
    snprintf(parent, sizeof parent, "parent process (pid %d)", (int)getppid());
    bad += gradsync_comm_allreduce(c, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM) != GRADSYNC_E_MISUSE;
    bad += strstr(gradsync_last_error_message(), parent) == NULL;
    bad += gradsync_request_wait(req, -1) != GRADSYNC_E_MISUSE;
    bad += gradsync_request_test(req, &done) != GRADSYNC_E_MISUSE;
    bad += gradsync_comm_barrier(c) != GRADSYNC_E_MISUSE;
    bad += gradsync_comm_allreduce(h, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM) != GRADSYNC_E_MISUSE;
    bad += strstr(gradsync_last_error_message(), parent) == NULL;
    bad += mapped("/dev/shm/gradsync.") != 1;
    if (bad)
      fprintf(stderr, "forked child of rank %d: %d check(s) failed; last error: %s\n", world_rank, bad,
              gradsync_last_error_message());
    gradsync_request_free(req);
    gradsync_comm_free(c);
    gradsync_comm_free(h);
    bad += mapped("/dev/shm/gradsync.") != 0;
    fflush(NULL);
    _exit(bad ? 1 : 0);
  }
  EXPECT(child > 0 && waitpid(child, &status, 0) == child);
  EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT(gradsync_request_wait(req, -1) == GRADSYNC_OK && x == (float)size);
  gradsync_request_free(req);
  v = 1.0f;
  EXPECT(gradsync_comm_allreduce(c, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM) == GRADSYNC_OK && v == (float)size);
  EXPECT(gradsync_comm_barrier(c) == GRADSYNC_OK);
  v = 1.0f;
  EXPECT(gradsync_comm_allreduce(h, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM) == GRADSYNC_OK && v == (float)size);
}

int main(int argc, char** argv) {
  int provided = 0, world_size = 0, rank = -1, size = -1, transport = -1, st, i;
  MPI_Comm reversed;
  gradsync_comm *c, *w, *bad = NULL;
  gradsync_comm_options o;
  float seed[2];
  float small[4] = {1, 1, 1, 1};
  size_t counts[2];
  void* recvs[2];
  float a[3], b[5];
  double weighted[1];
  uint64_t total = 0;

  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  EXPECT(gradsync_has_feature(GRADSYNC_FEATURE_MPI_TRANSPORT) == 1);

  /* The host's own communicator, ranks in reverse order: our rank must follow it. */
  MPI_Comm_split(MPI_COMM_WORLD, 0, world_size - 1 - world_rank, &reversed);
  c = create((int64_t)MPI_Comm_c2f(reversed), GRADSYNC_UNSET_I32);
  EXPECT(c != NULL);
  EXPECT(gradsync_comm_rank(c, &rank) == GRADSYNC_OK && rank == world_size - 1 - world_rank);
  EXPECT(gradsync_comm_size(c, &size) == GRADSYNC_OK && size == world_size);
  EXPECT(gradsync_comm_transport(c, &transport) == GRADSYNC_OK && transport == GRADSYNC_TRANSPORT_MPI);

  /* Seed: [2,4] and [4,8] -> mean [3,6] (rank r contributes (r+1)*[2,4]). */
  seed[0] = 2.0f * (float)(rank + 1);
  seed[1] = 4.0f * (float)(rank + 1);
  EXPECT(gradsync_comm_allreduce(c, seed, seed, 2, GRADSYNC_F32, GRADSYNC_MEAN) == GRADSYNC_OK);
  if (size == 2) EXPECT(seed[0] == 3.0f && seed[1] == 6.0f);

  /* The host's traffic on its communicator is untouched by ours (we work on duplicates). */
  MPI_Allreduce(MPI_IN_PLACE, small, 4, MPI_FLOAT, MPI_SUM, reversed);
  EXPECT(small[0] == (float)world_size);

  /* Mismatch: rank 1 passes 7 elements; every rank gets E_MISMATCH naming both sides. */
  st = gradsync_comm_allreduce(c, b, b, rank == 1 ? 5 : 3, GRADSYNC_F32, GRADSYNC_SUM);
  EXPECT(st == GRADSYNC_E_MISMATCH);
  EXPECT(strstr(gradsync_last_error_message(), "rank 1 called allreduce") != NULL);

  /* Fused allreduce through the C API. */
  for (i = 0; i < 3; ++i) a[i] = (float)(rank + i);
  for (i = 0; i < 5; ++i) b[i] = 1.0f;
  counts[0] = 3;
  counts[1] = 5;
  recvs[0] = a;
  recvs[1] = b;
  EXPECT(gradsync_comm_allreduce_many(c, NULL, (void* const*)recvs, counts, 2, GRADSYNC_F32, GRADSYNC_MAX) ==
         GRADSYNC_OK);
  EXPECT(a[0] == (float)(size - 1) && a[2] == (float)(size + 1) && b[4] == 1.0f);

  weighted[0] = (double)(rank + 1);
  EXPECT(gradsync_comm_weighted_mean(c, weighted, weighted, 1, GRADSYNC_F64, (uint64_t)(rank + 1), &total) ==
         GRADSYNC_OK);
  EXPECT(total == (uint64_t)(size * (size + 1) / 2));
  EXPECT(gradsync_comm_barrier(c) == GRADSYNC_OK);

  /* A second communicator over MPI_COMM_WORLD (the default), deterministic. */
  w = create(GRADSYNC_UNSET_I64, 1);
  EXPECT(w != NULL);
  EXPECT(gradsync_comm_rank(w, &rank) == GRADSYNC_OK && rank == world_rank);
  EXPECT(gradsync_comm_broadcast(w, a, 3, GRADSYNC_F32, 99) == GRADSYNC_E_OUT_OF_RANGE);
  gradsync_comm_free(w);

  /* Bad handles over the ABI: an invalid Fortran handle, one of MPI_COMM_NULL, out of MPI_Fint range. */
  gradsync_comm_options_init(&o, sizeof o);
  o.transport = GRADSYNC_TRANSPORT_MPI;
  o.mpi_fcomm = 1000000;
  EXPECT(gradsync_comm_create(&bad, &o) == GRADSYNC_E_INVALID_ARG && bad == NULL);
  EXPECT(strstr(gradsync_last_error_message(), "mpi_fcomm 1000000") != NULL);
  o.mpi_fcomm = (int64_t)MPI_Comm_c2f(MPI_COMM_NULL);
  EXPECT(gradsync_comm_create(&bad, &o) == GRADSYNC_E_INVALID_ARG && bad == NULL);
  o.mpi_fcomm = (int64_t)1 << 40;
  EXPECT(gradsync_comm_create(&bad, &o) == GRADSYNC_E_INVALID_ARG && bad == NULL);

  {
    gradsync_comm* h = NULL;
    gradsync_comm_options_init(&o, sizeof o);
    o.transport = GRADSYNC_TRANSPORT_HIER;
    o.timeout_ms = 20000;
    EXPECT(gradsync_comm_create(&h, &o) == GRADSYNC_OK);
    if (h != NULL) forked_child_leaves_the_group_alone(c, h, size);
    gradsync_comm_free(h);
  }

  gradsync_comm_free(c);
  gradsync_comm_free(NULL);
  MPI_Comm_free(&reversed);
  /* The library did not initialise MPI, so it must not have finalised it. */
  {
    int finalized = 1;
    MPI_Finalized(&finalized);
    EXPECT(finalized == 0);
  }
  MPI_Allreduce(MPI_IN_PLACE, &failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Finalize();
  if (world_rank == 0) printf("%s: %d failure(s)\n", failures ? "FAIL" : "ok", failures);
  return failures ? 1 : 0;
}
