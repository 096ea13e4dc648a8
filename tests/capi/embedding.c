/* SPDX-License-Identifier: Apache-2.0 */
/* The sharded embedding table through the C ABI: bitwise equality with a one-process reference
 * (built from the public table and accumulator) over 1, 2, 3 and 4 ranks, both sharding rules and
 * the three optimizers (SGD, row-wise Adagrad, Adam), on threads and on shm processes; checkpoints
 * of row-wise Adagrad and of Adam saved on 4 ranks and loaded into 3, 2, 5 and 1 ranks under either
 * rule; bad ids and buffers on one rank; damaged, hostile and
 * mismatched checkpoints. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "gradsync/gradsync.h"

#include "embedding_scenario.h"

#define MAX_RANKS 5

#define OPTIMIZERS 3                    /* SGD, ROW_ADAGRAD, ADAM: gradsync_optimizer_kind 0..2 */
static snapshot g_ref[OPTIMIZERS];      /* per optimizer, after STEPS steps */
static snapshot g_ref_more[OPTIMIZERS]; /* per optimizer, after STEPS + 2 steps */

/* Lookups in any order with repeats answer in the caller's order. */
static void check_lookup(gradsync_embedding* t, int rank, const snapshot* ref) {
  int64_t ids[97];
  float rows[97 * DIM];
  int i, bad = 0;
  for (i = 0; i < 97; ++i) ids[i] = (int64_t)(mix((uint64_t)(rank * 1000 + i)) % (i % 2 ? 7 : ROWS));
  CHECK_STATUS(gradsync_embedding_lookup(t, ids, 97, rows, 97 * DIM), GRADSYNC_OK);
  for (i = 0; i < 97; ++i) bad += memcmp(&rows[i * DIM], &ref->values[ids[i] * DIM], sizeof(float) * DIM) != 0;
  CHECK(bad == 0);
  /* a rank with nothing to look up takes part with n = 0 */
  if (rank == 0) {
    CHECK_STATUS(gradsync_embedding_lookup(t, NULL, 0, NULL, 0), GRADSYNC_OK);
  } else {
    CHECK_STATUS(gradsync_embedding_lookup(t, ids, 97, rows, 97 * DIM), GRADSYNC_OK);
    for (i = 0; i < 97; ++i) bad += memcmp(&rows[i * DIM], &ref->values[ids[i] * DIM], sizeof(float) * DIM) != 0;
    CHECK(bad == 0);
  }
}

typedef struct {
  const char* group;
  int32_t transport;
  int rank, size;
  int32_t optimizer, sharding;
} rank_arg;

static gradsync_comm* join(const char* name, int32_t transport, int rank, int size) {
  gradsync_comm_options opts = GRADSYNC_COMM_OPTIONS_INIT;
  gradsync_comm* comm = NULL;
  opts.transport = transport;
  opts.rank = rank;
  opts.size = size;
  opts.timeout_ms = 60000;
  strncpy(opts.name, name, sizeof opts.name - 1);
  if (gradsync_comm_create(&comm, &opts) != GRADSYNC_OK) {
    fprintf(stderr, "join %s rank %d: %s\n", name, rank, gradsync_last_error_message());
    check_failed();
  }
  return comm;
}

static gradsync_embedding* make_table(gradsync_comm* comm, int32_t optimizer, int32_t sharding) {
  gradsync_embedding_options o = table_options(optimizer, sharding);
  gradsync_embedding* t = NULL;
  CHECK_STATUS(gradsync_embedding_create(&t, comm, NULL, &o), GRADSYNC_OK);
  return t;
}

/* ---- determinism: the reference's bits on any number of ranks */
static void* determinism_rank(void* p) {
  const rank_arg* a = (const rank_arg*)p;
  char what[128];
  int64_t steps = 0;
  gradsync_comm* comm = join(a->group, a->transport, a->rank, a->size);
  gradsync_embedding* t;
  if (comm == NULL) return NULL;
  t = make_table(comm, a->optimizer, a->sharding);
  if (t != NULL) {
    train(t, a->rank, a->size, 0, STEPS);
    snprintf(what, sizeof what, "%s rank %d/%d", a->group, a->rank, a->size);
    compare_local(t, &g_ref[a->optimizer], a->optimizer, what);
    check_lookup(t, a->rank, &g_ref[a->optimizer]);
    CHECK_STATUS(gradsync_embedding_steps(t, &steps), GRADSYNC_OK);
    CHECK(steps == STEPS);
  }
  gradsync_embedding_free(t);
  gradsync_comm_free(comm);
  return NULL;
}

