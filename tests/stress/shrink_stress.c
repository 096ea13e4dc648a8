/* SPDX-License-Identifier: Apache-2.0 */
/* Survive kill -9 in place: shm processes train an Adam ZeRO-1 parameter (replicas >= 1) while a
 * supervisor SIGKILLs members at random times and phases: during steps, during the survivors'
 * shrink, during their reshard, and twice in a row. The survivors shrink, reshard and train on;
 * at the end every survivor's weights must equal, bit for bit, those of a run that never lost a
 * rank (every rank's gradient is the same exact value, so the mean is the same on any number of
 * ranks). Counts: kills, episodes by phase, hangs (an episode past its budget), wrong results,
 * lost state. Any hang, wrong result or lost state fails.
 * Grow episodes: after the loss and shrink, the survivors grow back to 4, one forked joiner per
 * grow attempt, and one process (a member or the joiner) is SIGKILLed at a random moment of the
 * grow or of the catch-up (the weights by broadcast, the optimizer slices by reshard). Every
 * process follows comm.h: a failed grow is reset on every member (shrunk when the reset fails: a
 * member is lost) and tried again with a fresh joiner; a failed catch-up shrinks the grown group.
 * Checked besides: one outcome per grow attempt (all OK, or all an error), only the documented
 * statuses, and every finishing process's weights (the joiners' too) bit for bit. After each
 * episode no segment of its groups is left, but one that only a killed process held once every
 * other member had left (comm.h: the next group of the name reclaims it).
 *
 * shrink_stress stress <episodes> [seed [grow]]: with "grow", only the grow episodes
 *   (SHRINK_STRESS_DEBUG=1 in the environment: every failed grow attempt's outcomes, by process)
 * shrink_stress bench <runs> [total_params]: 4 ranks, one killed, the time from the kill to the
 *   next completed step on 3 ranks, by phase (detect, agree, form, reshard, step), min/median/max.
 *   Detection counts from the later of the kill and the survivor's entry into the call that fails
 *   (a survivor may still be computing its gradient when the peer dies: that work is shown apart).
 *   For scale, in the same run: a whole step before and after, the reshard's CPU time, and one
 *   memcpy of the floats a survivor receives into freshly allocated memory (the floor of moving
 *   them in memory). The load average is printed: on a shared host the times follow it. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../capi/shm_locks.h"
#include "../capi/shm_sweep.h"
#include "gradsync/gradsync.h"

#define N 4
#define MAXJ 8        /* joiners an episode may fork, one per grow attempt */
#define NP (N + MAXJ) /* process slots: the members, then the joiners */
#define STEPS 40
#define STRESS_TOTAL 4099
#define EPISODE_BUDGET_S 60
#define TIMEOUT_MS 10000     /* the groups' deadline: detection must come well before it */
#define JOIN_TIMEOUT_MS 1000 /* a joiner's wait for the members to grow (they grow within ms of its start) */

enum { PH_START, PH_STEP, PH_SHRINK, PH_RESHARD, PH_GROW, PH_RESET, PH_JOIN, PH_CATCHUP, PH_CATCHUP_RESHARD, PH_DONE };
enum { EXIT_OK = 0, EXIT_WRONG = 1, EXIT_LOST = 3, EXIT_FAILED = 4, EXIT_TURNED_AWAY = 5 };
enum { KIND_STEP, KIND_IN_SHRINK, KIND_IN_RESHARD, KIND_TWICE, KIND_IN_GROW, KIND_IN_CATCHUP, KINDS };
static const char* const kind_names[KINDS] = {
    "one kill during steps", "a second kill during the shrink",     "a second kill during the reshard",
    "two kills in a row",    "shrink, a kill during the grow back", "shrink, a kill during the catch-up"};

typedef struct {
  volatile int32_t phase[NP];
  volatile int32_t steps[NP];
  volatile int32_t gen[NP];           /* the grow attempt the process is in (members) or joins (joiners) */
  volatile int32_t join_gen[NP];      /* a joiner's attempt (-1: a member of the first group) */
  volatile int32_t outcome[MAXJ][NP]; /* 100 + what grow (members) or join (joiners) of attempt g returned */
  volatile int64_t grow_ns[MAXJ][NP]; /* how long that call took */
  volatile int64_t kill_ns;
  volatile int32_t victim, victim_phase; /* a grow episode's kill: whom, in which phase (-1: none) */
  volatile int32_t doom_us[NP];          /* a joiner to die inside its join: this many µs + 1 after rank 0 met it */
  volatile int32_t orphan_gen;           /* the grow attempt whose lobby the victim held alone as it died (-1: none) */
  volatile int64_t left_ns[NP];          /* when the process had freed its groups (0: not yet) */
  volatile int64_t killed_ns[NP];        /* when the test sent it SIGKILL (0: never) */
  /* bench: the survivors' times, ns after the kill */
  volatile int64_t detect_ns[N], agree_ns[N], form_ns[N], reshard_ns[N], step_ns[N];
  volatile int64_t entered_ns[N]; /* the failing call began, after the kill (0: before it) */
  volatile int64_t reshard_cpu_ns[N], reshard_faults[N], moved_floats[N];
  volatile int64_t before_ns[N], after_ns[N]; /* a whole step on 4 ranks before the kill, on 3 after it */
  char why[NP][160];
} board;

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void pause_us(long us) {
  struct timespec t;
  t.tv_sec = us / 1000000;
  t.tv_nsec = (us % 1000000) * 1000L;
  nanosleep(&t, NULL);
}

static int64_t minor_faults(void) {
  struct rusage u;
  getrusage(RUSAGE_SELF, &u);
  return (int64_t)u.ru_minflt;
}

static int64_t cpu_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Element i is ((7i + 13s) mod 17 - 8) / 256, which repeats every 17 elements: one period, then
 * copies of it (the same values as computing each, at the cost of a copy). */
