/* SPDX-License-Identifier: Apache-2.0 */
/* gradsync_comm_shrink, gradsync_comm_grow and gradsync_comm_join on the MPI and hierarchical
 * transports, under mpirun: GRADSYNC_E_UNSUPPORTED at once on every rank, with a message that says
 * why (Open MPI aborts the job on a lost process, ULFM is the route and Debian's MPICH lacks it;
 * taking in processes needs MPI_Comm_spawn or connect/accept), and the communicators keep working
 * afterwards: a refusal, never a hang. */
#define _POSIX_C_SOURCE 200809L
#include <mpi.h>
#include <stdio.h>
#include <string.h>

#include "gradsync/gradsync.h"

static int failures = 0;
#define EXPECT(cond)                                                                           \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      fprintf(stderr, "%s:%d: EXPECT(%s) failed; last error: %s\n", __FILE__, __LINE__, #cond, \
              gradsync_last_error_message());                                                  \
      failures++;                                                                              \
    }                                                                                          \
  } while (0)

static void refused(int32_t transport, int size) {
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm *c = NULL, *next = NULL;
  int32_t failed[64];
  float v = 1.0f;
  o.transport = transport;
  o.timeout_ms = 30000;
  snprintf(o.name, sizeof o.name, "shrink-unsupported-%d", (int)transport);
  EXPECT(gradsync_comm_create(&c, &o) == GRADSYNC_OK);
  if (c == NULL) return;
  EXPECT(gradsync_comm_shrink(c, &next, failed, 64, NULL) == GRADSYNC_E_UNSUPPORTED && next == NULL);
  EXPECT(strstr(gradsync_last_error_message(), "aborts the whole job") != NULL);
  EXPECT(strstr(gradsync_last_error_message(), "ULFM") != NULL);
  EXPECT(strstr(gradsync_last_error_message(), "MPICH 4.0.2") != NULL);
  EXPECT(gradsync_comm_grow(c, "grow-unsupported", 1, &next, NULL) == GRADSYNC_E_UNSUPPORTED && next == NULL);
  EXPECT(strstr(gradsync_last_error_message(), "MPI_Comm_spawn") != NULL);
  {
    gradsync_comm_options j = GRADSYNC_COMM_OPTIONS_INIT;
    j.transport = transport;
    j.rank = 0;
    j.size = 1;
    snprintf(j.name, sizeof j.name, "join-unsupported");
    EXPECT(gradsync_comm_join(&next, &j, NULL) == GRADSYNC_E_UNSUPPORTED && next == NULL);
    EXPECT(strstr(gradsync_last_error_message(), "MPI_Comm_spawn") != NULL);
  }
  EXPECT(gradsync_comm_allreduce(c, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM) == GRADSYNC_OK && v == (float)size);
  gradsync_comm_free(c);
}

int main(int argc, char** argv) {
  int provided = 0, size = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  refused(GRADSYNC_TRANSPORT_MPI, size);
  refused(GRADSYNC_TRANSPORT_HIER, size);
  MPI_Finalize();
  if (failures != 0) return 1;
  printf("mpi:shrink_unsupported: all checks passed\n");
  return 0;
}
