/* SPDX-License-Identifier: Apache-2.0 */
/* Survive kill -9 in place: shm processes train an Adam ZeRO-1 parameter (replicas >= 1) while a
 * supervisor SIGKILLs members at random times and phases: during steps, during the survivors'
 * shrink, during their reshard, and twice in a row. The survivors shrink, reshard and train on;
 * at the end every survivor's weights must equal, bit for bit, those of a run that never lost a
 * rank (every rank's gradient is the same exact value, so the mean is the same on any number of
 * ranks). Counts: kills, episodes by phase, hangs (an episode past its budget), wrong results,
 * lost state. Any hang, wrong result or lost state fails.
 *
 * shrink_stress stress <episodes> [seed]
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

#include "../capi/shm_sweep.h"
#include "gradsync/gradsync.h"

#define N 4
#define STEPS 40
#define STRESS_TOTAL 4099
#define EPISODE_BUDGET_S 60
#define TIMEOUT_MS 10000 /* the groups' deadline: detection must come well before it */

enum { PH_START, PH_STEP, PH_SHRINK, PH_RESHARD, PH_DONE };
enum { EXIT_OK = 0, EXIT_WRONG = 1, EXIT_LOST = 3, EXIT_FAILED = 4 };
enum { KIND_STEP, KIND_IN_SHRINK, KIND_IN_RESHARD, KIND_TWICE, KINDS };
static const char* const kind_names[KINDS] = {"one kill during steps", "a second kill during the shrink",
                                              "a second kill during the reshard", "two kills in a row"};

