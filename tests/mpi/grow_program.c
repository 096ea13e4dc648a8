/* SPDX-License-Identifier: Apache-2.0 */
/* gradsync_comm_grow and gradsync_comm_join on the MPI and hierarchical transports, under mpirun
 * (--enable-recovery where a rank dies), run by tests/multihost/grow_hosts.py, which checks what
 * each rank printed.
 *
 *   grow_program MODE TRANSPORT TIMEOUT_MS    (TRANSPORT mpi|hier)
 *
 * MODE:
 *   plain       the group grows by 2 with nobody lost;
 *   after-loss  the last rank SIGKILLs itself between two calls; the others' next call fails, they
 *               shrink, and grow by 1: the joiner takes the lost rank's place, with a new member id;
 *   host-lost   every rank of the last rank's host dies (its daemon lives on), a whole host: the
 *               survivors shrink (on several hosts: an MPI group; on one: a shared-memory group),
 *               and their grow must be refused (E_UNSUPPORTED) on every one of them, after which
 *               their group still works;
 *   mismatch    the group grows by 1, and the joiner joins by another name than it was started for:
 *               every rank (the joiner too) fails with E_MISMATCH, and the members' group still works;
 *   stress      (a 4th argument: SEED; a 5th: THREADS, default 1; a 6th: OUTDIR, where each
 *               process then writes its lines to a file of its own) ROUNDS rounds of: a random
 *               process dies, between calls or at a random point of a loop of 1-float allreduces
 *               (each result checked); the others shrink and grow back by one process, and check
 *               the grown group. With THREADS > 1 every process runs that many threads as ranks
 *               (comm.h), each with its own communicator and lines, and a process's death takes all
 *               of its threads' ranks. Every thread draws the same sequence; a joiner of round k
 *               starts drawing at round k + 1 (it knows k from its member id), and may be a later
 *               round's victim. Where the losses empty a host, the survivors (on one host: a
 *               shared-memory group) have their grow refused (E_UNSUPPORTED) and end there
 *               ("member I: round K refused"). Lines begin "member I" (the rank's member id):
 *               "member I: round K shrunk failed [V] count THREADS", "member I round K: verified 4
 *               on N ranks", "member I: done".
 * The members' grow spawns this program again with GRADSYNC_JOIN set: it then joins instead of
 * creating (and takes the mode and transport from its arguments, as spawned). On the grown group
 * every rank checks its rank and member id, a broadcast from rank 0, and allreduces whose every
 * element is known (the members' ids summed: 64K doubles, which run in hier's levels, and one
 * float), prints "rank R: grown N ranks id I" and "rank R: verified N on M ranks", then
 * "rank R: done". R is the rank in the group the process first had (a joiner: "joiner J").
 * Failures print "rank R: <what> <status> <message>"; a wrong value prints WRONG. */
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

#define LARGE (64 * 1024)
#define PARAMS 1000
#define ROUNDS 3
#define MAX_THREADS 8

static _Thread_local char who[32] = "?";
static int g_threads = 1;           /* threads as ranks per process (stress) */
static pthread_barrier_t g_printed; /* g_threads > 1: the threads of a dying process have said so */

static void say(const char* what, int status) {
  printf("%s: %s %s %s\n", who, what, gradsync_status_string(status), gradsync_last_error_message());
  fflush(stdout);
}

static int32_t transport_of(const char* name) {
  return strcmp(name, "hier") == 0 ? GRADSYNC_TRANSPORT_HIER : GRADSYNC_TRANSPORT_MPI;
}

