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
 * 0: never), ROUND_RACE_BUDGET_S. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gradsync/gradsync.h"

#define MAX_RANKS 8
#define MSG_BYTES 176
#define LARGE_MAX 310000u   /* floats: past several 256 KiB chunks of the copy pipeline */
#define SMALL_BYTES 16384u  /* the inline path's limit */
#define ZC_MAX 65536u       /* floats per zero-copy buffer */
#define RESET_PATIENCE_S 10 /* a reset that keeps failing this long is a failure, not a race */

/* ------------------------------------------------------------------ configuration */

static uint64_t g_seed;
static int g_size;
static int g_shm;
static uint64_t g_calls;
static int64_t g_timeout_ms = 50;
static int64_t g_abort_us = 1000;
static int64_t g_budget_s = 120;
static unsigned g_stall_every = 1000;
static char g_group[GRADSYNC_COMM_NAME_MAX];

/* ------------------------------------------------------------------ state shared by ranks */

enum { V_NONE = 0, V_OK = 1, V_WRONG = 2, V_FAILED = 3 };
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

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void sleep_us(int64_t us) {
  struct timespec t;
  t.tv_sec = (time_t)(us / 1000000);
  t.tv_nsec = (long)(us % 1000000) * 1000;
  while (nanosleep(&t, &t) != 0 && errno == EINTR) {
  }
}

static uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/* ------------------------------------------------------------------ the calls, a function of k */

enum { K_SMALL, K_LARGE, K_BARRIER, K_BCAST, K_MANY, K_WMEAN, K_ZEROCOPY };
static const char* const kind_names[] = {"allreduce (inline)",
                                         "allreduce (large)",
                                         "barrier",
                                         "broadcast",
                                         "allreduce_many",
                                         "weighted_mean",
                                         "allreduce (comm_alloc buffers, on all ranks or some)"};

typedef struct {
  int kind;
  int32_t dtype, op, root;
  size_t n, n2;
  int in_place;
  int stall_rank;       /* -1: nobody; else this rank sleeps past the timeout before the call */
  int reset_stall_rank; /* -1: nobody; else this rank aborts the call and sleeps before its reset */
  int64_t stall_us;
  int quiet; /* aborters hold off, so the stall ends in a timeout rather than an abort */
  int heavy_rank, zero_rank;
  uint64_t total_weight;
  unsigned zc_ranks; /* K_ZEROCOPY: bit r set when rank r's buffers come from gradsync_comm_alloc */
} plan;

