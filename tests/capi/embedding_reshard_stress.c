/* SPDX-License-Identifier: Apache-2.0 */
/* Randomized gradsync_embedding_reshard on threads, every result verified. Each episode draws a
 * world of 1 to 5 ranks, a sharding rule, an optimizer (SGD, row-wise Adagrad or Adam), a number
 * of replicas (0 to 2), the step of a checkpoint and of the change, and one change:
 *   - a change of rule in place (the same group, possibly the same rule);
 *   - a grow by 1 or 2 joiners, under a drawn rule;
 *   - the loss of a drawn set of ranks (not all): the survivors' push fails and they shrink. When
 *     the replicas cover the loss (each lost rank has a survivor among the next `replicas` ranks),
 *     their reshard without a checkpoint moves every row in memory under a drawn rule, at the same
 *     step. Otherwise it fails on every survivor with GRADSYNC_E_LOST naming each lost rank's rows
 *     and changes nothing (the step count is checked), and with the checkpoint restores every row
 *     as of it, under a drawn rule; they replay the steps since. In half of the losses the
 *     survivors first grow by 1 or 2 joiners, and reshard onto that group in one call: the joiners
 *     take part alike (the replicas' rows reach them on the old group's ring, which they get from
 *     the members).
 * Then two more steps, and every final rank's rows and optimizer state must equal, bit for bit,
 * what one process computes from the same global batches, and the final ranks must own every row
 * between them. Usage: capi_embedding_reshard_stress [episodes [seed]] (default 100, seed 1). */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "embedding_scenario.h"
#include "gradsync/gradsync.h"

#define MAXP 5
#define MAXJ 2
#define AFTER 2 /* steps after the change */

enum { K_RULE, K_GROW, K_LOSS, KINDS };
static const char* const kind_names[KINDS] = {"rule change in place", "grow", "loss and restore"};

typedef struct {
  int size, joiners, kind, optimizer, rule0, rule1, ckpt_at, change_at, replicas;
  int replace; /* a loss whose survivors grow by `joiners` before they reshard */
  int lost[MAXP];
  int covered; /* the replicas hold every lost rank's rows */
  char name[64], join_name[64], dir[160];
  snapshot ref;
  pthread_mutex_t lock;
  int64_t rows_owned; /* by the final ranks, summed */
  int finished;       /* final ranks that compared their rows */
} episode;

typedef struct {
  episode* e;
  int rank; /* in the first group, or the joiner's index */
} job;

static gradsync_comm_options comm_options(const char* name, int rank, int size) {
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  o.rank = rank;
  o.size = size;
  o.timeout_ms = 30000;
  snprintf(o.name, sizeof o.name, "%s", name);
  return o;
}

static void finish(episode* e, gradsync_embedding* t, gradsync_comm* c) {
  int64_t local = 0, steps = -1;
  int32_t r = -1, size = 0;
  gradsync_comm_rank(c, &r);
  gradsync_comm_size(c, &size);
  train(t, r, size, e->change_at, e->change_at + AFTER);
  CHECK_STATUS(gradsync_embedding_steps(t, &steps), GRADSYNC_OK);
  CHECK(steps == e->change_at + AFTER);
  compare_local(t, &e->ref, e->optimizer, kind_names[e->kind]);
  CHECK_STATUS(gradsync_embedding_shape(t, NULL, NULL, &local), GRADSYNC_OK);
  pthread_mutex_lock(&e->lock);
  e->rows_owned += local;
  e->finished += 1;
  pthread_mutex_unlock(&e->lock);
}

/* A survivor among the `replicas` ranks after rank i (one host: rank order) holds its rows. */
static int held_by_replica(const episode* e, int i) {
  const int k = e->replicas < e->size - 1 ? e->replicas : e->size - 1;
  int d;
  for (d = 1; d <= k; ++d)
    if (!e->lost[(i + d) % e->size]) return 1;
  return 0;
}

/* After a loss, every rank of next (the survivors, or the group they grew): the reshard from the
 * replicas when they cover the loss; otherwise E_LOST, then the checkpoint and the replay. */