/* The checks on the grown group g: expect_rank and expect_id are this rank's; big holds LARGE. */
static int check_grown_in(gradsync_comm* g, int expect_size, int expect_rank, int64_t expect_id, double* big) {
  int32_t size = -1, rank = -1;
  int64_t id = -1, ids[1024], sum = 0;
  float params[PARAMS], one = 1.0f;
  int i, rc, checked = 0;
  gradsync_comm_size(g, &size);
  gradsync_comm_rank(g, &rank);
  gradsync_comm_member_id(g, &id);
  if (size != expect_size || rank != expect_rank || id != expect_id) {
    printf("%s: WRONG grown group: size %d rank %d id %lld, expected %d, %d, %lld\n", who, size, rank, (long long)id,
           expect_size, expect_rank, (long long)expect_id);
    return 1;
  }
  printf("%s: grown %d ranks id %lld\n", who, size, (long long)id);
  for (i = 0; i < PARAMS; ++i) params[i] = rank == 0 ? (float)i * 0.5f : -1.0f;
  if ((rc = gradsync_comm_broadcast(g, params, PARAMS, GRADSYNC_F32, 0)) != GRADSYNC_OK) {
    say("broadcast", rc);
    return 1;
  }
  for (i = 0; i < PARAMS; ++i) {
    if (params[i] != (float)i * 0.5f) {
      printf("%s: WRONG broadcast at %d: %g\n", who, i, params[i]);
      return 1;
    }
  }
  ++checked;
  if ((rc = gradsync_comm_allgather(g, &id, ids, (size_t)size, GRADSYNC_I64)) != GRADSYNC_OK) {
    say("allgather", rc);
    return 1;
  }
  for (i = 0; i < size; ++i) sum += ids[i];
  ++checked;
  for (i = 0; i < LARGE; ++i) big[i] = (double)id + (double)(i % 7);
  if ((rc = gradsync_comm_allreduce(g, big, big, LARGE, GRADSYNC_F64, GRADSYNC_SUM)) != GRADSYNC_OK) {
    say("allreduce", rc);
    return 1;
  }
  for (i = 0; i < LARGE; ++i) {
    if (big[i] != (double)sum + (double)size * (double)(i % 7)) {
      printf("%s: WRONG allreduce at %d: %g\n", who, i, big[i]);
      return 1;
    }
  }
  ++checked;
  if ((rc = gradsync_comm_allreduce(g, &one, &one, 1, GRADSYNC_F32, GRADSYNC_SUM)) != GRADSYNC_OK ||
      one != (float)size) {
    if (rc == GRADSYNC_OK) printf("%s: WRONG 1-float allreduce: %g\n", who, one);
    say("small allreduce", rc);
    return 1;
  }
  ++checked;
  printf("%s: verified %d on %d ranks\n", who, checked, size);
  fflush(stdout);
  return 0;
}

static int check_grown(gradsync_comm* g, int expect_size, int expect_rank, int64_t expect_id) {
  double* big = malloc(LARGE * sizeof *big); /* one per thread */
  int rc;
  if (big == NULL) return 1;
  rc = check_grown_in(g, expect_size, expect_rank, expect_id, big);
  free(big);
  return rc;
}

/* The survivors' group in place of *c (freed); failed and s filled. */
static int shrink(gradsync_comm** c, int32_t* failed, gradsync_shrink_result* s) {
  gradsync_comm* shrunk = NULL;
  int rc;
  memset(s, 0, sizeof *s);
  s->struct_size = sizeof *s;
  s->version = GRADSYNC_SHRINK_RESULT_VERSION;
  if ((rc = gradsync_comm_shrink(*c, &shrunk, failed, 64, s)) != GRADSYNC_OK) {
    say("shrink", rc);
    return rc;
  }
  gradsync_comm_free(*c);
  *c = shrunk;
  return GRADSYNC_OK;
}

static void* killer(void* arg) {
  const long us = (long)(intptr_t)arg;
  struct timespec t;
  t.tv_sec = us / 1000000;
  t.tv_nsec = (us % 1000000) * 1000;
  nanosleep(&t, NULL);
  kill(getpid(), SIGKILL);
  return NULL;
}

/* The stress rounds from round `first` on, over c (freed at the end). A process's threads hold
 * consecutive ranks (a group's processes keep their order through shrinks, and a joiner's threads
 * come last), so rank / g_threads is the process. */
