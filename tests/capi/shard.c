// SPDX-License-Identifier: Apache-2.0
/* The sharded parameter through the C ABI, as a C99 user with pthreads sees it: BigDL's
 * acceptance cases, the gradient processors, errors on every rank, bad input, and misuse of the
 * communicator under it (another thread in a call on it, a shard used after it was freed). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "gradsync/gradsync.h"
#include "two_threads.h"

static gradsync_comm* join(const char* name, int32_t rank, int32_t size) {
  gradsync_comm_options opts = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm* comm = NULL;
  opts.rank = rank;
  opts.size = size;
  opts.timeout_ms = 20000;
  strncpy(opts.name, name, sizeof opts.name - 1);
  if (gradsync_comm_create(&comm, &opts) != GRADSYNC_OK) {
    fprintf(stderr, "join %s rank %d: %s\n", name, (int)rank, gradsync_last_error_message());
    return NULL;
  }
  return comm;
}

static gradsync_shard* make_shard(gradsync_comm* comm, uint64_t total, const gradsync_shard_options* opts) {
  gradsync_shard* shard = NULL;
  if (gradsync_shard_create(&shard, comm, total, opts) != GRADSYNC_OK)
    fprintf(stderr, "shard create: %s\n", gradsync_last_error_message());
  return shard;
}

/* ---- three ranks: the partition rule, 0-based and BigDL's 1-based */
typedef struct {
  int32_t rank;
  uint64_t part10[2], part10_bigdl[2], part5[2];
  uint64_t ranges[6];
  size_t needed;
  int bufs_status;
} part_arg;

static void* part_worker(void* p) {
  part_arg* a = (part_arg*)p;
  gradsync_comm* comm = join("capi-shard-parts", a->rank, 3);
  gradsync_shard *s10, *s5;
  uint64_t small[3];
  if (comm == NULL) return NULL;
  s10 = make_shard(comm, 10, NULL);
  s5 = make_shard(comm, 5, NULL);
  CHECK_STATUS(gradsync_shard_part(s10, -1, 0, &a->part10[0], &a->part10[1]), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_part(s10, -1, 1, &a->part10_bigdl[0], &a->part10_bigdl[1]), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_part(s5, -1, 0, &a->part5[0], &a->part5[1]), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_ranges(s10, 1, a->ranges, 6, &a->needed), GRADSYNC_OK);
  a->bufs_status = gradsync_shard_ranges(s10, 0, small, 3, &a->needed);
  gradsync_shard_free(s10);
  gradsync_shard_free(s5);
  gradsync_comm_free(comm);
  return NULL;
}

/* ---- two ranks: BigDL's 100 -> 97 -> 82, processors, zero count, failures on one rank */
typedef struct {
  int32_t rank;
  float after_step, after_staged;
  float clamped[3], clipped[3];
  int zero_status, bad_step_status, recovered;
} pair_arg;