static void run_threads(void* (*fn)(void*), rank_arg* args, int size) {
  pthread_t threads[MAX_RANKS];
  int r;
  for (r = 0; r < size; ++r) pthread_create(&threads[r], NULL, fn, &args[r]);
  for (r = 0; r < size; ++r) pthread_join(threads[r], NULL);
}

static void determinism_on_threads(void) {
  int size, opt, sh, r;
  for (size = 1; size <= 4; ++size)
    for (opt = 0; opt < OPTIMIZERS; ++opt)
      for (sh = 0; sh < 2; ++sh) {
        rank_arg args[MAX_RANKS];
        char group[64];
        snprintf(group, sizeof group, "emb-det-%d-%d-%d", size, opt, sh);
        for (r = 0; r < size; ++r) {
          rank_arg a = {NULL, GRADSYNC_TRANSPORT_THREAD, 0, 0, 0, 0};
          a.group = strdup(group);
          a.rank = r;
          a.size = size;
          a.optimizer = opt;
          a.sharding = sh;
          args[r] = a;
        }
        run_threads(determinism_rank, args, size);
        for (r = 0; r < size; ++r) free((void*)args[r].group);
      }
}

/* ---- bad input on one rank: every rank fails in the same round, the table is unchanged, and the
 * group goes on */
static void* bad_input_rank(void* p) {
  const rank_arg* a = (const rank_arg*)p;
  gradsync_comm* comm = join("emb-bad", GRADSYNC_TRANSPORT_THREAD, a->rank, a->size);
  gradsync_embedding* t;
  int64_t ids[3] = {1, 2, 3};
  float g[3 * DIM], before[3 * DIM], after[3 * DIM];
  int i;
  if (comm == NULL) return NULL;
  for (i = 0; i < 3 * DIM; ++i) g[i] = 1.0f;
  t = make_table(comm, GRADSYNC_OPTIM_ROW_ADAGRAD, GRADSYNC_EMBEDDING_HASH);
  CHECK_STATUS(gradsync_embedding_lookup(t, ids, 3, before, 3 * DIM), GRADSYNC_OK);
  /* rank 1 pushes id 1000 (rows is 1000) at position 2 */
  if (a->rank == 1) ids[2] = ROWS;
  CHECK_STATUS_MSG(gradsync_embedding_push(t, ids, 3, g, 3 * DIM), GRADSYNC_E_OUT_OF_RANGE,
                   "rank 1: push: id 1000 at position 2 is outside [0, 1000)");
  if (a->rank == 2) ids[0] = -5;
  CHECK_STATUS_MSG(gradsync_embedding_lookup(t, ids, 3, after, 3 * DIM), GRADSYNC_E_OUT_OF_RANGE, "rank 1: lookup");
  ids[0] = 1;
  ids[2] = 3;
  /* a NULL gradient buffer, and a wrong count, on one rank */
  CHECK_STATUS_MSG(gradsync_embedding_push(t, ids, 3, a->rank == 2 ? NULL : g, 3 * DIM), GRADSYNC_E_INVALID_ARG,
                   "rank 2: push: the gradient buffer is NULL");
  CHECK_STATUS_MSG(gradsync_embedding_push(t, ids, 3, g, a->rank == 0 ? 3 * DIM - 1 : 3 * DIM), GRADSYNC_E_INVALID_ARG,
                   "rank 0: push: count is 20");
  CHECK_STATUS(gradsync_embedding_lookup(t, ids, 3, after, 3 * DIM), GRADSYNC_OK);
  CHECK(memcmp(before, after, sizeof before) == 0);
  CHECK_STATUS(gradsync_embedding_push(t, ids, 3, g, 3 * DIM), GRADSYNC_OK);
  CHECK_STATUS(gradsync_embedding_lookup(t, ids, 3, after, 3 * DIM), GRADSYNC_OK);
  CHECK(memcmp(before, after, sizeof before) != 0);
  gradsync_embedding_free(t);
  gradsync_comm_free(comm);
  return NULL;
}

/* ---- checkpoints: saved on 4 ranks (contiguous), loaded into 3, 2, 5 and 1 ranks under either
 * rule, every row and its optimizer state (Adagrad's; Adam's moments and per-row update counts)
 * bitwise, and training goes on as if never interrupted */
static char g_dir[256];

