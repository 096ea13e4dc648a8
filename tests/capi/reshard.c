/* SPDX-License-Identifier: Apache-2.0 */
/* gradsync_shard_reshard through the C ABI on threads: four ranks train an Adam parameter, one
 * goes, the survivors shrink and reshard and train on; their weights must equal, bit for bit,
 * those of a run that never lost a rank (every rank's gradient is the same exact value, so the
 * mean is the same on any number of ranks). With replicas = 1 nothing is lost; without replicas
 * the reshard fails on every survivor with GRADSYNC_E_LOST naming the lost range, and changes
 * nothing; two neighbours lost with replicas = 1 fail alike, with replicas = 2 they do not. Five
 * ranks with replicas = 3 that lose ranks 0 and 3: old rank 4 then holds old slices 0 and 4, which
 * are not neighbours, so a range that spans both arrives through a receive buffer rather than in
 * place. On two labelled hosts (0, 1 on "ha", 2, 3 on "hb") the replicas go round the replica ring
 * 0, 2, 1, 3, each on the other host: losing the whole of hb with replicas = 1 loses nothing (in
 * rank order, rank 2's slice would have had its only replica on rank 3). */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "gradsync/gradsync.h"

#define N 5        /* at most */
#define TOTAL 1003 /* not a multiple of 3 or 4: uneven parts before and after */
#define STEPS 12
#define LOSS_AT 5

static float g_reference[TOTAL];

/* The gradient of step s, the same on every rank: small multiples of 1/256, so every sum and mean
 * over up to five ranks is exact. */
static void gradient(int s, float* g) {
  int i;
  for (i = 0; i < TOTAL; ++i) g[i] = (float)(((i * 7 + s * 13) % 17) - 8) / 256.0f;
}

typedef struct {
  int rank;
  int size;
  int replicas;
  int lost[2];     /* ranks that go after LOSS_AT steps (-1: none) */
  int expect_lost; /* the survivors' reshard fails with GRADSYNC_E_LOST */
  const char* name;
  float* final_weights; /* rank 0's (or the first survivor's) weights after STEPS */
  int two_hosts;        /* the first half of the ranks labelled host "ha", the rest "hb" */
} job;

static int goes(const job* j) { return j->rank == j->lost[0] || j->rank == j->lost[1]; }

static void* member(void* p) {
  job* j = (job*)p;
  gradsync_comm_options copts = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_shard_options sopts = GRADSYNC_SHARD_OPTIONS_INIT;
  gradsync_comm *comm = NULL, *next = NULL;
  gradsync_shard* shard = NULL;
  float *w = malloc(TOTAL * sizeof(float)), *g = malloc(TOTAL * sizeof(float));
  int s, i, st;
  copts.rank = j->rank;
  copts.size = j->size;
  copts.timeout_ms = 20000;
  snprintf(copts.name, sizeof copts.name, "%s", j->name);
  if (j->two_hosts) snprintf(copts.host, sizeof copts.host, "%s", j->rank < j->size / 2 ? "ha" : "hb");
  sopts.optimizer = GRADSYNC_OPTIM_ADAM;
  sopts.lr = 0.01;
  sopts.replicas = j->replicas;
  CHECK_STATUS(gradsync_comm_create(&comm, &copts), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_create(&shard, comm, TOTAL, &sopts), GRADSYNC_OK);
  for (i = 0; i < TOTAL; ++i) w[i] = (float)i / TOTAL;
  CHECK_STATUS(gradsync_shard_init(shard, w, TOTAL), GRADSYNC_OK);
  for (s = 0; s < STEPS; ++s) {
    if (s == LOSS_AT && j->lost[0] >= 0) {
      int32_t failed[N];
      int64_t updates = -1;
      if (goes(j)) break;
      /* The survivors' next step fails once the lost ranks are gone; then shrink and reshard. */
      gradient(s, g);
      while ((st = gradsync_shard_step(shard, g, w, TOTAL, 1)) == GRADSYNC_OK) {
        CHECK(0 && "a step succeeded without the lost ranks");
        break;
      }
      CHECK_STATUS(gradsync_comm_shrink(comm, &next, failed, N, NULL), GRADSYNC_OK);
      if (next == NULL) break;
      st = gradsync_shard_reshard(shard, next, NULL);
      if (j->expect_lost) {
        CHECK_STATUS_MSG(st, GRADSYNC_E_LOST, "old rank");
        CHECK_STATUS(gradsync_shard_updates(shard, &updates), GRADSYNC_OK);
        CHECK(updates == LOSS_AT);
        break;
      }
      CHECK_STATUS(st, GRADSYNC_OK);
      CHECK_STATUS(gradsync_shard_updates(shard, &updates), GRADSYNC_OK);
      CHECK(updates == LOSS_AT);
    }
    gradient(s, g);
    st = gradsync_shard_step(shard, g, w, TOTAL, 1);
    CHECK_STATUS(st, GRADSYNC_OK);
    if (st != GRADSYNC_OK) break;
  }
  if (s == STEPS && j->final_weights != NULL) {
    int32_t r = -1;
    gradsync_comm_rank(next != NULL ? next : comm, &r);
    if (r == 0) memcpy(j->final_weights, w, TOTAL * sizeof(float));
  }
  gradsync_shard_free(shard);
  gradsync_comm_free(comm);
  gradsync_comm_free(next);
  free(w);
  free(g);
  return NULL;
}

