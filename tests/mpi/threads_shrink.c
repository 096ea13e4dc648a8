/* SPDX-License-Identifier: Apache-2.0 */
/* Shrink of a group of threads as ranks (comm.h): 3 processes x 2 threads (6 ranks) call
 * allreduces, each result checked, until process 1 SIGKILLs itself in the middle of them, taking
 * ranks 2 and 3. Every thread of processes 0 and 2 gets an error, shrinks, and checks the new
 * group: 4 ranks in the old order, each rank's member id kept, the topology (the survivors' hosts as
 * they were), and every collective
 * on it; then it shrinks that group with nobody lost (the same group again), checks it the same
 * way; then (the plain mode only) it grows that group back by one process, which MPI spawns and
 * whose 2 threads join (ranks 4 and 5, member ids 6 and 7), every collective checked on the grown
 * group by the members and the joiner (where process 1 was a host's only one, the grow is refused,
 * as over MPI after a host is lost); and finishes. Run by run_shrink.py (mode threads) under
 * mpirun --enable-recovery, which checks what every survivor printed; across namespace hosts, one
 * process on each, by tests/multihost/shrink_hosts.py --what threads.
 *
 *   mpirun --enable-recovery -np 3 threads_shrink [interleaved|host|silent]   (SHRINK_TRANSPORT=hier: the
 *   hierarchical transport; interleaved: the group is the whole one split thread by thread, whose
 *   ranks alternate between the processes, and process 1's are ranks 1 and 4; host: nobody kills
 *   itself, every rank says "looping" once under way, and the runner kills a host; silent: process 1
 *   does not die but stops calling, its threads asleep until it kills itself long after the
 *   survivors went on, on a timeout of SILENT_TIMEOUT_MS: the survivors' calls time out, and their
 *   shrink excludes process 1 only after a whole timeout of its silence, so thread 0's shrink of the
 *   process-level group outlasts a timeout, which its siblings must wait out) */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gradsync/gradsync.h"

#define THREADS 2
#define PROCS 3
#define VICTIM 1
#define LARGE 100003

static int32_t g_transport = GRADSYNC_TRANSPORT_MPI;
static int g_proc;
static int g_interleaved; /* the group shrunk is the whole one split thread by thread */
static int g_host_lost;   /* the runner kills a host: no process kills itself */
static int g_silent;      /* process 1 goes silent instead of dying */
#define SILENT_TIMEOUT_MS 3000
static pthread_mutex_t g_print = PTHREAD_MUTEX_INITIALIZER;

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

#define SAY(...)                    \
  do {                              \
    pthread_mutex_lock(&g_print);   \
    printf(__VA_ARGS__);            \
    fflush(stdout);                 \
    pthread_mutex_unlock(&g_print); \
  } while (0)

#define JOIN_NAME "threads-grow"

/* Every collective on the shrunk group, each result checked: how many were right (of 4). */
static int verify(gradsync_comm* c, int me, int n, const int* old_rank) {
  int right = 0;
  float one = (float)(old_rank[me] + 1), sum = 0;
  for (int r = 0; r < n; r++) sum += (float)(old_rank[r] + 1);
  if (gradsync_comm_allreduce(c, &one, &one, 1, GRADSYNC_F32, GRADSYNC_SUM) == GRADSYNC_OK && one == sum)
    right++;
  else
    SAY("rank %d: WRONG small allreduce %g, expected %g (%s)\n", old_rank[me], one, sum, gradsync_last_error_message());
  float* big = malloc(LARGE * sizeof(float));
  for (int i = 0; i < LARGE; i++) big[i] = (float)((i % 97) * (old_rank[me] + 1));
  if (gradsync_comm_allreduce(c, big, big, LARGE, GRADSYNC_F32, GRADSYNC_SUM) == GRADSYNC_OK) {
    int ok = 1;
    for (int i = 0; i < LARGE && ok; i++) ok = big[i] == (float)(i % 97) * sum;
    if (ok)
      right++;
    else
      SAY("rank %d: WRONG large allreduce\n", old_rank[me]);
  } else {
    SAY("rank %d: WRONG large allreduce failed: %s\n", old_rank[me], gradsync_last_error_message());
  }
  for (int i = 0; i < LARGE; i++) big[i] = me == n - 1 ? (float)i : -1.0f;
  if (gradsync_comm_broadcast(c, big, LARGE, GRADSYNC_F32, n - 1) == GRADSYNC_OK &&
      big[LARGE - 1] == (float)(LARGE - 1) && big[7] == 7.0f)
    right++;
  else
    SAY("rank %d: WRONG broadcast\n", old_rank[me]);
  int32_t mine = old_rank[me], all[8] = {0};
  if (gradsync_comm_allgather(c, &mine, all, (size_t)n, GRADSYNC_I32) == GRADSYNC_OK) {
    int ok = 1;
    for (int r = 0; r < n; r++) ok &= all[r] == old_rank[r];
    if (ok)
      right++;
    else
      SAY("rank %d: WRONG allgather\n", old_rank[me]);
  } else {
    SAY("rank %d: WRONG allgather failed: %s\n", old_rank[me], gradsync_last_error_message());
  }
  free(big);
  return right;
}

