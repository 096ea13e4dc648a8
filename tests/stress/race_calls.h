// SPDX-License-Identifier: Apache-2.0
/* The calls of the randomized races against the round protocol (round_race.c, and threads as
 * ranks under mpirun, tests/mpi/mpi_race.c): call k of a run is a function of the seed and k
 * alone (plan_of), the same on every rank, with small-integer values whose every sum, max, min and
 * power-of-two mean is exact, so each rank checks its result bit for bit (verify). The program
 * sets the g_ settings before its first plan. */
#ifndef GRADSYNC_TESTS_RACE_CALLS_H
#define GRADSYNC_TESTS_RACE_CALLS_H

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gradsync/gradsync.h"

#define MSG_BYTES 176
#define LARGE_MAX 310000u  /* floats: past several 256 KiB chunks of the copy pipeline */
#define SMALL_BYTES 16384u /* the inline path's limit */
#define ZC_MAX 65536u      /* floats per zero-copy buffer */

static uint64_t g_seed;
static int g_size;
static int64_t g_timeout_ms = 50;
static unsigned g_stall_every = 1000; /* 1 in how many calls a rank stalls (0: never) */
static unsigned g_mismatch_every = 0; /* 1 in how many calls a rank passes another count (0: never) */
static int64_t g_abort_us = 1000;     /* the group's mean time between its aborters' aborts */

enum { V_NONE = 0, V_OK = 1, V_WRONG = 2, V_FAILED = 3 };

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

static void spin_for(uint64_t n) {
  volatile uint64_t spin = n;
  while (spin > 0) --spin;
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
  int quiet;         /* aborters hold off, so the stall ends in a timeout rather than an abort */
  int mismatch_rank; /* -1: nobody; else this rank passes another count, which every rank must refuse */
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
  p.mismatch_rank = -1;
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
  if (g_size > 1 && g_mismatch_every > 0 && p.kind != K_BARRIER && p.stall_rank < 0 && p.reset_stall_rank < 0) {
    const uint64_t h3 = mix64(h2);
    if (h3 % g_mismatch_every == 0) p.mismatch_rank = (int)((h3 >> 20) % (uint64_t)g_size);
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
    w += snprintf(out + w, cap - (size_t)w, "; rank %d aborts it and stalls %.1f ms before its reset",
                  p->reset_stall_rank, (double)p->stall_us / 1000.0);
  }
  if (p->mismatch_rank >= 0 && w > 0 && (size_t)w < cap) {
    snprintf(out + w, cap - (size_t)w, "; rank %d passes another count", p->mismatch_rank);
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

/* A rank's aborter thread: it aborts the rank's group at random moments, and when cued just before
 * one of the rank's calls into the library, after a wake-up (a few microseconds, more on a busy
 * machine) and a spin of log-uniform length, so that aborts land near the round's arrival and
 * completion, where the protocol has to decide. Aborts at random moments rarely fall there: most of
 * the time goes to filling and checking buffers. It holds off around a call whose stall must end
 * in a timeout (plan.quiet), and, with `resetting` set, mostly while the rank resets. */
typedef struct {
  gradsync_comm* comm;
  int rank;
  const uint64_t* current; /* the call the rank is at (atomic) */
  const int* resetting;    /* non-zero while the rank resets (atomic), or NULL */
  uint64_t* sent;          /* aborts sent (atomic add) */
  uint64_t rng;            /* the rank's, for its cues */
  pthread_mutex_t lock;    /* cued, stop */
  pthread_cond_t cond;
  int cued, stop;
  pthread_t thread;
} race_aborter;

/* One rank's buffers and communicator, and its aborter (NULL: none). */
typedef struct race_rank {
  int rank;
  gradsync_comm* comm;
  char *send, *recv, *expect, *send2, *recv2, *expect2; /* LARGE_MAX floats each */
  float *zsend, *zrecv;                                 /* gradsync_comm_alloc: zero copy on shm */
  race_aborter* aborter;
} race_rank;

static void* race_aborter_main(void* arg) {
  race_aborter* a = (race_aborter*)arg;
  uint64_t rng = mix64(g_seed + 977u * (uint64_t)(a->rank + 1));
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
    pthread_mutex_lock(&a->lock);
    while (!a->cued && !a->stop && pthread_cond_timedwait(&a->cond, &a->lock, &until) == 0) {
    }
    cued = a->cued;
    a->cued = 0;
    stop = a->stop;
    pthread_mutex_unlock(&a->lock);
    if (stop) break;
    if (cued || (rng & 7) == 0) spin_for(((uint64_t)1 << ((rng >> 40) % 14)) + ((rng >> 20) & 15));
    k = __atomic_load_n(a->current, __ATOMIC_ACQUIRE);
    if (k > 0 && (plan_of(k).quiet || plan_of(k + 1).quiet || (k > 1 && plan_of(k - 1).quiet))) continue;
    /* A reset on MPI forms communicators anew, which takes longer than the aborts come: most
       aborts spare it, or no reset would ever finish. */
    if (a->resetting != NULL && __atomic_load_n(a->resetting, __ATOMIC_RELAXED) && (rng >> 50) % 8 != 0) continue;
    gradsync_comm_abort(a->comm);
    __atomic_add_fetch(a->sent, 1, __ATOMIC_RELAXED);
  }
  return NULL;
}

/* Starts the rank's aborter on its communicator (c->comm set). */
static void race_aborter_start(race_rank* c, race_aborter* a, const uint64_t* current, const int* resetting,
                               uint64_t* sent) {
  pthread_condattr_t attr;
  memset(a, 0, sizeof *a);
  a->comm = c->comm;
  a->rank = c->rank;
  a->current = current;
  a->resetting = resetting;
  a->sent = sent;
  a->rng = mix64(g_seed ^ (0xA5A5u + (uint64_t)c->rank));
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&a->cond, &attr);
  pthread_condattr_destroy(&attr);
  pthread_mutex_init(&a->lock, NULL);
  c->aborter = a;
  pthread_create(&a->thread, NULL, race_aborter_main, a);
}

