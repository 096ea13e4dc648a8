/* SPDX-License-Identifier: Apache-2.0 */
/* gradsync_embedding_reshard through a change of membership, on threads and on shared-memory
 * processes. Four ranks push the global batches of embedding_scenario.h into a row-wise Adagrad
 * table and save a checkpoint after CKPT_AT steps; rank `lost` goes after LOSS_AT (a SIGKILL on
 * shm, a thread that frees its communicator on threads). The survivors' next push fails, they
 * shrink 4 -> 3, and reshard:
 *   - with a checkpoint directory on some ranks only, or an unknown rule on one rank:
 *     GRADSYNC_E_INVALID_ARG on every survivor;
 *   - with the directory of a checkpoint of another shape: GRADSYNC_E_MISMATCH on every survivor;
 *   - without a directory: GRADSYNC_E_LOST naming the lost rank's rows, on every survivor;
 *   - with the last checkpoint: every row comes from it, the step count is CKPT_AT,
 * each failure leaving the table as it was. They replay the pushes since the checkpoint on 3 ranks
 * and train on to GROW_AT, then grow back to 4 with a joiner (a forked process on shm), which
 * creates its table on the grown group and gets its rows in memory by the reshard of every rank
 * (nothing lost: no checkpoint read); then all four change the rule to hash in place and train to
 * the end. Every rank's rows and Adagrad state must then equal, bit for bit, those one process
 * computes from the same global batches (the table's result does not depend on the world size).
 * Then a rank is SIGKILLed during the reshard itself (a change of rule in place on 4 ranks, and a
 * grow 3 -> 4 whose moved rows land in place), at delays that land in the call or after it: every
 * survivor's call returns, its rows are still the table's, and the documented recovery (shrink
 * new_comm, reshard from the checkpoint, replay) ends equal to one process.
 * Each phase of the recovery is timed (detect: from the loss to the failed push; shrink;
 * restore: the reshard that loads the checkpoint; replay) and printed; GRADSYNC_EMB_ELASTIC_RUNS
 * repeats the shm episode (default 1) and prints min / median / max. No time is asserted. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "embedding_scenario.h"
#include "gradsync/gradsync.h"
#include "shm_sweep.h"

#define N 4
#define CKPT_AT 3
#define LOSS_AT 6
#define GROW_AT 9
#define RULE_AT 11
#define ALL_STEPS 13
#define MAX_RUNS 32

enum { PHASE_DETECT, PHASE_SHRINK, PHASE_RESTORE, PHASE_REPLAY, PHASE_GROW, PHASE_RESHARD, PHASES };
static const char* const phase_names[PHASES] = {"detect", "shrink",      "restore (reshard from checkpoint)",
                                                "replay", "grow (join)", "reshard in memory (joiner)"};

/* Shared by the ranks (threads or processes) of one episode. */
typedef struct {
  volatile int32_t ready[N];  /* rank r trained to LOSS_AT */
  volatile int32_t shrunk[N]; /* survivor r is ready to grow */
  volatile int32_t may_grow;
  volatile int64_t lost_ns; /* when the lost rank went (CLOCK_MONOTONIC) */
  int64_t phase_ns[N][PHASES];
  int32_t bad[N + 1]; /* rows that differ from the reference, per final rank */
  int32_t done[N + 1];
} board;

static snapshot g_reference;
static char g_checkpoint[256], g_wrong_checkpoint[256];

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void pause_ms(long ms) {
  struct timespec t;
  t.tv_sec = ms / 1000;
  t.tv_nsec = (ms % 1000) * 1000000L;
  nanosleep(&t, NULL);
}

static gradsync_comm_options comm_options(int32_t transport, const char* name, int32_t rank, int32_t size) {
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  o.transport = transport;
  o.rank = rank;
  o.size = size;
  o.timeout_ms = 30000;
  snprintf(o.name, sizeof o.name, "%s", name);
  return o;
}

