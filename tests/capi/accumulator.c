// SPDX-License-Identifier: Apache-2.0
/* The accumulator through the C ABI: the seed acceptance, threads, touched set, apply, bad input. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "gradsync/gradsync.h"

static gradsync_accum* shared_accum = NULL;
static float ones[64];

static void* add_ones(void* arg) {
  (void)arg;
  CHECK_STATUS(gradsync_accum_add(shared_accum, 0, ones, 64), GRADSYNC_OK);
  return NULL;
}

static int row_is(gradsync_accum* a, int64_t row, float v) {
  float out[64];
  int i;
  if (gradsync_accum_get(a, row, out, 64) != GRADSYNC_OK) return 0;
  for (i = 0; i < 64; ++i)
    if (out[i] != v) return 0;
  return 1;
}

static void seed_acceptance(const char* path, int32_t concurrency) {
  gradsync_accum_options o = GRADSYNC_ACCUM_OPTIONS_INIT;
  gradsync_table_options to = GRADSYNC_TABLE_OPTIONS_INIT;
  gradsync_optimizer sgd = GRADSYNC_OPTIMIZER_INIT;
  gradsync_accum *a = NULL, *b = NULL;
  gradsync_table* params = NULL;
  pthread_t threads[10];
  float twos[64], x[64], p[64];
  int64_t n = -1, touched[4];
  size_t needed = 0;
  int32_t mode = -1;
  int i;

  for (i = 0; i < 64; ++i) {
    ones[i] = 1.0f;
    twos[i] = 2.0f;
    x[i] = 1.5f;
  }
  o.mode = GRADSYNC_TABLE_CREATE;
  o.rows = 100;
  o.dim = 64;
  o.concurrency = concurrency;
  CHECK_STATUS(gradsync_accum_open(&a, path, &o), GRADSYNC_OK);
  CHECK(gradsync_accum_get_concurrency(a, &mode, NULL) == GRADSYNC_OK && mode == concurrency);

  CHECK_STATUS(gradsync_accum_add(a, 0, ones, 64), GRADSYNC_OK);
  CHECK_STATUS(gradsync_accum_add(a, 0, twos, 64), GRADSYNC_OK);
  CHECK(row_is(a, 0, 3.0f));
  CHECK_STATUS(gradsync_accum_add(a, 0, x, 64), GRADSYNC_OK);
  CHECK_STATUS(gradsync_accum_zero(a), GRADSYNC_OK);
  CHECK(row_is(a, 0, 0.0f));

  shared_accum = a;
  for (i = 0; i < 10; ++i) CHECK(pthread_create(&threads[i], NULL, add_ones, NULL) == 0);
  for (i = 0; i < 10; ++i) pthread_join(threads[i], NULL);
  CHECK(row_is(a, 0, 10.0f));
  CHECK_STATUS(gradsync_accum_zero(a), GRADSYNC_OK);

  to.mode = GRADSYNC_TABLE_ANONYMOUS;
  to.rows = 100;
  to.dim = 64;
  CHECK_STATUS(gradsync_table_open(&params, NULL, &to), GRADSYNC_OK);
  for (i = 0; i < 64; ++i) p[i] = 10.0f;
  CHECK_STATUS(gradsync_table_set(params, 0, p, 64), GRADSYNC_OK);
  CHECK_STATUS(gradsync_accum_add(a, 0, ones, 64), GRADSYNC_OK);
  CHECK(gradsync_accum_touched_count(a, &n) == GRADSYNC_OK && n == 1);
  CHECK(gradsync_accum_touched(a, touched, 0, &needed) == GRADSYNC_E_BUFS && needed == 1 &&
        check_message_has("1 rows are touched"));
  CHECK(gradsync_accum_touched(a, touched, 4, &needed) == GRADSYNC_OK && needed == 1 && touched[0] == 0);
  sgd.lr = 0.1;
  CHECK_STATUS(gradsync_accum_apply(a, params, &sgd, NULL), GRADSYNC_OK);
  CHECK_STATUS(gradsync_table_get(params, 0, p, 64), GRADSYNC_OK);
  for (i = 0; i < 64; ++i) CHECK(p[i] > 9.9f - 1e-6f && p[i] < 9.9f + 1e-6f);
  CHECK(row_is(a, 0, 0.0f));
  CHECK(gradsync_accum_touched_count(a, &n) == GRADSYNC_OK && n == 0);

  /* a 32-float add to a dim-64 table, and other bad input */
  CHECK_STATUS_MSG(gradsync_accum_add(a, 0, ones, 32), GRADSYNC_E_INVALID_ARG, "the gradient has 32 floats");
  CHECK_STATUS_MSG(gradsync_accum_add(a, 100, ones, 64), GRADSYNC_E_OUT_OF_RANGE, "row 100 out of range [0, 100)");
  CHECK_STATUS(gradsync_accum_add(a, 0, NULL, 64), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_accum_add_batch(a, NULL, 1, ones, 64), GRADSYNC_E_INVALID_ARG);
  CHECK(gradsync_accum_touched_count(a, &n) == GRADSYNC_OK && n == 0);
  gradsync_table_free(params);
  gradsync_accum_free(a);

  /* reopen with another dim -> mismatch */
  o.mode = GRADSYNC_TABLE_OPEN;
  o.dim = 32;
  CHECK(gradsync_accum_open(&b, path, &o) == GRADSYNC_E_MISMATCH && b == NULL &&
        check_message_has("file has 100 x 64, asked for 100 x 32"));
  unlink(path);
}

