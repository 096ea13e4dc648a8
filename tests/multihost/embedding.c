/* SPDX-License-Identifier: Apache-2.0 */
/* The sharded embedding table across hosts (under hosts.py, on the hierarchical transport): every
 * rank's rows bitwise equal to the one-process reference after the same global batches, then a
 * checkpoint saved by every rank into a directory all hosts see, loaded by a subgroup of 3 ranks
 * under the other sharding rule, bitwise again, and trained on as if never interrupted; with
 * row-wise Adagrad, then Adam (each in a directory of its own under the one given).
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

/* The scenario with one optimizer, its checkpoint in dir. */
static void run(int32_t optimizer, const char* dir, int32_t* rank_out) {
  int32_t rank = -1, size = -1;
  char what[160];
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm *comm = NULL, *three = NULL;
  gradsync_embedding* t = NULL;
  gradsync_embedding_options eo = table_options(optimizer, GRADSYNC_EMBEDDING_HASH);
  const char* name = optimizer == GRADSYNC_OPTIM_ADAM ? "Adam" : "row-wise Adagrad";
  reference(optimizer, STEPS, 0, &g_ref);
  reference(optimizer, STEPS + 2, 0, &g_ref_more);
  o.transport = GRADSYNC_TRANSPORT_HIER;
  o.timeout_ms = 60000;
  CHECK_STATUS(gradsync_comm_create(&comm, &o), GRADSYNC_OK);
  if (comm == NULL) return;
  CHECK_STATUS(gradsync_comm_rank(comm, &rank), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_size(comm, &size), GRADSYNC_OK);
  *rank_out = rank;
  CHECK_STATUS(gradsync_embedding_create(&t, comm, NULL, &eo), GRADSYNC_OK);
  train(t, rank, size, 0, STEPS);
  snprintf(what, sizeof what, "%s: rank %d of %d across hosts", name, (int)rank, (int)size);
  compare_local(t, &g_ref, optimizer, what);
  CHECK_STATUS(gradsync_embedding_save(t, dir), GRADSYNC_OK);
  gradsync_embedding_free(t);
  t = NULL;
  /* 3 of the ranks, contiguous rows: the same rows and state from the checkpoint */
  CHECK_STATUS(gradsync_comm_split(comm, rank < 3 ? 0 : -1, rank, &three), GRADSYNC_OK);
  if (three != NULL) {
    int32_t r3 = -1, s3 = -1;
    eo = table_options(optimizer, GRADSYNC_EMBEDDING_CONTIGUOUS);
    CHECK_STATUS(gradsync_comm_rank(three, &r3), GRADSYNC_OK);
    CHECK_STATUS(gradsync_comm_size(three, &s3), GRADSYNC_OK);
    CHECK_STATUS(gradsync_embedding_create(&t, three, NULL, &eo), GRADSYNC_OK);
    CHECK_STATUS(gradsync_embedding_load(t, dir), GRADSYNC_OK);
    snprintf(what, sizeof what, "%s: rank %d of %d after loading across hosts", name, (int)r3, (int)s3);
    compare_local(t, &g_ref, optimizer, what);
    train(t, r3, s3, STEPS, STEPS + 2);
    compare_local(t, &g_ref_more, optimizer, what);
    gradsync_embedding_free(t);
    gradsync_comm_free(three);
  }
  gradsync_comm_free(comm);
}

int main(int argc, char** argv) {
  int provided = 0, world = 0;
  int32_t rank = -1;
  char dir[1024];
  if (argc != 2) {
    fprintf(stderr, "usage: embedding <checkpoint directory>\n");
    return 2;
  }
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  snprintf(dir, sizeof dir, "%s/row_adagrad", argv[1]);
  run(GRADSYNC_OPTIM_ROW_ADAGRAD, dir, &rank);
  snprintf(dir, sizeof dir, "%s/adam", argv[1]);
  run(GRADSYNC_OPTIM_ADAM, dir, &rank);
  if (rank == 0) printf("world %d: ", world);
  {
    const int mine = check_report("multihost embedding");
    int worst = 0;
    MPI_Allreduce(&mine, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Finalize();
    return worst;
  }
}