static void after_loss(episode* e, gradsync_embedding* t, gradsync_comm* next) {
  int32_t restored = -1, r = -1, size = 0;
  int64_t steps = -1;
  int i;
  if (e->covered) {
    CHECK_STATUS(gradsync_embedding_reshard(t, next, e->rule1, NULL, NULL, &restored), GRADSYNC_OK);
    CHECK(restored == 0);
    CHECK_STATUS(gradsync_embedding_steps(t, &steps), GRADSYNC_OK);
    CHECK(steps == e->change_at);
    finish(e, t, next);
    return;
  }
  CHECK_STATUS(gradsync_embedding_reshard(t, next, e->rule1, NULL, NULL, &restored), GRADSYNC_E_LOST);
  /* It names each lost rank whose rows no surviving replica holds, and only those. */
  for (i = 0; i < e->size; ++i) {
    char named[32];
    if (!e->lost[i]) continue;
    snprintf(named, sizeof named, "old rank %d's ", i);
    if (held_by_replica(e, i)) {
      CHECK(strstr(gradsync_last_error_message(), named) == NULL);
    } else {
      CHECK_MESSAGE(named);
    }
  }
  CHECK_STATUS(gradsync_embedding_reshard(t, next, e->rule1, e->dir, NULL, &restored), GRADSYNC_OK);
  CHECK(restored == 1);
  CHECK_STATUS(gradsync_embedding_steps(t, &steps), GRADSYNC_OK);
  CHECK(steps == e->ckpt_at);
  gradsync_comm_rank(next, &r);
  gradsync_comm_size(next, &size);
  train(t, r, size, e->ckpt_at, e->change_at); /* the replay */
  finish(e, t, next);
}

static void* member(void* p) {
  job* j = (job*)p;
  episode* e = j->e;
  gradsync_comm_options o = comm_options(e->name, j->rank, e->size);
  gradsync_embedding_options eo = table_options(e->optimizer, e->rule0);
  gradsync_comm *c = NULL, *next = NULL, *grown = NULL;
  eo.replicas = e->replicas;
  gradsync_embedding* t = NULL;
  int32_t restored = -1, failed[MAXP];
  CHECK_STATUS(gradsync_comm_create(&c, &o), GRADSYNC_OK);
  if (c == NULL) return NULL;
  CHECK_STATUS(gradsync_embedding_create(&t, c, NULL, &eo), GRADSYNC_OK);
  train(t, j->rank, e->size, 0, e->ckpt_at);
  CHECK_STATUS(gradsync_embedding_save(t, e->dir), GRADSYNC_OK);
  train(t, j->rank, e->size, e->ckpt_at, e->change_at);
  switch (e->kind) {
    case K_RULE:
      CHECK_STATUS(gradsync_embedding_reshard(t, c, e->rule1, NULL, NULL, &restored), GRADSYNC_OK);
      CHECK(restored == 0);
      finish(e, t, c);
      break;
    case K_GROW:
      CHECK_STATUS(gradsync_comm_grow(c, e->join_name, e->joiners, &next, NULL), GRADSYNC_OK);
      if (next == NULL) break;
      CHECK_STATUS(gradsync_embedding_reshard(t, next, e->rule1, NULL, NULL, &restored), GRADSYNC_OK);
      CHECK(restored == 0);
      finish(e, t, next);
      break;
    case K_LOSS:
      if (e->lost[j->rank]) break; /* goes: its communicator ends below */
      {
        int64_t none = 0;
        CHECK(gradsync_embedding_push(t, &none, 0, NULL, 0) != GRADSYNC_OK);
      }
      CHECK_STATUS(gradsync_comm_shrink(c, &next, failed, MAXP, NULL), GRADSYNC_OK);
      if (next == NULL) break;
      if (e->replace) {
        CHECK_STATUS(gradsync_comm_grow(next, e->join_name, e->joiners, &grown, NULL), GRADSYNC_OK);
        if (grown != NULL) after_loss(e, t, grown);
      } else {
        after_loss(e, t, next);
      }
      break;
    default: break;
  }
  gradsync_embedding_free(t);
  gradsync_comm_free(c);
  gradsync_comm_free(next);
  gradsync_comm_free(grown);
  return NULL;
}

static void* joiner(void* p) {
  job* j = (job*)p;
  episode* e = j->e;
  gradsync_comm_options o = comm_options(e->join_name, j->rank, e->joiners);
  gradsync_embedding_options eo = table_options(e->optimizer, e->rule0);
  gradsync_comm* grown = NULL;
  eo.replicas = e->replicas;
  gradsync_embedding* t = NULL;
  int32_t restored = -1;
  uint64_t moved = 0;
  CHECK_STATUS(gradsync_comm_join(&grown, &o, NULL), GRADSYNC_OK);
  if (grown == NULL) return NULL;
  CHECK_STATUS(gradsync_embedding_create(&t, grown, NULL, &eo), GRADSYNC_OK);
  if (e->kind == K_LOSS) {
    after_loss(e, t, grown);
  } else {
    CHECK_STATUS(gradsync_embedding_reshard(t, grown, e->rule1, NULL, &moved, &restored), GRADSYNC_OK);
    CHECK(restored == 0 && moved > 0);
    finish(e, t, grown);
  }
  gradsync_embedding_free(t);
  gradsync_comm_free(grown);
  return NULL;
}

