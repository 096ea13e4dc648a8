// SPDX-License-Identifier: Apache-2.0
/* comm.h promises one outcome per call: every rank returns GRADSYNC_OK with the same result, or
 * every rank fails that call, whatever races it; after a reset the next call is the same call on
 * every rank. An abort racing a round's completion once broke this (one rank OK, another
 * E_ABORTED, then the ranks stayed a call apart and later sums were wrong but "OK"). Only a great
 * many races, each result checked exactly, can show that the protocol still keeps the promise.
 *
 * round_race <thread|shm> <ranks> <calls>; environment: ROUND_RACE_SEED, ROUND_RACE_TIMEOUT_MS,
 * ROUND_RACE_ABORT_US (mean time between the group's random aborts), ROUND_RACE_STALL_EVERY (1 in
 * how many calls a rank stalls past the timeout before the call, and as many before a reset;
 * 0: never), ROUND_RACE_MISMATCH_EVERY (1 in how many calls a rank passes another count, which
 * every rank must fail; 0: never), ROUND_RACE_BUDGET_S. The calls: race_calls.h. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "race_calls.h"

#define MAX_RANKS 8
#define RESET_PATIENCE_S 10 /* a reset that keeps failing this long is a failure, not a race */

/* ------------------------------------------------------------------ configuration (and race_calls.h's) */

static int g_shm;
static uint64_t g_calls;
static int64_t g_budget_s = 120;
static char g_group[GRADSYNC_COMM_NAME_MAX];

/* ------------------------------------------------------------------ state shared by ranks */

enum { P_START, P_CALL, P_STALL, P_RESET, P_DONE };
static const char* const phase_names[] = {"starting", "in a call", "stalling", "in reset", "done"};

typedef struct {
  int32_t status;
  int32_t verdict;
  char msg[MSG_BYTES]; /* the error message, or what was wrong with an OK result */
} outcome;

typedef struct {
  uint64_t progress; /* calls whose outcome is recorded (release: the outcome is visible) */
  uint64_t current;  /* the call this rank is at; aborters hold off around stalled calls */
  int32_t phase;
  int32_t finished; /* left the loop; 2 once its communicator is freed */
  int32_t fatal;
  char fatal_msg[MSG_BYTES * 2];
  uint64_t aborts, resets, reset_retries;
} rank_state;

typedef struct {
  int32_t stop;    /* the supervisor saw enough: leave the loop */
  int32_t arrived; /* start line: every rank creates its communicator together */
  int32_t left;    /* finish line: nobody frees while a peer may still be in its last call */
  rank_state rank[MAX_RANKS];
} shared_state;

static shared_state* g_shared;
static outcome* g_outcomes; /* [call - 1][rank] */

static outcome* outcome_at(uint64_t k, int r) { return &g_outcomes[(k - 1) * (uint64_t)g_size + (uint64_t)r]; }