static void* save_rank(void* p) {
  const rank_arg* a = (const rank_arg*)p;
  gradsync_comm* comm = join(a->group, GRADSYNC_TRANSPORT_THREAD, a->rank, a->size);
  gradsync_embedding* t;
  if (comm == NULL) return NULL;
  t = make_table(comm, a->optimizer, GRADSYNC_EMBEDDING_CONTIGUOUS);
  /* no checkpoint of this table yet: an incremental save is refused on every rank */
  CHECK_STATUS_MSG(gradsync_embedding_save_incremental(t, g_dir), GRADSYNC_E_MISUSE, "save in full first");
  train(t, a->rank, a->size, 0, STEPS - 2);
  CHECK_STATUS(gradsync_embedding_save(t, g_dir), GRADSYNC_OK);
  /* a later checkpoint in the same directory replaces it whole */
  train(t, a->rank, a->size, STEPS - 2, STEPS - 1);
  CHECK_STATUS(gradsync_embedding_save(t, g_dir), GRADSYNC_OK);
  /* then a layer of the rows pushed since */
  train(t, a->rank, a->size, STEPS - 1, STEPS);
  CHECK_STATUS(gradsync_embedding_save_incremental(t, g_dir), GRADSYNC_OK);
  gradsync_embedding_free(t);
  gradsync_comm_free(comm);
  return NULL;
}

static void* load_rank(void* p) {
  const rank_arg* a = (const rank_arg*)p;
  char what[128];
  int64_t steps = 0;
  gradsync_comm* comm = join(a->group, GRADSYNC_TRANSPORT_THREAD, a->rank, a->size);
  gradsync_embedding* t;
  if (comm == NULL) return NULL;
  t = make_table(comm, a->optimizer, a->sharding);
  CHECK_STATUS(gradsync_embedding_load(t, g_dir), GRADSYNC_OK);
  snprintf(what, sizeof what, "loaded into %s", a->group);
  compare_local(t, &g_ref[a->optimizer], a->optimizer, what);
  CHECK_STATUS(gradsync_embedding_steps(t, &steps), GRADSYNC_OK);
  CHECK(steps == STEPS);
  train(t, a->rank, a->size, STEPS, STEPS + 2);
  snprintf(what, sizeof what, "resumed in %s", a->group);
  compare_local(t, &g_ref_more[a->optimizer], a->optimizer, what);
  gradsync_embedding_free(t);
  gradsync_comm_free(comm);
  return NULL;
}