static void race_aborter_stop(race_rank* c) {
  race_aborter* a = c->aborter;
  if (a == NULL) return;
  pthread_mutex_lock(&a->lock);
  a->stop = 1;
  pthread_cond_signal(&a->cond);
  pthread_mutex_unlock(&a->lock);
  pthread_join(a->thread, NULL);
  pthread_cond_destroy(&a->cond);
  pthread_mutex_destroy(&a->lock);
  c->aborter = NULL;
}

/* Just before some of its calls into the library (1 in 3 x size), the rank cues its aborter. */
static void enter(race_rank* c) {
  race_aborter* a = c->aborter;
  if (a == NULL) return;
  a->rng = mix64(a->rng);
  if (a->rng % (uint64_t)(3 * g_size) != 0) return;
  pthread_mutex_lock(&a->lock);
  a->cued = 1;
  pthread_cond_signal(&a->cond);
  pthread_mutex_unlock(&a->lock);
}

/* 0, or -1 when out of memory. */
static int race_rank_alloc(race_rank* c) {
  c->send = malloc(LARGE_MAX * sizeof(float));
  c->recv = malloc(LARGE_MAX * sizeof(float));
  c->expect = malloc(LARGE_MAX * sizeof(float));
  c->send2 = malloc(LARGE_MAX * sizeof(float));
  c->recv2 = malloc(LARGE_MAX * sizeof(float));
  c->expect2 = malloc(LARGE_MAX * sizeof(float));
  return c->send && c->recv && c->expect && c->send2 && c->recv2 && c->expect2 ? 0 : -1;
}

/* The communicator's buffers for K_ZEROCOPY: the status of gradsync_comm_alloc. */
static int race_rank_alloc_zc(race_rank* c) {
  int status = gradsync_comm_alloc(c->comm, ZC_MAX * sizeof(float), (void**)&c->zsend);
  if (status == GRADSYNC_OK) status = gradsync_comm_alloc(c->comm, ZC_MAX * sizeof(float), (void**)&c->zrecv);
  return status;
}

static void race_rank_free(race_rank* c) {
  free(c->send);
  free(c->recv);
  free(c->expect);
  free(c->send2);
  free(c->recv2);
  free(c->expect2);
}

/* K_ZEROCOPY's buffers on this rank: the communicator's, or its private ones. */
static float* zc_send(const race_rank* c, const plan* p) {
  return (p->zc_ranks >> c->rank) & 1 ? c->zsend : (float*)c->send;
}
static float* zc_out(const race_rank* c, const plan* p) {
  return p->in_place ? zc_send(c, p) : (p->zc_ranks >> c->rank) & 1 ? c->zrecv : (float*)c->recv;
}

static int run_call(race_rank* c, const plan* p, uint64_t k, uint64_t* total) {
  const size_t es = gradsync_dtype_size(p->dtype);
  /* the count this rank passes: one fewer or one more on the mismatch rank, within the buffers */
  const size_t n = p->mismatch_rank != c->rank ? p->n : p->n > 1 ? p->n - 1 : p->n + 1;
  switch (p->kind) {
    case K_SMALL:
    case K_LARGE: {
      void* out = p->in_place ? c->send : c->recv;
      fill(c->send, p->dtype, p->n, c->rank, k);
      if (!p->in_place) memset(c->recv, 0x7f, p->n * es); /* a result never written shows */
      enter(c);
      return gradsync_comm_allreduce(c->comm, c->send, out, n, p->dtype, p->op);
    }
    case K_ZEROCOPY: {
      float *send = zc_send(c, p), *out = zc_out(c, p);
      fill(send, GRADSYNC_F32, p->n, c->rank, k);
      if (!p->in_place) memset(out, 0x7f, p->n * sizeof(float));
      enter(c);
      return gradsync_comm_allreduce(c->comm, send, out, n, GRADSYNC_F32, GRADSYNC_SUM);
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
      return gradsync_comm_broadcast(c->comm, c->send, n, GRADSYNC_F32, p->root);
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
      counts[0] = n;
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
      return gradsync_comm_weighted_mean(c->comm, c->send, c->recv, n, GRADSYNC_F32, w, total);
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

static int verify(race_rank* c, const plan* p, uint64_t k, uint64_t total, char* msg) {
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

#endif