static int stress(gradsync_comm* c, unsigned seed, int first) {
  int32_t n = -1, rank = -1;
  int64_t id = -1;
  int k, rc;
  unsigned draws = seed; /* every thread draws the same sequence */
  gradsync_comm_size(c, &n);
  gradsync_comm_member_id(c, &id);
  snprintf(who, sizeof who, "member %lld", (long long)id);
  for (k = 0; k < 3 * first; ++k) (void)rand_r(&draws); /* the rounds before this process's first */
  for (k = first; k < ROUNDS; ++k) {
    /* Process 0 too: a former joiner may become rank 0. */
    const int victim = rand_r(&draws) % (n / g_threads), how = rand_r(&draws) % 2;
    const long delay = 1000 + rand_r(&draws) % 50000;
    gradsync_comm* g = NULL;
    gradsync_shrink_result s;
    gradsync_grow_result r;
    int32_t failed[64];
    float x = 1.0f;
    char name[64];
    gradsync_comm_rank(c, &rank);
    if ((rc = gradsync_comm_barrier(c)) != GRADSYNC_OK) {
      say("barrier", rc);
      return 1;
    }
    if (rank / g_threads == victim) {
      printf("%s: round %d dies\n", who, k);
      fflush(stdout);
      if (g_threads > 1) pthread_barrier_wait(&g_printed); /* every thread's line out before the kill */
      if (rank % g_threads == 0) {                         /* the process's first thread kills it */
        pthread_t t;
        if (how == 0) kill(getpid(), SIGKILL);
        pthread_create(&t, NULL, killer, (void*)(intptr_t)delay);
      }
    }
    while ((rc = gradsync_comm_allreduce(c, &x, &x, 1, GRADSYNC_F32, GRADSYNC_SUM)) == GRADSYNC_OK) {
      if (x != (float)n) {
        printf("%s: WRONG allreduce in round %d: %g\n", who, k, x);
        return 1;
      }
      x = 1.0f;
    }
    printf("%s: round %d ended in %s %s\n", who, k, gradsync_status_string(rc), gradsync_last_error_message());
    if (shrink(&c, failed, &s) != GRADSYNC_OK) return 1;
    printf("%s: round %d shrunk failed [%d] count %d\n", who, k, failed[0], s.failed_count);
    if (s.failed_count > g_threads) {
      /* Open MPI 4.1 ended a process with the victim (a joiner of an earlier round, whose TCP
       * connection to it broke with a send pending: tests/multihost/shrink_hosts.py, COLLATERAL):
       * the survivors shrank by all of them. They check their group and finish, as after a
       * refused grow. */
      x = 1.0f;
      if ((rc = gradsync_comm_allreduce(c, &x, &x, 1, GRADSYNC_F32, GRADSYNC_SUM)) != GRADSYNC_OK ||
          x != (float)(n - s.failed_count)) {
        printf("%s: WRONG: the survivors' group does not work after a collateral loss (%g)\n", who, x);
        return 1;
      }
      printf("%s: round %d collateral, verified 1 on %d ranks\n", who, k, n - s.failed_count);
      break;
    }
    memset(&r, 0, sizeof r);
    r.struct_size = sizeof r;
    r.version = GRADSYNC_GROW_RESULT_VERSION;
    snprintf(name, sizeof name, "stress-%u-%d", seed, k);
    gradsync_comm_rank(c, &rank);
    if ((rc = gradsync_comm_grow(c, name, 1, &g, &r)) == GRADSYNC_E_UNSUPPORTED) {
      /* The losses emptied a host (the survivors, all on one host, formed a shared-memory group):
       * the grow is refused, and the survivors go on. */
      say("grow", rc);
      x = 1.0f;
      if ((rc = gradsync_comm_allreduce(c, &x, &x, 1, GRADSYNC_F32, GRADSYNC_SUM)) != GRADSYNC_OK ||
          x != (float)(n - g_threads)) {
        printf("%s: WRONG: the survivors' group does not work after the refusal (%g)\n", who, x);
        return 1;
      }
      printf("%s: round %d refused, verified 1 on %d ranks\n", who, k, n - g_threads);
      break;
    }
    if (rc != GRADSYNC_OK) {
      say("grow", rc);
      return 1;
    }
    gradsync_comm_free(c);
    c = g;
    snprintf(who, sizeof who, "member %lld round %d", (long long)id, k);
    if (check_grown(c, n, rank, id) != 0) return 1;
    snprintf(who, sizeof who, "member %lld", (long long)id);
  }
  gradsync_comm_free(c);
  printf("%s: done\n", who);
  fflush(stdout);
  return 0;
}

/* thread: the joiner's thread (threads as ranks: j is then the process's index times g_threads
 * plus the thread's). */
static int joiner(const char* join_name, int32_t transport, const char* seed, int mismatch, int thread) {
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm* g = NULL;
  gradsync_grow_result r;
  const char* index = getenv("OMPI_COMM_WORLD_RANK"); /* in the spawned job: the joiner's index */
  int rc, j = (index != NULL ? atoi(index) : 0) * g_threads + thread;
  snprintf(who, sizeof who, "joiner %d", j);
  memset(&r, 0, sizeof r);
  r.struct_size = sizeof r;
  r.version = GRADSYNC_GROW_RESULT_VERSION;
  o.transport = transport;
  if (g_threads > 1) {
    o.threads = g_threads;
    o.thread = thread;
  }
  snprintf(o.name, sizeof o.name, "%s%s", mismatch ? "not-" : "", join_name);
  if ((rc = gradsync_comm_join(&g, &o, &r)) != GRADSYNC_OK) {
    say("join", rc);
    if (mismatch && rc == GRADSYNC_E_MISMATCH) {
      printf("%s: done\n", who);
      return 0;
    }
    return 1;
  }
  printf("%s: joined old_size %d new_size %d first_id %lld agree_us %lld form_us %lld\n", who, r.old_size, r.new_size,
         (long long)r.first_member_id, (long long)(r.agree_ns / 1000), (long long)(r.form_ns / 1000));
  /* A stress joiner of round k (one process a round, member ids from new_size) goes on at k + 1. */
  const int round = (int)(r.first_member_id - r.new_size) / g_threads;
  if (seed != NULL) snprintf(who, sizeof who, "member %lld round %d", (long long)(r.first_member_id + j), round);
  rc = check_grown(g, r.new_size, r.old_size + j, r.first_member_id + j);
  if (rc == 0 && seed != NULL) return stress(g, (unsigned)atoi(seed), round + 1);
  gradsync_comm_free(g);
  if (rc == 0) printf("%s: done\n", who);
  fflush(stdout);
  return rc;
}

