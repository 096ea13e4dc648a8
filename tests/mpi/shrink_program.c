/* SPDX-License-Identifier: Apache-2.0 */
/* gradsync_comm_shrink on the MPI transport under mpirun --enable-recovery, run by run_shrink.py
 * (one host) and tests/multihost/shrink_hosts.py (separate hosts), which check what each rank
 * printed. A rank SIGKILLs itself; the survivors see their collective fail, shrink, and run
 * collectives on the new group whose every result is checked. Modes:
 *   between   rank 1 dies between two calls (after a barrier);
 *   small     rank 1 dies at a random point of a loop of 1-float allreduces (the small path);
 *   large     rank 1 dies while the others wait for it in an allreduce of 256K floats (the large
 *             path), before it enters it;
 *   second    as between, and rank 2 dies while the others agree (it never proposes);
 *   second-random  as between, and rank 2 dies at a random point of its shrink (or just after it,
 *             while the others wait for it in their first call): the survivors shrink again if
 *             needed; a death after rank 2 confirmed (inside create_group) ends the job by the
 *             watchdog's MPI_Abort;
 *   stress S  S rounds of: a random rank other than 0 dies at a random point (between calls, in a
 *             small or a large call); the survivors shrink and check (seed S);
 *   victim V  as between, rank V dies (tests/multihost: a rank of another host);
 *   host      ranks labelled onto two hosts (0, 1 on h0; 2, 3 on h1, by OMPI_COMM_WORLD_RANK), and
 *             both ranks of h1 die between two calls: the survivors, all on h0, shrink into a
 *             shared-memory group;
 *   loop      every rank runs allreduces until one fails, saying "looping" once under way; a host
 *             is killed from outside; then every survivor shrinks (survivors all on one host into
 *             a shared-memory group, survivors on several into one of the transport's own), and
 *             checks its collectives.
 *   embedding every rank pushes into a sharded embedding table (row-wise Adagrad, hash rule) with
 *             one replica of each rank's rows (on the replica ring: on another host); after step
 *             5 and a barrier it says "looping", and ranks 2 and 3 (h1) SIGKILL themselves, their
 *             host then killed from outside; the survivors' next push fails, they shrink (as in
 *             loop) and reshard without a checkpoint, which must take h1's
 *             rows from the replicas at the failed push's step; they push 2 more steps and must
 *             hold, bit for bit, the rows one process computes (tests/capi's scenario); "verified
 *             N" then counts the rows checked.
 *   zero      as embedding, with a ZeRO-1 Adam parameter of ZTOTAL floats (its steps run in hier's
 *             levels) with one replica of each slice instead: the survivors' reshard must take the
 *             lost slices from their replicas, and after 2 more steps every weight must equal, bit
 *             for bit, a one-rank run's (every rank's gradient is the same exact value, so its mean
 *             is too); "verified N" counts the weights checked.
 * Every survivor prints "rank R: shrunk ..." with its new place, the failed ranks and the phases'
 * times, "rank R: verified N" after checking N collectives, and "rank R: done"; a failure prints
 * "rank R: <status> <message>". The process's rank R is its rank in MPI_COMM_WORLD (= member id).
 * With SHRINK_TRANSPORT=hier in the environment the group is on the hierarchical transport; its
 * `large` mode then skips the call check (check_mismatch 0), so that the survivors wait for the
 * victim inside the levels (shm, cross-host MPI) rather than in the check's MPI allreduce. `large V`
 * and `small V` make rank V the victim. SHRINK_TIMEOUT_MS sets the group's timeout (default 5000). */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../capi/embedding_scenario.h"
#include "gradsync/gradsync.h"

static int me = -1;
static int32_t want_transport = GRADSYNC_TRANSPORT_MPI; /* the shrunk group's too */

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static void say(const char* what, int status) {
  printf("rank %d: %s %s %s\n", me, what, gradsync_status_string(status), gradsync_last_error_message());
  fflush(stdout);
}

static void* killer(void* arg) {
  const long us = (long)(intptr_t)arg;
  struct timespec t = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&t, NULL);
  kill(getpid(), SIGKILL);
  return NULL;
}