static void gradient(int s, float* g, uint64_t total) {
  uint64_t i, have;
  for (i = 0; i < total && i < 17; ++i) g[i] = (float)((int)((i * 7 + (uint64_t)s * 13) % 17) - 8) / 256.0f;
  for (have = i; have < total;) {
    const uint64_t n = have / 17 * 17 < total - have ? have / 17 * 17 : total - have;
    memcpy(g + have, g, n * sizeof(float));
    have += n;
  }
}

static void initial(float* w, uint64_t total) {
  uint64_t i;
  for (i = 0; i < total; ++i) w[i] = (float)(i % 1000) / 1000.0f;
}

static gradsync_shard_options shard_options(int replicas) {
  gradsync_shard_options o = GRADSYNC_SHARD_OPTIONS_INIT;
  o.optimizer = GRADSYNC_OPTIM_ADAM;
  o.lr = 0.01;
  o.replicas = replicas;
  return o;
}

/* The undisturbed run: one rank, the same steps. */
static int reference(float* w, uint64_t total, int steps) {
  gradsync_comm_options co = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_shard_options so = shard_options(0);
  gradsync_comm* c = NULL;
  gradsync_shard* sh = NULL;
  float* g = malloc(total * sizeof(float));
  int s, st = GRADSYNC_OK;
  co.rank = 0;
  co.size = 1;
  snprintf(co.name, sizeof co.name, "shrink-stress-ref-%ld", (long)getpid());
  if (gradsync_comm_create(&c, &co) != GRADSYNC_OK || gradsync_shard_create(&sh, c, total, &so) != GRADSYNC_OK) {
    fprintf(stderr, "reference: %s\n", gradsync_last_error_message());
    return -1;
  }
  initial(w, total);
  gradsync_shard_init(sh, w, total);
  for (s = 0; s < steps && st == GRADSYNC_OK; ++s) {
    gradient(s, g, total);
    st = gradsync_shard_step(sh, g, w, total, 1);
  }
  gradsync_shard_free(sh);
  gradsync_comm_free(c);
  free(g);
  return st;
}

/* Whether a failure is one a lost peer causes: then the group is shrunk (comm.h). */
static int lost_peer(int st) { return st == GRADSYNC_E_REMOTE || st == GRADSYNC_E_TIMEOUT || st == GRADSYNC_E_ABORTED; }

/* The name is the episode's, at most 40 bytes: the grown groups' names keep 40 of the join name. */
static void join_name_of(char* out, size_t cap, const char* name, int gen) {
  snprintf(out, cap, "%.40s-j%d", name, gen % 100);
}

/* A joiner's catch-up on the grown group, and the members' side of it: the parameters by
 * broadcast from rank 0, the optimizer slices by reshard (a joiner's shard made on the grown group
 * and not initialised), and the gathered weights must be the broadcast ones. 1: they differ. */
static int catch_up(board* b, int slot, gradsync_comm* grown, gradsync_shard** shard, const gradsync_shard_options* so,
                    float* w, float* g, uint64_t total, int* caught_up) {
  int st;
  b->phase[slot] = PH_CATCHUP;
  st = gradsync_comm_broadcast(grown, w, total, GRADSYNC_F32, 0);
  if (st == GRADSYNC_OK && *shard == NULL) st = gradsync_shard_create(shard, grown, total, so);
  if (st != GRADSYNC_OK) return st;
  b->phase[slot] = PH_CATCHUP_RESHARD;
  st = gradsync_shard_reshard(*shard, grown, NULL);
  if (st != GRADSYNC_OK) return st;
  *caught_up = 1;
  st = gradsync_shard_gather(*shard, g, total);
  if (st != GRADSYNC_OK) return st;
  return memcmp(g, w, total * sizeof(float)) != 0;
}

typedef struct {
  board* b;
  int slot, gen;
  char lobby[GRADSYNC_COMM_NAME_MAX];
} doom;

/* A doomed joiner's own watch: once rank 0 met it in the lobby (the meeting lasts a millisecond or
 * two, too short for the supervisor to see on a loaded host), it dies at the chosen moment, inside
 * its join (or after it, where the join was faster). */
static void* watch_doom(void* p) {
  doom* d = (doom*)p;
  board* b = d->b;
  while (b->outcome[d->gen][d->slot] == 0) {
    if (b->doom_us[d->slot] > 0 && shm_locks_held(d->lobby, 3) == 6) {
      pause_us(b->doom_us[d->slot] - 1);
      if (b->doom_us[d->slot] <= 0) break; /* the supervisor took the kill over */
      b->victim_phase = b->phase[d->slot];
      b->killed_ns[d->slot] = now_ns();
      raise(SIGKILL);
    }
    pause_us(20);
  }
  return NULL;
}

/* One process: a member (slot < N, rank slot) trains, and after a loss shrinks, reshards and
 * trains on; with grow set it then grows the group back to N, one joiner at a time, each joiner
 * (slot >= N, joining grow attempt join_gen) catching up and training on as a member. */
