/* SPDX-License-Identifier: Apache-2.0 */
/* The sharded embedding table across hosts (under hosts.py, on the hierarchical transport): every
 * rank's rows bitwise equal to the one-process reference after the same global batches, then a
 * checkpoint saved by every rank into a directory all hosts see, loaded by a subgroup of 3 ranks
 * under the other sharding rule, bitwise again, and trained on as if never interrupted.
 *   embedding <checkpoint directory> */
#define _POSIX_C_SOURCE 200809L
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "../capi/check.h"
#include "../capi/embedding_scenario.h"
#include "gradsync/gradsync.h"

static snapshot g_ref, g_ref_more;

int main(int argc, char** argv) {
  int provided = 0, world = 0;
  int32_t rank = -1, size = -1;
  char what[128];
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm *comm = NULL, *three = NULL;
  gradsync_embedding* t = NULL;
  gradsync_embedding_options eo = table_options(GRADSYNC_OPTIM_ROW_ADAGRAD, GRADSYNC_EMBEDDING_HASH);
  if (argc != 2) {
    fprintf(stderr, "usage: embedding <checkpoint directory>\n");
    return 2;
  }
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  reference(GRADSYNC_OPTIM_ROW_ADAGRAD, STEPS, 0, &g_ref);
  reference(GRADSYNC_OPTIM_ROW_ADAGRAD, STEPS + 2, 0, &g_ref_more);
  o.transport = GRADSYNC_TRANSPORT_HIER;
  o.timeout_ms = 60000;
  CHECK_STATUS(gradsync_comm_create(&comm, &o), GRADSYNC_OK);
  if (comm != NULL) {
    CHECK_STATUS(gradsync_comm_rank(comm, &rank), GRADSYNC_OK);
    CHECK_STATUS(gradsync_comm_size(comm, &size), GRADSYNC_OK);
    CHECK_STATUS(gradsync_embedding_create(&t, comm, NULL, &eo), GRADSYNC_OK);
    train(t, rank, size, 0, STEPS);
    snprintf(what, sizeof what, "rank %d of %d across hosts", (int)rank, (int)size);
    compare_local(t, &g_ref, GRADSYNC_OPTIM_ROW_ADAGRAD, what);
    CHECK_STATUS(gradsync_embedding_save(t, argv[1]), GRADSYNC_OK);
    gradsync_embedding_free(t);
    t = NULL;
    /* 3 of the ranks, contiguous rows: the same rows and state from the checkpoint */
    CHECK_STATUS(gradsync_comm_split(comm, rank < 3 ? 0 : -1, rank, &three), GRADSYNC_OK);
    if (three != NULL) {
      int32_t r3 = -1, s3 = -1;
      eo = table_options(GRADSYNC_OPTIM_ROW_ADAGRAD, GRADSYNC_EMBEDDING_CONTIGUOUS);
      CHECK_STATUS(gradsync_comm_rank(three, &r3), GRADSYNC_OK);
      CHECK_STATUS(gradsync_comm_size(three, &s3), GRADSYNC_OK);
      CHECK_STATUS(gradsync_embedding_create(&t, three, NULL, &eo), GRADSYNC_OK);
      CHECK_STATUS(gradsync_embedding_load(t, argv[1]), GRADSYNC_OK);
      snprintf(what, sizeof what, "rank %d of %d after loading across hosts", (int)r3, (int)s3);
      compare_local(t, &g_ref, GRADSYNC_OPTIM_ROW_ADAGRAD, what);
      train(t, r3, s3, STEPS, STEPS + 2);
      compare_local(t, &g_ref_more, GRADSYNC_OPTIM_ROW_ADAGRAD, what);
      gradsync_embedding_free(t);
      gradsync_comm_free(three);
    }
    gradsync_comm_free(comm);
  }
  if (rank == 0) printf("world %d: ", world);
  {
    const int mine = check_report("multihost embedding");
    int worst = 0;
    MPI_Allreduce(&mine, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Finalize();
    return worst;
  }
}
