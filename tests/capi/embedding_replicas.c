/* SPDX-License-Identifier: Apache-2.0 */
/* A sharded embedding with replicas (option replicas) survives lost ranks without a checkpoint:
 * four ranks push the global batches of embedding_scenario.h; some go (a thread that frees its
 * communicator, or a process that SIGKILLs itself on shm); the survivors' next push fails, they
 * shrink and reshard with no checkpoint directory, and the lost rows come from the replicas, in
 * memory (restored = 0, the step count kept). They push on, lose a rank again (the reshard filled
 * the new group's replicas), reshard again, and push to the end: every survivor's rows and
 * optimizer state must then equal, bit for bit, what one process computes from the same batches.
 * Losing more neighbours than the replicas cover fails with GRADSYNC_E_LOST naming the rows and
 * changes nothing. A table in files, freed and reopened from its files, refills its replicas at
 * its first push (the holders could not know the reopened rows otherwise). Survivors that grow back
 * to 4 reshard straight onto the grown group, the joiners taking part: the lost rows still come
 * from the replicas, which the joiners find on the old group's ring, not on their own (a joiner
 * labelled on another host makes the two differ). */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "embedding_scenario.h"
#include "gradsync/gradsync.h"
#include "shm_sweep.h"

#define N 4
#define FIRST 3  /* steps before the first loss */
#define SECOND 6 /* ... before the second */
#define LAST 9

typedef struct {
  int32_t transport;
  int32_t replicas, optimizer, sharding;
  int lost_mask;   /* old ranks lost first */
  int second;      /* the rank of the shrunk group lost next, or -1 */
  int expect_lost; /* the first loss is more than the replicas cover */
  const char* dir; /* the table in files, freed and reopened before the first loss */
  int two_hosts;   /* ranks 0, 1 labelled host "ha", 2, 3 "hb": the replicas go to the other host */
  const char* label;
  const char* joiner_host; /* not NULL: the survivors grow back to N, joiners labelled so ("" none) */
} scenario;

typedef struct {
  volatile int32_t ready[N], ready2[N], shrunk[N], may_grow;
  int32_t bad[N], done[N];
} board;

typedef struct {
  const scenario* sc;
  board* b;
  char name[64];
  int rank;
} job;

static snapshot g_second, g_last;

static void pause_ms(long ms) {
  struct timespec t;
  t.tv_sec = ms / 1000;
  t.tv_nsec = (ms % 1000) * 1000000L;
  nanosleep(&t, NULL);
}

static void wait_all(volatile int32_t* flags, int n) {
  int i, waited;
  for (waited = 0; waited < 120000; ++waited) {
    int all = 1;
    for (i = 0; i < n; ++i) all &= __atomic_load_n(&flags[i], __ATOMIC_SEQ_CST) == 1;
    if (all) return;
    pause_ms(1);
  }
}

static int popcount(int m) {
  int c = 0;
  for (; m != 0; m >>= 1) c += m & 1;
  return c;
}

/* A lost rank goes once every rank of its group is ready: its process is SIGKILLed on shm, its
 * communicator freed on threads. */
static void go(const job* j, gradsync_embedding* t, gradsync_comm* c, volatile int32_t* flags, int n) {
  wait_all(flags, n);
  if (j->sc->transport == GRADSYNC_TRANSPORT_SHM) kill(getpid(), SIGKILL);
  gradsync_embedding_free(t);
  gradsync_comm_free(c);
}

/* The push of `step` fails (a rank is gone); the survivors shrink. */
static gradsync_comm* shrink_after(gradsync_embedding* t, gradsync_comm* c, int rank, int size, int step) {
  static __thread int64_t ids[GLOBAL];
  static __thread float grads[GLOBAL * DIM];
  gradsync_comm* shrunk = NULL;
  int32_t failed[N];
  int lo, hi;
  global_batch(step, ids, grads);
  slice_of(step, rank, size, &lo, &hi);
  CHECK(gradsync_embedding_push(t, ids + lo, (size_t)(hi - lo), grads + lo * DIM, (size_t)(hi - lo) * DIM) !=
        GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_shrink(c, &shrunk, failed, N, NULL), GRADSYNC_OK);
  return shrunk;
}

