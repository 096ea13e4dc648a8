/* SPDX-License-Identifier: Apache-2.0 */
/* Groups over MPI under randomized failures: every rank's aborter thread aborts the group at
 * random moments (cued just before calls, so that aborts land near arrivals and completions),
 * ranks stall past the deadline before a call or before a reset, and ranks pass another count than
 * their peers. The calls are round_race's (../stress/race_calls.h), every OK result checked bit
 * for bit. The groups: the MPI and hierarchical transports with one rank per process (-plain), and
 * threads as ranks over either (comm.h), whose failure rules between the levels are model-checked
 * (tests/model/threaded.pml); this runs the real code through them, thousands of times.
 *
 * What is checked, call by call, over every rank of every process:
 * - an OK result is exactly right;
 * - a failure is GRADSYNC_E_ABORTED or GRADSYNC_E_TIMEOUT, or GRADSYNC_E_MISMATCH on a call whose
 *   counts differ, and no rank returns OK for such a call;
 * - no call and no reset stays in the library longer than the hang bound (a watchdog ends the job);
 * - after a timeout or an abort anywhere, every rank's next call (a barrier) fails, the ranks that
 *   completed the call too: no rank goes on ahead of the others until the reset;
 * - after a failure anywhere, a reset on every rank (again on every rank while one fails with
 *   E_TIMEOUT or E_ABORTED, as comm.h says) gives a group whose next calls are right.
 * A call that fails on some ranks and succeeds on others is allowed (comm.h: a deadline at the
 * instant a call completes on MPI; per level on hier and with threads) and counted.
 *
 * The processes compare outcomes over an MPI communicator of the test's own, never the library's.
 *
 *   mpirun -np P mpi_race mpi|hier|mpi-plain|hier-plain T0,T1,... calls
 *
 * Ti: the threads (ranks) of process i (1 for every process with -plain). Environment:
 * MPI_RACE_SEED, MPI_RACE_TIMEOUT_MS, MPI_RACE_ABORT_US (mean time between the group's random
 * aborts), MPI_RACE_STALL_EVERY, MPI_RACE_MISMATCH_EVERY (1 in how many calls; 0: never). */
#define _POSIX_C_SOURCE 200809L
#include <mpi.h>
#include <pthread.h>
#include <unistd.h>

#include "../stress/race_calls.h"

#define MAX_PROCS 8
#define MAX_THREADS 8
#define MAX_RANKS (MAX_PROCS * MAX_THREADS)
#define RESET_ATTEMPTS 200 /* resets on every rank that keep failing this often are a failure, not a race */

static int32_t g_transport;
static int g_plain; /* one rank per process: options.threads unset */
static int g_procs, g_me, g_threads[MAX_PROCS], g_first[MAX_PROCS];
static uint64_t g_calls;
static double g_hang_s;
static MPI_Comm g_board, g_lib;
static pthread_barrier_t g_team;

typedef struct {
  int32_t status, verdict;
  char msg[MSG_BYTES];
} outcome;

static outcome g_mine[MAX_THREADS]; /* this process's ranks, this step */
static outcome g_every[MAX_RANKS];  /* every rank's, by rank, after the exchange */
static int g_stop;                  /* a broken promise: every thread leaves after this step */
static int stopped(void) { return __atomic_load_n(&g_stop, __ATOMIC_ACQUIRE); }
static void stop(void) { __atomic_store_n(&g_stop, 1, __ATOMIC_RELEASE); }
static int64_t g_since[MAX_THREADS]; /* when the rank entered the library, in µs (0: it is not in it) */
static uint64_t g_at[MAX_THREADS];   /* the call it is at */
static int g_resetting[MAX_THREADS]; /* whether it is in a reset */

/* Counts, kept by thread 0 of each process (alike on all: they judge the same outcomes). */
static uint64_t g_ok, g_failed, g_timed_out, g_split, g_refused, g_resets, g_reset_rounds, g_probes;
static uint64_t g_aborts; /* sent by this process's aborters */