/* A member's grow by `joiners` from c, then the checks; frees c on success. */
static int grow(gradsync_comm** c, int joiners, const char* name) {
  gradsync_grow_result r;
  gradsync_comm* g = NULL;
  int32_t rank = -1;
  int64_t id = -1;
  int rc;
  memset(&r, 0, sizeof r);
  r.struct_size = sizeof r;
  r.version = GRADSYNC_GROW_RESULT_VERSION;
  gradsync_comm_rank(*c, &rank);
  gradsync_comm_member_id(*c, &id);
  if ((rc = gradsync_comm_grow(*c, name, joiners, &g, &r)) != GRADSYNC_OK) {
    say("grow", rc);
    return rc;
  }
  printf("%s: grew old_size %d new_size %d first_id %lld agree_us %lld form_us %lld\n", who, r.old_size, r.new_size,
         (long long)r.first_member_id, (long long)(r.agree_ns / 1000), (long long)(r.form_ns / 1000));
  gradsync_comm_free(*c);
  *c = g;
  return check_grown(g, r.new_size, rank, id);
}

/* Threads as ranks (stress with THREADS > 1): each thread a rank of its own, or a joiner's. */
struct thread_run {
  int t;
  char** argv;
  const char* join_name;
  int rc;
};

static void* thread_main(void* arg) {
  struct thread_run* run = arg;
  char** argv = run->argv;
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm* c = NULL;
  int rc;
  if (run->join_name != NULL) {
    run->rc = joiner(run->join_name, transport_of(argv[2]), argv[4], 0, run->t);
    return NULL;
  }
  o.transport = transport_of(argv[2]);
  o.timeout_ms = atoi(argv[3]);
  o.threads = g_threads;
  o.thread = run->t;
  if ((rc = gradsync_comm_create(&c, &o)) != GRADSYNC_OK) {
    say("create", rc);
    run->rc = 1;
    return NULL;
  }
  run->rc = stress(c, (unsigned)atoi(argv[4]), 0);
  return NULL;
}

static int run_threads(char** argv, const char* join_name) {
  pthread_t threads[MAX_THREADS];
  struct thread_run runs[MAX_THREADS];
  int t, rc = 0;
  if (pthread_barrier_init(&g_printed, NULL, (unsigned)g_threads) != 0) return 1;
  for (t = 0; t < g_threads; ++t) {
    runs[t].t = t;
    runs[t].argv = argv;
    runs[t].join_name = join_name;
    runs[t].rc = 1;
    if (pthread_create(&threads[t], NULL, thread_main, &runs[t]) != 0) return 1;
  }
  for (t = 0; t < g_threads; ++t) {
    pthread_join(threads[t], NULL);
    rc |= runs[t].rc;
  }
  return rc;
}