/* Reshards onto next (the survivors, or a group grown from them) without a checkpoint; every row
 * must come from the old group's ranks and replicas, the step count kept. */
static int reshard_in_memory(gradsync_embedding* t, gradsync_comm* next, int64_t step) {
  int32_t restored = -1;
  int64_t steps = -1;
  const int st = gradsync_embedding_reshard(t, next, GRADSYNC_EMBEDDING_KEEP_SHARDING, NULL, NULL, &restored);
  CHECK_STATUS(gradsync_embedding_steps(t, &steps), GRADSYNC_OK);
  CHECK(steps == step);
  CHECK(st != GRADSYNC_OK || restored == 0);
  return st;
}

/* Shrinks after the failed push of `step` and reshards without a checkpoint. Returns the shrunk
 * group (NULL when the reshard was expected to fail). */
static gradsync_comm* recover(gradsync_embedding* t, gradsync_comm* c, int rank, int size, int step, int reopened,
                              int expect_lost) {
  gradsync_comm* shrunk = shrink_after(t, c, rank, size, step);
  int st;
  if (shrunk == NULL) return NULL;
  /* a table reopened from its files counts its pushes anew */
  st = reshard_in_memory(t, shrunk, step - reopened);
  if (expect_lost) {
    CHECK_STATUS_MSG(st, GRADSYNC_E_LOST, "lived only on lost ranks");
    gradsync_comm_free(shrunk);
    return NULL;
  }
  CHECK_STATUS(st, GRADSYNC_OK);
  return shrunk;
}

static void join_name(char* out, size_t n, const char* name) { snprintf(out, n, "%.40s-join", name); }

/* The grown group's part, members and joiners alike: one reshard from the old group (a joiner's
 * table is new), then on to SECOND, compared by the grown group's rank. */
static void grown_part(board* b, gradsync_embedding* t, gradsync_comm* grown, const scenario* sc) {
  int32_t r = -1;
  gradsync_comm_rank(grown, &r);
  CHECK_STATUS(reshard_in_memory(t, grown, FIRST), GRADSYNC_OK);
  train(t, r, N, FIRST, SECOND);
  b->bad[r] = compare_local(t, &g_second, sc->optimizer, sc->label);
  b->done[r] = 1;
}

static void* joiner(void* p) {
  job* j = (job*)p;
  const scenario* sc = j->sc;
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_embedding_options eo = table_options(sc->optimizer, sc->sharding);
  gradsync_comm* grown = NULL;
  gradsync_embedding* t = NULL;
  o.transport = sc->transport;
  o.rank = j->rank;
  o.size = popcount(sc->lost_mask);
  o.timeout_ms = 30000;
  join_name(o.name, sizeof o.name, j->name);
  snprintf(o.host, sizeof o.host, "%s", sc->joiner_host);
  eo.replicas = sc->replicas;
  CHECK_STATUS(gradsync_comm_join(&grown, &o, NULL), GRADSYNC_OK);
  if (grown == NULL) return NULL;
  CHECK_STATUS(gradsync_embedding_create(&t, grown, NULL, &eo), GRADSYNC_OK);
  if (t != NULL) grown_part(j->b, t, grown, sc);
  gradsync_embedding_free(t);
  gradsync_comm_free(grown);
  return NULL;
}