/* The members' ids after the shrink (process 1's ranks 2 and 3 lost), then the joiner's threads'
   (from first_id). */
static void grown_ids(int* ids, int64_t first_id) {
  const int kept[4] = {0, 1, 4, 5};
  for (int i = 0; i < 4; i++) ids[i] = kept[i];
  for (int t = 0; t < THREADS; t++) ids[4 + t] = (int)first_id + t;
}

/* The grown group, as every member or joiner thread sees it: its rank, size and member id as the
   grow said, and every collective on it. How many were right (of 4), or 0. */
static int check_grown(gradsync_comm* g, const char* who, int index, int rank_want, const gradsync_grow_result* r) {
  int rank = -1, size = 0, ids[4 + THREADS];
  int64_t id = -1;
  gradsync_comm_rank(g, &rank);
  gradsync_comm_size(g, &size);
  gradsync_comm_member_id(g, &id);
  grown_ids(ids, r->first_member_id);
  if (r->old_size != 4 || r->new_size != 4 + THREADS || r->first_member_id != PROCS * THREADS || rank != rank_want ||
      size != r->new_size || id != ids[rank]) {
    SAY("%s %d: WRONG grown group: rank %d of %d, member id %lld, result %d -> %d from id %lld\n", who, index, rank,
        size, (long long)id, (int)r->old_size, (int)r->new_size, (long long)r->first_member_id);
    return 0;
  }
  SAY("%s %d: grew to %d first_id %lld agree_us %.0f form_us %.0f\n", who, index, size, (long long)r->first_member_id,
      (double)r->agree_ns / 1e3, (double)r->form_ns / 1e3);
  return verify(g, rank, size, ids);
}

/* A thread of the process the members' grow spawned (GRADSYNC_JOIN set): it joins as rank 4 + t. */
static void* join(void* arg) {
  const int t = (int)(intptr_t)arg;
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm* g = NULL;
  gradsync_grow_result r;
  memset(&r, 0, sizeof r);
  r.struct_size = sizeof r;
  r.version = GRADSYNC_GROW_RESULT_VERSION;
  o.transport = g_transport;
  o.threads = THREADS;
  o.thread = t;
  o.timeout_ms = 20000;
  snprintf(o.name, sizeof o.name, "%s", JOIN_NAME);
  if (gradsync_comm_join(&g, &o, &r) != GRADSYNC_OK) {
    SAY("joiner %d: WRONG join failed: %s\n", t, gradsync_last_error_message());
    return NULL;
  }
  const int right = check_grown(g, "joiner", t, 4 + t, &r);
  if (right == 4) SAY("joiner %d: verified %d on %d ranks\n", t, right, 4 + THREADS);
  gradsync_comm_free(g);
  SAY("joiner %d: done\n", t);
  return NULL;
}