static void* pair_worker(void* p) {
  pair_arg* a = (pair_arg*)p;
  gradsync_comm* comm = join("capi-shard-pair", a->rank, 2);
  gradsync_shard_options opts;
  gradsync_shard* s;
  float w = 100.0f, g;
  const float grad3[3] = {0.3f, -0.4f, 1.2f};
  if (comm == NULL) return NULL;

  CHECK_STATUS(gradsync_shard_options_init(&opts, sizeof opts), GRADSYNC_OK);
  opts.optimizer = GRADSYNC_SHARD_SGD;
  opts.lr = 1.0;
  s = make_shard(comm, 1, &opts);
  CHECK_STATUS(gradsync_shard_init(s, &w, 1), GRADSYNC_OK);
  g = a->rank == 0 ? 2.0f : 4.0f;
  CHECK_STATUS(gradsync_shard_step(s, &g, &w, 1, 1), GRADSYNC_OK);
  a->after_step = w;
  g = a->rank == 0 ? 10.0f : 20.0f;
  CHECK_STATUS(gradsync_shard_put(s, &g, 1, 1), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_aggregate(s), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_update(s), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_gather(s, &w, 1), GRADSYNC_OK);
  a->after_staged = w;
  /* a count of 0 on every rank: an error on every rank, weights untouched */
  a->zero_status = gradsync_shard_step(s, &g, &w, 1, 0);
  CHECK(w == 82.0f);
  /* NULL gradient on rank 1: its own error there, GRADSYNC_E_REMOTE on rank 0, no hang */
  a->bad_step_status = gradsync_shard_step(s, a->rank == 1 ? NULL : &g, &w, 1, 1);
  a->recovered = gradsync_shard_step(s, &g, &w, 1, 1);
  gradsync_shard_free(s);

  /* clamp to [0, 0]: a zero gradient leaves the weights as they are */
  opts.clamp = 1;
  opts.clamp_min = 0.0;
  opts.clamp_max = 0.0;
  s = make_shard(comm, 3, &opts);
  a->clamped[0] = a->clamped[1] = a->clamped[2] = 1.0f;
  CHECK_STATUS(gradsync_shard_init(s, a->clamped, 3), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_step(s, grad3, a->clamped, 3, 1), GRADSYNC_OK);
  gradsync_shard_free(s);

  /* L2 clipping at 0.03 */
  opts.clamp = 0;
  opts.clip_norm = 0.03;
  s = make_shard(comm, 3, &opts);
  memset(a->clipped, 0, sizeof a->clipped);
  CHECK_STATUS(gradsync_shard_init(s, a->clipped, 3), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_step(s, grad3, a->clipped, 3, 1), GRADSYNC_OK);
  gradsync_shard_free(s);
  gradsync_comm_free(comm);
  return NULL;
}