typedef struct {
  board* b;
  int32_t transport;
  const char* name;
  int rank;
  int lost;
} job;

/* Every rank of the final group: its rows against the reference. */
static void finish(board* b, gradsync_embedding* t, gradsync_comm* c) {
  int32_t r = -1;
  gradsync_comm_rank(c, &r);
  if (r < 0 || r > N) return;
  b->bad[r] = compare_local(t, &g_reference, GRADSYNC_OPTIM_ROW_ADAGRAD, "after the loss, restore and grow");
  b->done[r] = 1;
}

/* Grows back to 4 and trains to the end: the part members and the joiner share. */
static void grown_part(board* b, gradsync_embedding* t, gradsync_comm* grown, int joiner, int64_t* phase) {
  int32_t r = -1, restored = -1;
  uint64_t moved = 0;
  int64_t steps = -1, t0 = now_ns();
  gradsync_comm_rank(grown, &r);
  /* The joiner holds nothing of the old group: the members' rows come to it in memory, and no
   * checkpoint is read (every row of the 3-rank group lives). */
  CHECK_STATUS(gradsync_embedding_reshard(t, grown, GRADSYNC_EMBEDDING_KEEP_SHARDING, g_checkpoint, &moved, &restored),
               GRADSYNC_OK);
  if (joiner) phase[PHASE_RESHARD] = now_ns() - t0;
  CHECK(restored == 0);
  CHECK(!joiner || moved > 0);
  CHECK_STATUS(gradsync_embedding_steps(t, &steps), GRADSYNC_OK);
  CHECK(steps == GROW_AT);
  train(t, r, N, GROW_AT, RULE_AT);
  /* A change of rule in place: the same group, hash sharding. */
  CHECK_STATUS(gradsync_embedding_reshard(t, grown, GRADSYNC_EMBEDDING_HASH, NULL, NULL, &restored), GRADSYNC_OK);
  CHECK(restored == 0);
  train(t, r, N, RULE_AT, ALL_STEPS);
  finish(b, t, grown);
}