static plan plan_of(uint64_t k) {
  const uint64_t h = mix64(g_seed ^ (k * 0xD1B54A32D192ED03ull));
  const uint64_t h2 = mix64(h);
  const unsigned pick = (unsigned)(h % 32);
  plan p;
  memset(&p, 0, sizeof p);
  p.dtype = GRADSYNC_F32;
  p.op = GRADSYNC_SUM;
  p.in_place = (int)((h >> 5) & 1);
  p.stall_rank = -1;
  p.reset_stall_rank = -1;
  p.zero_rank = -1;
  p.kind = pick < 11   ? K_SMALL
           : pick < 14 ? K_LARGE
           : pick < 19 ? K_BARRIER
           : pick < 22 ? K_BCAST
           : pick < 25 ? K_MANY
           : pick < 28 ? K_WMEAN
                       : K_ZEROCOPY;
  switch (p.kind) {
    case K_SMALL: {
      const unsigned d = (unsigned)((h >> 6) & 3), o = (unsigned)((h >> 8) & 3);
      p.dtype = d == 2 ? GRADSYNC_F64 : d == 3 ? GRADSYNC_I32 : GRADSYNC_F32;
      p.op = o == 2 ? GRADSYNC_MAX : o == 3 ? GRADSYNC_MIN : GRADSYNC_SUM;
      p.n = 1 + (size_t)((h >> 10) % (SMALL_BYTES / gradsync_dtype_size(p.dtype)));
      break;
    }
    case K_LARGE: p.n = 4097 + (size_t)((h >> 10) % (LARGE_MAX - 4097)); break;
    case K_BCAST:
      p.root = (int32_t)(k % (uint64_t)g_size);
      p.n = (h >> 6) & 1 ? 1 + (size_t)((h >> 10) % 4096) : 4097 + (size_t)((h >> 10) % (LARGE_MAX - 4097));
      break;
    case K_MANY:
      p.n = 1 + (size_t)((h >> 10) % 3000);
      p.n2 = 1 + (size_t)((h >> 30) % ((h >> 7) & 1 ? 1000 : 120000));
      break;
    case K_WMEAN: {
      int m = 1;
      while ((1 << m) < g_size + 1) ++m;
      m += (int)((h >> 10) % 3);
      p.total_weight = (uint64_t)1 << m; /* a power of two: the mean of small integers is exact */
      p.n = 1 + (size_t)((h >> 20) % 20000);
      p.heavy_rank = (int)(k % (uint64_t)g_size);
      /* a rank of weight 0 sends NaN, which must contribute nothing */
      if (g_size > 1 && ((h >> 40) & 3) == 0) p.zero_rank = (int)((k + 1) % (uint64_t)g_size);
      break;
    }
    case K_ZEROCOPY:
      /* up to 16 KiB half the time: the sizes whose round goes inline unless every rank's buffers
         are reachable, and then direct */
      p.n = 1 + (size_t)((h >> 10) % ((h >> 40) & 1 ? SMALL_BYTES / sizeof(float) : ZC_MAX));
      p.zc_ranks = (h >> 41) & 3 ? ~0u : (unsigned)(h >> 44);
      break;
    default: break;
  }
  if (g_size > 1 && g_stall_every > 0 && h2 % g_stall_every == 0) {
    p.stall_rank = (int)((h2 >> 20) % (uint64_t)g_size);
    /* around the deadline, mostly past it: the late arrival races the peers' timeout */
    p.stall_us = g_timeout_ms * 1000 - g_timeout_ms * 100 + (int64_t)((h2 >> 32) % (uint64_t)(g_timeout_ms * 600));
    p.quiet = (int)((h2 >> 60) & 1) || p.kind == K_BARRIER;
  } else if (g_size > 1 && g_stall_every > 1 && h2 % g_stall_every == g_stall_every / 2) {
    /* the call fails for sure (this rank aborts it), then the late reset races the peers' */
    p.reset_stall_rank = (int)((h2 >> 20) % (uint64_t)g_size);
    p.stall_us = g_timeout_ms * 1000 - g_timeout_ms * 100 + (int64_t)((h2 >> 32) % (uint64_t)(g_timeout_ms * 400));
  }
  return p;
}

static void describe(const plan* p, char* out, size_t cap) {
  static const char* const dtypes[] = {"f32", "f64", "i32"};
  static const char* const ops[] = {"sum", "mean", "max", "min"};
  int w = snprintf(out, cap, "%s", kind_names[p->kind]);
  switch (p->kind) {
    case K_SMALL:
    case K_LARGE:
    case K_ZEROCOPY:
      w += snprintf(out + w, cap - (size_t)w, " of %zu %s %s%s", p->n, dtypes[p->dtype], ops[p->op],
                    p->in_place ? " in place" : "");
      if (p->kind == K_ZEROCOPY) w += snprintf(out + w, cap - (size_t)w, ", rank mask %#x", p->zc_ranks);
      break;
    case K_BCAST: w += snprintf(out + w, cap - (size_t)w, " of %zu f32 from root %d", p->n, (int)p->root); break;
    case K_MANY:
      w += snprintf(out + w, cap - (size_t)w, " of %zu + %zu f32%s", p->n, p->n2, p->in_place ? " in place" : "");
      break;
    case K_WMEAN:
      w += snprintf(out + w, cap - (size_t)w, " of %zu f32, total weight %" PRIu64 ", zero-weight rank %d", p->n,
                    p->total_weight, p->zero_rank);
      break;
    default: break;
  }
  if (p->stall_rank >= 0 && w > 0 && (size_t)w < cap) {
    snprintf(out + w, cap - (size_t)w, "; rank %d stalls %.1f ms first%s", p->stall_rank, (double)p->stall_us / 1000.0,
             p->quiet ? " (no aborts)" : "");
  }
  if (p->reset_stall_rank >= 0 && w > 0 && (size_t)w < cap) {
    snprintf(out + w, cap - (size_t)w, "; rank %d aborts it and stalls %.1f ms before its reset", p->reset_stall_rank,
             (double)p->stall_us / 1000.0);
  }
}