static void bad_input(void) {
  gradsync_comm* comm = join("capi-shard-alone", 0, 1);
  gradsync_shard_options opts = GRADSYNC_SHARD_OPTIONS_INIT;
  unsigned char big[sizeof(gradsync_shard_options) + 32];
  gradsync_shard* s = NULL;
  uint64_t off, len, wb, ob, bb;
  int64_t updates = -1;
  float w[4] = {0, 0, 0, 0};
  if (comm == NULL) {
    check_failed();
    return;
  }
  gradsync_shard_free(NULL); /* no-op */
  CHECK_STATUS(gradsync_shard_create(NULL, comm, 4, NULL), GRADSYNC_E_INVALID_ARG);
  CHECK(gradsync_shard_create(&s, NULL, 4, NULL) == GRADSYNC_E_MISUSE && s == NULL);
  CHECK(gradsync_shard_create(&s, comm, 0, NULL) == GRADSYNC_E_INVALID_ARG && s == NULL);
  CHECK_MESSAGE("total parameter count is 0");
  CHECK(gradsync_shard_create(&s, comm, UINT64_MAX, NULL) == GRADSYNC_E_INVALID_ARG && s == NULL);
  opts.struct_size = 8;
  CHECK_STATUS(gradsync_shard_create(&s, comm, 4, &opts), GRADSYNC_E_INVALID_ARG);
  opts = (gradsync_shard_options)GRADSYNC_SHARD_OPTIONS_INIT;
  opts.version = 0; /* every options struct checks its version (capi/options.hpp) */
  CHECK_STATUS_MSG(gradsync_shard_create(&s, comm, 4, &opts), GRADSYNC_E_INVALID_ARG, "options.version 0");
  opts = (gradsync_shard_options)GRADSYNC_SHARD_OPTIONS_INIT;
  opts.compress = 9;
  CHECK_STATUS(gradsync_shard_create(&s, comm, 4, &opts), GRADSYNC_E_INVALID_ARG);
  opts.compress = GRADSYNC_CODEC_BF16;
  opts.optimizer = 42;
  CHECK_STATUS(gradsync_shard_create(&s, comm, 4, &opts), GRADSYNC_E_INVALID_ARG);
  CHECK_MESSAGE("unknown optimizer 42");
  /* One optimizer enum: row-wise Adagrad is the accumulator's; a version 1 struct (an older
     header) still means momentum by 1, as it did; momentum keeps one state float per weight. */
  opts.optimizer = GRADSYNC_OPTIM_ROW_ADAGRAD;
  CHECK_STATUS_MSG(gradsync_shard_create(&s, comm, 4, &opts), GRADSYNC_E_UNSUPPORTED, "gradsync_accum_apply");
  {
    uint64_t state_bytes = 0;
    int version;
    for (version = 1; version <= 2; ++version) {
      opts = (gradsync_shard_options)GRADSYNC_SHARD_OPTIONS_INIT;
      opts.version = (uint32_t)version;
      opts.optimizer = version == 1 ? 1 : GRADSYNC_OPTIM_MOMENTUM;
      CHECK_STATUS(gradsync_shard_create(&s, comm, 4, &opts), GRADSYNC_OK);
      CHECK_STATUS(gradsync_shard_memory(s, NULL, &state_bytes, NULL), GRADSYNC_OK);
      CHECK(state_bytes == 4 * sizeof(float));
      gradsync_shard_free(s);
      s = NULL;
    }
  }
  opts = (gradsync_shard_options)GRADSYNC_SHARD_OPTIONS_INIT;
  opts.compress = GRADSYNC_CODEC_BF16;
  opts.optimizer = GRADSYNC_SHARD_ADAM;
  opts.beta1 = 1.5;
  CHECK_STATUS(gradsync_shard_create(&s, comm, 4, &opts), GRADSYNC_E_INVALID_ARG);
  CHECK_MESSAGE("beta1");
  /* a newer caller's larger struct: zeros beyond what we know are fine */
  memset(big, 0, sizeof big);
  CHECK_STATUS(gradsync_shard_options_init((gradsync_shard_options*)(void*)big, sizeof big), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_options_init(NULL, sizeof opts), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_shard_options_init(&opts, 4), GRADSYNC_E_INVALID_ARG);
  opts = (gradsync_shard_options)GRADSYNC_SHARD_OPTIONS_INIT;
  opts.optimizer = GRADSYNC_SHARD_ADAM;
  CHECK_STATUS(gradsync_shard_create(&s, comm, 4, &opts), GRADSYNC_OK);

  /* NULL handle, wrong kind of handle */
  CHECK_STATUS(gradsync_shard_part(NULL, -1, 0, &off, &len), GRADSYNC_E_MISUSE);
  CHECK_STATUS(gradsync_shard_step((gradsync_shard*)(void*)comm, w, w, 4, 1), GRADSYNC_E_MISUSE);
  CHECK_MESSAGE("expected a shard, got a comm");
  CHECK_STATUS(gradsync_shard_part(s, 1, 0, &off, &len), GRADSYNC_E_OUT_OF_RANGE);
  CHECK_MESSAGE("rank 1 out of range [0, 1)");
  CHECK_STATUS(gradsync_shard_memory(s, &wb, &ob, &bb), GRADSYNC_OK);
  CHECK(wb == 16 && ob == 32);
  /* states: step before init, update without aggregate, sizes */
  CHECK_STATUS(gradsync_shard_step(s, w, w, 4, 1), GRADSYNC_E_MISUSE);
  CHECK_STATUS(gradsync_shard_init(s, w, 3), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_shard_init(s, w, 4), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_update(s), GRADSYNC_E_MISUSE);
  CHECK_STATUS(gradsync_shard_gather(s, w, 4), GRADSYNC_E_MISUSE); /* reports the failed update */
  CHECK_STATUS(gradsync_shard_step(s, w, w, 5, 1), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_shard_read_slice(s, 7, w, 4), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_shard_read_slice(s, GRADSYNC_SHARD_WEIGHTS, w, 2), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_shard_set_lr(s, -1.0), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_shard_step(s, w, w, 4, 1), GRADSYNC_OK);
  CHECK(gradsync_shard_updates(s, &updates) == GRADSYNC_OK && updates == 1);
  CHECK_STATUS(gradsync_shard_updates(s, NULL), GRADSYNC_E_INVALID_ARG);
  gradsync_shard_free(s);
  gradsync_comm_free(comm);
}