static void die_after(long us) {
  pthread_t t;
  pthread_create(&t, NULL, killer, (void*)(intptr_t)us);
  pthread_detach(t);
}

static void die_now(void) {
  printf("rank %d: dies\n", me);
  fflush(stdout);
  kill(getpid(), SIGKILL);
}

/* The embedding and zero modes: after step 5, once every rank is past its transfers (a barrier: a
 * death inside MPI's blocking transfer ends the job instead, which the loop mode's kill covers),
 * h1's ranks 2 and 3 go. Returns the barrier's status. */
static int lose_h1_after(int step, gradsync_comm* c) {
  int rc;
  if (step != 5) return GRADSYNC_OK;
  if ((rc = gradsync_comm_barrier(c)) != GRADSYNC_OK) return rc;
  printf("rank %d: looping\n", me);
  fflush(stdout);
  if (me == 2 || me == 3) die_now();
  return GRADSYNC_OK;
}

#define LARGE (256 * 1024)
#define ZTOTAL 100003 /* not a multiple of the ranks: uneven slices */

/* The zero mode's gradient of step s, the same on every rank: multiples of 1/256, so that the mean
 * over any number of ranks is exact. */
static void zero_gradient(int s, float* g) {
  int i;
  for (i = 0; i < ZTOTAL; ++i) g[i] = (float)(((i * 7 + s * 13) % 17) - 8) / 256.0f;
}

/* A ZeRO-1 Adam parameter with `replicas` on c, initialised alike on every rank. */
static gradsync_shard* zero_parameter(gradsync_comm* c, int replicas, float* w) {
  gradsync_shard_options so = GRADSYNC_SHARD_OPTIONS_INIT;
  gradsync_shard* shard = NULL;
  int i, rc;
  so.optimizer = GRADSYNC_OPTIM_ADAM;
  so.lr = 0.01;
  so.replicas = replicas;
  if ((rc = gradsync_shard_create(&shard, c, ZTOTAL, &so)) != GRADSYNC_OK) {
    say("shard create", rc);
    return NULL;
  }
  for (i = 0; i < ZTOTAL; ++i) w[i] = (float)i / ZTOTAL;
  if ((rc = gradsync_shard_init(shard, w, ZTOTAL)) != GRADSYNC_OK) {
    say("shard init", rc);
    gradsync_shard_free(shard);
    return NULL;
  }
  return shard;
}

/* The weights of a one-rank run of `steps` steps. */
static int zero_reference(int steps, float* w) {
  static float g[ZTOTAL];
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm* c = NULL;
  gradsync_shard* shard = NULL;
  int s, rc = GRADSYNC_OK;
  o.rank = 0;
  o.size = 1;
  snprintf(o.name, sizeof o.name, "shrink-zero-ref-%d", me);
  if ((rc = gradsync_comm_create(&c, &o)) != GRADSYNC_OK) return rc;
  shard = zero_parameter(c, 0, w);
  for (s = 0; shard != NULL && s < steps && rc == GRADSYNC_OK; ++s) {
    zero_gradient(s, g);
    rc = gradsync_shard_step(shard, g, w, ZTOTAL, 1);
  }
  if (shard == NULL) rc = GRADSYNC_E_INTERNAL;
  gradsync_shard_free(shard);
  gradsync_comm_free(c);
  return rc;
}
static float big[LARGE];
#define HUGE_CALL (4 * 1024 * 1024) /* transfer: a call whose blocking transfer takes most of its time */
static float huge[HUGE_CALL];

/* Checked collectives on c, whose members are the old ranks in `alive` (ascending): returns the
 * status of the first that failed, after checking every result bit for bit. */
