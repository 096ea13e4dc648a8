/* SPDX-License-Identifier: Apache-2.0 */
/* gradsync_comm_grow and gradsync_comm_join through the C ABI.
 * Threads: four ranks train an Adam parameter (ZeRO-1, replicas = 1); rank 2 goes, the survivors
 * shrink 4 -> 3 and reshard, train on, then grow 3 -> 4 with a joiner, which gets the weights by
 * broadcast and its optimizer slice by reshard; the final weights must equal, bit for bit, those
 * of a run that never lost a rank (every rank's gradient is the same exact value, so the mean is
 * the same on any number of ranks, and Adam's state decides every later step). The joiner is rank
 * 3 with member id 4: ids are never reused. Then the failures: bad arguments, members that
 * disagree, a joiner that never comes (the members' deadline), members that never grow (the
 * joiner's), joiners that disagree with the members on their count; each leaves the group
 * working after a reset.
 * Shm processes: four processes, one SIGKILLed, the survivors shrink and grow back with a joiner
 * process; and a joiner SIGKILLed while it waits in the join: the grow fails on every member,
 * they reset and grow again with a replacement. After each, no segment of its groups is left. */
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
#include "gradsync/gradsync.h"
#include "shm_locks.h"
#include "shm_sweep.h"

#define N 4
#define TOTAL 1003 /* not a multiple of 3 or 4: uneven parts before and after */
#define STEPS 12
#define LOSS_AT 4
#define GROW_AT 8

static void pause_ms(long ms) {
  struct timespec t;
  t.tv_sec = ms / 1000;
  t.tv_nsec = (ms % 1000) * 1000000L;
  nanosleep(&t, NULL);
}

static gradsync_comm_options options(int32_t transport, const char* name, int32_t rank, int32_t size,
                                     int64_t timeout_ms) {
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  o.transport = transport;
  o.rank = rank;
  o.size = size;
  o.timeout_ms = timeout_ms;
  snprintf(o.name, sizeof o.name, "%s", name);
  return o;
}

static gradsync_grow_result grow_result(void) {
  gradsync_grow_result r;
  memset(&r, 0, sizeof r);
  r.struct_size = sizeof r;
  r.version = GRADSYNC_GROW_RESULT_VERSION;
  return r;
}

static double sum_of(gradsync_comm* c, double x, int* status) {
  double y = x;
  *status = gradsync_comm_allreduce(c, &y, &y, 1, GRADSYNC_F64, GRADSYNC_SUM);
  return y;
}

/* ------------------------------------------------------------------ threads: shrink, grow, reshard */

static float g_reference[TOTAL];

/* The gradient of step s, the same on every rank: small multiples of 1/256, so every sum and mean
 * over up to four ranks is exact. */
static void gradient(int s, float* g) {
  int i;
  for (i = 0; i < TOTAL; ++i) g[i] = (float)(((i * 7 + s * 13) % 17) - 8) / 256.0f;
}

static gradsync_shard_options shard_options(void) {
  gradsync_shard_options o = GRADSYNC_SHARD_OPTIONS_INIT;
  o.optimizer = GRADSYNC_OPTIM_ADAM;
  o.lr = 0.01;
  o.replicas = 1;
  return o;
}

typedef struct {
  int rank; /* -1: the joiner */
  int disturbed;
  const char* name;
  float* final_weights; /* rank 0's weights after STEPS */
} job;

/* Steps from..STEPS-1 on comm; returns the step it stopped at. */
static int train(gradsync_shard* shard, float* w, float* g, int from, int to) {
  int s;
  for (s = from; s < to; ++s) {
    int st;
    gradient(s, g);
    st = gradsync_shard_step(shard, g, w, TOTAL, 1);
    CHECK_STATUS(st, GRADSYNC_OK);
    if (st != GRADSYNC_OK) break;
  }
  return s;
}