static int member(board* b, const char* name, int slot, int join_gen, int replicas, int grow, uint64_t total, int steps,
                  const float* ref, int bench) {
  gradsync_comm_options co = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_shard_options so = shard_options(replicas);
  /* Every group this process was in, freed at the end: the shard may still be on an older one
   * while a reshard fails. */
  gradsync_comm* comms[4 * NP];
  gradsync_comm* latest = NULL; /* the newest group */
  gradsync_shard* shard = NULL;
  float *w = malloc(total * sizeof(float)), *g = malloc(total * sizeof(float));
  int s = 0, st, recovering = 0, ncomms = 0, gen = 0, attempts = 0, caught_up = slot < N;
  enum { GO_ON, RECOVER, CATCH_UP } todo = GO_ON;
  int64_t updates = 0;
  uint64_t i;
  co.transport = GRADSYNC_TRANSPORT_SHM;
  co.timeout_ms = TIMEOUT_MS;
  if (slot < N) {
    co.rank = slot;
    co.size = N;
    snprintf(co.name, sizeof co.name, "%s", name);
    if (gradsync_comm_create(&latest, &co) != GRADSYNC_OK ||
        gradsync_shard_create(&shard, latest, total, &so) != GRADSYNC_OK) {
      snprintf(b->why[slot], sizeof b->why[slot], "create: %s", gradsync_last_error_message());
      return EXIT_FAILED;
    }
    comms[ncomms++] = latest;
    initial(w, total);
    gradsync_shard_init(shard, w, total);
  } else {
    gradsync_grow_result res;
    int64_t t0 = now_ns();
    memset(&res, 0, sizeof res);
    res.struct_size = sizeof res;
    res.version = GRADSYNC_GROW_RESULT_VERSION;
    co.rank = 0;
    co.size = 1;
    co.timeout_ms = JOIN_TIMEOUT_MS;
    join_name_of(co.name, sizeof co.name, name, join_gen);
    doom d;
    pthread_t watcher;
    d.b = b;
    d.slot = slot;
    d.gen = join_gen;
    snprintf(d.lobby, sizeof d.lobby, "%s", co.name);
    b->gen[slot] = join_gen;
    b->phase[slot] = PH_JOIN;
    if (pthread_create(&watcher, NULL, watch_doom, &d) != 0) {
      snprintf(b->why[slot], sizeof b->why[slot], "pthread_create failed");
      return EXIT_FAILED;
    }
    st = gradsync_comm_join(&latest, &co, &res);
    b->grow_ns[join_gen][slot] = now_ns() - t0;
    b->outcome[join_gen][slot] = 100 + st;
    pthread_join(watcher, NULL);
    if (st != GRADSYNC_OK) {
      snprintf(b->why[slot], sizeof b->why[slot], "join: %s: %s", gradsync_status_string(st),
               gradsync_last_error_message());
      /* comm.h: a member or another joiner died during the grow (or the members' grow failed while
       * the grown group formed), or the members did not grow within the timeout. */
      return st == GRADSYNC_E_REMOTE || st == GRADSYNC_E_TIMEOUT ? EXIT_TURNED_AWAY : EXIT_FAILED;
    }
    comms[ncomms++] = latest;
    gen = join_gen + 1;
    todo = CATCH_UP;
  }
  b->phase[slot] = PH_STEP;
  for (;;) {
    int64_t t0;
    if (todo == CATCH_UP) {
      st = catch_up(b, slot, latest, &shard, &so, w, g, total, &caught_up);
      if (st == 1) {
        snprintf(b->why[slot], sizeof b->why[slot], "catch-up: the gathered weights differ from the broadcast ones");
        return EXIT_WRONG;
      }
      if (st == GRADSYNC_OK) {
        gradsync_shard_updates(shard, &updates);
        s = (int)updates;
        b->steps[slot] = s;
        b->phase[slot] = PH_STEP;
        todo = GO_ON;
        continue;
      }
      if (st == GRADSYNC_E_LOST || !lost_peer(st)) {
        snprintf(b->why[slot], sizeof b->why[slot], "catch-up: %s: %s", gradsync_status_string(st),
                 gradsync_last_error_message());
        return st == GRADSYNC_E_LOST ? EXIT_LOST : EXIT_FAILED;
      }
      todo = RECOVER; /* a member or the joiner was lost: shrink the grown group */
    }
    if (todo == RECOVER) {
      gradsync_comm* next = NULL;
      gradsync_shrink_result res;
      memset(&res, 0, sizeof res);
      res.struct_size = sizeof res;
      res.version = GRADSYNC_SHRINK_RESULT_VERSION;
      b->phase[slot] = PH_SHRINK;
      if (ncomms == (int)(sizeof comms / sizeof comms[0])) {
        snprintf(b->why[slot], sizeof b->why[slot], "%d groups in one episode", ncomms);
        return EXIT_FAILED;
      }
      st = gradsync_comm_shrink(latest, &next, NULL, 0, &res);
      if (st != GRADSYNC_OK) {
        snprintf(b->why[slot], sizeof b->why[slot], "shrink: %s", gradsync_last_error_message());
        return EXIT_FAILED;
      }
      if (bench) {
        b->agree_ns[slot] = res.agree_ns;
        b->form_ns[slot] = res.form_ns;
      }
      comms[ncomms++] = latest = next;
      b->phase[slot] = PH_RESHARD;
      if (!caught_up) {
        /* A joiner whose catch-up failed before its reshard: it joins the survivors' reshard as a
         * joiner of their group, with a shard made on it. */
        gradsync_shard_free(shard);
        shard = NULL;
        if (gradsync_shard_create(&shard, latest, total, &so) != GRADSYNC_OK) {
          snprintf(b->why[slot], sizeof b->why[slot], "create: %s", gradsync_last_error_message());
          return EXIT_FAILED;
        }
      }
      {
        const int64_t r0 = now_ns(), c0 = cpu_ns(), f0 = minor_faults();
        uint64_t moved = 0;
        st = gradsync_shard_reshard(shard, latest, &moved);
        if (bench) {
          b->reshard_ns[slot] = now_ns() - r0;
          b->reshard_cpu_ns[slot] = cpu_ns() - c0;
          b->reshard_faults[slot] = minor_faults() - f0;
          b->moved_floats[slot] = (int64_t)moved;
        }
      }
      if (st == GRADSYNC_OK) caught_up = 1;
      if (st == GRADSYNC_E_LOST) {
        snprintf(b->why[slot], sizeof b->why[slot], "%s", gradsync_last_error_message());
        return EXIT_LOST;
      }
      /* The failed step may have left the weights half gathered (its update may have been
       * applied everywhere, so that step is not run again): gather them afresh. */
      if (st == GRADSYNC_OK) st = gradsync_shard_gather(shard, w, total);
      if (st != GRADSYNC_OK && !lost_peer(st)) {
        snprintf(b->why[slot], sizeof b->why[slot], "reshard: %s: %s", gradsync_status_string(st),
                 gradsync_last_error_message());
        return EXIT_FAILED;
      }
      if (st != GRADSYNC_OK) continue; /* a member was lost during the reshard or the gather: shrink again */
      gradsync_shard_updates(shard, &updates);
      s = (int)updates;
      b->phase[slot] = PH_STEP;
      todo = GO_ON;
    }
    if (grow) {
      int32_t size = 0;
      gradsync_comm_size(latest, &size);
      if (size < N) {
        gradsync_comm* grown = NULL;
        gradsync_grow_result res;
        char join_name[GRADSYNC_COMM_NAME_MAX];
        int64_t g0;
        double most = (double)gen;
        memset(&res, 0, sizeof res);
        res.struct_size = sizeof res;
        res.version = GRADSYNC_GROW_RESULT_VERSION;
        if (++attempts > MAXJ) {
          snprintf(b->why[slot], sizeof b->why[slot], "no grow back succeeded in %d attempts", MAXJ);
          return EXIT_FAILED;
        }
        /* Each attempt is named apart (comm.h): the members agree on its number, since those that
         * failed a reset and shrank made one attempt less than those whose reset succeeded. */
        b->phase[slot] = PH_GROW;
        st = gradsync_comm_allreduce(latest, &most, &most, 1, GRADSYNC_F64, GRADSYNC_MAX);
        if (st != GRADSYNC_OK) {
          todo = RECOVER;
          continue;
        }
        gen = (int)most;
        if (gen >= MAXJ) {
          snprintf(b->why[slot], sizeof b->why[slot], "grow attempt %d: past the joiners the test forks", gen);
          return EXIT_FAILED;
        }
        join_name_of(join_name, sizeof join_name, name, gen);
        b->gen[slot] = gen;
        g0 = now_ns();
        st = gradsync_comm_grow(latest, join_name, 1, &grown, &res);
        b->grow_ns[gen][slot] = now_ns() - g0;
        b->outcome[gen][slot] = 100 + st;
        ++gen;
        if (st == GRADSYNC_OK) {
          comms[ncomms++] = latest = grown;
          todo = CATCH_UP;
          continue;
        }
        /* comm.h: a member or the joiner died (REMOTE), another member failed the grow (ABORTED),
         * or one did not come in time (TIMEOUT); then a reset on every member, or a shrink when a
         * member of the group is lost (the reset fails then). */
        if (!lost_peer(st)) {
          snprintf(b->why[slot], sizeof b->why[slot], "grow: %s: %s", gradsync_status_string(st),
                   gradsync_last_error_message());
          return EXIT_FAILED;
        }
        b->phase[slot] = PH_RESET;
        st = gradsync_comm_reset(latest);
        if (st != GRADSYNC_OK && !lost_peer(st)) {
          snprintf(b->why[slot], sizeof b->why[slot], "reset: %s: %s", gradsync_status_string(st),
                   gradsync_last_error_message());
          return EXIT_FAILED;
        }
        todo = st == GRADSYNC_OK ? GO_ON : RECOVER;
        continue;
      }
    }
    if (s >= steps) break;
    b->phase[slot] = PH_STEP;
    gradient(s, g, total);
    t0 = now_ns();
    st = gradsync_shard_step(shard, g, w, total, 1);
    if (st == GRADSYNC_OK) {
      if (bench && b->kill_ns == 0) b->before_ns[slot] = now_ns() - t0;
      if (bench && b->kill_ns != 0 && !recovering) b->after_ns[slot] = now_ns() - t0;
      if (recovering && bench) b->step_ns[slot] = now_ns() - b->kill_ns;
      recovering = 0;
      b->steps[slot] = ++s;
      continue;
    }
    if (bench && !recovering) {
      b->detect_ns[slot] = now_ns() - b->kill_ns;
      b->entered_ns[slot] = t0 > b->kill_ns ? t0 - b->kill_ns : 0;
    }
    recovering = 1;
    todo = RECOVER;
  }
  b->phase[slot] = PH_DONE;
  for (i = 0; ref != NULL && i < total; ++i) {
    if (memcmp(&w[i], &ref[i], sizeof(float)) != 0) {
      snprintf(b->why[slot], sizeof b->why[slot], "weight %" PRIu64 " is %.9g, the undisturbed run has %.9g", i,
               (double)w[i], (double)ref[i]);
      return EXIT_WRONG;
    }
  }
  gradsync_shard_free(shard);
  while (ncomms > 0) gradsync_comm_free(comms[--ncomms]);
  b->left_ns[slot] = now_ns();
  free(w);
  free(g);
  return EXIT_OK;
}