static int verify(gradsync_comm* c, const int* alive, int n, int rounds) {
  int32_t rank = -1, size = -1;
  int64_t id = -1;
  int i, k, rc;
  gradsync_comm_rank(c, &rank);
  gradsync_comm_size(c, &size);
  int32_t transport = -1;
  gradsync_comm_member_id(c, &id);
  gradsync_comm_transport(c, &transport);
  if (size != n || id != me || alive[rank] != me || transport != want_transport) {
    printf("rank %d: WRONG group: rank %d size %d member id %lld transport %d (expected size %d, transport %d)\n", me,
           (int)rank, (int)size, (long long)id, (int)transport, n, (int)want_transport);
    return GRADSYNC_E_INTERNAL;
  }
  for (k = 0; k < rounds; ++k) {
    float one = (float)(me + 1 + k), sum = 0;
    float gathered[64];
    float root_data[4] = {0, 0, 0, 0};
    for (i = 0; i < n; ++i) sum += (float)(alive[i] + 1 + k);
    if ((rc = gradsync_comm_allreduce(c, &one, &one, 1, GRADSYNC_F32, GRADSYNC_SUM)) != GRADSYNC_OK) return rc;
    if (one != sum) {
      printf("rank %d: WRONG small allreduce %g, expected %g\n", me, one, sum);
      return GRADSYNC_E_INTERNAL;
    }
    for (i = 0; i < LARGE; ++i) big[i] = (float)((me + 1) * (i % 97 + k));
    if ((rc = gradsync_comm_allreduce(c, big, big, LARGE, GRADSYNC_F32, GRADSYNC_SUM)) != GRADSYNC_OK) return rc;
    for (i = 0; i < LARGE; ++i) {
      float want = 0;
      int j;
      for (j = 0; j < n; ++j) want += (float)((alive[j] + 1) * (i % 97 + k));
      if (big[i] != want) {
        printf("rank %d: WRONG large allreduce at %d: %g, expected %g\n", me, i, big[i], want);
        return GRADSYNC_E_INTERNAL;
      }
    }
    if (rank == n - 1)
      for (i = 0; i < 4; ++i) root_data[i] = (float)(me * 10 + i + k);
    if ((rc = gradsync_comm_broadcast(c, root_data, 4, GRADSYNC_F32, n - 1)) != GRADSYNC_OK) return rc;
    for (i = 0; i < 4; ++i)
      if (root_data[i] != (float)(alive[n - 1] * 10 + i + k)) {
        printf("rank %d: WRONG broadcast\n", me);
        return GRADSYNC_E_INTERNAL;
      }
    one = (float)(me * 100 + k);
    if ((rc = gradsync_comm_allgather(c, &one, gathered, (size_t)n, GRADSYNC_F32)) != GRADSYNC_OK) return rc;
    for (i = 0; i < n; ++i)
      if (gathered[i] != (float)(alive[i] * 100 + k)) {
        printf("rank %d: WRONG allgather\n", me);
        return GRADSYNC_E_INTERNAL;
      }
  }
  return GRADSYNC_OK;
}

/* Shrinks *c (after a failure), prints the outcome, updates alive/n to the survivors. */
static int shrink(gradsync_comm** c, int* alive, int* n, double failed_at) {
  int32_t failed[64];
  gradsync_shrink_result r;
  gradsync_comm* next = NULL;
  int i, j, kept = 0, rc;
  const double start = now_us();
  char list[256] = "";
  int32_t hosts[64], num_hosts = 0, one_host = 1, first = -1;
  memset(&r, 0, sizeof r);
  gradsync_comm_topology(*c, NULL, NULL, NULL, &num_hosts, hosts, 64);
  r.struct_size = sizeof r;
  r.version = GRADSYNC_SHRINK_RESULT_VERSION;
  rc = gradsync_comm_shrink(*c, &next, failed, 64, &r);
  if (rc != GRADSYNC_OK) {
    say("shrink", rc);
    return rc;
  }
  for (i = 0; i < r.failed_count; ++i)
    snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d", i ? "," : "", alive[failed[i]]);
  for (i = 0, j = 0; i < *n; ++i) {
    if (j < r.failed_count && failed[j] == i) {
      ++j;
      continue;
    }
    if (first < 0) first = hosts[i];
    one_host &= hosts[i] == first;
    alive[kept++] = alive[i];
  }
  *n = kept;
  /* A whole host lost, and every survivor on one host: a shared-memory group (comm.h). */
  if (num_hosts > 1 && one_host) want_transport = GRADSYNC_TRANSPORT_SHM;
  printf("rank %d: shrunk failed [%s] size %d attempts %d detect_us %.0f shrink_us %.0f agree_us %.0f form_us %.0f\n",
         me, list, kept, (int)r.attempts, start - failed_at, now_us() - start, (double)r.agree_ns / 1e3,
         (double)r.form_ns / 1e3);
  fflush(stdout);
  gradsync_comm_free(*c);
  *c = next;
  return GRADSYNC_OK;
}