int main(int argc, char** argv) {
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm* c = NULL;
  const char* mode = argc > 1 ? argv[1] : "";
  const char* join_name = getenv("GRADSYNC_JOIN");
  int32_t rank = -1, size = -1;
  int rc;
  float x = 1.0f;
  const int stressed = strcmp(mode, "stress") == 0, mismatch = strcmp(mode, "mismatch") == 0;
  if (argc < 4 + stressed ||
      (strcmp(mode, "plain") && strcmp(mode, "after-loss") && strcmp(mode, "host-lost") && !stressed && !mismatch)) {
    fprintf(stderr,
            "usage: %s plain|after-loss|host-lost|mismatch|stress mpi|hier TIMEOUT_MS [SEED [THREADS [OUTDIR]]]\n",
            argv[0]);
    return 2;
  }
  if (stressed && argc > 5) g_threads = atoi(argv[5]);
  if (g_threads < 1 || g_threads > MAX_THREADS) {
    fprintf(stderr, "%s: THREADS must be 1 to %d\n", argv[0], MAX_THREADS);
    return 2;
  }
  if (stressed && argc > 6) {
    /* OUTDIR: this process's lines go to a file of its own there, each written out as it ends, which
     * mpirun's forwarding of output cannot lose when it tears a job down. */
    char path[4096];
    int fd;
    snprintf(path, sizeof path, "%s/lines-XXXXXX", argv[6]); /* hosts' PID namespaces repeat pids */
    if ((fd = mkstemp(path)) < 0 || close(fd) != 0 || freopen(path, "w", stdout) == NULL) {
      perror(path);
      return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
  }
  if (g_threads > 1) return run_threads(argv, join_name);
  if (join_name != NULL) return joiner(join_name, transport_of(argv[2]), stressed ? argv[4] : NULL, mismatch, 0);
  o.transport = transport_of(argv[2]);
  o.timeout_ms = atoi(argv[3]);
  if ((rc = gradsync_comm_create(&c, &o)) != GRADSYNC_OK) {
    say("create", rc);
    return 1;
  }
  gradsync_comm_rank(c, &rank);
  gradsync_comm_size(c, &size);
  snprintf(who, sizeof who, "rank %d", rank);
  if (stressed) return stress(c, (unsigned)atoi(argv[4]), 0);
  if (strcmp(mode, "plain") == 0) {
    if (grow(&c, 2, "grow-plain") != GRADSYNC_OK) return 1;
  } else if (mismatch) {
    if ((rc = grow(&c, 1, "grow-mismatch")) != GRADSYNC_E_MISMATCH) {
      printf("%s: WRONG: a grow whose joiner came by another name gave %s\n", who, gradsync_status_string(rc));
      return 1;
    }
    if ((rc = gradsync_comm_allreduce(c, &x, &x, 1, GRADSYNC_F32, GRADSYNC_SUM)) != GRADSYNC_OK || x != (float)size) {
      printf("%s: WRONG: the group does not work after the failed grow (%g)\n", who, x);
      say("allreduce", rc);
      return 1;
    }
    printf("%s: verified 1 on %d ranks\n", who, size);
  } else {
    gradsync_shrink_result s;
    int32_t failed[64];
    if ((rc = gradsync_comm_barrier(c)) != GRADSYNC_OK) {
      say("barrier", rc);
      return 1;
    }
    int32_t hosts[1024], victims = 1, i;
    if (strcmp(mode, "host-lost") == 0 &&
        (rc = gradsync_comm_topology(c, NULL, NULL, NULL, NULL, hosts, (size_t)size)) == GRADSYNC_OK) {
      for (victims = 0, i = 0; i < size; ++i) victims += hosts[i] == hosts[size - 1];
    }
    if (rank >= size - victims) { /* ranks are numbered host by host: the last host's */
      printf("%s: dies\n", who);
      fflush(stdout);
      kill(getpid(), SIGKILL);
    }
    while ((rc = gradsync_comm_allreduce(c, &x, &x, 1, GRADSYNC_F32, GRADSYNC_SUM)) == GRADSYNC_OK) x = 1.0f;
    say("call", rc);
    if (shrink(&c, failed, &s) != GRADSYNC_OK) return 1;
    printf("%s: shrunk failed %d (from rank %d) size %d\n", who, s.failed_count, failed[0], size - s.failed_count);
    if (strcmp(mode, "after-loss") == 0) {
      if (grow(&c, 1, "grow-after-loss") != GRADSYNC_OK) return 1;
    } else {
      gradsync_comm* g = NULL;
      rc = gradsync_comm_grow(c, "grow-host-lost", 1, &g, NULL);
      say("grow", rc);
      if (rc != GRADSYNC_E_UNSUPPORTED || g != NULL) {
        printf("%s: WRONG: the grow after a whole host was lost was not refused\n", who);
        return 1;
      }
      x = 1.0f;
      if ((rc = gradsync_comm_allreduce(c, &x, &x, 1, GRADSYNC_F32, GRADSYNC_SUM)) != GRADSYNC_OK ||
          x != (float)(size - victims)) {
        printf("%s: WRONG: the group does not work after the refusal (%g)\n", who, x);
        say("allreduce", rc);
        return 1;
      }
      printf("%s: verified 1 on %d ranks\n", who, size - victims);
    }
  }
  gradsync_comm_free(c);
  printf("%s: done\n", who);
  fflush(stdout);
  return 0;
}