static void* run(void* arg) {
  const int t = (int)(intptr_t)arg;
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm* c = NULL;
  o.transport = g_transport;
  o.threads = THREADS;
  o.thread = t;
  o.timeout_ms = g_silent ? SILENT_TIMEOUT_MS : 20000;
  snprintf(o.name, sizeof o.name, "threads-shrink");
  if (gradsync_comm_create(&c, &o) != GRADSYNC_OK) {
    SAY("process %d thread %d: create failed: %s\n", g_proc, t, gradsync_last_error_message());
    return NULL;
  }
  gradsync_comm* whole = NULL;
  if (g_interleaved) { /* the same ranks thread by thread: thread 0 of each process, then thread 1 */
    whole = c;
    if (gradsync_comm_split(whole, 0, t * PROCS + g_proc, &c) != GRADSYNC_OK) {
      SAY("process %d thread %d: split failed: %s\n", g_proc, t, gradsync_last_error_message());
      gradsync_comm_free(whole);
      return NULL;
    }
  }
  int me = -1, size = 0;
  gradsync_comm_rank(c, &me);
  gradsync_comm_size(c, &size);
  int64_t my_id = -1;
  gradsync_comm_member_id(c, &my_id);
  int32_t old_hosts[PROCS * THREADS];
  gradsync_comm_topology(c, NULL, NULL, NULL, NULL, old_hosts, PROCS * THREADS);
  double started = 0;
  int status = GRADSYNC_OK;
  for (int round = 0;; round++) {
    float v = (float)(me + 1);
    if (g_host_lost && round == 40) SAY("rank %d: looping\n", me);
    if (g_silent && g_proc == VICTIM && round == 40) {
      SAY("rank %d: silent\n", me);
      sleep(3 * SILENT_TIMEOUT_MS / 1000); /* the survivors time out, then shrink without it */
      if (t == 0) kill(getpid(), SIGKILL);
      sleep(3 * SILENT_TIMEOUT_MS / 1000);
    }
    if (!g_host_lost && !g_silent && g_proc == VICTIM && t == 0 && round == 40) {
      SAY("rank %d: dies\n", me);
      kill(getpid(), SIGKILL);
    }
    started = now_us();
    status = gradsync_comm_allreduce(c, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM);
    if (status != GRADSYNC_OK) break;
    if (v != (float)(size * (size + 1) / 2)) SAY("rank %d: WRONG allreduce %g in round %d\n", me, v, round);
  }
  const double detect = now_us() - started;
  SAY("rank %d: failed %s %s\n", me, gradsync_status_string(status), gradsync_last_error_message());
  gradsync_comm* n = NULL;
  int32_t failed[PROCS * THREADS];
  gradsync_shrink_result res;
  memset(&res, 0, sizeof res);
  res.struct_size = sizeof res;
  res.version = GRADSYNC_SHRINK_RESULT_VERSION;
  const double shrink_start = now_us();
  status = gradsync_comm_shrink(c, &n, failed, PROCS * THREADS, &res);
  const double shrink = now_us() - shrink_start;
  if (status != GRADSYNC_OK) {
    SAY("rank %d: shrink %s %s\n", me, gradsync_status_string(status), gradsync_last_error_message());
    gradsync_comm_free(c);
    return NULL;
  }
  char list[64] = "";
  for (int i = 0; i < res.failed_count; i++)
    snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d", i ? "," : "", (int)failed[i]);
  int new_rank = -1, new_size = 0;
  int64_t id = -1;
  gradsync_comm_rank(n, &new_rank);
  gradsync_comm_size(n, &new_size);
  gradsync_comm_member_id(n, &id);
  SAY("rank %d: shrunk failed [%s] size %d attempts %d detect_us %.0f shrink_us %.0f agree_us %.0f form_us %.0f\n", me,
      list, new_size, (int)res.attempts, detect, shrink, (double)res.agree_ns / 1e3, (double)res.form_ns / 1e3);
  /* The survivors in the old order; each keeps its member id (its old rank here). */
  int old_rank[PROCS * THREADS], k = 0;
  for (int r = 0; r < size; r++) {
    int out = 0;
    for (int i = 0; i < res.failed_count; i++) out |= failed[i] == r;
    if (!out) old_rank[k++] = r;
  }
  /* The topology: the survivors' hosts as they were, numbered again in the order of their first
     rank (on one host, or on namespace hosts with one of them lost). */
  int32_t hosts = 0, new_hosts[PROCS * THREADS], renumbered[PROCS * THREADS], seen = 0;
  int topo_ok = gradsync_comm_topology(n, NULL, NULL, NULL, &hosts, new_hosts, PROCS * THREADS) == GRADSYNC_OK;
  for (int i = 0; i < k && topo_ok; i++) {
    int32_t h = -1;
    for (int j = 0; j < i && h < 0; j++)
      if (old_hosts[old_rank[j]] == old_hosts[old_rank[i]]) h = renumbered[j];
    renumbered[i] = h >= 0 ? h : seen++;
    topo_ok = new_hosts[i] == renumbered[i];
  }
  topo_ok = topo_ok && hosts == seen;
  if (k != new_size || new_rank < 0 || old_rank[new_rank] != me || id != my_id || !topo_ok) {
    SAY("rank %d: WRONG group: rank %d size %d member id %lld (expected size %d, rank of old %d, member id %lld)\n", me,
        new_rank, new_size, (long long)id, k, me, (long long)my_id);
  } else {
    int right = verify(n, new_rank, new_size, old_rank);
    /* A shrink with nobody lost: the same group again, each rank where it was. */
    gradsync_comm* again = NULL;
    status = gradsync_comm_shrink(n, &again, failed, PROCS * THREADS, &res);
    int again_rank = -1, again_size = 0;
    if (status == GRADSYNC_OK) {
      gradsync_comm_rank(again, &again_rank);
      gradsync_comm_size(again, &again_size);
    }
    if (status != GRADSYNC_OK || res.failed_count != 0 || again_rank != new_rank || again_size != new_size) {
      SAY("rank %d: WRONG shrink with nobody lost: %s, %d failed, rank %d of %d (%s)\n", me,
          gradsync_status_string(status), (int)res.failed_count, again_rank, again_size, gradsync_last_error_message());
    } else {
      right += verify(again, new_rank, new_size, old_rank);
    }
    if (right == 8) SAY("rank %d: verified %d on %d ranks\n", me, right, new_size);
    if (right == 8 && !g_interleaved && !g_host_lost && !g_silent) { /* grown back by one process of 2 threads */
      gradsync_comm* g = NULL;
      gradsync_grow_result r;
      memset(&r, 0, sizeof r);
      r.struct_size = sizeof r;
      r.version = GRADSYNC_GROW_RESULT_VERSION;
      const int grew = gradsync_comm_grow(again, JOIN_NAME, 1, &g, &r);
      if (grew == GRADSYNC_E_UNSUPPORTED) { /* a whole host was lost (one process per host) */
        SAY("rank %d: grow refused: %s\n", me, gradsync_last_error_message());
      } else if (grew != GRADSYNC_OK) {
        SAY("rank %d: WRONG grow failed: %s\n", me, gradsync_last_error_message());
      } else {
        const int grown = check_grown(g, "rank", me, new_rank, &r);
        if (grown == 4) SAY("rank %d: grown verified %d on %d ranks\n", me, grown, 4 + THREADS);
      }
      gradsync_comm_free(g);
    }
    gradsync_comm_free(again);
  }
  gradsync_comm_free(n);
  gradsync_comm_free(c);
  gradsync_comm_free(whole);
  SAY("rank %d: done\n", me);
  return NULL;
}

int main(int argc, char** argv) {
  const char* transport = getenv("SHRINK_TRANSPORT");
  g_interleaved = argc > 1 && strcmp(argv[1], "interleaved") == 0;
  g_host_lost = argc > 1 && strcmp(argv[1], "host") == 0;
  g_silent = argc > 1 && strcmp(argv[1], "silent") == 0;
  if (transport != NULL && strcmp(transport, "hier") == 0) g_transport = GRADSYNC_TRANSPORT_HIER;
  const char* world_rank = getenv("OMPI_COMM_WORLD_RANK");
  g_proc = world_rank != NULL ? atoi(world_rank) : 0;
  pthread_t ids[THREADS];
  const int joiner = getenv("GRADSYNC_JOIN") != NULL;
  for (int t = 0; t < THREADS; t++) pthread_create(&ids[t], NULL, joiner ? join : run, (void*)(intptr_t)t);
  for (int t = 0; t < THREADS; t++) pthread_join(ids[t], NULL);
  return 0;
}