static void* member(void* p) {
  job* j = (job*)p;
  gradsync_comm_options copts = options(GRADSYNC_TRANSPORT_THREAD, j->name, j->rank, N, 20000);
  gradsync_shard_options sopts = shard_options();
  gradsync_comm *comm = NULL, *shrunk = NULL, *grown = NULL;
  gradsync_shard* shard = NULL;
  float *w = malloc(TOTAL * sizeof(float)), *g = malloc(TOTAL * sizeof(float));
  int i, s = 0;
  CHECK_STATUS(gradsync_comm_create(&comm, &copts), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_create(&shard, comm, TOTAL, &sopts), GRADSYNC_OK);
  for (i = 0; i < TOTAL; ++i) w[i] = (float)i / TOTAL;
  CHECK_STATUS(gradsync_shard_init(shard, w, TOTAL), GRADSYNC_OK);
  if (!j->disturbed) {
    s = train(shard, w, g, 0, STEPS);
  } else {
    int32_t failed[N], r = -1, size = -1;
    int64_t id = -1, updates = -1;
    gradsync_grow_result res = grow_result();
    if (train(shard, w, g, 0, LOSS_AT) != LOSS_AT) goto out;
    if (j->rank == 2) goto out; /* goes: its communicator is freed, its thread ends */
    /* The survivors' next step fails once rank 2 is gone; then shrink 4 -> 3 and reshard. */
    gradient(LOSS_AT, g);
    CHECK(gradsync_shard_step(shard, g, w, TOTAL, 1) != GRADSYNC_OK);
    CHECK_STATUS(gradsync_comm_shrink(comm, &shrunk, failed, N, NULL), GRADSYNC_OK);
    if (shrunk == NULL) goto out;
    CHECK_STATUS(gradsync_shard_reshard(shard, shrunk, NULL), GRADSYNC_OK);
    if (train(shard, w, g, LOSS_AT, GROW_AT) != GROW_AT) goto out;
    /* Grow 3 -> 4 at a round boundary; the joiner meets the members by "<name>-join". */
    {
      char join_name[64];
      snprintf(join_name, sizeof join_name, "%.40s-join", j->name);
      CHECK_STATUS(gradsync_comm_grow(shrunk, join_name, 1, &grown, &res), GRADSYNC_OK);
    }
    if (grown == NULL) goto out;
    CHECK(res.old_size == 3 && res.new_size == 4 && res.first_member_id == 4);
    CHECK_STATUS(gradsync_comm_rank(grown, &r), GRADSYNC_OK);
    CHECK_STATUS(gradsync_comm_size(grown, &size), GRADSYNC_OK);
    CHECK_STATUS(gradsync_comm_member_id(grown, &id), GRADSYNC_OK);
    CHECK(size == 4 && id == j->rank && r == (j->rank < 2 ? j->rank : j->rank - 1));
    /* Catch-up: the parameters by broadcast from rank 0, the optimizer slices by reshard. */
    CHECK_STATUS(gradsync_comm_broadcast(grown, w, TOTAL, GRADSYNC_F32, 0), GRADSYNC_OK);
    CHECK_STATUS(gradsync_shard_reshard(shard, grown, NULL), GRADSYNC_OK);
    CHECK_STATUS(gradsync_shard_updates(shard, &updates), GRADSYNC_OK);
    CHECK(updates == GROW_AT);
    {
      float* gathered = malloc(TOTAL * sizeof(float));
      CHECK_STATUS(gradsync_shard_gather(shard, gathered, TOTAL), GRADSYNC_OK);
      CHECK(memcmp(gathered, w, TOTAL * sizeof(float)) == 0);
      free(gathered);
    }
    gradsync_comm_free(shrunk); /* the old groups are done with */
    shrunk = NULL;
    s = train(shard, w, g, GROW_AT, STEPS);
  }
  if (s == STEPS && j->final_weights != NULL) {
    int32_t r = -1;
    gradsync_comm_rank(grown != NULL ? grown : comm, &r);
    if (r == 0) memcpy(j->final_weights, w, TOTAL * sizeof(float));
  }
out:
  gradsync_shard_free(shard);
  gradsync_comm_free(comm);
  gradsync_comm_free(shrunk);
  gradsync_comm_free(grown);
  free(w);
  free(g);
  return NULL;
}

/* The replacement: started with the others (a launcher's spare), it waits in the join until the
 * survivors grow. */