static void* member(void* p) {
  job* j = (job*)p;
  const scenario* sc = j->sc;
  board* b = j->b;
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_embedding_options eo = table_options(sc->optimizer, sc->sharding);
  gradsync_comm *c = NULL, *shrunk = NULL, *again = NULL;
  gradsync_embedding* t = NULL;
  int32_t r = -1;
  const int left = N - popcount(sc->lost_mask);
  o.transport = sc->transport;
  o.rank = j->rank;
  o.size = N;
  o.timeout_ms = 30000;
  snprintf(o.name, sizeof o.name, "%s", j->name);
  if (sc->two_hosts) snprintf(o.host, sizeof o.host, "%s", j->rank < 2 ? "ha" : "hb");
  eo.replicas = sc->replicas;
  CHECK_STATUS(gradsync_comm_create(&c, &o), GRADSYNC_OK);
  if (c == NULL) return NULL;
  CHECK_STATUS(gradsync_embedding_create(&t, c, sc->dir, &eo), GRADSYNC_OK);
  if (sc->dir != NULL) {
    /* The first push refills the replicas from every owner; a table reopened from its files
     * (its rows are no longer the seed's) then needs the same. */
    train(t, j->rank, N, 0, 1);
    gradsync_embedding_free(t);
    t = NULL;
    CHECK_STATUS(gradsync_embedding_create(&t, c, sc->dir, &eo), GRADSYNC_OK);
    train(t, j->rank, N, 1, FIRST);
  } else {
    train(t, j->rank, N, 0, FIRST);
  }
  __atomic_store_n(&b->ready[j->rank], 1, __ATOMIC_SEQ_CST);
  if (sc->lost_mask & (1 << j->rank)) {
    go(j, t, c, b->ready, N);
    return NULL;
  }
  if (sc->joiner_host != NULL) {
    char name[64];
    shrunk = shrink_after(t, c, j->rank, N, FIRST);
    if (shrunk == NULL) goto out;
    __atomic_store_n(&b->shrunk[j->rank], 1, __ATOMIC_SEQ_CST);
    while (!__atomic_load_n(&b->may_grow, __ATOMIC_SEQ_CST)) pause_ms(1);
    join_name(name, sizeof name, j->name);
    CHECK_STATUS(gradsync_comm_grow(shrunk, name, popcount(sc->lost_mask), &again, NULL), GRADSYNC_OK);
    if (again != NULL) grown_part(b, t, again, sc);
    goto out;
  }
  shrunk = recover(t, c, j->rank, N, FIRST, sc->dir != NULL, sc->expect_lost);
  if (shrunk == NULL) goto out;
  gradsync_comm_rank(shrunk, &r);
  train(t, r, left, FIRST, SECOND);
  if (sc->second >= 0) {
    __atomic_store_n(&b->ready2[r], 1, __ATOMIC_SEQ_CST);
    if (r == sc->second) {
      go(j, t, shrunk, b->ready2, left);
      gradsync_comm_free(c);
      return NULL;
    }
    again = recover(t, shrunk, r, left, SECOND, sc->dir != NULL, 0);
    if (again == NULL) goto out;
    gradsync_comm_rank(again, &r);
    train(t, r, left - 1, SECOND, LAST);
    b->bad[j->rank] = compare_local(t, &g_last, sc->optimizer, sc->label);
  } else {
    b->bad[j->rank] = compare_local(t, &g_second, sc->optimizer, sc->label);
  }
  b->done[j->rank] = 1;
out:
  gradsync_embedding_free(t);
  gradsync_comm_free(again);
  gradsync_comm_free(shrunk);
  gradsync_comm_free(c);
  return NULL;
}

/* Slots that must reach the end: the survivors of both losses (none when the first is fatal), by
 * their first rank; or every rank of a group grown back, by its rank there. */
static int finisher(const scenario* sc, int rank) {
  int r = 0, i;
  if (sc->joiner_host != NULL) return 1;
  if (sc->expect_lost || (sc->lost_mask & (1 << rank))) return 0;
  for (i = 0; i < rank; ++i) r += !(sc->lost_mask & (1 << i));
  return r != sc->second;
}

/* Once the survivors shrank, the joiners come (threads, or processes on shm). */
static void start_joiners(const scenario* sc, board* b, const job* like, job* jobs, pthread_t* threads, pid_t* pids) {
  int i, waited;
  const int joiners = popcount(sc->lost_mask);
  for (waited = 0; waited < 120000; ++waited) {
    int all = 1;
    for (i = 0; i < N; ++i) all &= (sc->lost_mask & (1 << i)) || __atomic_load_n(&b->shrunk[i], __ATOMIC_SEQ_CST) == 1;
    if (all) break;
    pause_ms(1);
  }
  for (i = 0; i < joiners; ++i) {
    jobs[i] = *like;
    jobs[i].rank = i;
    if (sc->transport == GRADSYNC_TRANSPORT_THREAD) {
      pthread_create(&threads[i], NULL, joiner, &jobs[i]);
    } else if ((pids[i] = fork()) == 0) {
      check_failures = 0;
      joiner(&jobs[i]);
      _exit(check_failures == 0 ? 0 : 1);
    }
  }
  __atomic_store_n(&b->may_grow, 1, __ATOMIC_SEQ_CST);
}