static void entered(int t) { __atomic_store_n(&g_since[t], (int64_t)(now_s() * 1e6) + 1, __ATOMIC_RELEASE); }
static void left(int t) { __atomic_store_n(&g_since[t], 0, __ATOMIC_RELEASE); }

/* ------------------------------------------------------------------ one rank */

typedef struct {
  race_rank base;
  int t;
  race_aborter aborter;
} rank_ctx;

/* Every rank's outcome of this step, to every rank: this process's threads meet, its thread 0
 * trades them with the other processes over the test's own communicator. */
static void exchange(int t, void (*judge)(void*), void* arg) {
  pthread_barrier_wait(&g_team);
  if (t == 0) {
    int counts[MAX_PROCS], displs[MAX_PROCS];
    for (int p = 0; p < g_procs; p++) {
      counts[p] = g_threads[p] * (int)sizeof(outcome);
      displs[p] = g_first[p] * (int)sizeof(outcome);
    }
    MPI_Allgatherv(g_mine, counts[g_me], MPI_BYTE, g_every, counts, displs, MPI_BYTE, g_board);
    judge(arg);
  }
  pthread_barrier_wait(&g_team);
}

static void print_outcomes(const char* what) {
  if (g_me != 0) return;
  fprintf(stderr, "  %s\n", what);
  for (int r = 0; r < g_size; r++) {
    const outcome* o = &g_every[r];
    fprintf(stderr, "    rank %d: %s%s%s\n", r,
            o->verdict == V_OK      ? "OK, verified"
            : o->verdict == V_WRONG ? "OK, WRONG RESULT"
                                    : gradsync_status_string(o->status),
            o->verdict != V_OK ? ": " : "", o->verdict != V_OK ? o->msg : "");
  }
}

/* Thread 0 of every process, on the same outcomes: the promise for call k. */
static void judge_call(void* arg) {
  const uint64_t k = *(const uint64_t*)arg;
  const plan p = plan_of(k);
  const int mismatched = p.mismatch_rank >= 0;
  int oks = 0, timeouts = 0, refusals = 0, broken = 0;
  for (int r = 0; r < g_size; r++) {
    const outcome* o = &g_every[r];
    const int allowed = o->status == GRADSYNC_E_ABORTED || o->status == GRADSYNC_E_TIMEOUT ||
                        (mismatched && o->status == GRADSYNC_E_MISMATCH);
    oks += o->status == GRADSYNC_OK;
    timeouts += o->status == GRADSYNC_E_TIMEOUT;
    refusals += o->status == GRADSYNC_E_MISMATCH;
    if (o->verdict == V_WRONG || (o->status == GRADSYNC_OK && mismatched) || (o->status != GRADSYNC_OK && !allowed))
      broken = 1;
  }
  if (broken) {
    char what[320];
    describe(&p, what, sizeof what);
    if (g_me == 0) fprintf(stderr, "mpi_race: BROKEN PROMISE at call %" PRIu64 " (seed %" PRIu64 "):\n", k, g_seed);
    print_outcomes(what);
    stop();
    return;
  }
  if (oks == g_size) {
    g_ok++;
  } else if (oks == 0) {
    g_failed++;
    g_timed_out += timeouts > 0;
    g_refused += refusals == g_size;
  } else {
    g_split++;
  }
}

/* Thread 0 of every process: the call after one that timed out or was aborted somewhere failed
 * on every rank, by a timeout or an abort. */
static void judge_probe(void* arg) {
  const uint64_t k = *(const uint64_t*)arg;
  g_probes++;
  for (int r = 0; r < g_size; r++) {
    const int32_t status = g_every[r].status;
    if (status != GRADSYNC_E_ABORTED && status != GRADSYNC_E_TIMEOUT) {
      char what[320];
      const plan p = plan_of(k);
      describe(&p, what, sizeof what);
      if (g_me == 0)
        fprintf(stderr,
                "mpi_race: BROKEN PROMISE: the barrier after call %" PRIu64
                " (failed by a timeout or an abort) did not fail on every rank (seed %" PRIu64 "); call %" PRIu64
                ": %s; the barrier:\n",
                k, g_seed, k, what);
      print_outcomes("the barrier after it");
      stop();
      return;
    }
  }
}