static void survivor_part(job* j, gradsync_comm* c, gradsync_embedding* t) {
  board* b = j->b;
  int64_t* phase = b->phase_ns[j->rank];
  gradsync_comm *shrunk = NULL, *grown = NULL;
  int32_t failed[N], r = -1, restored = -1;
  int64_t steps = -1, t0;
  char join_name[64];
  int64_t* ids = malloc(GLOBAL * sizeof(int64_t));
  float* grads = malloc(GLOBAL * DIM * sizeof(float));
  int lo, hi, st;
  snprintf(join_name, sizeof join_name, "%.40s-join", j->name);
  /* The push of step LOSS_AT fails once the loss shows. */
  global_batch(LOSS_AT, ids, grads);
  slice_of(LOSS_AT, j->rank, N, &lo, &hi);
  st = gradsync_embedding_push(t, ids + lo, (size_t)(hi - lo), grads + lo * DIM, (size_t)(hi - lo) * DIM);
  phase[PHASE_DETECT] = now_ns() - __atomic_load_n(&b->lost_ns, __ATOMIC_SEQ_CST);
  CHECK(st != GRADSYNC_OK);
  free(ids);
  free(grads);
  t0 = now_ns();
  CHECK_STATUS(gradsync_comm_shrink(c, &shrunk, failed, N, NULL), GRADSYNC_OK);
  phase[PHASE_SHRINK] = now_ns() - t0;
  if (shrunk == NULL) return;
  gradsync_comm_rank(shrunk, &r);
  /* Bad input first; each fails on every survivor alike and changes nothing. */
  CHECK_STATUS_MSG(
      gradsync_embedding_reshard(t, shrunk, GRADSYNC_EMBEDDING_KEEP_SHARDING, r == 1 ? NULL : g_checkpoint, NULL, NULL),
      GRADSYNC_E_INVALID_ARG, "checkpoint directory");
  /* An unknown rule on one rank: judged in the call's agreement, so its peers fail with it at once
   * instead of waiting out their deadline. */
  CHECK_STATUS_MSG(
      gradsync_embedding_reshard(t, shrunk, r == 2 ? 7 : GRADSYNC_EMBEDDING_KEEP_SHARDING, g_checkpoint, NULL, NULL),
      GRADSYNC_E_INVALID_ARG, "rank 2 passed an unknown sharding");
  CHECK_STATUS_MSG(
      gradsync_embedding_reshard(t, shrunk, GRADSYNC_EMBEDDING_KEEP_SHARDING, g_wrong_checkpoint, NULL, NULL),
      GRADSYNC_E_MISMATCH, " has 1000 x 8, the table 1000 x 7");
  {
    char lost_rows[64];
    snprintf(lost_rows, sizeof lost_rows, "old rank %d's rows [%d, %d)", j->lost, ROWS * j->lost / N,
             ROWS * (j->lost + 1) / N);
    CHECK_STATUS_MSG(gradsync_embedding_reshard(t, shrunk, GRADSYNC_EMBEDDING_KEEP_SHARDING, NULL, NULL, &restored),
                     GRADSYNC_E_LOST, lost_rows);
  }
  CHECK_STATUS(gradsync_embedding_steps(t, &steps), GRADSYNC_OK);
  CHECK(steps == LOSS_AT);
  /* The honest path: every row from the last checkpoint, then replay. */
  t0 = now_ns();
  CHECK_STATUS(gradsync_embedding_reshard(t, shrunk, GRADSYNC_EMBEDDING_KEEP_SHARDING, g_checkpoint, NULL, &restored),
               GRADSYNC_OK);
  phase[PHASE_RESTORE] = now_ns() - t0;
  CHECK(restored == 1);
  CHECK_STATUS(gradsync_embedding_steps(t, &steps), GRADSYNC_OK);
  CHECK(steps == CKPT_AT);
  t0 = now_ns();
  train(t, r, N - 1, CKPT_AT, LOSS_AT);
  phase[PHASE_REPLAY] = now_ns() - t0;
  train(t, r, N - 1, LOSS_AT, GROW_AT);
  __atomic_store_n(&b->shrunk[j->rank], 1, __ATOMIC_SEQ_CST);
  while (!__atomic_load_n(&b->may_grow, __ATOMIC_SEQ_CST)) pause_ms(1);
  CHECK_STATUS(gradsync_comm_grow(shrunk, join_name, 1, &grown, NULL), GRADSYNC_OK);
  if (grown != NULL) grown_part(b, t, grown, 0, phase);
  gradsync_embedding_free(t);
  gradsync_comm_free(c);
  gradsync_comm_free(shrunk);
  gradsync_comm_free(grown);
}

static void* member(void* p) {
  job* j = (job*)p;
  gradsync_comm_options o = comm_options(j->transport, j->name, j->rank, N);
  gradsync_embedding_options eo = table_options(GRADSYNC_OPTIM_ROW_ADAGRAD, GRADSYNC_EMBEDDING_CONTIGUOUS);
  gradsync_comm* c = NULL;
  gradsync_embedding* t = NULL;
  CHECK_STATUS(gradsync_comm_create(&c, &o), GRADSYNC_OK);
  if (c == NULL) return NULL;
  CHECK_STATUS(gradsync_embedding_create(&t, c, NULL, &eo), GRADSYNC_OK);
  train(t, j->rank, N, 0, CKPT_AT);
  CHECK_STATUS(gradsync_embedding_save(t, g_checkpoint), GRADSYNC_OK);
  train(t, j->rank, N, CKPT_AT, LOSS_AT);
  __atomic_store_n(&j->b->ready[j->rank], 1, __ATOMIC_SEQ_CST);
  if (j->rank == j->lost) {
    if (j->transport == GRADSYNC_TRANSPORT_SHM) {
      for (;;) pause_ms(1000); /* the parent SIGKILLs it */
    }
    /* threads: the rank goes (its communicator ends) */
    while (!(__atomic_load_n(&j->b->ready[0], __ATOMIC_SEQ_CST) && __atomic_load_n(&j->b->ready[1], __ATOMIC_SEQ_CST) &&
             __atomic_load_n(&j->b->ready[2], __ATOMIC_SEQ_CST) && __atomic_load_n(&j->b->ready[3], __ATOMIC_SEQ_CST)))
      pause_ms(1);
    __atomic_store_n(&j->b->lost_ns, now_ns(), __ATOMIC_SEQ_CST);
    gradsync_embedding_free(t);
    gradsync_comm_free(c);
    return NULL;
  }
  survivor_part(j, c, t);
  return NULL;
}

