/* SPDX-License-Identifier: Apache-2.0 */
/* kill -9 against a sharded embedding table with replicas: 4 shm processes push the global batches
 * of tests/capi/embedding_scenario.h into a table (the optimizer and sharding rule drawn per
 * episode) while a supervisor SIGKILLs members at random moments: once during the pushes (one
 * replica), or twice (two replicas), the second while the survivors shrink or reshard, or at once
 * after the first. A survivor whose push fails shrinks, reshards without a checkpoint (the lost
 * rows must come from the replicas), and pushes on from the table's step; a failure during the
 * shrink or the reshard shrinks again. Every process that finishes must hold, bit for bit, the
 * rows one process computes from the same batches, and no segment of the episode's groups may be
 * left once every process has ended (when no process had finished before a kill: comm.h leaves a
 * segment to the next group of its name when a member is killed after every other has left).
 * Counts: kills, hangs (an episode past its budget), wrong rows, lost rows (E_LOST), segments left,
 * other failures; any of the last five fails the test.
 *   embedding_kill9 <episodes> [seed] */
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

#include "../capi/check.h"
#include "../capi/embedding_scenario.h"
#include "../capi/shm_sweep.h"
#include "gradsync/gradsync.h"

#define N 4
#define ALL_STEPS 48
#define EPISODE_BUDGET_S 60
#define TIMEOUT_MS 10000

enum { PH_START, PH_PUSH, PH_SHRINK, PH_RESHARD, PH_DONE };
enum { EXIT_OK = 0, EXIT_WRONG = 1, EXIT_LOST = 3, EXIT_FAILED = 4 };
enum { KIND_ONE, KIND_IN_SHRINK, KIND_IN_RESHARD, KIND_TWICE, KINDS };
static const char* const kind_names[KINDS] = {"one kill during the pushes", "a second kill during the shrink",
                                              "a second kill during the reshard", "two kills in a row"};

typedef struct {
  volatile int32_t phase[N];
  volatile int32_t steps[N];
  char why[N][240];
} board;

static snapshot g_reference;

static void pause_us(long us) {
  struct timespec t;
  t.tv_sec = us / 1000000;
  t.tv_nsec = (us % 1000000) * 1000L;
  nanosleep(&t, NULL);
}

static int lost_peer(int st) { return st == GRADSYNC_E_REMOTE || st == GRADSYNC_E_TIMEOUT || st == GRADSYNC_E_ABORTED; }

static int member(board* b, const char* name, int slot, int replicas, int32_t optimizer, int32_t sharding) {
  gradsync_comm_options co = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_embedding_options eo = table_options(optimizer, sharding);
  gradsync_comm* comms[2 * N];
  gradsync_embedding* t = NULL;
  int ncomms = 0, st;
  int64_t s = 0;
  co.transport = GRADSYNC_TRANSPORT_SHM;
  co.timeout_ms = TIMEOUT_MS;
  co.rank = slot;
  co.size = N;
  snprintf(co.name, sizeof co.name, "%s", name);
  eo.replicas = replicas;
  if (gradsync_comm_create(&comms[0], &co) != GRADSYNC_OK || gradsync_embedding_create(&t, comms[0], NULL, &eo) != 0) {
    snprintf(b->why[slot], sizeof b->why[slot], "create: %s", gradsync_last_error_message());
    return EXIT_FAILED;
  }
  ncomms = 1;
  while (s < ALL_STEPS) {
    gradsync_comm* latest = comms[ncomms - 1];
    int32_t rank = -1, size = 0;
    gradsync_comm_rank(latest, &rank);
    gradsync_comm_size(latest, &size);
    b->steps[slot] = (int32_t)s;
    b->phase[slot] = PH_PUSH;
    st = push_step(t, rank, size, (int)s);
    if (st == GRADSYNC_OK) {
      ++s;
      continue;
    }
    /* A peer is gone: shrink the newest group, reshard onto it with no checkpoint, and go on from
     * the table's step; a loss meanwhile shrinks again. */
    while (st != GRADSYNC_OK) {
      gradsync_comm* next = NULL;
      if (!lost_peer(st)) {
        snprintf(b->why[slot], sizeof b->why[slot], "step %lld: %s: %s", (long long)s, gradsync_status_string(st),
                 gradsync_last_error_message());
        return EXIT_FAILED;
      }
      if (ncomms == (int)(sizeof comms / sizeof comms[0])) {
        snprintf(b->why[slot], sizeof b->why[slot], "%d groups in one episode", ncomms);
        return EXIT_FAILED;
      }
      b->phase[slot] = PH_SHRINK;
      st = gradsync_comm_shrink(comms[ncomms - 1], &next, NULL, 0, NULL);
      if (st != GRADSYNC_OK) {
        snprintf(b->why[slot], sizeof b->why[slot], "shrink: %s", gradsync_last_error_message());
        return EXIT_FAILED;
      }
      comms[ncomms++] = next;
      b->phase[slot] = PH_RESHARD;
      st = gradsync_embedding_reshard(t, next, GRADSYNC_EMBEDDING_KEEP_SHARDING, NULL, NULL, NULL);
      if (st == GRADSYNC_E_LOST) {
        snprintf(b->why[slot], sizeof b->why[slot], "%s", gradsync_last_error_message());
        return EXIT_LOST;
      }
    }
    gradsync_embedding_steps(t, &s);
  }
  b->phase[slot] = PH_DONE;
  if (compare_local(t, &g_reference, optimizer, "after the kills") != 0) {
    snprintf(b->why[slot], sizeof b->why[slot], "rows differ from one process's");
    return EXIT_WRONG;
  }
  gradsync_embedding_free(t);
  while (ncomms > 0) gradsync_comm_free(comms[--ncomms]);
  return EXIT_OK;
}