/* Thread 0 of every process, after every rank has created, reset or reached the end: whether
 * every rank returned OK, or they go again. A status other than a timeout or an abort is a
 * broken promise. */
typedef struct {
  const char* what;
  int done;
} settling;

static void judge_settled(void* arg) {
  settling* s = (settling*)arg;
  s->done = 1;
  for (int r = 0; r < g_size; r++) {
    const int32_t status = g_every[r].status;
    if (status == GRADSYNC_OK) continue;
    s->done = 0;
    if (status != GRADSYNC_E_TIMEOUT && status != GRADSYNC_E_ABORTED && !stopped()) {
      if (g_me == 0) fprintf(stderr, "mpi_race: %s returned another status (seed %" PRIu64 "):\n", s->what, g_seed);
      print_outcomes(s->what);
      stop();
    }
  }
}

static void record(int t, int status, int verdict) {
  g_mine[t].status = status;
  g_mine[t].verdict = verdict;
  if (verdict == V_FAILED) snprintf(g_mine[t].msg, MSG_BYTES, "%s", gradsync_last_error_message());
}

/* Every rank resets, and again while any rank's reset fails (comm.h: call it again on every rank). */
static void reset_everywhere(rank_ctx* c, const plan* p) {
  static settling reset = {"a reset", 0}; /* written by thread 0 between the barriers only */
  for (int attempt = 0;; attempt++) {
    if (attempt == 0 && p->reset_stall_rank == c->base.rank) sleep_us(p->stall_us); /* a late reset */
    __atomic_store_n(&g_resetting[c->t], 1, __ATOMIC_RELAXED);
    entered(c->t);
    const int status = gradsync_comm_reset(c->base.comm);
    left(c->t);
    record(c->t, status, status == GRADSYNC_OK ? V_OK : V_FAILED);
    exchange(c->t, judge_settled, &reset);
    if (c->t == 0) g_reset_rounds++;
    if (reset.done || stopped()) return;
    if (attempt == RESET_ATTEMPTS) {
      if (g_me == 0 && c->t == 0)
        fprintf(stderr, "mpi_race: the resets did not settle in %d rounds (seed %" PRIu64 ")\n", RESET_ATTEMPTS,
                g_seed);
      stop(); /* every thread sees the same rounds: they all leave here */
      return;
    }
  }
}