static void* joiner(void* p) {
  job* j = (job*)p;
  char join_name[64];
  gradsync_comm_options o;
  gradsync_embedding_options eo = table_options(GRADSYNC_OPTIM_ROW_ADAGRAD, GRADSYNC_EMBEDDING_CONTIGUOUS);
  gradsync_comm* grown = NULL;
  gradsync_embedding* t = NULL;
  int64_t t0;
  snprintf(join_name, sizeof join_name, "%.40s-join", j->name);
  o = comm_options(j->transport, join_name, 0, 1);
  t0 = now_ns();
  CHECK_STATUS(gradsync_comm_join(&grown, &o, NULL), GRADSYNC_OK);
  j->b->phase_ns[j->lost][PHASE_GROW] = now_ns() - t0;
  if (grown == NULL) return NULL;
  /* Its own rows (the seed's) are discarded: the reshard brings the members'. */
  CHECK_STATUS(gradsync_embedding_create(&t, grown, NULL, &eo), GRADSYNC_OK);
  grown_part(j->b, t, grown, 1, j->b->phase_ns[j->lost]);
  gradsync_embedding_free(t);
  gradsync_comm_free(grown);
  return NULL;
}

static void wait_flags(volatile int32_t* flags, int lost) {
  int waited, i;
  for (waited = 0; waited < 120000; ++waited) {
    int all = 1;
    for (i = 0; i < N; ++i) all &= i == lost || __atomic_load_n(&flags[i], __ATOMIC_SEQ_CST) == 1;
    if (all) return;
    pause_ms(1);
  }
}

/* Writes a checkpoint of a table of another shape (DIM + 1) into g_wrong_checkpoint. */
static void wrong_shape_checkpoint(void) {
  gradsync_comm_options o = comm_options(GRADSYNC_TRANSPORT_THREAD, "capi-emb-elastic-wrong", 0, 1);
  gradsync_embedding_options eo = table_options(GRADSYNC_OPTIM_ROW_ADAGRAD, GRADSYNC_EMBEDDING_CONTIGUOUS);
  gradsync_comm* c = NULL;
  gradsync_embedding* t = NULL;
  eo.dim = DIM + 1;
  CHECK_STATUS(gradsync_comm_create(&c, &o), GRADSYNC_OK);
  CHECK_STATUS(gradsync_embedding_create(&t, c, NULL, &eo), GRADSYNC_OK);
  CHECK_STATUS(gradsync_embedding_save(t, g_wrong_checkpoint), GRADSYNC_OK);
  gradsync_embedding_free(t);
  gradsync_comm_free(c);
}

static void check_final(const board* b, const char* label) {
  int i;
  for (i = 0; i < N; ++i) {
    if (!b->done[i] || b->bad[i] != 0) {
      fprintf(stderr, "%s: final rank %d %s\n", label, i, b->done[i] ? "differs from the reference" : "did not finish");
      check_failed();
    }
  }
}