static int alive_other(const int* dead, int avoid, unsigned* seed) {
  int r;
  do r = (int)(rand_r(seed) % N);
  while (dead[r] || r == avoid);
  return r;
}

/* Waits until some live member is in phase ph (or all are done); false if none gets there. */
static int wait_phase(board* b, const int* dead, int ph, int64_t until) {
  while (now_ns() < until) {
    int r, done = 1;
    for (r = 0; r < N; ++r) {
      if (dead[r]) continue;
      if (b->phase[r] == ph) return 1;
      done &= b->phase[r] == PH_DONE;
    }
    if (done) return 0;
    pause_us(20);
  }
  return 0;
}

/* Where a grow episode's kill landed: the victim's phase when it was sent. */
enum { AT_GROW, AT_JOIN, AT_CATCHUP, AT_CATCHUP_RESHARD, AT_OTHER, AT_NONE, ATS };
static const char* const at_names[ATS] = {"a member in the grow",          "the joiner in the join",
                                          "in the catch-up's broadcast",   "in the catch-up's reshard or gather",
                                          "after it (steps, shrink, ...)", "no kill (the victim had finished)"};

typedef struct {
  int kills, hangs, wrong, lost, failed, done, unremovable;
  /* grow episodes */
  int joiners, joiners_done, turned_away, attempts, attempts_ok, landed[ATS];
  int member_status[3], joiner_status[3]; /* failed grow/join: REMOTE, ABORTED, TIMEOUT */
  int64_t grow_ns[4096];
  int grow_samples;
} tally;

