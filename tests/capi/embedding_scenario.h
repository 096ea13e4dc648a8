/* SPDX-License-Identifier: Apache-2.0 */
/* The scenario the sharded embedding's tests share (tests/capi/embedding.c on threads and shm,
 * tests/multihost/embedding.c across hosts): global batches that any number of ranks split
 * unevenly, the one-process reference built from the public table and accumulator, and a bitwise
 * comparison of a rank's rows with it. Include after check.h. */
#ifndef GRADSYNC_TESTS_CAPI_EMBEDDING_SCENARIO_H
#define GRADSYNC_TESTS_CAPI_EMBEDDING_SCENARIO_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "gradsync/gradsync.h"

#define ROWS 1000
#define DIM 7 /* odd: a push record's id then sits at a 4-byte, not 8-byte, boundary */
#define GLOBAL 600
#define STEPS 4
#define STATE_MAX (2 * DIM + 1) /* Adam's floats of state per row: m, v, the row's update count */

/* Floats of state per row the optimizer keeps (0 SGD), and that gradsync_embedding_local_rows
 * writes (1 for SGD: zeros). */
static int state_width(int32_t optimizer) {
  return optimizer == GRADSYNC_OPTIM_ADAM ? STATE_MAX : optimizer == GRADSYNC_OPTIM_ROW_ADAGRAD ? 1 : 0;
}
static int local_state_width(int32_t optimizer) { return optimizer == GRADSYNC_OPTIM_ADAM ? STATE_MAX : 1; }

static uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* The global batch of a step: a third of the ids among 10 hot rows (each summed from dozens of
 * contributions, so a change of order changes bits), the rest anywhere; gradients spanning several
 * orders of magnitude. */
static void global_batch(int step, int64_t* ids, float* grads) {
  int i, j;
  for (i = 0; i < GLOBAL; ++i) {
    const uint64_t h = mix((uint64_t)step * 100003u + (uint64_t)i);
    ids[i] = (int64_t)(h % 3 == 0 ? (h >> 8) % 10 : (h >> 8) % ROWS);
    for (j = 0; j < DIM; ++j) {
      const uint64_t g = mix(h + (uint64_t)j);
      grads[i * DIM + j] = ((float)(g % 2001) - 1000.0f) * (j % 3 == 0 ? 1e-4f : j % 3 == 1 ? 1e-1f : 3.0f);
    }
  }
}

/* Rank r's slice [lo, hi) of the global batch among p ranks: uneven, rank 0's the smallest (empty
 * on some steps). */
static void slice_of(int step, int r, int p, int* lo, int* hi) {
  if (step % 2 == 0) {
    *lo = GLOBAL * r * r / (p * p);
    *hi = GLOBAL * (r + 1) * (r + 1) / (p * p);
  } else {
    *lo = r == 0 ? 0 : GLOBAL * (r + 1) / (p + 1);
    *hi = GLOBAL * (r + 2) / (p + 1);
    if (r == p - 1) *hi = GLOBAL;
  }
}

typedef struct {
  float values[ROWS * DIM];
  float state[ROWS * STATE_MAX]; /* state_width(optimizer) floats per row */
} snapshot;

static gradsync_embedding_options table_options(int32_t optimizer, int32_t sharding) {
  gradsync_embedding_options o = GRADSYNC_EMBEDDING_OPTIONS_INIT;
  o.rows = ROWS;
  o.dim = DIM;
  o.optimizer = optimizer;
  o.sharding = sharding;
  o.lr = 0.05;
  o.init = GRADSYNC_TABLE_INIT_UNIFORM;
  o.seed = 42;
  o.lo = -0.1;
  o.hi = 0.1;
  return o;
}

/* One process, the public table and accumulator: after `steps` steps of the global batches
 * (reverse: each batch added back to front, to show the order matters). */