/* Owner mode through the ABI: a version-1 options struct (no threads field) still opens; batches
   large enough for the owners sum exactly, the same for 1 and 3 owners; bad thread counts. */
static void owner_batches(const char* path) {
  enum { kRows = 64, kDim = 4, kN = 1000 };
  gradsync_accum_options o = GRADSYNC_ACCUM_OPTIONS_INIT;
  gradsync_accum* a = NULL;
  static int64_t ids[kN];
  static float g[kN * kDim];
  float out[kDim], first[kRows][kDim];
  int64_t threads, r;
  int i;

  for (i = 0; i < kN; ++i) ids[i] = (i * 7) % kRows;
  for (i = 0; i < kN * kDim; ++i) g[i] = (float)(i % 13) * 0.1f + 1e-4f * (float)(i % 7);
  o.mode = GRADSYNC_TABLE_ANONYMOUS;
  o.rows = kRows;
  o.dim = kDim;
  o.concurrency = GRADSYNC_ACCUM_OWNER;
  o.threads = 0;
  CHECK_STATUS_MSG(gradsync_accum_open(&a, NULL, &o), GRADSYNC_E_INVALID_ARG, "threads must be in [1, 64], got 0");
  for (threads = 1; threads <= 3; threads += 2) {
    o.threads = threads;
    CHECK_STATUS(gradsync_accum_open(&a, NULL, &o), GRADSYNC_OK);
    CHECK_STATUS(gradsync_accum_add_batch(a, ids, kN, g, kN * kDim), GRADSYNC_OK);
    CHECK_STATUS(gradsync_accum_add_batch(a, ids, kN, g, kN * kDim), GRADSYNC_OK);
    for (r = 0; r < kRows; ++r) {
      CHECK(gradsync_accum_get(a, r, out, kDim) == GRADSYNC_OK);
      if (threads == 1)
        memcpy(first[r], out, sizeof out);
      else
        CHECK(memcmp(first[r], out, sizeof out) == 0); /* bitwise the same with 3 owners */
    }
    gradsync_accum_free(a);
  }
  /* a caller compiled against version 1 of the struct */
  o.struct_size = (uint32_t)offsetof(gradsync_accum_options, threads);
  o.version = 1;
  o.mode = GRADSYNC_TABLE_CREATE;
  CHECK_STATUS(gradsync_accum_open(&a, path, &o), GRADSYNC_OK);
  CHECK_STATUS(gradsync_accum_add_batch(a, ids, kN, g, kN * kDim), GRADSYNC_OK);
  gradsync_accum_free(a);
  unlink(path);
}

/* Gradient files are private unless the caller shares them (version 3's file_mode); a version-2
   struct gets the private default. */