/* Whether a member was killed after every member that lived had left the first group: its rank
 * lock then outlives every leaver, and no live member remains to remove the group's name. */
static int killed_after_the_others_left(const board* b, const int* dead) {
  int r, v;
  for (v = 0; v < N; ++v) {
    int all_left = dead[v];
    for (r = 0; r < N && all_left; ++r)
      if (!dead[r]) all_left = b->left_ns[r] != 0 && b->left_ns[r] < b->killed_ns[v];
    if (all_left) return 1;
  }
  return 0;
}

static int status_index(int st) { return st == GRADSYNC_E_REMOTE ? 0 : st == GRADSYNC_E_ABORTED ? 1 : 2; }

static int landed_at(int ph) {
  return ph == PH_GROW              ? AT_GROW
         : ph == PH_JOIN            ? AT_JOIN
         : ph == PH_CATCHUP         ? AT_CATCHUP
         : ph == PH_CATCHUP_RESHARD ? AT_CATCHUP_RESHARD
                                    : AT_OTHER;
}

/* Called once the victim, killed in the grow or the join, is dead: a lobby whose other member had
 * left holds only the victim's lock, and no live member remains to remove it (comm.h: the next
 * group of the name reclaims it). */
static void note_orphan(int victim, const char* name, board* b) {
  char its[GRADSYNC_COMM_NAME_MAX];
  if (b->gen[victim] < 0) return;
  join_name_of(its, sizeof its, name, b->gen[victim]);
  if ((shm_locks_held(its, 3) & ~1) == 0) b->orphan_gen = b->gen[victim];
}

/* A doomed joiner that killed itself (reaped): counted as the supervisor's kills are. */
static void self_killed(int victim, const char* name, int* dead, tally* t, board* b) {
  dead[victim] = 1;
  t->kills++;
  b->victim = victim;
  t->landed[landed_at(b->victim_phase)]++;
  if (b->victim_phase == PH_JOIN) note_orphan(victim, name, b);
}

/* A grow episode's supervision, until every process has ended or the budget is spent: forks a
 * joiner for each grow attempt the members make (for the first, half the time while the survivors
 * still recover from the loss, so that it waits in the join), and kills one process, a member or
 * the first joiner, at a random moment of the first grow (kind KIND_IN_GROW) or of its catch-up. A
 * joiner is killed once rank 0 met it in the lobby (or later): one killed before rank 0 came is a
 * lobby that rank 0 would rebuild and wait in until its deadline. */
static void supervise_grow(int kind, const char* name, unsigned* seed, pid_t* pids, int* dead, int* nproc,
                           int64_t deadline, tally* t, board* b, const float* ref) {
  int joiner_of[MAXJ], reaped[NP] = {0}, g, r, state = 0, victim = -1, want_joiner = 0;
  const int early = (int)(rand_r(seed) % 2);
  const int trigger = kind == KIND_IN_GROW ? PH_GROW : rand_r(seed) % 2 ? PH_CATCHUP : PH_CATCHUP_RESHARD;
  const long spread_us = kind == KIND_IN_GROW ? 3000 : trigger == PH_CATCHUP ? 1500 : 400;
  int64_t kill_at = 0;
  char lobby[GRADSYNC_COMM_NAME_MAX];
  for (g = 0; g < MAXJ; ++g) joiner_of[g] = -1;
  join_name_of(lobby, sizeof lobby, name, 0);
  while (now_ns() < deadline) {
    int running = 0;
    for (r = 0; r < *nproc; ++r) {
      int status;
      if (reaped[r]) continue;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        reaped[r] = 1;
        pids[r] = -status - 1; /* episode() reads the status from here: the pid is reaped */
        continue;
      }
      running++;
    }
    if (running == 0) break;
    /* A joiner for each grow attempt a live member is in. */
    for (r = 0; r < *nproc; ++r) {
      int gen = b->gen[r];
      if (reaped[r] || dead[r] || b->phase[r] != PH_GROW || gen < 0 || gen >= MAXJ || joiner_of[gen] >= 0) continue;
      if (*nproc == NP) break;
      joiner_of[gen] = *nproc;
      b->gen[*nproc] = b->join_gen[*nproc] = gen;
      pids[*nproc] = fork();
      if (pids[*nproc] == 0) _exit(member(b, name, *nproc, gen, 2, 1, STRESS_TOTAL, STEPS, ref, 0));
      ++*nproc;
      t->joiners++;
    }
    if (early && joiner_of[0] < 0) {
      for (r = 0; r < N; ++r)
        if (!dead[r] && b->phase[r] == PH_RESHARD) want_joiner = 1;
      if (want_joiner) {
        joiner_of[0] = *nproc;
        b->gen[*nproc] = b->join_gen[*nproc] = 0;
        pids[*nproc] = fork();
        if (pids[*nproc] == 0) _exit(member(b, name, *nproc, 0, 2, 1, STRESS_TOTAL, STEPS, ref, 0));
        ++*nproc;
        t->joiners++;
      }
    }
    if (state == 0) { /* the trigger: a member (or, for the catch-up, any process) in the phase */
      int hit = 0, count = 0, live[NP];
      for (r = 0; r < *nproc; ++r) {
        if (reaped[r] || dead[r]) continue;
        if (b->phase[r] == trigger && (kind != KIND_IN_GROW || b->gen[r] == 0)) hit = 1;
        if (r < N || r == joiner_of[0]) live[count++] = r;
      }
      if (hit) {
        const int pick = (int)(rand_r(seed) % (unsigned)(count + (kind == KIND_IN_GROW && joiner_of[0] < 0)));
        victim = pick < count ? live[pick] : -2; /* -2: the first joiner, not yet forked */
        state = 1;
      }
    }
    if (state == 1) { /* a joiner victim: until rank 0 met it in the lobby, or the grow went past that */
      int ready = victim >= 0 && victim < N;
      if (!ready && victim == -2 && joiner_of[0] >= 0) victim = joiner_of[0];
      if (!ready && victim >= 0 && reaped[victim] && b->killed_ns[victim] != 0) {
        self_killed(victim, name, dead, t, b); /* it died inside its join, as doomed */
        state = 3;
      } else if (!ready && victim >= 0) {
        /* It watches for its meeting with rank 0 itself; once past its join, the kill is the
         * supervisor's again (then in the catch-up). */
        int past = b->outcome[0][victim] != 0;
        for (r = 0; r < *nproc; ++r) past |= b->outcome[0][r] != 0;
        if (kind == KIND_IN_GROW && !past && b->doom_us[victim] == 0)
          b->doom_us[victim] = 1 + (int32_t)(rand_r(seed) % 800);
        ready = past || kind != KIND_IN_GROW;
        if (ready) b->doom_us[victim] = 0;
      }
      if (ready) {
        kill_at = now_ns() + (int64_t)(rand_r(seed) % (unsigned)spread_us) * 1000;
        state = 2;
      }
    }
    if (state == 2 && b->killed_ns[victim] != 0) { /* its own watch fired just before it was taken over */
      while (!reaped[victim]) {
        int status = 0;
        if (waitpid(pids[victim], &status, 0) == pids[victim]) {
          reaped[victim] = 1;
          pids[victim] = -status - 1;
        }
      }
      self_killed(victim, name, dead, t, b);
      state = 3;
    }
    if (state == 2 && now_ns() >= kill_at) {
      const int ph = b->phase[victim];
      state = 3;
      b->victim = victim;
      b->victim_phase = ph;
      if (!reaped[victim]) {
        int status = 0;
        b->killed_ns[victim] = now_ns();
        kill(pids[victim], SIGKILL);
        dead[victim] = 1;
        t->kills++;
        if (ph == PH_GROW || ph == PH_JOIN) {
          if (waitpid(pids[victim], &status, 0) == pids[victim]) {
            reaped[victim] = 1;
            pids[victim] = -status - 1;
          }
          note_orphan(victim, name, b);
        }
        t->landed[landed_at(ph)]++;
      } else {
        t->landed[AT_NONE]++;
      }
    }
    pause_us(20);
  }
  if (state != 3) t->landed[AT_NONE]++;
}