typedef struct {
  volatile int32_t phase[N];
  volatile int32_t steps[N];
  volatile int64_t kill_ns;
  volatile int64_t left_ns[N];   /* when the member had freed its first group (0: not yet) */
  volatile int64_t killed_ns[N]; /* when the test sent it SIGKILL (0: never) */
  /* bench: the survivors' times, ns after the kill */
  volatile int64_t detect_ns[N], agree_ns[N], form_ns[N], reshard_ns[N], step_ns[N];
  volatile int64_t entered_ns[N]; /* the failing call began, after the kill (0: before it) */
  volatile int64_t reshard_cpu_ns[N], reshard_faults[N], moved_floats[N];
  volatile int64_t before_ns[N], after_ns[N]; /* a whole step on 4 ranks before the kill, on 3 after it */
  char why[N][160];
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

/* One member: trains, and after a loss shrinks, reshards and trains on. */
static int member(board* b, const char* name, int rank, int replicas, uint64_t total, int steps, const float* ref,
                  int bench) {
  gradsync_comm_options co = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_shard_options so = shard_options(replicas);
  gradsync_comm *comm = NULL, *first;
  gradsync_shard* shard = NULL;
  float *w = malloc(total * sizeof(float)), *g = malloc(total * sizeof(float));
  int s = 0, st, recovering = 0;
  int64_t updates = 0;
  uint64_t i;
  co.transport = GRADSYNC_TRANSPORT_SHM;
  co.rank = rank;
  co.size = N;
  co.timeout_ms = TIMEOUT_MS;
  snprintf(co.name, sizeof co.name, "%s", name);
  if (gradsync_comm_create(&comm, &co) != GRADSYNC_OK ||
      gradsync_shard_create(&shard, comm, total, &so) != GRADSYNC_OK) {
    snprintf(b->why[rank], sizeof b->why[rank], "create: %s", gradsync_last_error_message());
    return EXIT_FAILED;
  }
  first = comm;
  initial(w, total);
  gradsync_shard_init(shard, w, total);
  b->phase[rank] = PH_STEP;
  while (s < steps) {
    int64_t t0;
    gradient(s, g, total);
    t0 = now_ns();
    st = gradsync_shard_step(shard, g, w, total, 1);
    if (st == GRADSYNC_OK) {
      if (bench && b->kill_ns == 0) b->before_ns[rank] = now_ns() - t0;
      if (bench && b->kill_ns != 0 && !recovering) b->after_ns[rank] = now_ns() - t0;
      if (recovering && bench) b->step_ns[rank] = now_ns() - b->kill_ns;
      recovering = 0;
      b->steps[rank] = ++s;
      continue;
    }
    if (bench && !recovering) {
      b->detect_ns[rank] = now_ns() - b->kill_ns;
      b->entered_ns[rank] = t0 > b->kill_ns ? t0 - b->kill_ns : 0;
    }
    recovering = 1;
    for (;;) {
      gradsync_comm* next = NULL;
      gradsync_shrink_result res;
      memset(&res, 0, sizeof res);
      res.struct_size = sizeof res;
      res.version = GRADSYNC_SHRINK_RESULT_VERSION;
      b->phase[rank] = PH_SHRINK;
      st = gradsync_comm_shrink(comm, &next, NULL, 0, &res);
      if (st != GRADSYNC_OK) {
        snprintf(b->why[rank], sizeof b->why[rank], "shrink: %s", gradsync_last_error_message());
        return EXIT_FAILED;
      }
      if (bench) {
        b->agree_ns[rank] = res.agree_ns;
        b->form_ns[rank] = res.form_ns;
      }
      /* The first group stays until the end: the shard may still be on it if a reshard fails. */
      if (comm != first) gradsync_comm_free(comm);
      comm = next;
      b->phase[rank] = PH_RESHARD;
      {
        const int64_t t0 = now_ns(), c0 = cpu_ns(), f0 = minor_faults();
        uint64_t moved = 0;
        st = gradsync_shard_reshard(shard, comm, &moved);
        if (bench) {
          b->reshard_ns[rank] = now_ns() - t0;
          b->reshard_cpu_ns[rank] = cpu_ns() - c0;
          b->reshard_faults[rank] = minor_faults() - f0;
          b->moved_floats[rank] = (int64_t)moved;
        }
      }
      if (st == GRADSYNC_E_LOST) {
        snprintf(b->why[rank], sizeof b->why[rank], "%s", gradsync_last_error_message());
        return EXIT_LOST;
      }
      /* The failed step may have left the weights half gathered (its update may have been
       * applied everywhere, so that step is not run again): gather them afresh. */
      if (st == GRADSYNC_OK) st = gradsync_shard_gather(shard, w, total);
      if (st == GRADSYNC_OK) break;
      /* A member was lost during the reshard or the gather: shrink again. */
    }
    gradsync_shard_updates(shard, &updates);
    s = (int)updates;
    b->phase[rank] = PH_STEP;
  }
  b->phase[rank] = PH_DONE;
  for (i = 0; ref != NULL && i < total; ++i) {
    if (memcmp(&w[i], &ref[i], sizeof(float)) != 0) {
      snprintf(b->why[rank], sizeof b->why[rank], "weight %" PRIu64 " is %.9g, the undisturbed run has %.9g", i,
               (double)w[i], (double)ref[i]);
      return EXIT_WRONG;
    }
  }
  gradsync_shard_free(shard);
  if (comm != first) gradsync_comm_free(comm);
  gradsync_comm_free(first);
  b->left_ns[rank] = now_ns();
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

typedef struct {
  int kills, hangs, wrong, lost, failed, done, unremovable;
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

static void episode(int id, int kind, unsigned* seed, const float* ref, tally* t, board* b) {
  char name[64];
  pid_t pids[N];
  int dead[N] = {0, 0, 0, 0}, r, first, replicas = kind == KIND_STEP ? 1 : 2;
  int64_t deadline;
  memset(b, 0, sizeof *b);
  snprintf(name, sizeof name, "shrink-stress-%ld-%d", (long)getpid(), id);
  for (r = 0; r < N; ++r) {
    pids[r] = fork();
    if (pids[r] == 0) _exit(member(b, name, r, replicas, STRESS_TOTAL, STEPS, ref, 0));
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
  if (kind != KIND_STEP) {
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
  for (r = 0; r < N; ++r) {
    int status = 0;
    pid_t got = 0;
    while ((got = waitpid(pids[r], &status, WNOHANG)) == 0 && now_ns() < deadline) pause_us(200);
    if (got == 0) {
      fprintf(stderr, "episode %d (%s): member %d hangs (phase %d, step %d)\n", id, kind_names[kind], r,
              (int)b->phase[r], (int)b->steps[r]);
      t->hangs++;
      for (first = 0; first < N; ++first) kill(pids[first], SIGKILL);
      waitpid(pids[r], &status, 0);
      continue;
    }
    if (dead[r]) continue;
    if (WIFEXITED(status) && WEXITSTATUS(status) == EXIT_OK) {
      t->done++;
      continue;
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == EXIT_WRONG)
      t->wrong++;
    else if (WIFEXITED(status) && WEXITSTATUS(status) == EXIT_LOST)
      t->lost++;
    else
      t->failed++;
    fprintf(stderr, "episode %d (%s): member %d ended with status %#x: %s\n", id, kind_names[kind], r, (unsigned)status,
            b->why[r]);
  }
  {
    /* The last live member of each group removes its segment, whatever was killed. */
    const int left = shm_sweep(name, 0);
    if (left != 0 && killed_after_the_others_left(b, dead)) {
      /* Nobody live is left to remove the name (comm.h: the next group of the name reclaims it). */
      t->unremovable++;
    } else if (left != 0) {
      fprintf(stderr, "episode %d (%s): %d segment(s) left behind\n", id, kind_names[kind], left);
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
      if (pids[r] == 0) _exit(member(b, name, r, 1, total, 6, NULL, 1));
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
    static float ref[STRESS_TOTAL];
    board* b = mmap(NULL, sizeof(board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    tally t;
    int i, by_kind[KINDS] = {0};
    memset(&t, 0, sizeof t);
    if (b == MAP_FAILED || reference(ref, STRESS_TOTAL, STEPS) != GRADSYNC_OK) return 2;
    shm_sweep("shrink-stress-", 1);
    printf("shrink_stress: seed %u, %d episodes\n", seed, episodes);
    for (i = 0; i < episodes; ++i) {
      const int kind = (int)(rand_r(&seed) % KINDS);
      by_kind[kind]++;
      episode(i, kind, &seed, ref, &t, b);
    }
    for (i = 0; i < KINDS; ++i) printf("  %-34s %d episodes\n", kind_names[i], by_kind[i]);
    printf(
        "kills %d; survivors that finished verified %d; hangs %d; wrong results %d; lost state %d; other failures %d; "
        "segments only a killed member held at the end %d\n",
        t.kills, t.done, t.hangs, t.wrong, t.lost, t.failed, t.unremovable);
    return t.hangs == 0 && t.wrong == 0 && t.lost == 0 && t.failed == 0 ? 0 : 1;
  }
  fprintf(stderr, "usage: shrink_stress stress <episodes> [seed] | bench <runs> [total_params]\n");
  return 2;
}