/* ---- a shard whose communicator was freed: its collective stages are refused, its local calls work */
static void shard_after_comm_free(void) {
  gradsync_comm* comm = join("capi-shard-orphan", 0, 1);
  gradsync_shard* s;
  float w[4] = {1, 2, 3, 4}, g[4] = {1, 1, 1, 1}, out[4];
  uint64_t off = 9, len = 9;
  if (comm == NULL) {
    check_failed();
    return;
  }
  s = make_shard(comm, 4, NULL);
  if (s == NULL) {
    check_failed();
    gradsync_comm_free(comm);
    return;
  }
  CHECK_STATUS(gradsync_shard_init(s, w, 4), GRADSYNC_OK);
  CHECK_STATUS(gradsync_shard_step(s, g, out, 4, 1), GRADSYNC_OK);
  gradsync_comm_free(comm);
  /* (a group of one never communicates: without the check these would return OK) */
  CHECK_STATUS_MSG(gradsync_shard_step(s, g, out, 4, 1), GRADSYNC_E_MISUSE,
                   "gradsync_shard_step: communicator 'capi-shard-orphan' (thread transport, rank 0 of 1) was freed "
                   "(gradsync_comm_free)");
  CHECK_STATUS(gradsync_shard_put(s, g, 4, 1), GRADSYNC_OK); /* local */
  CHECK_STATUS_MSG(gradsync_shard_aggregate(s), GRADSYNC_E_MISUSE, "was freed");
  CHECK_STATUS_MSG(gradsync_shard_gather(s, out, 4), GRADSYNC_E_MISUSE, "was freed");
  /* local calls read only the shard: its slice is still there, as the last good step left it */
  CHECK(gradsync_shard_part(s, -1, 0, &off, &len) == GRADSYNC_OK && off == 0 && len == 4);
  CHECK_STATUS(gradsync_shard_read_slice(s, GRADSYNC_SHARD_WEIGHTS, out, 4), GRADSYNC_OK);
  CHECK(out[0] == 1.0f - 0.01f && out[3] == 4.0f - 0.01f);
  gradsync_shard_free(s);
}

/* ---- a shard's collective stage holds its communicator: another thread's call on it is refused */
typedef struct {
  gradsync_shard* shard;
  float grad[2], weights[2];
  int status;
} stage_arg;

static void* stage_worker(void* p) {
  stage_arg* a = (stage_arg*)p;
  RETRY_WHILE_PROBED(a->status, gradsync_shard_step(a->shard, a->grad, a->weights, 2, 1));
  return NULL;
}