static void episode(int id, int kind, unsigned* seed, const float* ref, tally* t, board* b) {
  char name[64];
  pid_t pids[NP];
  int dead[NP], r, first, nproc = N, replicas = kind == KIND_STEP ? 1 : 2, g;
  const int grow = kind == KIND_IN_GROW || kind == KIND_IN_CATCHUP;
  int64_t deadline;
  memset(b, 0, sizeof *b);
  memset(dead, 0, sizeof dead);
  for (r = 0; r < NP; ++r) b->gen[r] = b->join_gen[r] = -1;
  b->victim = b->victim_phase = b->orphan_gen = -1;
  snprintf(name, sizeof name, "shrink-stress-%ld-%d", (long)getpid(), id);
  for (r = 0; r < N; ++r) {
    pids[r] = fork();
    if (pids[r] == 0) _exit(member(b, name, r, -1, replicas, grow, STRESS_TOTAL, STEPS, ref, 0));
  }
  deadline = now_ns() + (int64_t)EPISODE_BUDGET_S * 1000000000;
  /* The first kill at a random step. */
  {
    const int at = 1 + (int)(rand_r(seed) % (STEPS - 2));
    first = (int)(rand_r(seed) % N);
    while (now_ns() < deadline && b->steps[first] < at) pause_us(20);
    pause_us((long)(rand_r(seed) % 300));
    b->killed_ns[first] = now_ns();
    kill(pids[first], SIGKILL);
    dead[first] = 1;
    t->kills++;
  }
  if (grow) {
    supervise_grow(kind, name, seed, pids, dead, &nproc, deadline, t, b, ref);
  } else if (kind != KIND_STEP) {
    const int second = alive_other(dead, first, seed);
    int ph = kind == KIND_IN_SHRINK ? PH_SHRINK : kind == KIND_IN_RESHARD ? PH_RESHARD : -1;
    if (ph < 0 || wait_phase(b, dead, ph, deadline)) {
      pause_us((long)(rand_r(seed) % (ph < 0 ? 2000 : 200)));
      b->killed_ns[second] = now_ns();
      kill(pids[second], SIGKILL);
      dead[second] = 1;
      t->kills++;
    }
  }
  for (r = 0; r < nproc; ++r) {
    int status = 0;
    pid_t got = 0;
    if (pids[r] < 0) { /* reaped by supervise_grow, which kept the status */
      status = -(pids[r] + 1);
      got = 1;
    }
    while (got == 0 && (got = waitpid(pids[r], &status, WNOHANG)) == 0 && now_ns() < deadline) pause_us(200);
    if (got == 0) {
      fprintf(stderr, "episode %d (%s): %s %d hangs (phase %d, step %d)\n", id, kind_names[kind],
              r < N ? "member" : "joiner", r, (int)b->phase[r], (int)b->steps[r]);
      t->hangs++;
      for (first = 0; first < nproc; ++first)
        if (pids[first] > 0) kill(pids[first], SIGKILL);
      waitpid(pids[r], &status, 0);
      continue;
    }
    if (dead[r] && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) continue;
    if (WIFEXITED(status) && WEXITSTATUS(status) == EXIT_OK) {
      t->done++;
      if (r >= N) t->joiners_done++;
      continue;
    }
    if (r >= N && WIFEXITED(status) && WEXITSTATUS(status) == EXIT_TURNED_AWAY) {
      t->turned_away++;
      continue;
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == EXIT_WRONG)
      t->wrong++;
    else if (WIFEXITED(status) && WEXITSTATUS(status) == EXIT_LOST)
      t->lost++;
    else
      t->failed++;
    fprintf(stderr, "episode %d (%s): %s %d ended with status %#x: %s\n", id, kind_names[kind],
            r < N ? "member" : "joiner", r, (unsigned)status, b->why[r]);
  }
  /* One outcome per grow attempt (comm.h): every member and joiner that returned got OK, or each
   * an error. */
  for (g = 0; grow && g < MAXJ; ++g) {
    int ok = 0, failed = 0;
    for (r = 0; r < nproc; ++r) {
      const int st = b->outcome[g][r] - 100;
      if (b->outcome[g][r] == 0) continue;
      if (st == GRADSYNC_OK) {
        ok++;
        if (r < N && t->grow_samples < (int)(sizeof t->grow_ns / sizeof t->grow_ns[0]))
          t->grow_ns[t->grow_samples++] = b->grow_ns[g][r];
      } else {
        failed++;
        if (b->join_gen[r] != g)
          t->member_status[status_index(st)]++;
        else
          t->joiner_status[status_index(st)]++;
      }
    }
    if (ok + failed == 0) continue;
    if (getenv("SHRINK_STRESS_DEBUG") != NULL && failed > 0) {
      fprintf(stderr, "episode %d (%s) attempt %d: victim %d phase %d\n", id, kind_names[kind], g, (int)b->victim,
              (int)b->victim_phase);
      for (r = 0; r < nproc; ++r)
        if (b->outcome[g][r] != 0)
          fprintf(stderr, "  process %d: %d after %.1f ms: %s\n", r, (int)b->outcome[g][r] - 100,
                  (double)b->grow_ns[g][r] / 1e6, b->why[r]);
    }
    t->attempts++;
    t->attempts_ok += ok > 0;
    if (ok > 0 && failed > 0) {
      fprintf(stderr, "episode %d (%s): grow attempt %d succeeded on %d of its processes, failed on %d\n", id,
              kind_names[kind], g, ok, failed);
      t->failed++;
    }
  }
  if (b->orphan_gen >= 0) {
    char path[128];
    snprintf(path, sizeof path, "/dev/shm/gradsync.%.40s-j%d", name, (int)b->orphan_gen % 100);
    if (unlink(path) == 0) t->unremovable++;
  }
  {
    /* The last live member of each group removes its segment, whatever was killed. */
    const int left = shm_sweep(name, 0);
    if (left != 0 && killed_after_the_others_left(b, dead)) {
      /* Nobody live is left to remove the name (comm.h: the next group of the name reclaims it). */
      t->unremovable++;
    } else if (left != 0) {
      fprintf(stderr, "episode %d (%s): %d segment(s) left behind (the grow's kill: process %d in phase %d)\n", id,
              kind_names[kind], left, (int)b->victim, (int)b->victim_phase);
      t->failed++;
    }
  }
}