static int alive_other(const int* dead, unsigned* seed) {
  int r;
  do r = (int)(rand_r(seed) % N);
  while (dead[r]);
  return r;
}

/* Waits until some live member is in `phase` (or all have finished); returns 1 if one is. */
static int wait_phase(const board* b, const int* dead, int phase, int64_t budget_us) {
  int64_t waited;
  int r;
  for (waited = 0; waited < budget_us; waited += 50) {
    int done = 1;
    for (r = 0; r < N; ++r) {
      if (dead[r]) continue;
      if (b->phase[r] == phase) return 1;
      done &= b->phase[r] == PH_DONE;
    }
    if (done) return 0;
    pause_us(50);
  }
  return 0;
}

typedef struct {
  int kills, hangs, wrong, lost, failed, finished, left, by_kind[KINDS];
} totals;

/* Whether some member had finished (a kill then may come after every other member left). */
static int any_done(const board* b) {
  int r, done = 0;
  for (r = 0; r < N; ++r) done |= b->phase[r] == PH_DONE;
  return done;
}

static void episode(int e, unsigned* seed, board* b, totals* tot) {
  const int kind = (int)(rand_r(seed) % KINDS);
  const int replicas = kind == KIND_ONE ? 1 : 2;
  static const int32_t optimizers[] = {GRADSYNC_OPTIM_SGD, GRADSYNC_OPTIM_ROW_ADAGRAD, GRADSYNC_OPTIM_ADAM};
  const int32_t optimizer = optimizers[rand_r(seed) % 3];
  const int32_t sharding = (int32_t)(rand_r(seed) % 2);
  char name[64];
  pid_t pids[N];
  int dead[N] = {0, 0, 0, 0}, status[N], r, first, ended = 0;
  const int at = 2 + (int)(rand_r(seed) % (ALL_STEPS / 2));
  int clean = 1; /* no process had finished at a kill: nothing of the groups may be left */
  int64_t waited;
  memset(b, 0, sizeof *b);
  snprintf(name, sizeof name, "emb-kill9-%ld-%d", (long)getpid(), e);
  reference(optimizer, ALL_STEPS, 0, &g_reference);
  for (r = 0; r < N; ++r) {
    pids[r] = fork();
    if (pids[r] == 0) {
      check_failures = 0;
      _exit(member(b, name, r, replicas, optimizer, sharding));
    }
  }
  /* The first kill: at a random moment once the group reached step `at`, inside a push as often as
   * not. */
  for (waited = 0; waited < 20000000; waited += 100) {
    int there = 1;
    for (r = 0; r < N; ++r) there &= b->steps[r] >= at || b->phase[r] == PH_DONE;
    if (there) break;
    pause_us(100);
  }
  pause_us((long)(rand_r(seed) % 3000));
  first = alive_other(dead, seed);
  clean &= !any_done(b);
  kill(pids[first], SIGKILL);
  dead[first] = 1;
  ++tot->kills;
  if (kind != KIND_ONE) {
    const int second = alive_other(dead, seed);
    int hit = 1;
    if (kind == KIND_IN_SHRINK) hit = wait_phase(b, dead, PH_SHRINK, 5000000);
    if (kind == KIND_IN_RESHARD) hit = wait_phase(b, dead, PH_RESHARD, 5000000);
    if (kind != KIND_TWICE) pause_us((long)(rand_r(seed) % 500));
    if (hit) {
      clean &= !any_done(b);
      kill(pids[second], SIGKILL);
      dead[second] = 1;
      ++tot->kills;
    }
  }
  tot->by_kind[kind] += 1;
  /* Every process ends within the budget, or the episode is a hang. */
  for (waited = 0; waited < (int64_t)EPISODE_BUDGET_S * 1000000 && ended < N; waited += 1000) {
    for (r = 0; r < N; ++r) {
      if (pids[r] > 0 && waitpid(pids[r], &status[r], WNOHANG) == pids[r]) {
        pids[r] = -pids[r];
        ++ended;
      }
    }
    if (ended < N) pause_us(1000);
  }
  if (ended < N) {
    ++tot->hangs;
    fprintf(stderr, "episode %d (%s): a hang; phases", e, kind_names[kind]);
    for (r = 0; r < N; ++r) fprintf(stderr, " %d@%d", b->phase[r], b->steps[r]);
    fprintf(stderr, "\n");
    for (r = 0; r < N; ++r)
      if (pids[r] > 0) {
        kill(pids[r], SIGKILL);
        waitpid(pids[r], &status[r], 0);
      }
  }
  for (r = 0; r < N; ++r) {
    const int st = status[r];
    if (dead[r]) continue;
    if (WIFEXITED(st) && WEXITSTATUS(st) == EXIT_OK) {
      ++tot->finished;
      continue;
    }
    if (WIFEXITED(st) && WEXITSTATUS(st) == EXIT_WRONG)
      ++tot->wrong;
    else if (WIFEXITED(st) && WEXITSTATUS(st) == EXIT_LOST)
      ++tot->lost;
    else
      ++tot->failed;
    fprintf(stderr, "episode %d (%s, replicas %d, optimizer %d, sharding %d): process %d ended with %#x: %s\n", e,
            kind_names[kind], replicas, (int)optimizer, (int)sharding, r, (unsigned)st, b->why[r]);
  }
  {
    const int left = shm_sweep(name, 0);
    if (left != 0 && clean && ended == N) {
      ++tot->left;
      fprintf(stderr, "episode %d (%s): %d segment(s) left behind\n", e, kind_names[kind], left);
    }
  }
}

