/* SPDX-License-Identifier: Apache-2.0 */
/* gradsync_comm_topology on an MPI group, checked against the layout the launcher made:
 *
 *   mpirun ... topology_check 2,2          hosts of 2 and 2 ranks, filled in rank order
 *   mpirun ... topology_check 2,1 mod2     host labels "h<rank % 2>" replace the detected hosts
 *
 * Every rank checks the whole topology (the same on every rank), then splits the group by host and
 * by local rank (the two levels of a hierarchical allreduce) and checks a sum over each level and
 * their composition against the flat sum. Each rank prints its line, so the output shows the
 * topology. Exit status 0 when every rank agrees with the layout. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gradsync/gradsync.h"

#define MAX_RANKS 64

static int failures = 0;

#define EXPECT(cond, ...)                                                                  \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      fprintf(stderr, "topology_check rank %d: %s:%d: ", (int)g_rank, __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                                                        \
      fprintf(stderr, " (last error: %s)\n", gradsync_last_error_message());               \
      failures++;                                                                          \
    }                                                                                      \
  } while (0)

static int32_t g_rank = -1;

int main(int argc, char** argv) {
  int32_t expect_host[MAX_RANKS], nexpect = 0, nhosts_expected = 0;
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm *world = NULL, *host_group = NULL, *cross = NULL;
  int32_t size = 0, host = -1, local_rank = -1, local_size = -1, num_hosts = -1, rank_hosts[MAX_RANKS];
  const int by_label = argc > 2 && strcmp(argv[2], "mod2") == 0;
  char hostname[256] = "";
  int32_t i;
  double x, flat = 0, levels;
  char* spec;

  if (argc < 2) {
    fprintf(stderr, "usage: %s <ranks per host, e.g. 2,2> [mod2]\n", argv[0]);
    return 2;
  }
  for (spec = strtok(argv[1], ","); spec != NULL; spec = strtok(NULL, ","), ++nhosts_expected) {
    int k, n = atoi(spec);
    for (k = 0; k < n && nexpect < MAX_RANKS; ++k) expect_host[nexpect++] = nhosts_expected;
  }
  o.transport = GRADSYNC_TRANSPORT_MPI;
  o.timeout_ms = 60000;
  o.deterministic = 1;
  if (gradsync_comm_create(&world, &o) != GRADSYNC_OK) {
    fprintf(stderr, "topology_check: create: %s\n", gradsync_last_error_message());
    return 1;
  }
  gradsync_comm_rank(world, &g_rank);
  gradsync_comm_size(world, &size);
  if (by_label) {
    /* Re-create with labels: rank r claims host "h<r % 2>" whatever the machine says. */
    gradsync_comm_free(world);
    snprintf(o.host, sizeof o.host, "h%d", (int)(g_rank % 2));
    if (gradsync_comm_create(&world, &o) != GRADSYNC_OK) {
      fprintf(stderr, "topology_check: create with a label: %s\n", gradsync_last_error_message());
      return 1;
    }
    for (i = 0; i < size && i < MAX_RANKS; ++i) expect_host[i] = i % 2;
    nexpect = size;
    nhosts_expected = size > 1 ? 2 : 1;
  }
  EXPECT(size == nexpect && size <= MAX_RANKS, "group of %d ranks, the layout has %d", (int)size, (int)nexpect);
  if (size != nexpect || size > MAX_RANKS) return 1;

  EXPECT(
      gradsync_comm_topology(world, &host, &local_rank, &local_size, &num_hosts, rank_hosts, MAX_RANKS) == GRADSYNC_OK,
      "gradsync_comm_topology failed");
  gethostname(hostname, sizeof hostname - 1);
  printf("topology rank %d (%s): host %d of %d, local rank %d of %d, hosts by rank:", (int)g_rank, hostname, (int)host,
         (int)num_hosts, (int)local_rank, (int)local_size);
  for (i = 0; i < size; ++i) printf(" %d", (int)rank_hosts[i]);
  printf("\n");
  fflush(stdout);

  EXPECT(num_hosts == nhosts_expected, "%d hosts, expected %d", (int)num_hosts, (int)nhosts_expected);
  for (i = 0; i < size; ++i)
    EXPECT(rank_hosts[i] == expect_host[i], "rank %d on host %d, expected %d", (int)i, (int)rank_hosts[i],
           (int)expect_host[i]);
  {
    int32_t lr = 0, ls = 0;
    for (i = 0; i < size; ++i) {
      if (expect_host[i] != expect_host[g_rank]) continue;
      if (i < g_rank) ++lr;
      ++ls;
    }
    EXPECT(host == expect_host[g_rank] && local_rank == lr && local_size == ls,
           "host %d local %d of %d, expected host %d local %d of %d", (int)host, (int)local_rank, (int)local_size,
           (int)expect_host[g_rank], (int)lr, (int)ls);
  }

  /* The two levels of a hierarchy: the ranks of this host, and the ranks of this local rank
   * across hosts. A sum over the first, then the second, equals the flat sum. */
  EXPECT(gradsync_comm_split(world, host, local_rank, &host_group) == GRADSYNC_OK, "split by host");
  EXPECT(gradsync_comm_split(world, local_rank, host, &cross) == GRADSYNC_OK, "split by local rank");
  x = (double)(g_rank + 1);
  EXPECT(gradsync_comm_allreduce(world, &x, &flat, 1, GRADSYNC_F64, GRADSYNC_SUM) == GRADSYNC_OK, "flat sum");
  if (host_group != NULL && cross != NULL) {
    int32_t hs = 0, hr = -1, h2 = -1, n2 = -1, l2 = -1;
    gradsync_comm_size(host_group, &hs);
    gradsync_comm_rank(host_group, &hr);
    EXPECT(hs == local_size && hr == local_rank, "host subgroup rank %d of %d", (int)hr, (int)hs);
    EXPECT(gradsync_comm_topology(host_group, &h2, NULL, &l2, &n2, NULL, 0) == GRADSYNC_OK && n2 == 1 && h2 == 0 &&
               l2 == hs,
           "host subgroup topology: host %d of %d, %d local", (int)h2, (int)n2, (int)l2);
    levels = x;
    EXPECT(gradsync_comm_allreduce(host_group, &levels, &levels, 1, GRADSYNC_F64, GRADSYNC_SUM) == GRADSYNC_OK,
           "host sum");
    /* Only local rank 0 of each host carries its host's sum across; the others add 0. */
    if (local_rank != 0) levels = 0;
    {
      double across = levels;
      int32_t cs = 0;
      gradsync_comm_size(cross, &cs);
      EXPECT(gradsync_comm_allreduce(cross, &across, &across, 1, GRADSYNC_F64, GRADSYNC_SUM) == GRADSYNC_OK,
             "cross-host sum");
      if (local_rank == 0) EXPECT(across == flat, "levels give %g, flat %g", across, flat);
      EXPECT(cs <= num_hosts, "cross-host subgroup of %d ranks over %d hosts", (int)cs, (int)num_hosts);
    }
  }
  EXPECT(flat == (double)size * (size + 1) / 2, "flat sum %g", flat);
  gradsync_comm_free(cross);
  gradsync_comm_free(host_group);
  gradsync_comm_free(world);
  return failures == 0 ? 0 : 1;
}