static void* joiner(void* p) {
  job* j = (job*)p;
  char join_name[64];
  gradsync_comm_options o;
  gradsync_shard_options sopts = shard_options();
  /* The result as a newer header would size it: the library zeroes the fields it does not know. */
  struct {
    gradsync_grow_result r;
    unsigned char newer[24];
  } big;
  gradsync_comm* grown = NULL;
  gradsync_shard* shard = NULL;
  float *w = malloc(TOTAL * sizeof(float)), *g = malloc(TOTAL * sizeof(float)),
        *gathered = malloc(TOTAL * sizeof(float));
  int32_t r = -1, size = -1;
  int64_t id = -1, updates = -1;
  uint64_t moved = 0;
  snprintf(join_name, sizeof join_name, "%.40s-join", j->name);
  o = options(GRADSYNC_TRANSPORT_THREAD, join_name, 0, 1, 60000);
  memset(&big, 0xff, sizeof big);
  big.r.struct_size = sizeof big;
  big.r.version = GRADSYNC_GROW_RESULT_VERSION;
  CHECK_STATUS(gradsync_comm_join(&grown, &o, &big.r), GRADSYNC_OK);
  if (grown == NULL) goto out;
  CHECK(big.r.struct_size == sizeof big && big.r.version == GRADSYNC_GROW_RESULT_VERSION);
  CHECK(big.r.old_size == 3 && big.r.new_size == 4 && big.r.first_member_id == 4);
  {
    size_t i;
    for (i = sizeof big.r; i < sizeof big; ++i) CHECK(((const unsigned char*)&big)[i] == 0);
  }
  CHECK_STATUS(gradsync_comm_rank(grown, &r), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_size(grown, &size), GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_member_id(grown, &id), GRADSYNC_OK);
  CHECK(r == 3 && size == 4 && id == 4); /* after the old ranks; id 2 (the lost rank's) is not reused */
  memset(w, 0xff, TOTAL * sizeof(float));
  CHECK_STATUS(gradsync_comm_broadcast(grown, w, TOTAL, GRADSYNC_F32, 0), GRADSYNC_OK);
  /* An empty shard on the grown group takes part in the reshard as a receiver. */
  CHECK_STATUS(gradsync_shard_create(&shard, grown, TOTAL, &sopts), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_reshard(shard, grown, &moved), GRADSYNC_OK);
  CHECK(moved > 0);
  CHECK_STATUS(gradsync_shard_updates(shard, &updates), GRADSYNC_OK);
  CHECK(updates == GROW_AT);
  /* Its slice (with everyone's) gathers into the broadcast weights. */
  CHECK_STATUS(gradsync_shard_gather(shard, gathered, TOTAL), GRADSYNC_OK);
  CHECK(memcmp(gathered, w, TOTAL * sizeof(float)) == 0);
  train(shard, w, g, GROW_AT, STEPS);
out:
  gradsync_shard_free(shard);
  gradsync_comm_free(grown);
  free(w);
  free(g);
  free(gathered);
  return NULL;
}

static void run(const char* name, int disturbed, float* final_weights) {
  pthread_t t[N + 1];
  job jobs[N + 1];
  int i;
  for (i = 0; i <= N; ++i) {
    jobs[i].rank = i < N ? i : -1;
    jobs[i].disturbed = disturbed;
    jobs[i].name = name;
    jobs[i].final_weights = final_weights;
    if (i < N || disturbed) pthread_create(&t[i], NULL, i < N ? member : joiner, &jobs[i]);
  }
  for (i = 0; i < N + (disturbed ? 1 : 0); ++i) pthread_join(t[i], NULL);
}

static void test_shrink_grow_state(void) {
  static float got[TOTAL];
  int i, differ = 0;
  run("capi-grow-ref", 0, g_reference);
  memset(got, 0xff, sizeof got);
  run("capi-grow", 1, got);
  for (i = 0; i < TOTAL; ++i) differ += memcmp(&got[i], &g_reference[i], sizeof(float)) != 0;
  if (differ != 0)
    fprintf(stderr, "shrink 4->3, grow 3->4: %d of %d weights differ from the undisturbed run\n", differ, TOTAL);
  CHECK(differ == 0);
}

/* ------------------------------------------------------------------ threads: failures */

typedef struct {
  int rank;
  int scenario;
} fail_job;

enum { F_MISMATCH, F_NO_JOINER, F_COUNT, F_ABORT };