static void print_phases(const board* b, int lost, const char* label) {
  int i, p;
  for (p = 0; p < PHASES; ++p) {
    int64_t worst = 0;
    for (i = 0; i < N; ++i)
      if (b->phase_ns[i][p] > worst) worst = b->phase_ns[i][p];
    fprintf(stderr, "%s (rank %d lost): %s %.2f ms (slowest rank)\n", label, lost, phase_names[p], worst / 1e6);
  }
}

/* Ranks 0 to N-1 of the first group, then the joiner. */
static void set_jobs(job* jobs, board* b, int32_t transport, const char* name, int lost) {
  int i;
  memset(b, 0, sizeof *b);
  for (i = 0; i <= N; ++i) {
    jobs[i].b = b;
    jobs[i].transport = transport;
    jobs[i].name = name;
    jobs[i].rank = i;
    jobs[i].lost = lost;
  }
}

static void episode_threads(int lost, board* b) {
  pthread_t t[N + 1];
  job jobs[N + 1];
  char name[64];
  int i;
  snprintf(name, sizeof name, "capi-emb-elastic-thr-%d", lost);
  set_jobs(jobs, b, GRADSYNC_TRANSPORT_THREAD, name, lost);
  for (i = 0; i < N; ++i) pthread_create(&t[i], NULL, member, &jobs[i]);
  wait_flags(b->shrunk, lost);
  pthread_create(&t[N], NULL, joiner, &jobs[N]);
  __atomic_store_n(&b->may_grow, 1, __ATOMIC_SEQ_CST);
  for (i = 0; i <= N; ++i) pthread_join(t[i], NULL);
  check_final(b, "threads");
  print_phases(b, lost, "threads");
}

static int child_exit(void) { return check_failures == 0 ? 0 : 1; }

static void reap(pid_t pid, int killed, const char* who) {
  int status = 0;
  waitpid(pid, &status, 0);
  if (killed) {
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "shm: %s ended with status %#x\n", who, (unsigned)status);
    check_failed();
  }
}

static void episode_shm(int lost, int run, board* b) {
  pid_t pids[N], joiner_pid;
  job jobs[N + 1];
  char name[64];
  int i;
  snprintf(name, sizeof name, "capi-emb-elastic-%ld-%d-%d", (long)getpid(), lost, run);
  set_jobs(jobs, b, GRADSYNC_TRANSPORT_SHM, name, lost);
  for (i = 0; i < N; ++i) {
    pids[i] = fork();
    if (pids[i] == 0) {
      member(&jobs[i]);
      _exit(child_exit());
    }
  }
  wait_flags(b->ready, -1);
  __atomic_store_n(&b->lost_ns, now_ns(), __ATOMIC_SEQ_CST);
  kill(pids[lost], SIGKILL);
  wait_flags(b->shrunk, lost);
  joiner_pid = fork();
  if (joiner_pid == 0) {
    joiner(&jobs[N]);
    _exit(child_exit());
  }
  __atomic_store_n(&b->may_grow, 1, __ATOMIC_SEQ_CST);
  for (i = 0; i < N; ++i) reap(pids[i], i == lost, "a member");
  reap(joiner_pid, 0, "the joiner");
  check_final(b, "shm");
  print_phases(b, lost, "shm");
  {
    const int left = shm_sweep(name, 0);
    if (left != 0) fprintf(stderr, "shm: %d segment(s) left behind\n", left);
    CHECK(left == 0);
  }
}

/* A rank SIGKILLed during a change of rule in place (contiguous -> hash, 4 shm ranks): a thread of
 * the victim kills its own process `delay_us` after the four enter the call, so that across delays
 * the kill lands in the call's agreement, the exchange, or after the call. Whichever it hits, every
 * survivor's call returns (an error from the communicator, or success when the call completed
 * first), its rows are then still the table's as of LOSS_AT, bit for bit, and the documented
 * recovery (shrink, reshard from the last checkpoint, replay) ends equal to one process. */