/* Small integers, so every sum, max, min and power-of-two mean is exact in any dtype. */
static int32_t base_value(uint64_t k, size_t i) {
  return (int32_t)(((uint32_t)i * 37u + (uint32_t)k * 11u) & 255u) - 128;
}
static int32_t rank_step(uint64_t k) { return (int32_t)(k % 7u) - 3; }
static int32_t value(int r, uint64_t k, size_t i) { return base_value(k, i) + (r + 1) * rank_step(k); }
static int32_t reduced(int32_t op, uint64_t k, size_t i) {
  const int32_t b = base_value(k, i), s = rank_step(k), n = g_size;
  if (op == GRADSYNC_MAX) return b + (s > 0 ? n * s : s);
  if (op == GRADSYNC_MIN) return b + (s > 0 ? s : n * s);
  return n * b + s * n * (n + 1) / 2;
}
static uint64_t weight_of(const plan* p, int r) {
  if (r == p->zero_rank) return 0;
  if (r == p->heavy_rank) return p->total_weight - (uint64_t)(g_size - 1 - (p->zero_rank >= 0));
  return 1;
}

static void fill(void* buf, int32_t dtype, size_t n, int r, uint64_t k) {
  size_t i;
  if (dtype == GRADSYNC_F64) {
    for (i = 0; i < n; ++i) ((double*)buf)[i] = (double)value(r, k, i);
  } else if (dtype == GRADSYNC_I32) {
    for (i = 0; i < n; ++i) ((int32_t*)buf)[i] = value(r, k, i);
  } else {
    for (i = 0; i < n; ++i) ((float*)buf)[i] = (float)value(r, k, i);
  }
}

static void fill_expected(void* buf, int32_t dtype, int32_t op, size_t n, uint64_t k) {
  size_t i;
  if (dtype == GRADSYNC_F64) {
    for (i = 0; i < n; ++i) ((double*)buf)[i] = (double)reduced(op, k, i);
  } else if (dtype == GRADSYNC_I32) {
    for (i = 0; i < n; ++i) ((int32_t*)buf)[i] = reduced(op, k, i);
  } else {
    for (i = 0; i < n; ++i) ((float*)buf)[i] = (float)reduced(op, k, i);
  }
}

/* ------------------------------------------------------------------ one rank */