static void* rank_main(void* arg) {
  rank_ctx* c = (rank_ctx*)arg;
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  o.transport = g_transport;
  if (!g_plain) {
    o.threads = g_threads[g_me];
    o.thread = c->t;
  }
  o.timeout_ms = g_timeout_ms;
  o.mpi_fcomm = (int64_t)MPI_Comm_c2f(g_lib);
  snprintf(o.name, sizeof o.name, "mpi-race");
  /* Forming has the calls' short deadline, which a loaded host can miss: the test is about the
     calls, so a group that could not form is formed again. */
  static settling formed = {"a create", 0};
  int status = GRADSYNC_E_TIMEOUT;
  for (int attempt = 0; attempt < 20 && !formed.done && !stopped(); attempt++) {
    status = gradsync_comm_create(&c->base.comm, &o);
    record(c->t, status, status == GRADSYNC_OK ? V_OK : V_FAILED);
    exchange(c->t, judge_settled, &formed);
    if (!formed.done && status == GRADSYNC_OK) {
      gradsync_comm_free(c->base.comm);
      c->base.comm = NULL;
    }
  }
  if (!formed.done) {
    fprintf(stderr, "mpi_race: process %d thread %d: create: %s: %s\n", g_me, c->t, gradsync_status_string(status),
            gradsync_last_error_message());
    stop();
    return NULL;
  }
  gradsync_comm_rank(c->base.comm, &c->base.rank);
  if (race_rank_alloc(&c->base) != 0 || race_rank_alloc_zc(&c->base) != GRADSYNC_OK) {
    fprintf(stderr, "mpi_race: process %d thread %d: out of memory\n", g_me, c->t);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  race_aborter_start(&c->base, &c->aborter, &g_at[c->t], &g_resetting[c->t], &g_aborts);

  for (uint64_t k = 1; k <= g_calls && !stopped(); k++) {
    const plan p = plan_of(k);
    uint64_t total = 0;
    __atomic_store_n(&g_at[c->t], k, __ATOMIC_RELEASE);
    __atomic_store_n(&g_resetting[c->t], 0, __ATOMIC_RELAXED);
    if (p.stall_rank == c->base.rank) sleep_us(p.stall_us);
    if (p.reset_stall_rank == c->base.rank) gradsync_comm_abort(c->base.comm);
    entered(c->t);
    status = run_call(&c->base, &p, k, &total);
    left(c->t);
    if (status == GRADSYNC_OK) {
      const int right = verify(&c->base, &p, k, total, g_mine[c->t].msg) == 0;
      g_mine[c->t].status = status;
      g_mine[c->t].verdict = right ? V_OK : V_WRONG;
    } else {
      record(c->t, status, V_FAILED);
    }
    exchange(c->t, judge_call, &k);
    int any_failed = 0, any_stopped = 0;
    for (int r = 0; r < g_size; r++) {
      any_failed |= g_every[r].status != GRADSYNC_OK;
      any_stopped |= g_every[r].status == GRADSYNC_E_ABORTED || g_every[r].status == GRADSYNC_E_TIMEOUT;
    }
    if (any_stopped && !stopped()) {
      /* comm.h: after a timeout or an abort every rank's next call fails until the reset, the
         ranks that completed this call too (no rank goes on a call ahead of the others) */
      entered(c->t);
      status = gradsync_comm_barrier(c->base.comm);
      left(c->t);
      record(c->t, status, status == GRADSYNC_OK ? V_OK : V_FAILED);
      exchange(c->t, judge_probe, &k);
    }
    if (any_failed && !stopped()) {
      if (c->t == 0) g_resets++;
      reset_everywhere(c, &p);
    }
  }

  race_aborter_stop(&c->base);
  /* every rank out of its last call before any frees (freeing is collective) */
  static settling finish = {"the finish", 0};
  record(c->t, GRADSYNC_OK, V_OK);
  exchange(c->t, judge_settled, &finish);
  gradsync_comm_free(c->base.comm);
  race_rank_free(&c->base);
  return NULL;
}

/* A rank in the library past the bound is a hang: say where, and end the job. */
static void* watchdog_main(void* arg) {
  (void)arg;
  for (;;) {
    sleep_us(250000);
    for (int t = 0; t < g_threads[g_me]; t++) {
      const double since = (double)__atomic_load_n(&g_since[t], __ATOMIC_ACQUIRE) * 1e-6;
      if (since > 0 && now_s() - since > g_hang_s) {
        const uint64_t k = __atomic_load_n(&g_at[t], __ATOMIC_ACQUIRE);
        const plan p = plan_of(k);
        char what[320];
        describe(&p, what, sizeof what);
        fprintf(stderr,
                "mpi_race: HANG: process %d thread %d has been in %s %.0f s, at call %" PRIu64 " (%s); seed %" PRIu64
                "\n",
                g_me, t, __atomic_load_n(&g_resetting[t], __ATOMIC_RELAXED) ? "a reset" : "the call", now_s() - since,
                k, what, g_seed);
        fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 3);
      }
    }
  }
  return NULL;
}