#define KILLED 2
static snapshot g_at_loss;

typedef struct {
  volatile int32_t ready[N], go;
  int32_t failed[N]; /* survivor r's reshard returned an error */
  int64_t returned_ns[N];
  char message[N][200]; /* its error: names the collective the kill interrupted */
} kill_board;

static void* kill_self(void* p) {
  const long us = *(const long*)p;
  struct timespec t;
  t.tv_sec = us / 1000000;
  t.tv_nsec = (us % 1000000) * 1000L;
  if (us > 0) nanosleep(&t, NULL);
  kill(getpid(), SIGKILL);
  return NULL;
}

/* Rank `rank` of a kill episode. Rule change: 4 ranks of one group, contiguous -> hash in place.
 * Grow: ranks 0-2 form a group of 3, grow it by rank 3, a joiner, and all four reshard onto the
 * grown group (contiguous: the moved rows land in place). */
static void kill_rank(kill_board* kb, const char* name, const char* ckpt, int rank, long delay_us, int grow) {
  const int members = grow ? N - 1 : N, joiner = grow && rank == N - 1;
  char join_name[64];
  gradsync_comm_options o = comm_options(GRADSYNC_TRANSPORT_SHM, name, rank, members);
  gradsync_embedding_options eo = table_options(GRADSYNC_OPTIM_ROW_ADAGRAD, GRADSYNC_EMBEDDING_CONTIGUOUS);
  gradsync_comm *c = NULL, *next = NULL, *shrunk = NULL;
  gradsync_embedding* t = NULL;
  int32_t failed[N], r = -1, restored = -1;
  int64_t steps = -1, t0;
  int st;
  pthread_t killer;
  snprintf(join_name, sizeof join_name, "%.40s-join", name);
  if (joiner) o = comm_options(GRADSYNC_TRANSPORT_SHM, join_name, 0, 1);
  o.timeout_ms = 5000;
  if (joiner) {
    CHECK_STATUS(gradsync_comm_join(&next, &o, NULL), GRADSYNC_OK);
    if (next == NULL) return;
    CHECK_STATUS(gradsync_embedding_create(&t, next, NULL, &eo), GRADSYNC_OK);
  } else {
    CHECK_STATUS(gradsync_comm_create(&c, &o), GRADSYNC_OK);
    if (c == NULL) return;
    CHECK_STATUS(gradsync_embedding_create(&t, c, NULL, &eo), GRADSYNC_OK);
    train(t, rank, members, 0, CKPT_AT);
    CHECK_STATUS(gradsync_embedding_save(t, ckpt), GRADSYNC_OK);
    train(t, rank, members, CKPT_AT, LOSS_AT);
    if (grow) {
      CHECK_STATUS(gradsync_comm_grow(c, join_name, 1, &next, NULL), GRADSYNC_OK);
      if (next == NULL) return;
    } else {
      next = c;
    }
  }
  __atomic_store_n(&kb->ready[rank], 1, __ATOMIC_SEQ_CST);
  while (!__atomic_load_n(&kb->go, __ATOMIC_SEQ_CST)) sched_yield(); /* the four start together */
  if (rank == KILLED && pthread_create(&killer, NULL, kill_self, &delay_us) != 0) kill(getpid(), SIGKILL);
  t0 = now_ns();
  st = gradsync_embedding_reshard(t, next, grow ? GRADSYNC_EMBEDDING_KEEP_SHARDING : GRADSYNC_EMBEDDING_HASH, NULL,
                                  NULL, NULL);
  kb->returned_ns[rank] = now_ns() - t0;
  if (rank == KILLED) {
    for (;;) pause_ms(1000); /* its thread kills it */
  }
  kb->failed[rank] = st != GRADSYNC_OK;
  if (st != GRADSYNC_OK) snprintf(kb->message[rank], sizeof kb->message[rank], "%s", gradsync_last_error_message());
  if (st != GRADSYNC_OK && st != GRADSYNC_E_REMOTE && st != GRADSYNC_E_TIMEOUT && st != GRADSYNC_E_ABORTED) {
    fprintf(stderr, "kill after %ld us: rank %d's reshard returned %d (%s)\n", delay_us, rank, st,
            gradsync_last_error_message());
    check_failed();
  }
  /* Failed or not, a member's rows are the table's as of LOSS_AT (on the old or the new layout); a
   * joiner's only once the call succeeded. */
  if (!joiner || st == GRADSYNC_OK) {
    CHECK_STATUS(gradsync_embedding_steps(t, &steps), GRADSYNC_OK);
    CHECK(steps == LOSS_AT);
    CHECK(compare_local(t, &g_at_loss, GRADSYNC_OPTIM_ROW_ADAGRAD, "after the interrupted reshard") == 0);
  }
  /* The documented recovery: shrink new_comm, every row from the checkpoint, replay. */
  CHECK_STATUS(gradsync_comm_shrink(next, &shrunk, failed, N, NULL), GRADSYNC_OK);
  if (shrunk != NULL) {
    gradsync_comm_rank(shrunk, &r);
    if (joiner && st != GRADSYNC_OK) { /* it never held the table: it joins the shrunk group afresh */
      gradsync_embedding_free(t);
      t = NULL;
      CHECK_STATUS(gradsync_embedding_create(&t, shrunk, NULL, &eo), GRADSYNC_OK);
    }
    CHECK_STATUS(gradsync_embedding_reshard(t, shrunk, GRADSYNC_EMBEDDING_HASH, ckpt, NULL, &restored), GRADSYNC_OK);
    CHECK(restored == 1);
    CHECK_STATUS(gradsync_embedding_steps(t, &steps), GRADSYNC_OK);
    CHECK(steps == CKPT_AT);
    train(t, r, N - 1, CKPT_AT, ALL_STEPS);
    CHECK(compare_local(t, &g_reference, GRADSYNC_OPTIM_ROW_ADAGRAD, "after the kill, restore and replay") == 0);
  }
  gradsync_embedding_free(t);
  gradsync_comm_free(shrunk);
  if (next != c) gradsync_comm_free(next);
  gradsync_comm_free(c);
}