typedef struct {
  int rank;
  gradsync_comm* comm;
  rank_state* state;
  char *send, *recv, *expect, *send2, *recv2, *expect2; /* LARGE_MAX floats each */
  float *zsend, *zrecv;                                 /* gradsync_comm_alloc: zero copy on shm */
  uint64_t rng;
  pthread_mutex_t lock; /* cue and stop_aborter */
  pthread_cond_t cond;
  int cued, stop_aborter;
  pthread_t aborter;
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

static void spin_for(uint64_t n) {
  volatile uint64_t spin = n;
  while (spin > 0) --spin;
}

/* Just before some of its calls into the library, the rank wakes its aborter, whose wake-up (a
 * few microseconds, more on a busy machine) and a spin of log-uniform length land the abort near
 * the round's arrival and completion, where the protocol has to decide. Aborts at random moments
 * rarely fall there: most of the time goes to filling and checking buffers. */
static void enter(rank_ctx* c) {
  c->rng = mix64(c->rng);
  if (c->rng % (uint64_t)(3 * g_size) != 0) return;
  pthread_mutex_lock(&c->lock);
  c->cued = 1;
  pthread_cond_signal(&c->cond);
  pthread_mutex_unlock(&c->lock);
}

static void* aborter_main(void* arg) {
  rank_ctx* c = (rank_ctx*)arg;
  uint64_t rng = mix64(g_seed + 977u * (uint64_t)(c->rank + 1));
  /* each of the group's aborters waits size times the group's mean interval */
  const uint64_t span = (uint64_t)(2 * g_abort_us * g_size) + 1;
  for (;;) {
    struct timespec until;
    uint64_t k, wait_ns;
    int cued, stop;
    rng = mix64(rng);
    wait_ns = ((rng >> 8) % span) * 1000u;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += (time_t)((wait_ns + (uint64_t)until.tv_nsec) / 1000000000u);
    until.tv_nsec = (long)((wait_ns + (uint64_t)until.tv_nsec) % 1000000000u);
    pthread_mutex_lock(&c->lock);
    while (!c->cued && !c->stop_aborter && pthread_cond_timedwait(&c->cond, &c->lock, &until) == 0) {
    }
    cued = c->cued;
    c->cued = 0;
    stop = c->stop_aborter;
    pthread_mutex_unlock(&c->lock);
    if (stop) break;
    if (cued || (rng & 7) == 0) spin_for(((uint64_t)1 << ((rng >> 40) % 14)) + ((rng >> 20) & 15));
    k = ld64(&c->state->current);
    if (k > 0 && (plan_of(k).quiet || plan_of(k + 1).quiet || (k > 1 && plan_of(k - 1).quiet))) continue;
    gradsync_comm_abort(c->comm);
    __atomic_add_fetch(&c->state->aborts, 1, __ATOMIC_RELAXED);
  }
  return NULL;
}

/* K_ZEROCOPY's buffers on this rank: the communicator's, or its private ones. */
static float* zc_send(const rank_ctx* c, const plan* p) {
  return (p->zc_ranks >> c->rank) & 1 ? c->zsend : (float*)c->send;
}
static float* zc_out(const rank_ctx* c, const plan* p) {
  return p->in_place ? zc_send(c, p) : (p->zc_ranks >> c->rank) & 1 ? c->zrecv : (float*)c->recv;
}

static int run_call(rank_ctx* c, const plan* p, uint64_t k, uint64_t* total) {
  const size_t es = gradsync_dtype_size(p->dtype);
  switch (p->kind) {
    case K_SMALL:
    case K_LARGE: {
      void* out = p->in_place ? c->send : c->recv;
      fill(c->send, p->dtype, p->n, c->rank, k);
      if (!p->in_place) memset(c->recv, 0x7f, p->n * es); /* a result never written shows */
      enter(c);
      return gradsync_comm_allreduce(c->comm, c->send, out, p->n, p->dtype, p->op);
    }
    case K_ZEROCOPY: {
      float *send = zc_send(c, p), *out = zc_out(c, p);
      fill(send, GRADSYNC_F32, p->n, c->rank, k);
      if (!p->in_place) memset(out, 0x7f, p->n * sizeof(float));
      enter(c);
      return gradsync_comm_allreduce(c->comm, send, out, p->n, GRADSYNC_F32, GRADSYNC_SUM);
    }
    case K_BARRIER: enter(c); return gradsync_comm_barrier(c->comm);
    case K_BCAST: {
      size_t i;
      if (c->rank == p->root) {
        fill(c->send, GRADSYNC_F32, p->n, c->rank, k);
      } else {
        for (i = 0; i < p->n; ++i) ((float*)c->send)[i] = 7777.0f;
      }
      enter(c);
      return gradsync_comm_broadcast(c->comm, c->send, p->n, GRADSYNC_F32, p->root);
    }
    case K_MANY: {
      const void* sends[2];
      void* recvs[2];
      size_t counts[2];
      fill(c->send, GRADSYNC_F32, p->n, c->rank, k);
      fill(c->send2, GRADSYNC_F32, p->n2, c->rank, k + 100000007u);
      sends[0] = c->send;
      sends[1] = c->send2;
      recvs[0] = p->in_place ? c->send : c->recv;
      recvs[1] = p->in_place ? c->send2 : c->recv2;
      counts[0] = p->n;
      counts[1] = p->n2;
      if (!p->in_place) {
        memset(c->recv, 0x7f, p->n * sizeof(float));
        memset(c->recv2, 0x7f, p->n2 * sizeof(float));
      }
      enter(c);
      return gradsync_comm_allreduce_many(c->comm, p->in_place ? NULL : sends, recvs, counts, 2, GRADSYNC_F32,
                                          GRADSYNC_SUM);
    }
    case K_WMEAN: {
      const uint64_t w = weight_of(p, c->rank);
      size_t i;
      fill(c->send, GRADSYNC_F32, p->n, c->rank, k);
      if (w == 0) {
        for (i = 0; i < p->n; ++i) ((float*)c->send)[i] = (i & 1) ? (float)NAN : (float)INFINITY;
      }
      memset(c->recv, 0x7f, p->n * sizeof(float));
      *total = 0;
      enter(c);
      return gradsync_comm_weighted_mean(c->comm, c->send, c->recv, p->n, GRADSYNC_F32, w, total);
    }
    default: return GRADSYNC_E_INTERNAL;
  }
}

/* 0 when got holds exactly want; else says where it differs. */
static int compare(const char* got, const char* want, size_t n, int32_t dtype, const char* which, char* msg) {
  const size_t es = gradsync_dtype_size(dtype);
  size_t i;
  if (memcmp(got, want, n * es) == 0) return 0;
  for (i = 0; i < n && memcmp(got + i * es, want + i * es, es) == 0; ++i) {
  }
  if (dtype == GRADSYNC_F64) {
    snprintf(msg, MSG_BYTES, "WRONG %s[%zu] of %zu: got %.17g, want %.17g", which, i, n, ((const double*)got)[i],
             ((const double*)want)[i]);
  } else if (dtype == GRADSYNC_I32) {
    snprintf(msg, MSG_BYTES, "WRONG %s[%zu] of %zu: got %d, want %d", which, i, n, (int)((const int32_t*)got)[i],
             (int)((const int32_t*)want)[i]);
  } else {
    snprintf(msg, MSG_BYTES, "WRONG %s[%zu] of %zu: got %.9g, want %.9g", which, i, n, (double)((const float*)got)[i],
             (double)((const float*)want)[i]);
  }
  return -1;
}

static int verify(rank_ctx* c, const plan* p, uint64_t k, uint64_t total, char* msg) {
  size_t i;
  switch (p->kind) {
    case K_SMALL:
    case K_LARGE:
      fill_expected(c->expect, p->dtype, p->op, p->n, k);
      return compare(p->in_place ? c->send : c->recv, c->expect, p->n, p->dtype, "recv", msg);
    case K_ZEROCOPY:
      fill_expected(c->expect, GRADSYNC_F32, GRADSYNC_SUM, p->n, k);
      return compare((const char*)zc_out(c, p), c->expect, p->n, GRADSYNC_F32, "recv", msg);
    case K_BARRIER: return 0;
    case K_BCAST:
      fill(c->expect, GRADSYNC_F32, p->n, p->root, k);
      return compare(c->send, c->expect, p->n, GRADSYNC_F32, "buf", msg);
    case K_MANY:
      fill_expected(c->expect, GRADSYNC_F32, GRADSYNC_SUM, p->n, k);
      fill_expected(c->expect2, GRADSYNC_F32, GRADSYNC_SUM, p->n2, k + 100000007u);
      if (compare(p->in_place ? c->send : c->recv, c->expect, p->n, GRADSYNC_F32, "buffer 0", msg) != 0) return -1;
      return compare(p->in_place ? c->send2 : c->recv2, c->expect2, p->n2, GRADSYNC_F32, "buffer 1", msg);
    case K_WMEAN:
      if (total != p->total_weight) {
        snprintf(msg, MSG_BYTES, "WRONG total weight %" PRIu64 ", want %" PRIu64, total, p->total_weight);
        return -1;
      }
      for (i = 0; i < p->n; ++i) {
        double s = 0;
        int r;
        for (r = 0; r < g_size; ++r) s += (double)weight_of(p, r) * (double)value(r, k, i);
        ((float*)c->expect)[i] = (float)(s / (double)p->total_weight);
      }
      return compare(c->recv, c->expect, p->n, GRADSYNC_F32, "recv", msg);
    default: return -1;
  }
}

/* Retries while the group is still settling (a peer slow to reach its reset). */
static int reset_after_failure(rank_ctx* c) {
  const double give_up = now_s() + RESET_PATIENCE_S;
  st(&c->state->phase, P_RESET);
  __atomic_add_fetch(&c->state->resets, 1, __ATOMIC_RELAXED);
  for (;;) {
    const int status = gradsync_comm_reset(c->comm);
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
  c->rank = rank;
  c->state = &g_shared->rank[rank];
  c->send = malloc(LARGE_MAX * sizeof(float));
  c->recv = malloc(LARGE_MAX * sizeof(float));
  c->expect = malloc(LARGE_MAX * sizeof(float));
  c->send2 = malloc(LARGE_MAX * sizeof(float));
  c->recv2 = malloc(LARGE_MAX * sizeof(float));
  c->expect2 = malloc(LARGE_MAX * sizeof(float));
  if (!c->send || !c->recv || !c->expect || !c->send2 || !c->recv2 || !c->expect2) {
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
    status = gradsync_comm_create(&c->comm, &opts);
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
  if ((status = gradsync_comm_alloc(c->comm, ZC_MAX * sizeof(float), (void**)&c->zsend)) != GRADSYNC_OK ||
      (status = gradsync_comm_alloc(c->comm, ZC_MAX * sizeof(float), (void**)&c->zrecv)) != GRADSYNC_OK) {
    fatal(c, "gradsync_comm_alloc", status);
    rc = 1;
    goto out;
  }
  {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&c->cond, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_init(&c->lock, NULL);
    c->rng = mix64(g_seed ^ (0xA5A5u + (uint64_t)rank));
    pthread_create(&c->aborter, NULL, aborter_main, c);
  }

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
    if (p.reset_stall_rank == rank) gradsync_comm_abort(c->comm);
    status = run_call(c, &p, k, &total);
    o->status = status;
    if (status == GRADSYNC_OK) {
      o->verdict = verify(c, &p, k, total, o->msg) == 0 ? V_OK : V_WRONG;
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
  pthread_mutex_lock(&c->lock);
  c->stop_aborter = 1;
  pthread_cond_signal(&c->cond);
  pthread_mutex_unlock(&c->lock);
  pthread_join(c->aborter, NULL);
  pthread_cond_destroy(&c->cond);
  pthread_mutex_destroy(&c->lock);
  st(&c->state->phase, P_DONE);
  st(&c->state->finished, 1);
  meet(&g_shared->left);
out:
  gradsync_comm_free(c->comm);
  st(&c->state->finished, 2);
  free(c->send);
  free(c->recv);
  free(c->expect);
  free(c->send2);
  free(c->recv2);
  free(c->expect2);
  return rc;
}

/* ------------------------------------------------------------------ supervision */

typedef struct {
  uint64_t checked, ok, failed, timed_out, disagreements;
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
  int r, oks = 0, fails = 0, timeouts = 0;
  for (r = 0; r < g_size; ++r) {
    const outcome* o = outcome_at(k, r);
    if (o->verdict == V_OK) {
      ++oks;
    } else if (o->verdict == V_FAILED && (o->status == GRADSYNC_E_ABORTED || o->status == GRADSYNC_E_TIMEOUT)) {
      ++fails;
      timeouts += o->status == GRADSYNC_E_TIMEOUT;
    }
  }
  if (oks == g_size) {
    t->ok++;
    return 1;
  }
  if (fails == g_size) {
    t->failed++;
    t->timed_out += timeouts > 0;
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
           " ok and verified, %" PRIu64 " disagreements; %" PRIu64 " aborts sent, %" PRIu64 " rank resets (%" PRIu64
           " retried); %.1f s, seed %" PRIu64 "\n",
           title, t.checked, t.failed, t.timed_out, t.ok, t.disagreements, aborts, resets, retries, now_s() - start,
           g_seed);
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
