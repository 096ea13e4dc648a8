/* SPDX-License-Identifier: Apache-2.0 */
/* The hierarchical transport on one host moves no data through MPI: under mpirun on this host,
 * with the counting plugin (counting_plugin.cpp) as the MPI plugin, every collective (small and
 * large, every dtype, topology_independent or not) gives the right result and adds no MPI message.
 * The MPI transport on the same ranks, doing the same, does send messages: the count counts.
 *
 *   GRADSYNC_MPI_PLUGIN=<counting plugin> mpirun ... hier_one_host */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gradsync/gradsync.h"

static int failures = 0;
static int32_t g_rank = -1;

#define EXPECT(cond, ...)                                                                 \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      fprintf(stderr, "hier_one_host rank %d: %s:%d: ", (int)g_rank, __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                                                       \
      fprintf(stderr, " (last error: %s)\n", gradsync_last_error_message());              \
      failures++;                                                                         \
    }                                                                                     \
  } while (0)

typedef uint64_t (*messages_fn)(void);

/* Every collective once, results checked; returns the MPI messages it sent. */
static uint64_t run_calls(gradsync_comm* comm, messages_fn messages, const char* what) {
  int32_t rank = 0, size = 0, i, r;
  const size_t big = (size_t)1 << 18; /* 1 MiB of floats: past every small-message path */
  float *x = malloc(big * sizeof(float)), *y = malloc(big * sizeof(float));
  float* all = NULL;
  double d = 0;
  uint64_t total = 0, before;
  gradsync_comm_rank(comm, &rank);
  gradsync_comm_size(comm, &size);
  all = malloc((size_t)size * big * sizeof(float));
  before = messages();

  for (i = 0; i < (int32_t)big; i++) x[i] = (float)(rank + 1) * (float)(i % 7);
  EXPECT(gradsync_comm_allreduce(comm, x, y, big, GRADSYNC_F32, GRADSYNC_SUM) == GRADSYNC_OK, "%s: allreduce", what);
  for (i = 0; i < (int32_t)big; i++) {
    if (y[i] != (float)(size * (size + 1) / 2) * (float)(i % 7)) {
      EXPECT(0, "%s: allreduce element %d is %g", what, i, (double)y[i]);
      break;
    }
  }
  d = rank + 1.0;
  EXPECT(gradsync_comm_allreduce(comm, &d, &d, 1, GRADSYNC_F64, GRADSYNC_SUM) == GRADSYNC_OK, "%s: small", what);
  EXPECT(d == size * (size + 1) / 2.0, "%s: small allreduce gave %g", what, d);
  x[0] = rank == 1 ? 42.0f : -1.0f;
  EXPECT(gradsync_comm_broadcast(comm, x, big, GRADSYNC_F32, 1) == GRADSYNC_OK, "%s: broadcast", what);
  EXPECT(x[0] == 42.0f, "%s: broadcast gave %g", what, (double)x[0]);
  for (i = 0; i < (int32_t)big; i++) x[i] = (float)rank;
  EXPECT(gradsync_comm_allgather(comm, x, all, (size_t)size * big, GRADSYNC_F32) == GRADSYNC_OK, "%s: allgather", what);
  for (r = 0; r < size; r++) EXPECT(all[(size_t)r * big] == (float)r, "%s: allgather block %d", what, r);
  for (i = 0; i < (int32_t)big; i++) x[i] = 1.0f;
  EXPECT(gradsync_comm_reduce_scatter(comm, x, y, big, GRADSYNC_F32, GRADSYNC_SUM) == GRADSYNC_OK, "%s: reduce_scatter",
         what);
  EXPECT(y[0] == (float)size, "%s: reduce_scatter gave %g", what, (double)y[0]);
  for (i = 0; i < (int32_t)big; i++) x[i] = (float)rank;
  EXPECT(gradsync_comm_alltoall(comm, x, all, big, GRADSYNC_F32) == GRADSYNC_OK, "%s: alltoall", what);
  EXPECT(all[0] == 0.0f, "%s: alltoall gave %g from rank 0", what, (double)all[0]);
  EXPECT(gradsync_comm_weighted_mean(comm, x, y, 4, GRADSYNC_F32, 1, &total) == GRADSYNC_OK, "%s: weighted mean", what);
  EXPECT(total == (uint64_t)size, "%s: total weight %llu", what, (unsigned long long)total);
  EXPECT(gradsync_comm_barrier(comm) == GRADSYNC_OK, "%s: barrier", what);
  free(x);
  free(y);
  free(all);
  return messages() - before;
}

static gradsync_comm* create(int32_t transport, int32_t topology_independent) {
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm* comm = NULL;
  o.transport = transport;
  o.topology_independent = topology_independent;
  o.timeout_ms = 60000;
  EXPECT(gradsync_comm_create(&comm, &o) == GRADSYNC_OK, "create (transport %d)", (int)transport);
  return comm;
}

int main(void) {
  const char* plugin = getenv("GRADSYNC_MPI_PLUGIN");
  void* handle = NULL;
  messages_fn messages = NULL;
  gradsync_comm* comm = NULL;
  uint64_t sent = 0;
  int32_t hosts = 0, t;

  if (plugin == NULL || *plugin == '\0') {
    fprintf(stderr, "hier_one_host: set GRADSYNC_MPI_PLUGIN to the counting plugin\n");
    return 2;
  }
  for (t = 0; t < 2; t++) {
    comm = create(GRADSYNC_TRANSPORT_HIER, t);
    if (comm == NULL) return 1;
    if (messages == NULL) {
      /* The library loaded the plugin: this finds the same one. */
      handle = dlopen(plugin, RTLD_NOW | RTLD_NOLOAD);
      messages = handle != NULL ? (messages_fn)(uintptr_t)dlsym(handle, "gradsync_test_mpi_messages") : NULL;
      if (messages == NULL) {
        fprintf(stderr, "hier_one_host: %s is loaded without gradsync_test_mpi_messages\n", plugin);
        return 2;
      }
    }
    gradsync_comm_rank(comm, &g_rank);
    EXPECT(gradsync_comm_topology(comm, NULL, NULL, NULL, &hosts, NULL, 0) == GRADSYNC_OK && hosts == 1,
           "one host expected, the topology has %d", (int)hosts);
    sent = run_calls(comm, messages, t ? "hier, topology_independent" : "hier");
    EXPECT(sent == 0, "hier on one host (topology_independent %d) sent %llu MPI messages", (int)t,
           (unsigned long long)sent);
    gradsync_comm_free(comm);
  }
  comm = create(GRADSYNC_TRANSPORT_MPI, 0);
  if (comm == NULL) return 1;
  sent = run_calls(comm, messages, "mpi");
  EXPECT(sent > 0, "the MPI transport's calls sent no counted message: the count counts nothing");
  gradsync_comm_free(comm);
  if (g_rank == 0)
    printf("hier_one_host: hier on one host sent 0 MPI messages; the MPI transport sent %llu\n",
           (unsigned long long)sent);
  return failures == 0 ? 0 : 1;
}