static int cmp64(const void* a, const void* b) {
  const int64_t x = *(const int64_t*)a, y = *(const int64_t*)b;
  return x < y ? -1 : x > y;
}

/* min, median and max of v, divided by unit (1e6: ns as ms) */
static void spread(const char* what, int64_t* v, int n, double unit) {
  qsort(v, (size_t)n, sizeof *v, cmp64);
  printf("  %-26s %8.2f %8.2f %8.2f\n", what, (double)v[0] / unit, (double)v[n / 2] / unit, (double)v[n - 1] / unit);
}

/* One memcpy of `floats` floats into fresh memory (huge pages hinted, as the library's slices),
 * from a source already touched: the floor of moving them in memory. */
static int64_t copy_floor(const float* src, uint64_t floats) {
  const size_t bytes = (size_t)floats * sizeof(float);
  int64_t t0;
  void* dst;
  if (bytes == 0) return 0;
  dst = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (dst == MAP_FAILED) return 0;
#ifdef MADV_HUGEPAGE
  madvise(dst, bytes, MADV_HUGEPAGE);
#endif
  t0 = now_ns();
  memcpy(dst, src, bytes);
  t0 = now_ns() - t0;
  munmap(dst, bytes);
  return t0;
}

static void print_load(const char* when) {
  char line[128] = "?";
  FILE* f = fopen("/proc/loadavg", "r");
  if (f != NULL) {
    if (fgets(line, sizeof line, f) == NULL) strcpy(line, "?");
    fclose(f);
  }
  line[strcspn(line, "\n")] = 0;
  printf("  load average %s: %s\n", when, line);
}