static uint64_t g_rng;
static int draw(int n) {
  g_rng = mix(g_rng);
  return (int)(g_rng % (uint64_t)n);
}

int main(int argc, char** argv) {
  const int episodes = argc > 1 ? atoi(argv[1]) : 100;
  const uint64_t seed = argc > 2 ? strtoull(argv[2], NULL, 10) : 1;
  static episode e;
  char tmp[] = "/tmp/gradsync-emb-stress-XXXXXX";
  int n, i, counts[KINDS] = {0, 0, 0}, wrong = 0, covered = 0, replaced = 0;
  if (mkdtemp(tmp) == NULL) {
    CHECK(0 && "no temporary directory");
    return check_report("capi:embedding_reshard_stress");
  }
  g_rng = seed;
  pthread_mutex_init(&e.lock, NULL);
  for (n = 0; n < episodes; ++n) {
    pthread_t t[MAXP + MAXJ];
    job jobs[MAXP + MAXJ];
    int threads = 0, survivors = 0, failures_before = check_failures;
    e.size = 1 + draw(MAXP);
    e.kind = draw(KINDS);
    if (e.kind == K_LOSS && e.size == 1) e.kind = K_GROW;
    e.replace = e.kind == K_LOSS && draw(2) == 0;
    e.joiners = e.kind == K_GROW || e.replace ? 1 + draw(MAXJ) : 0;
    {
      static const int32_t optimizers[] = {GRADSYNC_OPTIM_SGD, GRADSYNC_OPTIM_ROW_ADAGRAD, GRADSYNC_OPTIM_ADAM};
      e.optimizer = optimizers[draw(3)];
    }
    e.replicas = draw(3);
    e.rule0 = draw(2);
    e.rule1 = draw(2);
    e.change_at = 1 + draw(3);
    e.ckpt_at = draw(e.change_at + 1);
    memset(e.lost, 0, sizeof e.lost);
    if (e.kind == K_LOSS) {
      while (survivors == 0 || survivors == e.size) {
        survivors = 0;
        for (i = 0; i < e.size; ++i) survivors += !(e.lost[i] = draw(3) == 0);
      }
    }
    e.covered = e.kind == K_LOSS;
    for (i = 0; i < e.size && e.covered; ++i) e.covered = !e.lost[i] || held_by_replica(&e, i);
    covered += e.covered;
    replaced += e.replace;
    e.rows_owned = 0;
    e.finished = 0;
    snprintf(e.name, sizeof e.name, "emb-stress-%ld-%d", (long)getpid(), n);
    snprintf(e.join_name, sizeof e.join_name, "emb-stress-%ld-%d-join", (long)getpid(), n);
    snprintf(e.dir, sizeof e.dir, "%s/ckpt-%d", tmp, n);
    reference(e.optimizer, e.change_at + AFTER, 0, &e.ref);
    for (i = 0; i < e.size; ++i) {
      jobs[threads].e = &e;
      jobs[threads].rank = i;
      pthread_create(&t[threads], NULL, member, &jobs[threads]);
      ++threads;
    }
    for (i = 0; i < e.joiners; ++i) {
      jobs[threads].e = &e;
      jobs[threads].rank = i;
      pthread_create(&t[threads], NULL, joiner, &jobs[threads]);
      ++threads;
    }
    for (i = 0; i < threads; ++i) pthread_join(t[i], NULL);
    {
      const int final_ranks = (e.kind == K_LOSS ? survivors : e.size) + e.joiners;
      CHECK(e.finished == final_ranks);
      CHECK(e.rows_owned == ROWS);
    }
    counts[e.kind] += 1;
    if (check_failures != failures_before) {
      ++wrong;
      fprintf(stderr,
              "episode %d (seed %llu): %s, %d ranks, %d joiners, rule %d -> %d, optimizer %d, replicas %d, "
              "checkpoint at %d, change at %d: failed\n",
              n, (unsigned long long)seed, kind_names[e.kind], e.size, e.joiners, e.rule0, e.rule1, e.optimizer,
              e.replicas, e.ckpt_at, e.change_at);
    }
  }
  fprintf(stderr,
          "capi:embedding_reshard_stress: %d episodes (%d rule changes, %d grows, %d losses, %d of them carried by "
          "replicas, %d with joiners), %d wrong\n",
          episodes, counts[K_RULE], counts[K_GROW], counts[K_LOSS], covered, replaced, wrong);
  {
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmp);
  }
  return check_report("capi:embedding_reshard_stress");
}