/* Verified collectives on c, shrinking again (at most `more` times) when a member is lost. */
static int survive(gradsync_comm** c, int* alive, int* n, int more) {
  for (;;) {
    const double t = now_us();
    const int rc = verify(*c, alive, *n, 3);
    if (rc == GRADSYNC_OK) {
      printf("rank %d: verified %d on %d ranks\n", me, 3 * 4, *n);
      fflush(stdout);
      return rc;
    }
    say("verify", rc);
    if (rc == GRADSYNC_E_INTERNAL || more-- <= 0) return rc;
    if (shrink(c, alive, n, t) != GRADSYNC_OK) return GRADSYNC_E_REMOTE;
  }
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm* c = NULL;
  int alive[64], n = 0, i, rc, victim = 1;
  float x = 1.0f;
  double t = 0;
  const char* transport = getenv("SHRINK_TRANSPORT");
  const int hier = transport != NULL && strcmp(transport, "hier") == 0;
  want_transport = o.transport = hier ? GRADSYNC_TRANSPORT_HIER : GRADSYNC_TRANSPORT_MPI;
  o.timeout_ms = getenv("SHRINK_TIMEOUT_MS") != NULL ? atoi(getenv("SHRINK_TIMEOUT_MS")) : 5000;
  if (hier && strcmp(mode, "large") == 0) o.check_mismatch = 0;
  snprintf(o.name, sizeof o.name, "shrink-%s", mode);
  if (strcmp(mode, "host") == 0) {
    const char* world_rank = getenv("OMPI_COMM_WORLD_RANK");
    snprintf(o.host, sizeof o.host, "h%d", world_rank != NULL && atoi(world_rank) >= 2);
  }
  if ((rc = gradsync_comm_create(&c, &o)) != GRADSYNC_OK) {
    say("create", rc);
    return 1;
  }
  {
    int32_t r, s;
    gradsync_comm_rank(c, &r);
    gradsync_comm_size(c, &s);
    me = r;
    n = s;
    for (i = 0; i < n; ++i) alive[i] = i;
  }
  srand((unsigned)(time(NULL) ^ (me * 7919)));
  if ((strcmp(mode, "victim") == 0 || strcmp(mode, "large") == 0 || strcmp(mode, "small") == 0 ||
       strcmp(mode, "transfer") == 0) &&
      argc > 2)
    victim = atoi(argv[2]);
  if (strcmp(mode, "stress") == 0) {
    const unsigned seed = argc > 2 ? (unsigned)atoi(argv[2]) : 1u;
    int round;
    /* Every rank draws the same sequence: who dies, and how. */
    srand(seed);
    for (round = 0; n > 2; ++round) {
      const int who = alive[1 + rand() % (n - 1)], how = rand() % 3;
      const long delay = 1000 + rand() % 100000;
      int k;
      if (me == who) {
        if (how == 0) {
          gradsync_comm_barrier(c);
          die_now();
        }
        if (how == 1) die_after(delay);
      }
      t = now_us();
      for (k = 0;; ++k) {
        if (how == 2 && k == 3 && me == who) {
          die_after(20000);
          sleep(5);
        }
        if (how == 0 && k == 0) {
          if ((rc = gradsync_comm_barrier(c)) != GRADSYNC_OK) break;
          t = now_us();
        }
        x = (float)me;
        rc = how == 2 ? gradsync_comm_allreduce(c, big, big, LARGE, GRADSYNC_F32, GRADSYNC_SUM)
                      : gradsync_comm_allreduce(c, &x, &x, 1, GRADSYNC_F32, GRADSYNC_SUM);
        if (rc != GRADSYNC_OK) break;
        t = now_us();
      }
      say("call", rc);
      if (shrink(&c, alive, &n, t) != GRADSYNC_OK) return 1;
      if (survive(&c, alive, &n, 0) != GRADSYNC_OK) return 1;
      printf("rank %d: round %d lost rank %d (how %d)\n", me, round, who, how);
    }
  } else if (strcmp(mode, "embedding") == 0) {
    static snapshot ref;
    static int64_t ids[GLOBAL];
    static float grads[GLOBAL * DIM];
    gradsync_embedding_options eo = table_options(GRADSYNC_OPTIM_ROW_ADAGRAD, GRADSYNC_EMBEDDING_HASH);
    gradsync_embedding* table = NULL;
    int32_t r = -1, restored = -1;
    int64_t steps = -1, local = 0;
    int lo, hi, step;
    eo.replicas = 1;
    if ((rc = gradsync_embedding_create(&table, c, NULL, &eo)) != GRADSYNC_OK) {
      say("create", rc);
      return 1;
    }
    for (step = 0;; ++step) {
      t = now_us();
      global_batch(step, ids, grads);
      slice_of(step, me, n, &lo, &hi);
      rc = gradsync_embedding_push(table, ids + lo, (size_t)(hi - lo), grads + lo * DIM, (size_t)(hi - lo) * DIM);
      if (rc != GRADSYNC_OK) break;
      if ((rc = lose_h1_after(step, c)) != GRADSYNC_OK) break;
    }
    say("call", rc);
    if (shrink(&c, alive, &n, t) != GRADSYNC_OK) return 1;
    if ((rc = gradsync_embedding_reshard(table, c, GRADSYNC_EMBEDDING_KEEP_SHARDING, NULL, NULL, &restored)) !=
        GRADSYNC_OK) {
      say("reshard", rc);
      return 1;
    }
    gradsync_embedding_steps(table, &steps);
    if (restored != 0 || steps != step) {
      printf("rank %d: WRONG reshard: restored %d, at step %lld, the failed push was step %d\n", me, (int)restored,
             (long long)steps, step);
      return 1;
    }
    gradsync_comm_rank(c, &r);
    train(table, r, n, step, step + 2);
    reference(GRADSYNC_OPTIM_ROW_ADAGRAD, step + 2, 0, &ref);
    if (check_failures != 0 || compare_local(table, &ref, GRADSYNC_OPTIM_ROW_ADAGRAD, "after the host loss") != 0) {
      printf("rank %d: WRONG rows after the host loss and the reshard from replicas\n", me);
      return 1;
    }
    gradsync_embedding_shape(table, NULL, NULL, &local);
    printf("rank %d: verified %lld on %d ranks\n", me, (long long)local, n);
    fflush(stdout);
    gradsync_embedding_free(table);
  } else if (strcmp(mode, "zero") == 0) {
    static float w[ZTOTAL], g[ZTOTAL], ref[ZTOTAL];
    gradsync_shard* shard = zero_parameter(c, 1, w);
    int64_t updates = -1;
    int step, differ = 0, end;
    if (shard == NULL) return 1;
    for (step = 0;; ++step) {
      t = now_us();
      zero_gradient(step, g);
      if ((rc = gradsync_shard_step(shard, g, w, ZTOTAL, 1)) != GRADSYNC_OK) break;
      if ((rc = lose_h1_after(step, c)) != GRADSYNC_OK) break;
    }
    say("call", rc);
    if (shrink(&c, alive, &n, t) != GRADSYNC_OK) return 1;
    if ((rc = gradsync_shard_reshard(shard, c, NULL)) != GRADSYNC_OK) {
      say("reshard", rc);
      return 1;
    }
    gradsync_shard_updates(shard, &updates);
    if (updates != step) {
      printf("rank %d: WRONG reshard: %lld updates, the failed step was step %d\n", me, (long long)updates, step);
      return 1;
    }
    for (end = step + 2; step < end; ++step) {
      zero_gradient(step, g);
      if ((rc = gradsync_shard_step(shard, g, w, ZTOTAL, 1)) != GRADSYNC_OK) {
        say("step after the reshard", rc);
        return 1;
      }
    }
    if ((rc = zero_reference(end, ref)) != GRADSYNC_OK) {
      say("reference", rc);
      return 1;
    }
    for (i = 0; i < ZTOTAL; ++i) differ += memcmp(&w[i], &ref[i], sizeof(float)) != 0;
    if (differ != 0) {
      printf("rank %d: WRONG weights after the host loss and the reshard from replicas: %d of %d differ\n", me, differ,
             ZTOTAL);
      return 1;
    }
    printf("rank %d: verified %d on %d ranks\n", me, ZTOTAL, n);
    fflush(stdout);
    gradsync_shard_free(shard);
  } else if (strcmp(mode, "loop") == 0) {
    for (i = 0;; ++i) {
      t = now_us();
      if ((rc = gradsync_comm_allreduce(c, &x, &x, 1, GRADSYNC_F32, GRADSYNC_SUM)) != GRADSYNC_OK) break;
      x = 1.0f;
      if (i == 10) {
        printf("rank %d: looping\n", me);
        fflush(stdout);
      }
    }
    say("call", rc);
    if (shrink(&c, alive, &n, t) != GRADSYNC_OK) return 1;
    if (survive(&c, alive, &n, 0) != GRADSYNC_OK) return 1;
  } else {
    const int large = strcmp(mode, "large") == 0, small = strcmp(mode, "small") == 0;
    const int host = strcmp(mode, "host") == 0;
    /* transfer: killed at a random point of a loop of large calls, most often inside MPI's
     * blocking transfer, which nothing can interrupt: the job must end rather than hang. */
    const int transfer = strcmp(mode, "transfer") == 0;
    if (!large && !small && !host && !transfer && strcmp(mode, "between") && strcmp(mode, "second") &&
        strcmp(mode, "second-random") && strcmp(mode, "victim")) {
      fprintf(stderr, "usage: %s between|small|large|second|victim V|host|transfer|stress SEED|loop|embedding|zero\n",
              argv[0]);
      return 2;
    }
    if (gradsync_comm_barrier(c) != GRADSYNC_OK) return 1;
    if (me == victim) {
      if (small) die_after(20000 + rand() % 200000);
      if (large) die_after(150000);
      if (transfer) die_after(50000 + rand() % 250000);
    }
    t = now_us();
    for (i = 0;; ++i) {
      if (!small && !large && i == 3 && (host ? me >= 2 : me == victim)) die_now();
      if (large && me == victim) sleep(5); /* killed while the others wait for it in the call */
      x = 1.0f;
      rc = large      ? gradsync_comm_allreduce(c, big, big, LARGE, GRADSYNC_F32, GRADSYNC_SUM)
           : transfer ? gradsync_comm_allreduce(c, huge, huge, HUGE_CALL, GRADSYNC_F32, GRADSYNC_SUM)
                      : gradsync_comm_allreduce(c, &x, &x, 1, GRADSYNC_F32, GRADSYNC_SUM);
      if (rc != GRADSYNC_OK) break;
      if (!large && !transfer && x != (float)n) {
        printf("rank %d: WRONG allreduce before the death\n", me);
        return 1;
      }
      t = now_us();
    }
    say("call", rc);
    if (me == 2 && strcmp(mode, "second") == 0) {
      die_after(20000); /* while the others agree, waiting for its proposal */
      sleep(5);
    }
    if (me == 2 && strcmp(mode, "second-random") == 0) die_after(rand() % 8000);
    if (shrink(&c, alive, &n, t) != GRADSYNC_OK) return 1;
    /* Its shrink done first: it dies while the others wait for it in their first (small) call, never
     * inside MPI's blocking transfer of a large one (which nothing ends: docs/mpi.md). */
    if (me == 2 && strcmp(mode, "second-random") == 0) sleep(5);
    if (survive(&c, alive, &n, strcmp(mode, "second-random") == 0 ? 1 : 0) != GRADSYNC_OK) return 1;
  }
  gradsync_comm_free(c);
  printf("rank %d: done\n", me);
  fflush(stdout);
  return 0;
}