static void episode_kill(long delay_us, int grow, const char* dir, kill_board* kb) {
  pid_t pids[N];
  char name[64], ckpt[300];
  int i, failed = 0;
  int64_t slowest = 0;
  snprintf(name, sizeof name, "capi-emb-elastic-kill-%ld-%d-%ld", (long)getpid(), grow, delay_us);
  snprintf(ckpt, sizeof ckpt, "%s/kill-%d-%ld", dir, grow, delay_us);
  memset(kb, 0, sizeof *kb);
  for (i = 0; i < N; ++i) {
    pids[i] = fork();
    if (pids[i] == 0) {
      kill_rank(kb, name, ckpt, i, delay_us, grow);
      _exit(child_exit());
    }
  }
  /* Bounded: a child that died before it was ready would leave the others waiting for go forever. */
  {
    const int64_t give_up = now_ns() + 60 * 1000000000LL;
    for (i = 0; i < N; ++i) {
      while (!__atomic_load_n(&kb->ready[i], __ATOMIC_SEQ_CST) && now_ns() < give_up) pause_ms(1);
      if (!__atomic_load_n(&kb->ready[i], __ATOMIC_SEQ_CST)) {
        int j;
        fprintf(stderr, "shm: rank %d was not ready within 60 s; ending the episode\n", i);
        for (j = 0; j < N; ++j) kill(pids[j], SIGKILL);
        for (j = 0; j < N; ++j) waitpid(pids[j], NULL, 0);
        shm_sweep(name, 0);
        check_failed();
        return;
      }
    }
  }
  __atomic_store_n(&kb->go, 1, __ATOMIC_SEQ_CST);
  for (i = 0; i < N; ++i) reap(pids[i], i == KILLED, "a survivor");
  for (i = 0; i < N; ++i) {
    if (i == KILLED) continue;
    failed += kb->failed[i];
    if (kb->returned_ns[i] > slowest) slowest = kb->returned_ns[i];
  }
  fprintf(
      stderr,
      "shm: rank %d killed %ld us into the reshard (%s): %d of %d survivors failed (%s), the slowest returned after "
      "%.2f ms\n",
      KILLED, delay_us, grow ? "grow 3 -> 4" : "contiguous -> hash", failed, N - 1, kb->message[0], slowest / 1e6);
  {
    const int left = shm_sweep(name, 0);
    if (left != 0) fprintf(stderr, "shm: %d segment(s) left behind\n", left);
    CHECK(left == 0);
  }
}