static int bench(int runs, uint64_t total) {
  enum {
    DETECT,
    BEFORE_CALL,
    AGREE,
    FORM,
    RESHARD,
    RECOVERY,
    STEP,
    WHOLE,
    RESHARD_CPU,
    FAULTS,
    FLOOR,
    STEP4,
    STEP3,
    FIGURES
  };
  static const char* const names[FIGURES] = {"detect (in the call)",
                                             "caller's work before it",
                                             "agree (failed set)",
                                             "form (new group + commit)",
                                             "reshard",
                                             "detect..reshard",
                                             "next step (remainder)",
                                             "kill -> next step done",
                                             "reshard, CPU time",
                                             "reshard, page faults (K)",
                                             "memcpy of what it receives",
                                             "step on 4 ranks, before",
                                             "step on 3 ranks, after"};
  board* b = mmap(NULL, sizeof(board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  int64_t* fig[FIGURES];
  float* src = malloc((size_t)total * sizeof(float));
  int run, r, i, ok = 0;
  if (b == MAP_FAILED || src == NULL) return 2;
  for (i = 0; i < FIGURES; ++i) fig[i] = calloc((size_t)runs, sizeof(int64_t));
  memset(src, 1, (size_t)total * sizeof(float));
  printf("recovery: 4 shm ranks, one SIGKILLed, %" PRIu64
         " parameters (Adam: %.0f MB of ZeRO-1 state), replicas = 1, "
         "%d runs, deadline %d ms; ms after the kill\n",
         total, (double)total * 8 / 1e6, runs, TIMEOUT_MS);
  print_load("before");
  for (run = 0; run < runs; ++run) {
    char name[64];
    pid_t pids[N];
    int victim = 1 + run % (N - 1), good = 1, watch = 0;
    int64_t whole = 0;
    memset(b, 0, sizeof *b);
    snprintf(name, sizeof name, "recovery-bench-%ld-%d", (long)getpid(), run);
    for (r = 0; r < N; ++r) {
      pids[r] = fork();
      if (pids[r] == 0) _exit(member(b, name, r, -1, 1, 0, total, 6, NULL, 1));
    }
    while (b->steps[victim] < 3) pause_us(100);
    b->kill_ns = now_ns();
    kill(pids[victim], SIGKILL);
    for (r = 0; r < N; ++r) {
      int status = 0;
      waitpid(pids[r], &status, 0);
      if (r != victim && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        fprintf(stderr, "run %d: member %d ended with %#x: %s\n", run, r, (unsigned)status, b->why[r]);
        good = 0;
      }
    }
    if (!good) continue;
    watch = victim == 0 ? 1 : 0; /* a survivor's view; the latest step completion of any survivor */
    for (r = 0; r < N; ++r) {
      if (r != victim && b->step_ns[r] > whole) whole = b->step_ns[r];
    }
    fig[BEFORE_CALL][ok] = b->entered_ns[watch];
    fig[DETECT][ok] = b->detect_ns[watch] - b->entered_ns[watch];
    fig[AGREE][ok] = b->agree_ns[watch];
    fig[FORM][ok] = b->form_ns[watch];
    fig[RESHARD][ok] = b->reshard_ns[watch];
    fig[RECOVERY][ok] = fig[DETECT][ok] + fig[AGREE][ok] + fig[FORM][ok] + fig[RESHARD][ok];
    fig[STEP][ok] = whole - b->detect_ns[watch] - fig[AGREE][ok] - fig[FORM][ok] - fig[RESHARD][ok];
    fig[WHOLE][ok] = whole;
    fig[RESHARD_CPU][ok] = b->reshard_cpu_ns[watch];
    fig[FAULTS][ok] = b->reshard_faults[watch];
    fig[FLOOR][ok] =
        copy_floor(src, (uint64_t)b->moved_floats[watch] < total ? (uint64_t)b->moved_floats[watch] : total);
    fig[STEP4][ok] = b->before_ns[watch];
    fig[STEP3][ok] = b->after_ns[watch];
    ++ok;
  }
  if (ok == 0) return 1;
  print_load("after");
  printf("  %-26s %8s %8s %8s   (%d runs)\n", "phase", "min", "median", "max", ok);
  for (i = 0; i < FIGURES; ++i) {
    if (i == RESHARD_CPU) printf("  for scale:\n");
    spread(names[i], fig[i], ok, i == FAULTS ? 1e3 : 1e6);
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc >= 3 && strcmp(argv[1], "bench") == 0) {
    return bench(atoi(argv[2]), argc >= 4 ? strtoull(argv[3], NULL, 10) : 12500000u);
  }
  if (argc >= 3 && strcmp(argv[1], "stress") == 0) {
    const int episodes = atoi(argv[2]);
    unsigned seed = argc >= 4 ? (unsigned)strtoul(argv[3], NULL, 10) : (unsigned)time(NULL);
    const int only_grow = argc >= 5 && strcmp(argv[4], "grow") == 0;
    static float ref[STRESS_TOTAL];
    board* b = mmap(NULL, sizeof(board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    tally t;
    int i, by_kind[KINDS] = {0};
    memset(&t, 0, sizeof t);
    if (b == MAP_FAILED || reference(ref, STRESS_TOTAL, STEPS) != GRADSYNC_OK) return 2;
    shm_sweep("shrink-stress-", 1);
    printf("shrink_stress: seed %u, %d episodes\n", seed, episodes);
    for (i = 0; i < episodes; ++i) {
      const int kind = only_grow ? KIND_IN_GROW + (int)(rand_r(&seed) % 2) : (int)(rand_r(&seed) % KINDS);
      by_kind[kind]++;
      episode(i, kind, &seed, ref, &t, b);
    }
    for (i = 0; i < KINDS; ++i) printf("  %-38s %d episodes\n", kind_names[i], by_kind[i]);
    if (by_kind[KIND_IN_GROW] + by_kind[KIND_IN_CATCHUP] > 0) {
      printf(
          "  grow episodes: joiners forked %d (finished verified %d, turned away by a failed grow %d); grow attempts "
          "%d, succeeded %d\n",
          t.joiners, t.joiners_done, t.turned_away, t.attempts, t.attempts_ok);
      printf("    failed grows: members REMOTE %d, ABORTED %d, TIMEOUT %d; joiners REMOTE %d, TIMEOUT %d\n",
             t.member_status[0], t.member_status[1], t.member_status[2], t.joiner_status[0], t.joiner_status[2]);
      printf("    the grow episode's kill landed:");
      for (i = 0; i < ATS; ++i) printf("%s %s %d", i == 0 ? "" : ";", at_names[i], t.landed[i]);
      printf("\n");
      if (t.grow_samples > 0) spread("grow that succeeded (ms)", t.grow_ns, t.grow_samples, 1e6);
    }
    printf(
        "kills %d; processes that finished verified %d; hangs %d; wrong results %d; lost state %d; other failures %d; "
        "segments only a killed member held at the end %d\n",
        t.kills, t.done, t.hangs, t.wrong, t.lost, t.failed, t.unremovable);
    return t.hangs == 0 && t.wrong == 0 && t.lost == 0 && t.failed == 0 ? 0 : 1;
  }
  fprintf(stderr, "usage: shrink_stress stress <episodes> [seed [grow]] | bench <runs> [total_params]\n");
  return 2;
}