static int64_t env_or(const char* name, int64_t fallback) {
  const char* v = getenv(name);
  return v != NULL && *v != '\0' ? (int64_t)strtoll(v, NULL, 0) : fallback;
}

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_me);
  if (argc != 4 || provided < MPI_THREAD_MULTIPLE) {
    if (g_me == 0)
      fprintf(stderr,
              "usage: mpirun -np P %s mpi|hier|mpi-plain|hier-plain T0,T1,... calls (MPI_THREAD_MULTIPLE: %s)\n",
              argv[0], provided < MPI_THREAD_MULTIPLE ? "not given" : "given");
    MPI_Finalize();
    return 2;
  }
  g_transport = strncmp(argv[1], "hier", 4) == 0 ? GRADSYNC_TRANSPORT_HIER : GRADSYNC_TRANSPORT_MPI;
  g_plain = strstr(argv[1], "-plain") != NULL;
  for (const char* s = argv[2]; *s != '\0' && g_procs < MAX_PROCS;) {
    g_threads[g_procs++] = (int)strtol(s, (char**)&s, 10);
    if (*s == ',') s++;
  }
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  for (int p = 0; p < g_procs; p++) {
    g_first[p] = g_size;
    g_size += g_threads[p];
    if (g_threads[p] < 1 || g_threads[p] > (g_plain ? 1 : MAX_THREADS)) world = -1;
  }
  g_calls = strtoull(argv[3], NULL, 10);
  if (world != g_procs || g_calls < 1) {
    if (g_me == 0) fprintf(stderr, "mpi_race: the layout %s does not fit %d processes\n", argv[2], world);
    MPI_Finalize();
    return 2;
  }
  /* one seed for all: process 0's */
  int64_t seed = env_or("MPI_RACE_SEED", (int64_t)(mix64((uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32)) >> 1));
  MPI_Bcast(&seed, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
  g_seed = (uint64_t)seed;
  g_timeout_ms = env_or("MPI_RACE_TIMEOUT_MS", 300);
  g_abort_us = env_or("MPI_RACE_ABORT_US", 20000);
  g_stall_every = (unsigned)env_or("MPI_RACE_STALL_EVERY", 100);
  g_mismatch_every = (unsigned)env_or("MPI_RACE_MISMATCH_EVERY", 25);
  /* a call waits at most a deadline per level, a few in all; far past that is a hang */
  g_hang_s = 30.0 + 40.0 * (double)g_timeout_ms / 1000.0;
  MPI_Comm_dup(MPI_COMM_WORLD, &g_board);
  MPI_Comm_dup(MPI_COMM_WORLD, &g_lib);
  pthread_barrier_init(&g_team, NULL, (unsigned)g_threads[g_me]);

  const double start = now_s();
  rank_ctx ctx[MAX_THREADS];
  pthread_t ids[MAX_THREADS], watchdog;
  memset(ctx, 0, sizeof ctx);
  pthread_create(&watchdog, NULL, watchdog_main, NULL);
  pthread_detach(watchdog);
  for (int t = 0; t < g_threads[g_me]; t++) {
    ctx[t].t = t;
    pthread_create(&ids[t], NULL, rank_main, &ctx[t]);
  }
  for (int t = 0; t < g_threads[g_me]; t++) pthread_join(ids[t], NULL);

  uint64_t aborts = 0, mine = g_aborts;
  MPI_Reduce(&mine, &aborts, 1, MPI_UINT64_T, MPI_SUM, 0, g_board);
  const uint64_t checked = g_ok + g_failed + g_split;
  const int passed = !stopped() && checked == g_calls && g_ok > 0 && g_failed > 0;
  if (g_me == 0) {
    printf("mpi_race %s %s: %s: %" PRIu64 " calls on %d ranks: %" PRIu64 " ok and verified, %" PRIu64
           " failed on every rank (%" PRIu64 " with a timeout, %" PRIu64
           " refused as a mismatch by every rank), %" PRIu64 " failed on some ranks only; %" PRIu64
           " aborts sent; %" PRIu64 " barriers after a timeout or abort, failed on every rank; %" PRIu64
           " resets on every rank (%" PRIu64 " rounds); %.1f s, seed %" PRIu64 "\n",
           argv[1], argv[2], passed ? "ok" : "FAILED", checked, g_size, g_ok, g_failed, g_timed_out, g_refused, g_split,
           aborts, g_probes, g_resets, g_reset_rounds, now_s() - start, g_seed);
  }
  MPI_Comm_free(&g_lib);
  MPI_Comm_free(&g_board);
  MPI_Finalize();
  return passed ? 0 : 1;
}