int main(int argc, char** argv) {
  const int episodes = argc > 1 ? atoi(argv[1]) : 20;
  unsigned seed = argc > 2 ? (unsigned)strtoul(argv[2], NULL, 10) : (unsigned)time(NULL);
  board* b = mmap(NULL, sizeof(board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  totals tot;
  int e, k;
  if (b == MAP_FAILED) {
    CHECK(0 && "no shared board");
    return check_report("stress:embedding_kill9");
  }
  memset(&tot, 0, sizeof tot);
  fprintf(stderr, "embedding_kill9: seed %u, %d episodes\n", seed, episodes);
  shm_sweep("emb-kill9-", 1);
  for (e = 0; e < episodes; ++e) episode(e, &seed, b, &tot);
  for (k = 0; k < KINDS; ++k) fprintf(stderr, "  %-36s %d episodes\n", kind_names[k], tot.by_kind[k]);
  fprintf(stderr,
          "kills %d; processes that finished verified %d; hangs %d; wrong rows %d; lost rows %d; segments left %d; "
          "other failures %d\n",
          tot.kills, tot.finished, tot.hangs, tot.wrong, tot.lost, tot.left, tot.failed);
  CHECK(tot.hangs == 0 && tot.wrong == 0 && tot.lost == 0 && tot.left == 0 && tot.failed == 0);
  CHECK(tot.finished > 0);
  munmap(b, sizeof *b);
  return check_report("stress:embedding_kill9");
}