static uint64_t allgathers(const gradsync_comm* c) {
  gradsync_comm_statistics s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  s.version = GRADSYNC_COMM_STATISTICS_VERSION;
  CHECK_STATUS(gradsync_comm_stats(c, &s, NULL, 0), GRADSYNC_OK);
  return s.collective[GRADSYNC_COLLECTIVE_ALLGATHER].calls;
}

typedef struct {
  gradsync_comm* comm;
  uint64_t before; /* allgathers of comm before the grow */
} abort_job;

/* Aborts the group (from another thread, as allowed) once the grow is under way: the members
 * have agreed on it (the grow's first step is an allgather of comm, counted once it is done), so
 * rank 0 waits for the joiner that never comes and rank 1 to form the grown group. */
static void* abort_in_grow(void* p) {
  abort_job* a = (abort_job*)p;
  int waited;
  for (waited = 0; waited < 60000 && allgathers(a->comm) == a->before; ++waited) pause_ms(1);
  CHECK(allgathers(a->comm) > a->before);
  CHECK_STATUS(gradsync_comm_abort(a->comm), GRADSYNC_OK);
  return NULL;
}

static void* fail_member(void* p) {
  fail_job* j = (fail_job*)p;
  gradsync_comm_options o =
      options(GRADSYNC_TRANSPORT_THREAD, "capi-grow-fail", j->rank, 2, j->scenario == F_NO_JOINER ? 400 : 10000);
  gradsync_comm *c = NULL, *grown = NULL;
  gradsync_grow_result bad = grow_result();
  int st;
  double sum;
  CHECK_STATUS(gradsync_comm_create(&c, &o), GRADSYNC_OK);
  if (c == NULL) return NULL;
  /* Bad arguments: this member only, nothing started. */
  CHECK_STATUS(gradsync_comm_grow(c, "x", 1, NULL, NULL), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS_MSG(gradsync_comm_grow(c, NULL, 1, &grown, NULL), GRADSYNC_E_INVALID_ARG, "join_name");
  CHECK_STATUS_MSG(gradsync_comm_grow(c, "", 1, &grown, NULL), GRADSYNC_E_INVALID_ARG, "join_name");
  CHECK_STATUS_MSG(gradsync_comm_grow(c, "x", 0, &grown, NULL), GRADSYNC_E_INVALID_ARG, "joiner");
  CHECK_STATUS_MSG(gradsync_comm_grow(c, "x", 1023, &grown, NULL), GRADSYNC_E_INVALID_ARG, "joiner");
  CHECK_STATUS_MSG(gradsync_comm_grow(c, "capi-grow-fail", 1, &grown, NULL), GRADSYNC_E_INVALID_ARG, "own name");
  bad.version = 0;
  CHECK_STATUS_MSG(gradsync_comm_grow(c, "x", 1, &grown, &bad), GRADSYNC_E_INVALID_ARG, "struct_size");
  CHECK(grown == NULL);
  sum = sum_of(c, 1.0, &st);
  CHECK(st == GRADSYNC_OK && sum == 2.0);
  switch (j->scenario) {
    case F_MISMATCH: /* the members disagree: every member sees it */
      CHECK_STATUS_MSG(gradsync_comm_grow(c, "capi-grow-fail-join", 1 + j->rank, &grown, NULL), GRADSYNC_E_MISMATCH,
                       "joiner");
      break;
    case F_NO_JOINER: /* nobody joins: rank 0 times out in the lobby, rank 1 forming the group; whichever
                         gives up second may hear of the other first */
      st = gradsync_comm_grow(c, "capi-grow-nobody", 1, &grown, NULL);
      CHECK(st == GRADSYNC_E_TIMEOUT || st == GRADSYNC_E_ABORTED);
      break;
    case F_COUNT: /* a joiner that counts two joiners where the members grow by one */
      st = gradsync_comm_grow(c, "capi-grow-count", 1, &grown, NULL);
      CHECK(j->rank == 0 ? st == GRADSYNC_E_MISMATCH : st == GRADSYNC_E_ABORTED);
      break;
    case F_ABORT: { /* an abort of the group during the grow (nobody joins): every member stops at once */
      pthread_t t;
      abort_job a;
      a.comm = c;
      a.before = allgathers(c);
      if (j->rank == 0) pthread_create(&t, NULL, abort_in_grow, &a);
      CHECK_STATUS_MSG(gradsync_comm_grow(c, "capi-grow-aborted", 1, &grown, NULL), GRADSYNC_E_ABORTED, "abort");
      if (j->rank == 0) pthread_join(t, NULL);
      break;
    }
  }
  CHECK(grown == NULL);
  /* The group is stopped as after a failed collective; a reset brings it back. */
  (void)sum_of(c, 1.0, &st);
  CHECK(st != GRADSYNC_OK);
  CHECK_STATUS(gradsync_comm_reset(c), GRADSYNC_OK);
  sum = sum_of(c, 1.0, &st);
  CHECK(st == GRADSYNC_OK && sum == 2.0);
  gradsync_comm_free(c);
  return NULL;
}

static void* count_joiner(void* p) {
  (void)p;
  {
    gradsync_comm_options o = options(GRADSYNC_TRANSPORT_THREAD, "capi-grow-count", 0, 2, 20000);
    gradsync_comm* grown = NULL;
    CHECK_STATUS_MSG(gradsync_comm_join(&grown, &o, NULL), GRADSYNC_E_MISMATCH, "size");
    CHECK(grown == NULL);
  }
  return NULL;
}

static void test_failures(void) {
  int scenario, i;
  for (scenario = F_MISMATCH; scenario <= F_ABORT; ++scenario) {
    pthread_t t[3];
    fail_job jobs[2];
    for (i = 0; i < 2; ++i) {
      jobs[i].rank = i;
      jobs[i].scenario = scenario;
      pthread_create(&t[i], NULL, fail_member, &jobs[i]);
    }
    if (scenario == F_COUNT) pthread_create(&t[2], NULL, count_joiner, NULL);
    for (i = 0; i < 2; ++i) pthread_join(t[i], NULL);
    if (scenario == F_COUNT) pthread_join(t[2], NULL);
  }
  {
    /* Members that never grow: the joiner's own deadline. Bad options: its own arguments. */
    gradsync_comm_options o = options(GRADSYNC_TRANSPORT_THREAD, "capi-grow-never", 0, 1, 200);
    gradsync_comm* grown = NULL;
    CHECK_STATUS(gradsync_comm_join(&grown, &o, NULL), GRADSYNC_E_TIMEOUT);
    CHECK(grown == NULL);
    CHECK_STATUS(gradsync_comm_join(NULL, &o, NULL), GRADSYNC_E_INVALID_ARG);
    CHECK_STATUS(gradsync_comm_join(&grown, NULL, NULL), GRADSYNC_E_INVALID_ARG);
    o.rank = 1;
    CHECK_STATUS(gradsync_comm_join(&grown, &o, NULL), GRADSYNC_E_OUT_OF_RANGE);
    /* Over MPI only a process that a grow started joins: refused here (before MPI is initialised:
     * this process forks afterwards), or unsupported in a build without MPI. */
    o = options(GRADSYNC_TRANSPORT_MPI, "x", 0, 1, 200);
    if (gradsync_has_feature(GRADSYNC_FEATURE_MPI_TRANSPORT)) {
      CHECK_STATUS_MSG(gradsync_comm_join(&grown, &o, NULL), GRADSYNC_E_INVALID_ARG, "not started by a grow");
    } else {
      CHECK_STATUS_MSG(gradsync_comm_join(&grown, &o, NULL), GRADSYNC_E_UNSUPPORTED, "MPI");
    }
  }
}

/* A joiner that initialises its shard before the reshard: every member of the grown group is
 * told so (the reshard brings a joiner the weights and the step). */
static void* early_init(void* p) {
  const int rank = *(const int*)p; /* 0, 1: members; 2: the joiner */
  gradsync_comm_options o = options(GRADSYNC_TRANSPORT_THREAD, rank < 2 ? "capi-grow-early" : "capi-grow-early-join",
                                    rank < 2 ? rank : 0, rank < 2 ? 2 : 1, 20000);
  gradsync_shard_options sopts = shard_options();
  gradsync_comm *c = NULL, *grown = NULL;
  gradsync_shard* shard = NULL;
  static float w[3][TOTAL];
  if (rank < 2) {
    CHECK_STATUS(gradsync_comm_create(&c, &o), GRADSYNC_OK);
    if (c == NULL) return NULL;
    CHECK_STATUS(gradsync_shard_create(&shard, c, TOTAL, &sopts), GRADSYNC_OK);
    CHECK_STATUS(gradsync_shard_init(shard, w[rank], TOTAL), GRADSYNC_OK);
    CHECK_STATUS(gradsync_comm_grow(c, "capi-grow-early-join", 1, &grown, NULL), GRADSYNC_OK);
  } else {
    CHECK_STATUS(gradsync_comm_join(&grown, &o, NULL), GRADSYNC_OK);
    if (grown != NULL) {
      CHECK_STATUS(gradsync_shard_create(&shard, grown, TOTAL, &sopts), GRADSYNC_OK);
      CHECK_STATUS(gradsync_shard_init(shard, w[rank], TOTAL), GRADSYNC_OK);
    }
  }
  if (grown != NULL && shard != NULL)
    CHECK_STATUS_MSG(gradsync_shard_reshard(shard, grown, NULL), GRADSYNC_E_MISUSE, "must not initialise");
  gradsync_shard_free(shard);
  gradsync_comm_free(grown);
  gradsync_comm_free(c);
  return NULL;
}

static void test_early_init(void) {
  static const int ranks[3] = {0, 1, 2};
  pthread_t t[3];
  int i;
  for (i = 0; i < 3; ++i) pthread_create(&t[i], NULL, early_init, (void*)&ranks[i]);
  for (i = 0; i < 3; ++i) pthread_join(t[i], NULL);
}

/* ------------------------------------------------------------------ shm processes */

typedef struct {
  volatile int32_t ready[N];   /* trained LOSS_AT steps */
  volatile int32_t shrunk[N];  /* in the group of 3 (2: and reset after the failed grow) */
  volatile int32_t growing[N]; /* about to grow */
  volatile int32_t joining;    /* the doomed joiner is in gradsync_comm_join */
  volatile int32_t may_grow;   /* the parent let the members grow */
  float weights[2][TOTAL];     /* after STEPS: the grown group's rank 0's, and the joiner's */
} board;

enum { S_GROW, S_JOINER_DIES };

/* A member process: trains on 4, loses rank 1 (the parent SIGKILLs it), shrinks and reshards,
 * trains on 3, grows back to 4 and reshards, trains to the end. */
static int shm_member(board* b, const char* name, int32_t rank, int scenario) {
  gradsync_comm_options o = options(GRADSYNC_TRANSPORT_SHM, name, rank, N, 20000);
  gradsync_shard_options sopts = shard_options();
  gradsync_comm *c = NULL, *shrunk = NULL, *grown = NULL;
  gradsync_shard* shard = NULL;
  gradsync_grow_result res = grow_result();
  char join_name[64];
  static float w[TOTAL], g[TOTAL];
  int st, i;
  double sum;
  int32_t failed[N], r = -1;
  int64_t id = -1;
  snprintf(join_name, sizeof join_name, "%.40s-join", name);
  CHECK_STATUS(gradsync_comm_create(&c, &o), GRADSYNC_OK);
  if (c == NULL) return 2;
  CHECK_STATUS(gradsync_shard_create(&shard, c, TOTAL, &sopts), GRADSYNC_OK);
  for (i = 0; i < TOTAL; ++i) w[i] = (float)i / TOTAL;
  CHECK_STATUS(gradsync_shard_init(shard, w, TOTAL), GRADSYNC_OK);
  if (train(shard, w, g, 0, LOSS_AT) != LOSS_AT) return 1;
  __atomic_store_n(&b->ready[rank], 1, __ATOMIC_SEQ_CST);
  if (rank == 1) {
    for (;;) pause_ms(1000); /* the parent kills it */
  }
  gradient(LOSS_AT, g);
  CHECK(gradsync_shard_step(shard, g, w, TOTAL, 1) != GRADSYNC_OK); /* until the loss shows */
  CHECK_STATUS(gradsync_comm_shrink(c, &shrunk, failed, N, NULL), GRADSYNC_OK);
  if (shrunk == NULL) return 1;
  CHECK_STATUS(gradsync_shard_reshard(shard, shrunk, NULL), GRADSYNC_OK);
  if (train(shard, w, g, LOSS_AT, GROW_AT) != GROW_AT) return 1;
  __atomic_store_n(&b->shrunk[rank], 1, __ATOMIC_SEQ_CST);
  while (!__atomic_load_n(&b->may_grow, __ATOMIC_SEQ_CST)) pause_ms(1);
  __atomic_store_n(&b->growing[rank], 1, __ATOMIC_SEQ_CST);
  if (scenario == S_JOINER_DIES) {
    /* Two joiners expected; the one that came dies in the lobby with rank 0 while the others wait
     * to form the grown group: rank 0 sees the joiner die, and stops the others before it leaves
     * the lobby, so they hear of its failure (none waits out its timeout). A reset, then a
     * replacement joins. */
    if (rank == 0) {
      CHECK_STATUS_MSG(gradsync_comm_grow(shrunk, join_name, 2, &grown, NULL), GRADSYNC_E_REMOTE, join_name);
    } else {
      CHECK_STATUS_MSG(gradsync_comm_grow(shrunk, join_name, 2, &grown, NULL), GRADSYNC_E_ABORTED, "rank 0");
    }
    CHECK(grown == NULL);
    CHECK_STATUS(gradsync_comm_reset(shrunk), GRADSYNC_OK);
    __atomic_store_n(&b->shrunk[rank], 2, __ATOMIC_SEQ_CST);
  }
  CHECK_STATUS(gradsync_comm_grow(shrunk, join_name, 1, &grown, &res), GRADSYNC_OK);
  if (grown == NULL) return 1;
  CHECK(res.old_size == 3 && res.new_size == 4 && res.first_member_id == 4); /* a failed grow used no ids */
  gradsync_comm_rank(grown, &r);
  gradsync_comm_member_id(grown, &id);
  CHECK(id == rank && r == (rank == 0 ? 0 : rank - 1));
  sum = sum_of(grown, (double)id, &st);
  CHECK(st == GRADSYNC_OK && sum == 0 + 2 + 3 + 4);
  CHECK_STATUS(gradsync_comm_broadcast(grown, w, TOTAL, GRADSYNC_F32, 0), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_reshard(shard, grown, NULL), GRADSYNC_OK);
  if (train(shard, w, g, GROW_AT, STEPS) == STEPS && r == 0) memcpy(b->weights[0], w, sizeof w);
  gradsync_shard_free(shard);
  gradsync_comm_free(c);
  gradsync_comm_free(shrunk);
  gradsync_comm_free(grown);
  return check_failures == 0 ? 0 : 1;
}

static int shm_joiner(board* b, const char* name, int doomed) {
  char join_name[64];
  gradsync_comm_options o;
  gradsync_shard_options sopts = shard_options();
  gradsync_grow_result res = grow_result();
  gradsync_comm* grown = NULL;
  gradsync_shard* shard = NULL;
  static float w[TOTAL], g[TOTAL];
  int32_t r = -1;
  int64_t id = -1, updates = -1;
  int st;
  double sum;
  snprintf(join_name, sizeof join_name, "%.40s-join", name);
  o = options(GRADSYNC_TRANSPORT_SHM, join_name, 0, doomed ? 2 : 1, 20000);
  if (doomed) __atomic_store_n(&b->joining, 1, __ATOMIC_SEQ_CST);
  CHECK_STATUS(gradsync_comm_join(&grown, &o, &res), GRADSYNC_OK);
  if (grown == NULL) return 1;
  gradsync_comm_rank(grown, &r);
  gradsync_comm_member_id(grown, &id);
  CHECK(r == 3 && id == 4 && res.first_member_id == 4);
  sum = sum_of(grown, (double)id, &st);
  CHECK(st == GRADSYNC_OK && sum == 0 + 2 + 3 + 4);
  CHECK_STATUS(gradsync_comm_broadcast(grown, w, TOTAL, GRADSYNC_F32, 0), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_create(&shard, grown, TOTAL, &sopts), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_reshard(shard, grown, NULL), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_updates(shard, &updates), GRADSYNC_OK);
  CHECK(updates == GROW_AT);
  if (train(shard, w, g, GROW_AT, STEPS) == STEPS) memcpy(b->weights[1], w, sizeof w);
  gradsync_shard_free(shard);
  gradsync_comm_free(grown);
  return check_failures == 0 ? 0 : 1;
}

static void wait_all(volatile int32_t* flags, int32_t want, const int* which, int count) {
  int waited, i;
  for (waited = 0; waited < 60000; ++waited) {
    int all = 1;
    for (i = 0; i < count; ++i) all &= __atomic_load_n(&flags[which[i]], __ATOMIC_SEQ_CST) == want;
    if (all) return;
    pause_ms(1);
  }
}

/* Waits until rank 0 and the doomed joiner both are in the lobby of grow `name` (its shm group,
 * of the join name): their rank locks are held and its set-up lock is free. */
static void wait_in_lobby(const char* name) {
  char lobby[64];
  int waited;
  snprintf(lobby, sizeof lobby, "%.40s-join", name);
  for (waited = 0; waited < 60000; ++waited) {
    if (shm_locks_held(lobby, 3) == 6) return;
    pause_ms(1);
  }
  fprintf(stderr, "rank 0 and the doomed joiner never met in the lobby of %s\n", name);
  check_failed();
}

static void reap(pid_t pid, int killed, const char* label, const char* who) {
  int status = 0;
  waitpid(pid, &status, 0);
  if (killed) {
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "%s: %s ended with status %#x\n", label, who, (unsigned)status);
    check_failed();
  }
}