static void reference(int32_t optimizer, int steps, int reverse, snapshot* out) {
  gradsync_table_options to = GRADSYNC_TABLE_OPTIONS_INIT;
  gradsync_accum_options ao = GRADSYNC_ACCUM_OPTIONS_INIT;
  gradsync_optimizer opt = GRADSYNC_OPTIMIZER_INIT;
  gradsync_table *params = NULL, *state = NULL;
  gradsync_accum* accum = NULL;
  static int64_t ids[GLOBAL], rids[GLOBAL];
  static float grads[GLOBAL * DIM], rgrads[GLOBAL * DIM];
  int s, i;
  to.mode = GRADSYNC_TABLE_ANONYMOUS;
  to.rows = ROWS;
  to.dim = DIM;
  to.init = GRADSYNC_TABLE_INIT_UNIFORM;
  to.seed = 42;
  to.lo = -0.1;
  to.hi = 0.1;
  CHECK_STATUS(gradsync_table_open(&params, NULL, &to), GRADSYNC_OK);
  to.dim = state_width(optimizer) > 0 ? state_width(optimizer) : 1;
  to.init = GRADSYNC_TABLE_INIT_ZEROS;
  CHECK_STATUS(gradsync_table_open(&state, NULL, &to), GRADSYNC_OK);
  ao.mode = GRADSYNC_TABLE_ANONYMOUS;
  ao.rows = ROWS;
  ao.dim = DIM;
  ao.concurrency = GRADSYNC_ACCUM_OWNER;
  ao.threads = 2;
  CHECK_STATUS(gradsync_accum_open(&accum, NULL, &ao), GRADSYNC_OK);
  opt.kind = optimizer;
  opt.lr = 0.05;
  for (s = 0; s < steps; ++s) {
    global_batch(s, ids, grads);
    if (reverse) {
      for (i = 0; i < GLOBAL; ++i) {
        rids[i] = ids[GLOBAL - 1 - i];
        memcpy(&rgrads[i * DIM], &grads[(GLOBAL - 1 - i) * DIM], sizeof(float) * DIM);
      }
      CHECK_STATUS(gradsync_accum_add_batch(accum, rids, GLOBAL, rgrads, GLOBAL * DIM), GRADSYNC_OK);
    } else {
      CHECK_STATUS(gradsync_accum_add_batch(accum, ids, GLOBAL, grads, GLOBAL * DIM), GRADSYNC_OK);
    }
    CHECK_STATUS(gradsync_accum_apply(accum, params, &opt, state_width(optimizer) > 0 ? state : NULL), GRADSYNC_OK);
  }
  for (i = 0; i < ROWS; ++i) {
    CHECK_STATUS(gradsync_table_get(params, i, &out->values[i * DIM], DIM), GRADSYNC_OK);
    if (state_width(optimizer) > 0)
      CHECK_STATUS(
          gradsync_table_get(state, i, &out->state[i * state_width(optimizer)], (size_t)state_width(optimizer)),
          GRADSYNC_OK);
  }
  gradsync_accum_free(accum);
  gradsync_table_free(params);
  gradsync_table_free(state);
}

/* This rank's rows equal the reference bit for bit; returns the number of rows that differ. */
static int compare_local(gradsync_embedding* t, const snapshot* ref, int32_t optimizer, const char* what) {
  static __thread int64_t ids[ROWS];
  static __thread float values[ROWS * DIM], state[ROWS * STATE_MAX];
  const int sw = state_width(optimizer), stride = local_state_width(optimizer);
  int64_t local = 0, i;
  int bad = 0;
  CHECK_STATUS(gradsync_embedding_shape(t, NULL, NULL, &local), GRADSYNC_OK);
  CHECK_STATUS(gradsync_embedding_local_rows(t, ids, values, state, ROWS), GRADSYNC_OK);
  for (i = 0; i < local; ++i) {
    const int64_t g = ids[i];
    if (memcmp(&values[i * DIM], &ref->values[g * DIM], sizeof(float) * DIM) != 0 ||
        memcmp(&state[i * stride], &ref->state[g * sw], sizeof(float) * (size_t)sw) != 0) {
      if (bad++ == 0) fprintf(stderr, "%s: row %lld differs from the reference\n", what, (long long)g);
    }
  }
  if (bad != 0) check_failed();
  return bad;
}

/* Pushes step s of the global batches, this rank's slice of it; returns the push's status. */
static inline int push_step(gradsync_embedding* t, int rank, int size, int s) {
  static __thread int64_t ids[GLOBAL];
  static __thread float grads[GLOBAL * DIM];
  int lo, hi;
  global_batch(s, ids, grads);
  slice_of(s, rank, size, &lo, &hi);
  return gradsync_embedding_push(t, ids + lo, (size_t)(hi - lo), grads + lo * DIM, (size_t)(hi - lo) * DIM);
}

/* Pushes steps [from, to) of the global batches, this rank's slice of each. */
static inline void train(gradsync_embedding* t, int rank, int size, int from, int to) {
  int s;
  for (s = from; s < to; ++s) CHECK_STATUS(push_step(t, rank, size, s), GRADSYNC_OK);
}

#endif
