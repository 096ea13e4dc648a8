/* SPDX-License-Identifier: Apache-2.0 */
/* gradsync_comm_shrink and gradsync_comm_join on the MPI and hierarchical transports, under mpirun.
 * A shrink with nobody lost gives the whole group again (same ranks, member ids, nothing failed)
 * that works, and stops the old group, on both. A join in a process that no grow spawned is
 * refused (E_INVALID_ARG, saying how a grow over MPI starts its joiners), never a hang, and the
 * communicators keep working afterwards. (A shrink after a lost process: shrink_program.c under
 * mpirun --enable-recovery; a grow: grow_program.c.) */
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
  {
    gradsync_shrink_result r;
    int32_t rank = -1, n = -1;
    int64_t id = -1;
    memset(&r, 0, sizeof r);
    r.struct_size = sizeof r;
    r.version = GRADSYNC_SHRINK_RESULT_VERSION;
    EXPECT(gradsync_comm_rank(c, &rank) == GRADSYNC_OK);
    EXPECT(gradsync_comm_member_id(c, &id) == GRADSYNC_OK && id == rank);
    EXPECT(gradsync_comm_shrink(c, &next, failed, 64, &r) == GRADSYNC_OK && next != NULL);
    EXPECT(r.failed_count == 0 && r.attempts == 1 && r.agree_ns > 0 && r.form_ns > 0);
    if (next != NULL) {
      EXPECT(gradsync_comm_size(next, &n) == GRADSYNC_OK && n == size);
      EXPECT(gradsync_comm_member_id(next, &id) == GRADSYNC_OK && id == rank);
      EXPECT(gradsync_comm_rank(next, &n) == GRADSYNC_OK && n == rank);
      v = 1.0f;
      EXPECT(gradsync_comm_allreduce(next, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM) == GRADSYNC_OK && v == (float)size);
      /* the old group is stopped for good */
      EXPECT(gradsync_comm_allreduce(c, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM) == GRADSYNC_E_ABORTED);
      gradsync_comm_free(c);
      c = next;
      next = NULL;
    }
  }
  {
    gradsync_comm_options j = GRADSYNC_COMM_OPTIONS_INIT;
    j.transport = transport;
    j.rank = 0;
    j.size = 1;
    snprintf(j.name, sizeof j.name, "join-unsupported");
    EXPECT(gradsync_comm_join(&next, &j, NULL) == GRADSYNC_E_INVALID_ARG && next == NULL);
    EXPECT(strstr(gradsync_last_error_message(), "not started by a grow") != NULL);
    EXPECT(strstr(gradsync_last_error_message(), "MPI_Comm_spawn") != NULL);
  }
  v = 1.0f;
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