static void shard_stage_holds_comm(void) {
  gradsync_comm* comms[2];
  gradsync_shard* shards[2];
  gradsync_shard_options opts = GRADSYNC_SHARD_OPTIONS_INIT;
  const float start[2] = {1, 1};
  stage_arg first = {NULL, {1, 2}, {0, 0}, -1000};
  float grad1[2] = {3, 6}, weights1[2] = {0, 0};
  pthread_t t;
  int r;
  if (join_pair("capi-shard-busy", 20000, comms) != 0) return;
  opts.lr = 0.5;
  for (r = 0; r < 2; ++r) {
    shards[r] = make_shard(comms[r], 2, &opts);
    CHECK_STATUS(gradsync_shard_init(shards[r], start, 2), GRADSYNC_OK);
  }
  first.shard = shards[0];
  pthread_create(&t, NULL, stage_worker, &first); /* waits in its step for rank 1 */
  if (wait_until_in_call(comms[0]) == 0) {
    CHECK_STATUS_MSG(gradsync_comm_barrier(comms[0]), GRADSYNC_E_MISUSE,
                     "is already in a call on another thread (gradsync_shard_step)");
    CHECK_STATUS_MSG(gradsync_shard_gather(shards[0], weights1, 2), GRADSYNC_E_MISUSE,
                     "is already in a call on another thread (gradsync_shard_step)");
  }
  CHECK_STATUS(gradsync_shard_step(shards[1], grad1, weights1, 2, 1), GRADSYNC_OK);
  pthread_join(t, NULL);
  CHECK_STATUS(first.status, GRADSYNC_OK);
  /* mean gradient (2, 4), lr 0.5, from weights (1, 1): (0, -1) on both ranks */
  CHECK(first.weights[0] == 0.0f && first.weights[1] == -1.0f);
  CHECK(weights1[0] == 0.0f && weights1[1] == -1.0f);
  for (r = 0; r < 2; ++r) gradsync_shard_free(shards[r]);
  gradsync_comm_free(comms[0]);
  gradsync_comm_free(comms[1]);
}

int main(void) {
  pthread_t threads[3];
  part_arg parts[3];
  pair_arg pairs[2];
  int r;

  memset(parts, 0, sizeof parts);
  for (r = 0; r < 3; ++r) {
    parts[r].rank = r;
    pthread_create(&threads[r], NULL, part_worker, &parts[r]);
  }
  for (r = 0; r < 3; ++r) pthread_join(threads[r], NULL);
  {
    const uint64_t p10[3][2] = {{0, 4}, {4, 3}, {7, 3}}, p5[3][2] = {{0, 2}, {2, 2}, {4, 1}};
    const uint64_t bigdl[6] = {1, 4, 5, 3, 8, 3};
    for (r = 0; r < 3; ++r) {
      CHECK(parts[r].part10[0] == p10[r][0] && parts[r].part10[1] == p10[r][1]);
      CHECK(parts[r].part10_bigdl[0] == p10[r][0] + 1 && parts[r].part10_bigdl[1] == p10[r][1]);
      CHECK(parts[r].part5[0] == p5[r][0] && parts[r].part5[1] == p5[r][1]);
      CHECK(memcmp(parts[r].ranges, bigdl, sizeof bigdl) == 0);
      CHECK(parts[r].bufs_status == GRADSYNC_E_BUFS && parts[r].needed == 6);
    }
  }

  memset(pairs, 0, sizeof pairs);
  for (r = 0; r < 2; ++r) {
    pairs[r].rank = r;
    pthread_create(&threads[r], NULL, pair_worker, &pairs[r]);
  }
  for (r = 0; r < 2; ++r) pthread_join(threads[r], NULL);
  {
    const double norm = sqrt(0.3 * 0.3 + 0.4 * 0.4 + 1.2 * 1.2);
    const float grad3[3] = {0.3f, -0.4f, 1.2f};
    int i;
    for (r = 0; r < 2; ++r) {
      CHECK(pairs[r].after_step == 97.0f);
      CHECK(pairs[r].after_staged == 82.0f);
      CHECK_STATUS(pairs[r].zero_status, GRADSYNC_E_ZERO_WEIGHT);
      CHECK_STATUS(pairs[r].recovered, GRADSYNC_OK);
      for (i = 0; i < 3; ++i) {
        CHECK(pairs[r].clamped[i] == 1.0f);
        CHECK(fabs(pairs[r].clipped[i] + grad3[i] * 0.03 / norm) < 1e-7);
      }
    }
    CHECK_STATUS(pairs[0].bad_step_status, GRADSYNC_E_REMOTE);
    CHECK_STATUS(pairs[1].bad_step_status, GRADSYNC_E_INVALID_ARG);
  }

  bad_input();
  shard_after_comm_free();
  shard_stage_holds_comm();
  return check_report("shard C API");
}