static int by_value(const void* a, const void* b) {
  const int64_t x = *(const int64_t*)a, y = *(const int64_t*)b;
  return (x > y) - (x < y);
}

int main(void) {
  board* b = mmap(NULL, sizeof(board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  const char* runs_env = getenv("GRADSYNC_EMB_ELASTIC_RUNS");
  int runs = runs_env != NULL ? atoi(runs_env) : 1, run, p, i;
  static int64_t spread[PHASES][MAX_RUNS];
  char tmp[] = "/tmp/gradsync-emb-elastic-XXXXXX";
  if (b == MAP_FAILED || mkdtemp(tmp) == NULL) {
    CHECK(0 && "no shared board or temporary directory");
    return check_report("capi:embedding_elastic");
  }
  if (runs < 1) runs = 1;
  if (runs > MAX_RUNS) runs = MAX_RUNS;
  snprintf(g_checkpoint, sizeof g_checkpoint, "%s/ckpt", tmp);
  snprintf(g_wrong_checkpoint, sizeof g_wrong_checkpoint, "%s/wrong", tmp);
  shm_sweep("capi-emb-elastic-", 1);
  reference(GRADSYNC_OPTIM_ROW_ADAGRAD, ALL_STEPS, 0, &g_reference);
  wrong_shape_checkpoint();
  episode_threads(2, b);
  episode_threads(0, b);
  {
    static const long delays_us[] = {0, 300, 1000, 1500, 2000, 2500, 3000};
    kill_board* kb = mmap(NULL, sizeof(kill_board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(kb != MAP_FAILED);
    reference(GRADSYNC_OPTIM_ROW_ADAGRAD, LOSS_AT, 0, &g_at_loss);
    for (i = 0; kb != MAP_FAILED && i < (int)(sizeof delays_us / sizeof delays_us[0]); ++i) {
      episode_kill(delays_us[i], 0, tmp, kb);
      episode_kill(delays_us[i], 1, tmp, kb);
    }
    if (kb != MAP_FAILED) munmap(kb, sizeof *kb);
  }
  for (run = 0; run < runs; ++run) {
    const int lost = run % 2 == 0 ? 1 : 0; /* rank 0 (whose push merges its ids) too */
    episode_shm(lost, run, b);
    for (p = 0; p < PHASES; ++p) {
      int64_t worst = 0;
      for (i = 0; i < N; ++i)
        if (b->phase_ns[i][p] > worst) worst = b->phase_ns[i][p];
      spread[p][run] = worst;
    }
  }
  if (runs > 1) {
    for (p = 0; p < PHASES; ++p) {
      qsort(spread[p], (size_t)runs, sizeof(int64_t), by_value);
      fprintf(stderr, "shm over %d runs: %s min %.2f / median %.2f / max %.2f ms\n", runs, phase_names[p],
              spread[p][0] / 1e6, spread[p][runs / 2] / 1e6, spread[p][runs - 1] / 1e6);
    }
  }
  munmap(b, sizeof *b);
  {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmp);
  }
  return check_report("capi:embedding_elastic");
}