static void file_modes(const char* path) {
  gradsync_accum_options o = GRADSYNC_ACCUM_OPTIONS_INIT;
  gradsync_accum* a = NULL;
  struct stat sb;
  mode_t old_umask;
  CHECK(o.file_mode == 0); /* 0 is the default, 0600: zeroed new fields mean the same to older libraries */
  o.rows = 4;
  o.dim = 2;
  o.mode = GRADSYNC_TABLE_CREATE;
  CHECK_STATUS(gradsync_accum_open(&a, path, &o), GRADSYNC_OK);
  CHECK(stat(path, &sb) == 0 && (sb.st_mode & 07777) == 0600);
  gradsync_accum_free(a);
  unlink(path);
  o.file_mode = 0640;
  old_umask = umask(077); /* exactly the mode asked for, whatever the umask */
  CHECK_STATUS(gradsync_accum_open(&a, path, &o), GRADSYNC_OK);
  umask(old_umask);
  CHECK(stat(path, &sb) == 0 && (sb.st_mode & 07777) == 0640);
  gradsync_accum_free(a);
  unlink(path);
  o.file_mode = 01777;
  CHECK_STATUS_MSG(gradsync_accum_open(&a, path, &o), GRADSYNC_E_INVALID_ARG,
                   "file_mode 1777 is not a set of permission bits");
  o.file_mode = 0600;
  o.allow_other_owner = 2;
  CHECK_STATUS_MSG(gradsync_accum_open(&a, path, &o), GRADSYNC_E_INVALID_ARG,
                   "allow_other_owner must be 0 or 1, got 2");
  o.allow_other_owner = 0;
  o.struct_size = (uint32_t)offsetof(gradsync_accum_options, file_mode);
  o.version = 2;
  o.file_mode = 0666; /* beyond the caller's struct: never read */
  CHECK_STATUS(gradsync_accum_open(&a, path, &o), GRADSYNC_OK);
  CHECK(stat(path, &sb) == 0 && (sb.st_mode & 07777) == 0600);
  gradsync_accum_free(a);
  unlink(path);
}