static void run(const scenario* sc, board* b) {
  job jobs[2 * N + 1];
  pthread_t threads[N], joiner_threads[N];
  pid_t pids[N], joiner_pids[N];
  const int joiners = sc->joiner_host != NULL ? popcount(sc->lost_mask) : 0;
  int i;
  memset(b, 0, sizeof *b);
  reference(sc->optimizer, SECOND, 0, &g_second);
  reference(sc->optimizer, LAST, 0, &g_last);
  for (i = 0; i <= N; ++i) {
    jobs[i].sc = sc;
    jobs[i].b = b;
    jobs[i].rank = i;
    snprintf(jobs[i].name, sizeof jobs[i].name, "capi-emb-replicas-%ld", (long)getpid());
  }
  if (sc->transport == GRADSYNC_TRANSPORT_THREAD) {
    for (i = 0; i < N; ++i) pthread_create(&threads[i], NULL, member, &jobs[i]);
    if (joiners > 0) start_joiners(sc, b, &jobs[N], jobs + N + 1, joiner_threads, NULL);
    for (i = 0; i < N; ++i) pthread_join(threads[i], NULL);
    for (i = 0; i < joiners; ++i) pthread_join(joiner_threads[i], NULL);
  } else {
    for (i = 0; i < N; ++i) {
      pids[i] = fork();
      if (pids[i] == 0) {
        check_failures = 0; /* the parent's count is not this rank's */
        member(&jobs[i]);
        _exit(check_failures == 0 ? 0 : 1);
      }
    }
    if (joiners > 0) start_joiners(sc, b, &jobs[N], jobs + N + 1, NULL, joiner_pids);
    for (i = 0; i < N + joiners; ++i) {
      int status = 0;
      waitpid(i < N ? pids[i] : joiner_pids[i - N], &status, 0);
      if (!(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        fprintf(stderr, "%s: %s %d ended with status %#x\n", sc->label, i < N ? "rank" : "joiner", i < N ? i : i - N,
                (unsigned)status);
        check_failed();
      }
    }
    CHECK(shm_sweep(jobs[0].name, 0) == 0);
  }
  for (i = 0; i < N; ++i) {
    if (!finisher(sc, i)) continue;
    if (!b->done[i] || b->bad[i] != 0) {
      fprintf(stderr, "%s: rank %d %s\n", sc->label, i, b->done[i] ? "differs from one process" : "did not finish");
      check_failed();
    }
  }
  fprintf(stderr, "%s: ok\n", sc->label);
}

int main(void) {
  board* b = mmap(NULL, sizeof(board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  char tmp[] = "/tmp/gradsync-emb-replicas-XXXXXX", dir[300];
  const int32_t T = GRADSYNC_TRANSPORT_THREAD, S = GRADSYNC_TRANSPORT_SHM;
  const int32_t ADAM = GRADSYNC_OPTIM_ADAM, ADAGRAD = GRADSYNC_OPTIM_ROW_ADAGRAD, SGD = GRADSYNC_OPTIM_SGD;
  const int32_t CONT = GRADSYNC_EMBEDDING_CONTIGUOUS, HASH = GRADSYNC_EMBEDDING_HASH;
  size_t i;
  if (b == MAP_FAILED || mkdtemp(tmp) == NULL) {
    CHECK(0 && "no shared board or temporary directory");
    return check_report("capi:embedding_replicas");
  }
  snprintf(dir, sizeof dir, "%s/table", tmp);
  { /* bad counts, and a field reserved for later versions, are refused at creation */
    gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
    gradsync_embedding_options eo = table_options(SGD, CONT);
    gradsync_comm* c = NULL;
    gradsync_embedding* t = NULL;
    o.transport = T;
    o.rank = 0;
    o.size = 1;
    snprintf(o.name, sizeof o.name, "capi-emb-replicas-bad-%ld", (long)getpid());
    CHECK_STATUS(gradsync_comm_create(&c, &o), GRADSYNC_OK);
    eo.replicas = -1;
    CHECK_STATUS_MSG(gradsync_embedding_create(&t, c, NULL, &eo), GRADSYNC_E_INVALID_ARG,
                     "replicas must be in [0, 64]");
    eo.replicas = 65;
    CHECK_STATUS_MSG(gradsync_embedding_create(&t, c, NULL, &eo), GRADSYNC_E_INVALID_ARG, "got 65");
    eo.replicas = 1;
    eo.reserved0 = 7;
    CHECK_STATUS_MSG(gradsync_embedding_create(&t, c, NULL, &eo), GRADSYNC_E_INVALID_ARG, "reserved0 must be 0");
    CHECK(t == NULL);
    gradsync_comm_free(c);
  }
  {
    const scenario cases[] = {
        {T, 1, ADAM, CONT, 1 << 1, 1, 0, NULL, 0, "threads, replicas 1: rank 1 lost, then new rank 1", NULL},
        {T, 1, ADAGRAD, HASH, 1 << 0, 2, 0, NULL, 0, "threads, replicas 1, hash: rank 0 lost, then new rank 2", NULL},
        {T, 1, SGD, CONT, (1 << 0) | (1 << 2), -1, 0, NULL, 0, "threads, replicas 1: ranks 0 and 2 lost", NULL},
        {T, 1, ADAM, CONT, (1 << 1) | (1 << 2), -1, 1, NULL, 0, "threads, replicas 1: neighbours 1 and 2 lost", NULL},
        {T, 2, ADAM, HASH, (1 << 3) | (1 << 0), 0, 0, NULL, 0, "threads, replicas 2, hash: neighbours 3 and 0 lost",
         NULL},
        {T, 1, ADAGRAD, CONT, 1 << 3, 0, 0, dir, 0, "threads, replicas 1, in files reopened: rank 3 lost", NULL},
        {S, 1, ADAM, CONT, 1 << 2, 0, 0, NULL, 0, "shm, replicas 1: rank 2 SIGKILLed, then new rank 0", NULL},
        {S, 1, ADAGRAD, HASH, 1 << 0, -1, 0, NULL, 0, "shm, replicas 1, hash: rank 0 SIGKILLed", NULL},
        /* The replica ring interleaves the hosts (0, 2, 1, 3): each rank's replica is on the other
         * host, so losing a whole host loses nothing, where rank order would lose rank 2's rows. */
        {T, 1, ADAM, HASH, (1 << 2) | (1 << 3), -1, 0, NULL, 1, "threads on 2 labelled hosts, replicas 1: host hb lost",
         NULL},
        {T, 1, SGD, CONT, (1 << 0) | (1 << 1), 0, 0, NULL, 1, "threads on 2 labelled hosts, replicas 1: host ha lost",
         NULL},
        /* Grown back: the joiner (new rank 3) receives lost rank 3's rows. Its own ring (0, 3, 1, 2:
         * it is on another host) would expect them from old rank 1, which holds rank 0's; the old
         * ring (rank order) has them on old rank 0. */
        {T, 1, ADAGRAD, CONT, 1 << 3, -1, 0, NULL, 0, "threads, replicas 1: rank 3 lost, a joiner from another host",
         "elsewhere"},
        {T, 2, ADAM, HASH, (1 << 1) | (1 << 2), -1, 0, NULL, 0,
         "threads, replicas 2, hash: neighbours 1 and 2 lost, two joiners", ""},
        {S, 1, ADAM, CONT, 1 << 2, -1, 0, NULL, 0, "shm, replicas 1: rank 2 SIGKILLed, a joiner process", ""},
    };
    for (i = 0; i < sizeof cases / sizeof cases[0]; ++i) run(&cases[i], b);
  }
  munmap(b, sizeof *b);
  {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmp);
  }
  return check_report("capi:embedding_replicas");
}