static void run_hosts(const char* name, int size, int replicas, int lost0, int lost1, int expect_lost,
                      float* final_weights, int two_hosts) {
  pthread_t t[N];
  job jobs[N];
  int i;
  for (i = 0; i < size; ++i) {
    jobs[i].rank = i;
    jobs[i].size = size;
    jobs[i].replicas = replicas;
    jobs[i].lost[0] = lost0;
    jobs[i].lost[1] = lost1;
    jobs[i].expect_lost = expect_lost;
    jobs[i].name = name;
    jobs[i].final_weights = final_weights;
    jobs[i].two_hosts = two_hosts;
    pthread_create(&t[i], NULL, member, &jobs[i]);
  }
  for (i = 0; i < size; ++i) pthread_join(t[i], NULL);
}

static void run_sized(const char* name, int size, int replicas, int lost0, int lost1, int expect_lost,
                      float* final_weights) {
  run_hosts(name, size, replicas, lost0, lost1, expect_lost, final_weights, 0);
}

static void run(const char* name, int replicas, int lost0, int lost1, int expect_lost, float* final_weights) {
  run_sized(name, 4, replicas, lost0, lost1, expect_lost, final_weights);
}

int main(void) {
  static float got[TOTAL];
  int i, differ = 0;
  run("capi-reshard-ref", 0, -1, -1, 0, g_reference);
  memset(got, 0xff, sizeof got);
  run("capi-reshard-r1", 1, 2, -1, 0, got);
  for (i = 0; i < TOTAL; ++i) differ += memcmp(&got[i], &g_reference[i], sizeof(float)) != 0;
  if (differ != 0)
    fprintf(stderr, "replicas=1, rank 2 lost: %d of %d weights differ from the undisturbed run\n", differ, TOTAL);
  CHECK(differ == 0);
  run("capi-reshard-r0", 0, 1, -1, 1, NULL);
  run("capi-reshard-r1-two", 1, 1, 2, 1, NULL);
  memset(got, 0xff, sizeof got);
  run("capi-reshard-r2-two", 2, 1, 2, 0, got);
  differ = 0;
  for (i = 0; i < TOTAL; ++i) differ += memcmp(&got[i], &g_reference[i], sizeof(float)) != 0;
  if (differ != 0) fprintf(stderr, "replicas=2, ranks 1 and 2 lost: %d weights differ\n", differ);
  CHECK(differ == 0);
  memset(got, 0xff, sizeof got);
  run("capi-reshard-r1-apart", 1, 0, 2, 0, got); /* not neighbours: each has a replica elsewhere */
  differ = 0;
  for (i = 0; i < TOTAL; ++i) differ += memcmp(&got[i], &g_reference[i], sizeof(float)) != 0;
  CHECK(differ == 0);
  memset(got, 0xff, sizeof got);
  run_sized("capi-reshard-r3-five", 5, 3, 0, 3, 0, got);
  differ = 0;
  for (i = 0; i < TOTAL; ++i) differ += memcmp(&got[i], &g_reference[i], sizeof(float)) != 0;
  if (differ != 0) fprintf(stderr, "5 ranks, replicas=3, ranks 0 and 3 lost: %d weights differ\n", differ);
  CHECK(differ == 0);
  memset(got, 0xff, sizeof got);
  run_hosts("capi-reshard-r1-host", 4, 1, 2, 3, 0, got, 1);
  differ = 0;
  for (i = 0; i < TOTAL; ++i) differ += memcmp(&got[i], &g_reference[i], sizeof(float)) != 0;
  if (differ != 0) fprintf(stderr, "2 hosts, replicas=1, host hb lost: %d weights differ\n", differ);
  CHECK(differ == 0);
  return check_report("capi:reshard");
}