static void test_shm(int scenario, const char* label) {
  board* b = mmap(NULL, sizeof(board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  static const int all[N] = {0, 1, 2, 3}, survivors[3] = {0, 2, 3};
  char name[64];
  pid_t pids[N], doomed = -1, joiner_pid;
  int i;
  if (b == MAP_FAILED) {
    CHECK(b != MAP_FAILED);
    return;
  }
  memset(b, 0, sizeof *b);
  snprintf(name, sizeof name, "capi-grow-%ld-%d", (long)getpid(), scenario);
  for (i = 0; i < N; ++i) {
    pids[i] = fork();
    if (pids[i] == 0) _exit(shm_member(b, name, i, scenario));
  }
  wait_all(b->ready, 1, all, N);
  kill(pids[1], SIGKILL);
  wait_all(b->shrunk, 1, survivors, 3);
  if (scenario == S_JOINER_DIES) {
    /* A joiner waits in the join with the members: it dies there. */
    doomed = fork();
    if (doomed == 0) _exit(shm_joiner(b, name, 1));
    while (!__atomic_load_n(&b->joining, __ATOMIC_SEQ_CST)) pause_ms(1);
    __atomic_store_n(&b->may_grow, 1, __ATOMIC_SEQ_CST);
    wait_all(b->growing, 1, survivors, 3);
    /* Killed once both are in the lobby, so that rank 0 sees a member of it die (a joiner dead
     * before rank 0 came would leave a lobby that rank 0 reclaims and waits in). */
    wait_in_lobby(name);
    kill(doomed, SIGKILL);
    reap(doomed, 1, label, "the doomed joiner");
    wait_all(b->shrunk, 2, survivors, 3);
  }
  joiner_pid = fork();
  if (joiner_pid == 0) _exit(shm_joiner(b, name, 0));
  __atomic_store_n(&b->may_grow, 1, __ATOMIC_SEQ_CST);
  for (i = 0; i < N; ++i) reap(pids[i], i == 1, label, "a member");
  reap(joiner_pid, 0, label, "the joiner");
  /* The state after a real SIGKILL, a shrink and a grow: bit for bit the undisturbed run's. */
  CHECK(memcmp(b->weights[0], g_reference, sizeof g_reference) == 0);
  CHECK(memcmp(b->weights[1], g_reference, sizeof g_reference) == 0);
  {
    /* Every process has exited: the last live member of each group (the first, the shrunk, the
     * lobbies, the grown groups, a failed grow's) removed its segment, whoever was killed. */
    const int left = shm_sweep(name, 0);
    if (left != 0) fprintf(stderr, "%s: %d segment(s) left behind\n", label, left);
    CHECK(left == 0);
  }
  munmap(b, sizeof *b);
}

int main(void) {
  shm_sweep("capi-grow-", 1); /* what a killed earlier run left */
  test_shrink_grow_state();
  test_failures();
  test_early_init();
  test_shm(S_GROW, "shrink 4->3, grow 3->4");
  test_shm(S_JOINER_DIES, "a joiner that dies in the join");
  return check_report("capi:grow");
}