static int count_files(const char* dir) {
  DIR* d = opendir(dir);
  struct dirent* e;
  int n = 0;
  if (d == NULL) return -1;
  while ((e = readdir(d)) != NULL) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

static void resharding(int32_t optimizer) {
  static const int sizes[] = {3, 2, 5, 1, 4};
  rank_arg args[MAX_RANKS];
  int i, r, sh;
  for (r = 0; r < 4; ++r) {
    rank_arg a = {"emb-save-4", GRADSYNC_TRANSPORT_THREAD, 0, 4, 0, 0};
    a.optimizer = optimizer;
    a.rank = r;
    args[r] = a;
  }
  run_threads(save_rank, args, 4);
  /* the manifest, the 4 parts of the last full save and the 4 of its incremental layer */
  CHECK(count_files(g_dir) == 9);
  for (i = 0; i < (int)(sizeof sizes / sizeof sizes[0]); ++i)
    for (sh = 0; sh < 2; ++sh) {
      char group[64];
      snprintf(group, sizeof group, "emb-load-%d-%s-%d", sizes[i], sh ? "hash" : "contiguous", (int)optimizer);
      for (r = 0; r < sizes[i]; ++r) {
        rank_arg a = {NULL, GRADSYNC_TRANSPORT_THREAD, 0, 0, 0, 0};
        a.optimizer = optimizer;
        a.group = strdup(group);
        a.rank = r;
        a.size = sizes[i];
        a.sharding = sh;
        args[r] = a;
      }
      run_threads(load_rank, args, sizes[i]);
      for (r = 0; r < sizes[i]; ++r) free((void*)args[r].group);
    }
}

/* ---- damaged, hostile and mismatched checkpoints: a clear status on every rank, the table unchanged */
static int find_file(const char* dir, const char* prefix, char* path, size_t cap) {
  DIR* d = opendir(dir);
  struct dirent* e;
  int found = 0;
  if (d == NULL) return 0;
  while (!found && (e = readdir(d)) != NULL) {
    if (strncmp(e->d_name, prefix, strlen(prefix)) == 0) {
      found = (size_t)snprintf(path, cap, "%s/", dir) + strlen(e->d_name) < cap;
      if (found) strcat(path, e->d_name);
    }
  }
  closedir(d);
  return found;
}

static void damage(const char* path, long offset, const void* bytes, size_t n, long truncate_to) {
  int fd = open(path, O_WRONLY);
  CHECK(fd >= 0);
  if (fd < 0) return;
  if (n > 0) CHECK(pwrite(fd, bytes, n, offset) == (ssize_t)n);
  if (truncate_to >= 0) CHECK(ftruncate(fd, truncate_to) == 0);
  close(fd);
}

enum {
  DAMAGE_TRUNCATE_PART,
  DAMAGE_FLIP_VALUE,
  DAMAGE_GARBAGE_MANIFEST,
  DAMAGE_SHORT_MANIFEST,
  DAMAGE_VERSION,
  DAMAGE_MISSING_PART,
  DAMAGE_KINDS
};

static void* hostile_rank(void* p) {
  const rank_arg* a = (const rank_arg*)p;
  gradsync_comm* comm = join("emb-hostile", GRADSYNC_TRANSPORT_THREAD, a->rank, a->size);
  gradsync_embedding *t, *wide, *sgd, *adam;
  gradsync_embedding_options o = table_options(GRADSYNC_OPTIM_ROW_ADAGRAD, GRADSYNC_EMBEDDING_CONTIGUOUS);
  static float before[2][ROWS * DIM], before_state[2][ROWS], now[2][ROWS * DIM], now_state[2][ROWS];
  char path[1024], dir[300];
  int kind;
  if (comm == NULL) return NULL;
  snprintf(dir, sizeof dir, "%s/hostile", g_dir);
  t = make_table(comm, GRADSYNC_OPTIM_ROW_ADAGRAD, GRADSYNC_EMBEDDING_CONTIGUOUS);
  train(t, a->rank, a->size, 0, 1);
  CHECK_STATUS(gradsync_embedding_local_rows(t, NULL, before[a->rank], before_state[a->rank], ROWS), GRADSYNC_OK);

  CHECK_STATUS_MSG(gradsync_embedding_load(t, "/nonexistent/checkpoint"), GRADSYNC_E_IO, "no checkpoint in");
  for (kind = 0; kind < DAMAGE_KINDS; ++kind) {
    static const char garbage[200] = "not a checkpoint at all, but long enough to pass for a header";
    const uint32_t version = 99;
    const unsigned char flip = 0x5a;
    int expected = GRADSYNC_E_CORRUPT;
    CHECK_STATUS(gradsync_embedding_save(t, dir), GRADSYNC_OK);
    if (a->rank == 0) {
      switch (kind) {
        case DAMAGE_TRUNCATE_PART:
          CHECK(find_file(dir, "part-00001", path, sizeof path));
          damage(path, 0, NULL, 0, 128 + 10);
          break;
        case DAMAGE_FLIP_VALUE:
          CHECK(find_file(dir, "part-00000", path, sizeof path));
          damage(path, 128 + 8 * 500 + 4 * 3, &flip, 1, -1);
          break;
        case DAMAGE_GARBAGE_MANIFEST:
          CHECK(find_file(dir, "checkpoint.gsemb", path, sizeof path));
          damage(path, 0, garbage, sizeof garbage, 128 + 2 * 16);
          break;
        case DAMAGE_SHORT_MANIFEST:
          CHECK(find_file(dir, "checkpoint.gsemb", path, sizeof path));
          damage(path, 0, NULL, 0, 50);
          break;
        case DAMAGE_VERSION:
          CHECK(find_file(dir, "checkpoint.gsemb", path, sizeof path));
          damage(path, 8, &version, sizeof version, -1);
          expected = GRADSYNC_E_VERSION_MISMATCH;
          break;
        default:
          CHECK(find_file(dir, "part-00001", path, sizeof path));
          CHECK(unlink(path) == 0);
          break;
      }
    } else {
      expected = kind == DAMAGE_VERSION ? GRADSYNC_E_VERSION_MISMATCH : GRADSYNC_E_CORRUPT;
    }
    CHECK_STATUS(gradsync_comm_barrier(comm), GRADSYNC_OK);
    CHECK_STATUS(gradsync_embedding_load(t, dir), expected);
    if (kind == DAMAGE_FLIP_VALUE) CHECK_MESSAGE("checksum");
    if (kind == DAMAGE_TRUNCATE_PART) CHECK_MESSAGE("truncated");
    CHECK_STATUS(gradsync_embedding_local_rows(t, NULL, now[a->rank], now_state[a->rank], ROWS), GRADSYNC_OK);
    CHECK(memcmp(now[a->rank], before[a->rank], sizeof before[0]) == 0);
    CHECK(memcmp(now_state[a->rank], before_state[a->rank], sizeof before_state[0]) == 0);
  }
  /* Files of other users on this host: a FIFO in the manifest's place is refused at once (an open
   * of it would wait for a writer forever), and a link put where a save once wrote its temporary
   * file is never written through into the file it names. */
  {
    char fifo_dir[320], victim[1024];
    static const char victim_text[] = "another file, not to be overwritten";
    char readback[sizeof victim_text] = {0};
    int fd;
    snprintf(fifo_dir, sizeof fifo_dir, "%s-fifo", dir);
    snprintf(victim, sizeof victim, "%s-victim", dir);
    if (a->rank == 0) {
      CHECK(mkdir(fifo_dir, 0700) == 0);
      snprintf(path, sizeof path, "%s/checkpoint.gsemb", fifo_dir);
      CHECK(mkfifo(path, 0600) == 0);
      fd = open(victim, O_WRONLY | O_CREAT | O_TRUNC, 0600);
      CHECK(fd >= 0 && write(fd, victim_text, sizeof victim_text) == (ssize_t)sizeof victim_text);
      if (fd >= 0) close(fd);
      snprintf(path, sizeof path, "%s/checkpoint.gsemb.tmp", dir);
      unlink(path);
      CHECK(symlink(victim, path) == 0);
    }
    CHECK_STATUS(gradsync_comm_barrier(comm), GRADSYNC_OK);
    CHECK_STATUS_MSG(gradsync_embedding_load(t, fifo_dir), GRADSYNC_E_CORRUPT, "not a regular file");
    CHECK_STATUS(gradsync_embedding_save(t, dir), GRADSYNC_OK);
    fd = open(victim, O_RDONLY);
    CHECK(fd >= 0 && read(fd, readback, sizeof readback) == (ssize_t)sizeof victim_text);
    if (fd >= 0) close(fd);
    CHECK(memcmp(readback, victim_text, sizeof victim_text) == 0);
    CHECK_STATUS(gradsync_embedding_load(t, dir), GRADSYNC_OK);
  }

  /* another shape, another optimizer: refused */
  CHECK_STATUS(gradsync_embedding_save(t, dir), GRADSYNC_OK);
  CHECK_STATUS_MSG(gradsync_embedding_load(t, a->rank == 1 ? NULL : dir), GRADSYNC_E_INVALID_ARG, "rank 1");
  o.dim = DIM + 1;
  CHECK_STATUS(gradsync_embedding_create(&wide, comm, NULL, &o), GRADSYNC_OK);
  CHECK_STATUS_MSG(gradsync_embedding_load(wide, dir), GRADSYNC_E_MISMATCH, "has 1000 x 7, the table 1000 x 8");
  o = table_options(GRADSYNC_OPTIM_SGD, GRADSYNC_EMBEDDING_HASH);
  CHECK_STATUS(gradsync_embedding_create(&sgd, comm, NULL, &o), GRADSYNC_OK);
  CHECK_STATUS_MSG(gradsync_embedding_load(sgd, dir), GRADSYNC_E_MISMATCH, "optimizer");
  o = table_options(GRADSYNC_OPTIM_ADAM, GRADSYNC_EMBEDDING_CONTIGUOUS);
  CHECK_STATUS(gradsync_embedding_create(&adam, comm, NULL, &o), GRADSYNC_OK);
  CHECK_STATUS_MSG(gradsync_embedding_load(adam, dir), GRADSYNC_E_MISMATCH,
                   "holds the state of optimizer 1 (row-wise Adagrad, 1 floats per row), the table uses 2 (Adam)");
  /* and an Adam checkpoint into a row-wise Adagrad table */
  train(adam, a->rank, a->size, 0, 1);
  CHECK_STATUS(gradsync_embedding_save(adam, dir), GRADSYNC_OK);
  CHECK_STATUS_MSG(gradsync_embedding_load(t, dir), GRADSYNC_E_MISMATCH,
                   "holds the state of optimizer 2 (Adam, 15 floats per row), the table uses 1 (row-wise Adagrad)");
  CHECK_STATUS(gradsync_embedding_load(adam, dir), GRADSYNC_OK);
  CHECK_STATUS(gradsync_embedding_save(t, dir), GRADSYNC_OK);
  CHECK_STATUS(gradsync_embedding_load(t, dir), GRADSYNC_OK);
  gradsync_embedding_free(adam);
  gradsync_embedding_free(wide);
  gradsync_embedding_free(sgd);
  gradsync_embedding_free(t);
  gradsync_comm_free(comm);
  return NULL;
}

static void hostile_checkpoints(void) {
  rank_arg args[2];
  int r;
  for (r = 0; r < 2; ++r) {
    rank_arg a = {"emb-hostile", GRADSYNC_TRANSPORT_THREAD, 0, 2, 0, 0};
    a.rank = r;
    args[r] = a;
  }
  run_threads(hostile_rank, args, 2);
}

static void bad_input(void) {
  rank_arg args[3];
  int r;
  for (r = 0; r < 3; ++r) {
    rank_arg a = {"emb-bad", GRADSYNC_TRANSPORT_THREAD, 0, 3, 0, 0};
    a.rank = r;
    args[r] = a;
  }
  run_threads(bad_input_rank, args, 3);
}

/* ---- the same determinism on shm: real processes, forked before any handle exists */
static int shm_ranks(int size, int32_t optimizer) {
  pid_t pids[MAX_RANKS];
  char group[64];
  int r, failed = 0;
  snprintf(group, sizeof group, "emb-shm-%d-%d-%d", (int)getpid(), size, (int)optimizer);
  for (r = 0; r < size; ++r) {
    pids[r] = fork();
    if (pids[r] == 0) {
      rank_arg a = {NULL, GRADSYNC_TRANSPORT_SHM, 0, 0, 0, GRADSYNC_EMBEDDING_HASH};
      a.optimizer = optimizer;
      a.group = group;
      a.rank = r;
      a.size = size;
      alarm(120);
      determinism_rank(&a);
      _exit(check_failures == 0 ? 0 : 1);
    }
  }
  for (r = 0; r < size; ++r) {
    int status = 0;
    if (waitpid(pids[r], &status, 0) != pids[r] || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      fprintf(stderr, "shm rank %d of %d failed (status 0x%x)\n", r, size, status);
      failed = 1;
    }
  }
  return failed;
}

int main(void) {
  snapshot* reversed = (snapshot*)malloc(sizeof(snapshot));
  int32_t opt;
  int size;
  for (opt = 0; opt < OPTIMIZERS; ++opt) {
    reference(opt, STEPS, 0, &g_ref[opt]);
    reference(opt, STEPS + 2, 0, &g_ref_more[opt]);
  }
  /* Adam's rows are updated as often as the batches touch them: the hot rows every step, others
   * seldom, so the per-row counts differ (and a row's count says how often it was pushed). */
  CHECK(g_ref[GRADSYNC_OPTIM_ADAM].state[0 * STATE_MAX + 2 * DIM] == (float)STEPS);
  {
    int i, fewer = 0;
    for (i = 10; i < ROWS; ++i) {
      const float t = g_ref[GRADSYNC_OPTIM_ADAM].state[i * STATE_MAX + 2 * DIM];
      CHECK(t >= 0.0f && t <= (float)STEPS);
      fewer += t > 0.0f && t < (float)STEPS;
    }
    CHECK(fewer > 0);
  }
  /* The test can tell orders apart: summing each batch back to front changes some row's bits. */
  reference(GRADSYNC_OPTIM_SGD, STEPS, 1, reversed);
  CHECK(memcmp(reversed->values, g_ref[0].values, sizeof reversed->values) != 0);
  free(reversed);

  /* real processes first, while this one has no thread to copy into them */
  CHECK(shm_ranks(2, GRADSYNC_OPTIM_ROW_ADAGRAD) == 0);
  CHECK(shm_ranks(3, GRADSYNC_OPTIM_ROW_ADAGRAD) == 0);
  for (size = 1; size <= 4; ++size) CHECK(shm_ranks(size, GRADSYNC_OPTIM_ADAM) == 0);
  determinism_on_threads();
  bad_input();
  snprintf(g_dir, sizeof g_dir, "/tmp/gradsync-embedding-XXXXXX");
  CHECK(mkdtemp(g_dir) != NULL);
  resharding(GRADSYNC_OPTIM_ROW_ADAGRAD);
  resharding(GRADSYNC_OPTIM_ADAM);
  hostile_checkpoints();
  {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    CHECK(system(cmd) == 0);
  }
  return check_report("embedding");
}