int main(void) {
  char dir[] = "/tmp/gradsync-capi-accum-XXXXXX";
  char path[256];
  gradsync_accum_options o = GRADSYNC_ACCUM_OPTIONS_INIT, from_fn;
  gradsync_optimizer opt = GRADSYNC_OPTIMIZER_INIT, opt_fn;
  gradsync_accum* a = NULL;
  gradsync_table *params = NULL, *state = NULL, *narrow = NULL;
  gradsync_table_options to = GRADSYNC_TABLE_OPTIONS_INIT;
  int64_t ids[4] = {2, 5, 2, 7};
  float g[4 * 8], out[8];
  const void* view = NULL;
  size_t bytes = 0;
  int i;

  if (mkdtemp(dir) == NULL) return 1;
  snprintf(path, sizeof path, "%s/grad.gsa", dir);
  seed_acceptance(path, GRADSYNC_ACCUM_STRIPED);
  seed_acceptance(path, GRADSYNC_ACCUM_LOCK_FREE);
  seed_acceptance(path, GRADSYNC_ACCUM_OWNER);
  owner_batches(path);
  file_modes(path);

  CHECK(gradsync_accum_options_init(&from_fn, sizeof from_fn) == GRADSYNC_OK && memcmp(&from_fn, &o, sizeof o) == 0);
  CHECK(gradsync_optimizer_init(&opt_fn, sizeof opt_fn) == GRADSYNC_OK && memcmp(&opt_fn, &opt, sizeof opt) == 0);
  CHECK_STATUS(gradsync_optimizer_init(&opt_fn, 4), GRADSYNC_E_INVALID_ARG);

  /* anonymous, repeated ids summed, row-wise Adagrad with its state table */
  o.mode = GRADSYNC_TABLE_ANONYMOUS;
  o.rows = 10;
  o.dim = 8;
  o.rows_per_lock = 0;
  CHECK_STATUS_MSG(gradsync_accum_open(&a, NULL, &o), GRADSYNC_E_INVALID_ARG, "rows_per_lock");
  o.rows_per_lock = 4;
  o.concurrency = 7;
  CHECK_STATUS_MSG(gradsync_accum_open(&a, NULL, &o), GRADSYNC_E_INVALID_ARG, "unknown concurrency mode 7");
  o.concurrency = GRADSYNC_UNSET_I32;
  CHECK_STATUS(gradsync_accum_open(&a, NULL, &o), GRADSYNC_OK);
  for (i = 0; i < 32; ++i) g[i] = 1.0f;
  CHECK_STATUS(gradsync_accum_add_batch(a, ids, 4, g, 32), GRADSYNC_OK);
  CHECK(gradsync_accum_get(a, 2, out, 8) == GRADSYNC_OK && out[0] == 2.0f);
  CHECK(gradsync_accum_view(a, &view, &bytes) == GRADSYNC_OK && bytes == 10 * 8 * 4 &&
        ((const float*)view)[5 * 8] == 1.0f);
  ids[3] = 10;
  CHECK_STATUS_MSG(gradsync_accum_add_batch(a, ids, 4, g, 32), GRADSYNC_E_OUT_OF_RANGE, "row 10 (entry 3 of 4)");
  CHECK(gradsync_accum_get(a, 2, out, 8) == GRADSYNC_OK && out[0] == 2.0f); /* nothing written */

  to.mode = GRADSYNC_TABLE_ANONYMOUS;
  to.rows = 10;
  to.dim = 8;
  CHECK_STATUS(gradsync_table_open(&params, NULL, &to), GRADSYNC_OK);
  to.dim = 1;
  CHECK_STATUS(gradsync_table_open(&state, NULL, &to), GRADSYNC_OK);
  to.dim = 4;
  CHECK_STATUS(gradsync_table_open(&narrow, NULL, &to), GRADSYNC_OK);
  CHECK_STATUS_MSG(gradsync_accum_apply(a, narrow, &opt, NULL), GRADSYNC_E_MISMATCH, "parameter table has 10 x 4");
  opt.kind = GRADSYNC_OPTIM_ROW_ADAGRAD;
  opt.lr = 0.5;
  CHECK_STATUS_MSG(gradsync_accum_apply(a, params, &opt, NULL), GRADSYNC_E_INVALID_ARG, "state table");
  CHECK_STATUS(gradsync_accum_apply(a, params, &opt, narrow), GRADSYNC_E_MISMATCH);
  CHECK_STATUS(gradsync_accum_apply(a, params, &opt, state), GRADSYNC_OK);
  CHECK(gradsync_table_get(state, 2, out, 1) == GRADSYNC_OK && out[0] == 4.0f); /* mean(2^2) */
  CHECK(gradsync_table_get(params, 2, out, 8) == GRADSYNC_OK && out[0] > -0.5f - 1e-6f && out[0] < -0.5f + 1e-6f);
  CHECK(gradsync_table_get(params, 5, out, 8) == GRADSYNC_OK && out[0] > -0.5f - 1e-6f && out[0] < -0.5f + 1e-6f);
  CHECK(gradsync_table_get(params, 0, out, 8) == GRADSYNC_OK && out[0] == 0.0f);

  /* wrong handle kinds, NULL handles, free(NULL) */
  CHECK(gradsync_accum_apply(a, (gradsync_table*)(void*)a, &opt, state) == GRADSYNC_E_MISUSE &&
        check_message_has("expected a table, got an accumulator"));
  CHECK_STATUS_MSG(gradsync_accum_add(NULL, 0, g, 8), GRADSYNC_E_MISUSE, "NULL accumulator handle");
  CHECK_STATUS(gradsync_table_flush((gradsync_table*)(void*)a), GRADSYNC_E_MISUSE);
  CHECK_STATUS(gradsync_accum_zero(NULL), GRADSYNC_E_MISUSE);
  CHECK_STATUS(gradsync_accum_touched(a, NULL, 5, NULL), GRADSYNC_E_INVALID_ARG);
  gradsync_accum_free(NULL);
  gradsync_table_free(params);
  gradsync_table_free(state);
  gradsync_table_free(narrow);
  gradsync_accum_free(a);
  rmdir(dir);
  return check_report("capi accumulator");
}