static int32_t ld(const int32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static void st(int32_t* p, int32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static uint64_t ld64(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static void st64(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

/* ------------------------------------------------------------------ one rank */

typedef struct {
  race_rank base;
  rank_state* state;
  race_aborter aborter;
} rank_ctx;

static int stopping(void) { return (int)ld(&g_shared->stop); }

static void fatal(rank_ctx* c, const char* what, int status) {
  snprintf(c->state->fatal_msg, sizeof c->state->fatal_msg, "%s: %s: %s", what, gradsync_status_string(status),
           gradsync_last_error_message());
  st(&c->state->fatal, 1);
}

/* Everyone at the line, or the supervisor said stop; polls, as ranks may be processes. */
static void meet(int32_t* count) {
  __atomic_add_fetch(count, 1, __ATOMIC_ACQ_REL);
  while (ld(count) < g_size && !stopping()) sleep_us(200);
}

/* Retries while the group is still settling (a peer slow to reach its reset). */
static int reset_after_failure(rank_ctx* c) {
  const double give_up = now_s() + RESET_PATIENCE_S;
  st(&c->state->phase, P_RESET);
  __atomic_add_fetch(&c->state->resets, 1, __ATOMIC_RELAXED);
  for (;;) {
    const int status = gradsync_comm_reset(c->base.comm);
    if (status == GRADSYNC_OK) return 0;
    if ((status != GRADSYNC_E_TIMEOUT && status != GRADSYNC_E_ABORTED) || now_s() > give_up) {
      fatal(c, "gradsync_comm_reset", status);
      return -1;
    }
    if (stopping()) return -1;
    __atomic_add_fetch(&c->state->reset_retries, 1, __ATOMIC_RELAXED);
  }
}

static int rank_main(int rank) {
  rank_ctx ctx;
  rank_ctx* c = &ctx;
  gradsync_comm_options opts = GRADSYNC_COMM_OPTIONS_INIT;
  uint64_t k;
  int status, rc = 0;
  memset(c, 0, sizeof *c);
  c->base.rank = rank;
  c->state = &g_shared->rank[rank];
  if (race_rank_alloc(&c->base) != 0) {
    snprintf(c->state->fatal_msg, sizeof c->state->fatal_msg, "out of memory");
    st(&c->state->fatal, 1);
    rc = 1;
    goto out;
  }
  opts.transport = g_shm ? GRADSYNC_TRANSPORT_SHM : GRADSYNC_TRANSPORT_THREAD;
  opts.rank = rank;
  opts.size = g_size;
  opts.timeout_ms = g_timeout_ms;
  memcpy(opts.name, g_group, sizeof opts.name);
  meet(&g_shared->arrived);
  /* Joining has the calls' short deadline, which a loaded host can miss while a peer sets the
   * segment up. A rank that misses it fails with E_TIMEOUT and leaves, and the others then fail
   * with E_TIMEOUT, E_ABORTED or E_REMOTE (a peer left): every rank tries again. The rounds, not the join,
   * are what this test races. */
  for (int attempt = 0;; ++attempt) {
    status = gradsync_comm_create(&c->base.comm, &opts);
    if ((status != GRADSYNC_E_TIMEOUT && status != GRADSYNC_E_ABORTED && status != GRADSYNC_E_REMOTE) ||
        attempt == 200) {
      break;
    }
  }
  if (status != GRADSYNC_OK) {
    fatal(c, "gradsync_comm_create", status);
    rc = 1;
    goto out;
  }
  if ((status = race_rank_alloc_zc(&c->base)) != GRADSYNC_OK) {
    fatal(c, "gradsync_comm_alloc", status);
    rc = 1;
    goto out;
  }
  race_aborter_start(&c->base, &c->aborter, &c->state->current, NULL, &c->state->aborts);

  for (k = 1; k <= g_calls && !stopping(); ++k) {
    const plan p = plan_of(k);
    outcome* o = outcome_at(k, rank);
    uint64_t total = 0;
    st64(&c->state->current, k);
    if (p.stall_rank == rank) {
      st(&c->state->phase, P_STALL);
      sleep_us(p.stall_us);
    }
    st(&c->state->phase, P_CALL);
    if (p.reset_stall_rank == rank) gradsync_comm_abort(c->base.comm);
    status = run_call(&c->base, &p, k, &total);
    o->status = status;
    if (status == GRADSYNC_OK) {
      o->verdict = verify(&c->base, &p, k, total, o->msg) == 0 ? V_OK : V_WRONG;
    } else {
      o->verdict = V_FAILED;
      snprintf(o->msg, MSG_BYTES, "%s", gradsync_last_error_message());
    }
    st64(&c->state->progress, k);
    if (status != GRADSYNC_OK && p.reset_stall_rank == rank) {
      st(&c->state->phase, P_STALL);
      sleep_us(p.stall_us);
    }
    if (status != GRADSYNC_OK && reset_after_failure(c) != 0) {
      rc = 1;
      break;
    }
  }
  race_aborter_stop(&c->base);
  st(&c->state->phase, P_DONE);
  st(&c->state->finished, 1);
  meet(&g_shared->left);
out:
  gradsync_comm_free(c->base.comm);
  st(&c->state->finished, 2);
  race_rank_free(&c->base);
  return rc;
}

/* ------------------------------------------------------------------ supervision */

typedef struct {
  uint64_t checked, ok, failed, timed_out, mismatches, disagreements;
  uint64_t first_bad;
  double first_bad_at;
} tally;

static const char* verdict_name(const outcome* o) {
  switch (o->verdict) {
    case V_OK: return "OK, verified";
    case V_WRONG: return "OK, WRONG RESULT";
    case V_FAILED: return gradsync_status_string(o->status);
    default: return "not recorded";
  }
}

static void print_call(uint64_t k) {
  char what[256];
  const plan p = plan_of(k);
  int r;
  describe(&p, what, sizeof what);
  fprintf(stderr, "  call %" PRIu64 ": %s\n", k, what);
  for (r = 0; r < g_size; ++r) {
    const outcome* o = outcome_at(k, r);
    fprintf(stderr, "    rank %d: %s%s%s\n", r, verdict_name(o), o->verdict >= V_WRONG ? ": " : "",
            o->verdict >= V_WRONG ? o->msg : "");
  }
}

/* The promise, for one call whose outcome every rank has recorded. */
static int call_is_good(uint64_t k, tally* t) {
  const int mismatched = plan_of(k).mismatch_rank >= 0;
  int r, oks = 0, fails = 0, timeouts = 0, refusals = 0;
  for (r = 0; r < g_size; ++r) {
    const outcome* o = outcome_at(k, r);
    refusals += o->status == GRADSYNC_E_MISMATCH;
    if (o->verdict == V_OK) {
      ++oks;
    } else if (o->verdict == V_FAILED && (o->status == GRADSYNC_E_ABORTED || o->status == GRADSYNC_E_TIMEOUT ||
                                          (mismatched && o->status == GRADSYNC_E_MISMATCH))) {
      ++fails;
      timeouts += o->status == GRADSYNC_E_TIMEOUT;
    }
  }
  if (oks == g_size && !mismatched) {
    t->ok++;
    return 1;
  }
  if (fails == g_size) {
    t->failed++;
    t->timed_out += timeouts > 0;
    t->mismatches += refusals == g_size;
    return 1;
  }
  t->disagreements++;
  return 0;
}

static void print_ranks(void) {
  int r;
  for (r = 0; r < g_size; ++r) {
    rank_state* s = &g_shared->rank[r];
    fprintf(stderr,
            "  rank %d: %s at call %" PRIu64 ", %" PRIu64 " recorded, %" PRIu64 " aborts sent, %" PRIu64
            " resets (%" PRIu64 " retried)%s%s\n",
            r, phase_names[ld(&s->phase)], ld64(&s->current), ld64(&s->progress),
            __atomic_load_n(&s->aborts, __ATOMIC_RELAXED), __atomic_load_n(&s->resets, __ATOMIC_RELAXED),
            __atomic_load_n(&s->reset_retries, __ATOMIC_RELAXED), ld(&s->fatal) ? ": " : "",
            ld(&s->fatal) ? s->fatal_msg : "");
  }
}

/* Checks calls as every rank records them; stops the run at a broken promise (after a few more
 * calls, to show what followed), a fatal error on a rank, or the budget. 0 when all went well. */
static int supervise(const char* title, pid_t* pids) {
  tally t;
  const double start = now_s();
  int result = 0, r;
  memset(&t, 0, sizeof t);
  for (;;) {
    uint64_t done = g_calls;
    int finished = 0, fatal_rank = -1;
    /* Who is through is read before the progress: a pass that sees every rank through then
     * sees all of their outcomes. */
    if (pids != NULL) {
      /* a rank process that ended before its time (a crash, a sanitizer report) */
      for (r = 0; r < g_size; ++r) {
        int ws;
        if (pids[r] > 0 && waitpid(pids[r], &ws, WNOHANG) == pids[r]) {
          pids[r] = -pids[r];
          if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
            fprintf(stderr, "%s: rank %d (pid %d) ended with %s %d\n", title, r, (int)-pids[r],
                    WIFSIGNALED(ws) ? "signal" : "exit status", WIFSIGNALED(ws) ? WTERMSIG(ws) : WEXITSTATUS(ws));
            result = 1;
          }
          if (ld(&g_shared->rank[r].finished) != 2) result = 1;
        }
        finished += pids[r] < 0;
      }
    } else {
      for (r = 0; r < g_size; ++r) finished += ld(&g_shared->rank[r].finished) == 2;
    }
    for (r = 0; r < g_size; ++r) {
      const uint64_t p = ld64(&g_shared->rank[r].progress);
      if (p < done) done = p;
      if (ld(&g_shared->rank[r].fatal) && fatal_rank < 0) fatal_rank = r;
    }
    for (; t.checked < done; ++t.checked) {
      if (!call_is_good(t.checked + 1, &t) && t.first_bad == 0) {
        t.first_bad = t.checked + 1;
        t.first_bad_at = now_s();
      }
    }
    if (result != 0 && t.first_bad == 0) break;
    if (t.first_bad != 0 && (done >= t.first_bad + 6 || now_s() - t.first_bad_at > 3 || finished == g_size)) {
      uint64_t k;
      fprintf(stderr, "%s: BROKEN PROMISE: the ranks disagree on call %" PRIu64 " (seed %" PRIu64 "):\n", title,
              t.first_bad, g_seed);
      for (k = t.first_bad > 2 ? t.first_bad - 2 : 1; k <= done && k <= t.first_bad + 6; ++k) print_call(k);
      result = 1;
      break;
    }
    if (fatal_rank >= 0) {
      fprintf(stderr, "%s: rank %d gave up (seed %" PRIu64 "):\n", title, fatal_rank, g_seed);
      result = 1;
      break;
    }
    if (finished == g_size) break;
    if (now_s() - start > (double)g_budget_s) {
      fprintf(stderr,
              "%s: HANG: not finished within %" PRId64 " s (seed %" PRIu64 "); calls up to %" PRIu64 " checked\n",
              title, g_budget_s, g_seed, t.checked);
      result = 1;
      break;
    }
    sleep_us(2000);
  }
  if (result != 0) {
    print_ranks();
    if (t.first_bad == 0 && t.checked < g_calls) {
      uint64_t k;
      fprintf(stderr, "  the last calls every rank recorded:\n");
      for (k = t.checked > 3 ? t.checked - 3 : 1; k <= t.checked; ++k) print_call(k);
    }
    st(&g_shared->stop, 1);
    return 1;
  }
  {
    uint64_t aborts = 0, resets = 0, retries = 0;
    for (r = 0; r < g_size; ++r) {
      aborts += g_shared->rank[r].aborts;
      resets += g_shared->rank[r].resets;
      retries += g_shared->rank[r].reset_retries;
    }
    printf("%s: %" PRIu64 " calls, %" PRIu64 " failed alike (%" PRIu64 " with a timeout), %" PRIu64
           " ok and verified, %" PRIu64 " refused as a mismatch by every rank, %" PRIu64 " disagreements; %" PRIu64
           " aborts sent, %" PRIu64 " rank resets (%" PRIu64 " retried); %.1f s, seed %" PRIu64 "\n",
           title, t.checked, t.failed, t.timed_out, t.ok, t.mismatches, t.disagreements, aborts, resets, retries,
           now_s() - start, g_seed);
  }
  return t.checked == g_calls && t.disagreements == 0 ? 0 : 1;
}

/* ------------------------------------------------------------------ main */

static void* rank_thread(void* arg) {
  const int rank = (int)(intptr_t)arg;
  if (rank_main(rank) != 0 && !ld(&g_shared->rank[rank].fatal)) st(&g_shared->rank[rank].fatal, 1);
  return NULL;
}

static int64_t env_or(const char* name, int64_t fallback) {
  const char* v = getenv(name);
  return v != NULL && *v != '\0' ? (int64_t)strtoll(v, NULL, 0) : fallback;
}

int main(int argc, char** argv) {
  char title[64];
  size_t bytes;
  int rc, r;
  if (argc != 4 || (strcmp(argv[1], "thread") != 0 && strcmp(argv[1], "shm") != 0) || atoi(argv[2]) < 2 ||
      atoi(argv[2]) > MAX_RANKS || strtoull(argv[3], NULL, 10) < 1) {
    fprintf(stderr, "usage: %s <thread|shm> <ranks 2..%d> <calls>\n", argv[0], MAX_RANKS);
    return 2;
  }
  g_shm = strcmp(argv[1], "shm") == 0;
  g_size = atoi(argv[2]);
  g_calls = strtoull(argv[3], NULL, 10);
  g_seed =
      (uint64_t)env_or("ROUND_RACE_SEED", (int64_t)(mix64((uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32)) >> 1));
  g_timeout_ms = env_or("ROUND_RACE_TIMEOUT_MS", g_timeout_ms);
  g_abort_us = env_or("ROUND_RACE_ABORT_US", g_abort_us);
  g_budget_s = env_or("ROUND_RACE_BUDGET_S", g_budget_s);
  g_stall_every = (unsigned)env_or("ROUND_RACE_STALL_EVERY", g_stall_every);
  g_mismatch_every = (unsigned)env_or("ROUND_RACE_MISMATCH_EVERY", g_mismatch_every);
  snprintf(g_group, sizeof g_group, "round-race-%s-%d-%d", argv[1], g_size, (int)getpid());
  snprintf(title, sizeof title, "round_race %s x%d", argv[1], g_size);

  /* Outcomes must outlive and be seen across the rank processes: shared pages made before fork. */
  bytes = sizeof(shared_state) + (size_t)g_calls * (size_t)g_size * sizeof(outcome);
  {
    void* m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
      perror("mmap");
      return 1;
    }
    g_shared = (shared_state*)m;
    g_outcomes = (outcome*)((char*)m + sizeof(shared_state));
  }

  if (!g_shm) {
    pthread_t threads[MAX_RANKS];
    int joined = 0;
    for (r = 0; r < g_size; ++r) pthread_create(&threads[r], NULL, rank_thread, (void*)(intptr_t)r);
    rc = supervise(title, NULL);
    if (rc == 0) {
      for (r = 0; r < g_size; ++r) pthread_join(threads[r], NULL);
      joined = 1;
    } else {
      /* the ranks were told to stop; a rank stuck in the library must not hide the report */
      const double give_up = now_s() + 5;
      int finished = 0;
      while (finished < g_size && now_s() < give_up) {
        finished = 0;
        for (r = 0; r < g_size; ++r) finished += ld(&g_shared->rank[r].finished) == 2;
        sleep_us(10000);
      }
      if (finished == g_size) {
        for (r = 0; r < g_size; ++r) pthread_join(threads[r], NULL);
        joined = 1;
      }
    }
    if (!joined) {
      fflush(NULL);
      _exit(1);
    }
  } else {
    pid_t pids[MAX_RANKS];
    fflush(NULL);
    for (r = 0; r < g_size; ++r) {
      pids[r] = fork();
      if (pids[r] == 0) exit(rank_main(r));
      if (pids[r] < 0) {
        perror("fork");
        st(&g_shared->stop, 1);
        g_size = r;
        break;
      }
    }
    rc = supervise(title, pids);
    {
      /* stopped ranks leave within a timeout or two; the ones that do not are killed */
      const double give_up = now_s() + 5;
      for (r = 0; r < g_size; ++r) {
        int ws;
        while (pids[r] > 0) {
          const pid_t w = waitpid(pids[r], &ws, WNOHANG);
          if (w == pids[r]) {
            /* (ranks told to stop exit 1: only a crash is news after a failure) */
            if ((rc == 0 && (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0)) || WIFSIGNALED(ws)) {
              fprintf(stderr, "%s: rank %d (pid %d) ended with %s %d\n", title, r, (int)pids[r],
                      WIFSIGNALED(ws) ? "signal" : "exit status", WIFSIGNALED(ws) ? WTERMSIG(ws) : WEXITSTATUS(ws));
              rc = 1;
            }
            pids[r] = -pids[r];
          } else if (now_s() > give_up) {
            fprintf(stderr, "%s: rank %d (pid %d) did not stop; killing it\n", title, r, (int)pids[r]);
            kill(pids[r], SIGKILL);
            waitpid(pids[r], &ws, 0);
            pids[r] = -pids[r];
            rc = 1;
          } else {
            sleep_us(10000);
          }
        }
      }
      if (rc != 0) {
        /* a killed group leaves its segment behind */
        char path[128];
        snprintf(path, sizeof path, "/dev/shm/gradsync.%s", g_group);
        unlink(path);
      }
    }
  }
  munmap(g_shared, bytes);
  return rc;
}
