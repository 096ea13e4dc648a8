// SPDX-License-Identifier: Apache-2.0
/* Tables through the C ABI: modes, shape mismatch, durability across reopen, bad input. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "gradsync/gradsync.h"

int main(void) {
  char dir[] = "/tmp/gradsync-capi-table-XXXXXX";
  char path[256];
  gradsync_table_options opts = GRADSYNC_TABLE_OPTIONS_INIT;
  gradsync_table_options from_fn;
  unsigned char big[sizeof(gradsync_table_options) + 32];
  gradsync_table *t = NULL, *t2 = NULL;
  float row[64], out[64];
  int64_t rows = 0, dim = 0, ids[3] = {1, 5, 9};
  float three[3 * 64];
  const void* view = NULL;
  size_t bytes = 0;
  int32_t created = -1;
  int i;

  if (mkdtemp(dir) == NULL) return 1;
  snprintf(path, sizeof path, "%s/emb.gst", dir);

  /* options: init function equals the macro; an older (smaller) struct is refused, a newer is fine */
  CHECK_STATUS(gradsync_table_options_init(&from_fn, sizeof from_fn), GRADSYNC_OK);
  CHECK(memcmp(&from_fn, &opts, sizeof opts) == 0);
  CHECK_STATUS(gradsync_table_options_init(NULL, sizeof opts), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_table_options_init(&from_fn, 8), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_table_options_init((gradsync_table_options*)(void*)big, sizeof big), GRADSYNC_OK);
  CHECK(big[sizeof big - 1] == 0);

  /* create: rows and dim are required */
  opts.mode = GRADSYNC_TABLE_CREATE;
  CHECK(gradsync_table_open(&t, path, &opts) == GRADSYNC_E_INVALID_ARG && t == NULL &&
        check_message_has("rows must be at least 1"));
  opts.rows = 100;
  opts.dim = 64;
  CHECK(gradsync_table_open(&t, path, &opts) == GRADSYNC_OK && t != NULL);
  CHECK(gradsync_table_shape(t, &rows, &dim) == GRADSYNC_OK && rows == 100 && dim == 64);
  CHECK(gradsync_table_created(t, &created) == GRADSYNC_OK && created == 1);
  CHECK(gradsync_table_open(&t2, path, &opts) == GRADSYNC_E_IO && t2 == NULL && check_message_has("already exists"));

  /* seed: set row 10 = 1.5, flush, close, reopen -> 1.5 */
  for (i = 0; i < 64; ++i) row[i] = 1.5f;
  CHECK_STATUS(gradsync_table_set(t, 10, row, 64), GRADSYNC_OK);
  CHECK_STATUS(gradsync_table_flush(t), GRADSYNC_OK);
  gradsync_table_free(t);
  t = NULL;
  opts.mode = GRADSYNC_TABLE_OPEN;
  opts.rows = GRADSYNC_UNSET_I64;
  opts.dim = GRADSYNC_UNSET_I64;
  CHECK_STATUS(gradsync_table_open(&t, path, &opts), GRADSYNC_OK);
  CHECK(gradsync_table_created(t, &created) == GRADSYNC_OK && created == 0);
  CHECK_STATUS(gradsync_table_get(t, 10, out, 64), GRADSYNC_OK);
  for (i = 0; i < 64; ++i) CHECK(out[i] == 1.5f);

  /* reopen with another dim -> mismatch naming both */
  opts.dim = 32;
  CHECK(gradsync_table_open(&t2, path, &opts) == GRADSYNC_E_MISMATCH && t2 == NULL);
  CHECK(check_message_has("file has 100 x 64, asked for any x 32"));
  opts.dim = GRADSYNC_UNSET_I64;

  /* gather / scatter / view */
  for (i = 0; i < 3 * 64; ++i) three[i] = (float)(i / 64 + 1);
  CHECK_STATUS(gradsync_table_scatter(t, ids, 3, three, 3 * 64), GRADSYNC_OK);
  memset(three, 0, sizeof three);
  CHECK_STATUS(gradsync_table_gather(t, ids, 3, three, 3 * 64), GRADSYNC_OK);
  CHECK(three[0] == 1.0f && three[64] == 2.0f && three[128 + 63] == 3.0f);
  CHECK(gradsync_table_view(t, &view, &bytes) == GRADSYNC_OK && bytes == 100 * 64 * 4);
  CHECK(((const float*)view)[5 * 64] == 2.0f && ((const float*)view)[10 * 64] == 1.5f);
  CHECK_STATUS(gradsync_table_prefetch(t, ids, 3), GRADSYNC_OK);

  /* bad input: every call gives a status and a message naming the problem */
  CHECK_STATUS_MSG(gradsync_table_get(t, 100, out, 64), GRADSYNC_E_OUT_OF_RANGE, "row 100 out of range [0, 100)");
  CHECK_STATUS(gradsync_table_get(t, -1, out, 64), GRADSYNC_E_OUT_OF_RANGE);
  CHECK_STATUS_MSG(gradsync_table_set(t, 0, row, 32), GRADSYNC_E_INVALID_ARG, "32 floats");
  CHECK_STATUS(gradsync_table_set(t, 0, NULL, 64), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_table_get(t, 0, NULL, 64), GRADSYNC_E_INVALID_ARG);
  ids[2] = 1000;
  CHECK_STATUS_MSG(gradsync_table_scatter(t, ids, 3, three, 3 * 64), GRADSYNC_E_OUT_OF_RANGE, "row 1000");
  /* the buffer's size is checked before any id is read */
  CHECK_STATUS(gradsync_table_gather(t, ids, 3, three, (size_t)-1), GRADSYNC_E_INVALID_ARG);
  ids[2] = 9;
  CHECK_STATUS(gradsync_table_gather(t, ids, 3, three, (size_t)-1), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_table_gather(t, NULL, 3, three, 3 * 64), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS_MSG(gradsync_table_get(NULL, 0, out, 64), GRADSYNC_E_MISUSE, "NULL table handle");
  CHECK_STATUS(gradsync_table_flush(NULL), GRADSYNC_E_MISUSE);
  CHECK_STATUS(gradsync_table_shape((const gradsync_table*)(const void*)&opts, &rows, &dim), GRADSYNC_E_MISUSE);
  CHECK_STATUS_MSG(gradsync_table_fill_uniform(t, 1, 1.0f, 0.0f), GRADSYNC_E_INVALID_ARG, "lo <= hi");
  CHECK_STATUS(gradsync_table_view(t, NULL, &bytes), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_table_open(NULL, path, &opts), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS_MSG(gradsync_table_open(&t2, NULL, &opts), GRADSYNC_E_INVALID_ARG, "path is NULL");
  opts.mode = 99;
  CHECK_STATUS_MSG(gradsync_table_open(&t2, path, &opts), GRADSYNC_E_INVALID_ARG, "unknown table mode 99");
  opts.mode = GRADSYNC_TABLE_OPEN;
  opts.dtype = GRADSYNC_F64;
  CHECK_STATUS(gradsync_table_open(&t2, path, &opts), GRADSYNC_E_UNSUPPORTED);
  opts.dtype = GRADSYNC_F32;
  opts.struct_size = 4;
  CHECK_STATUS_MSG(gradsync_table_open(&t2, path, &opts), GRADSYNC_E_INVALID_ARG, "struct_size");
  opts.struct_size = sizeof opts;
  gradsync_table_free(t);
  gradsync_table_free(NULL);

  /* read-only */
  opts.read_only = 1;
  CHECK_STATUS(gradsync_table_open(&t, path, &opts), GRADSYNC_OK);
  CHECK_STATUS_MSG(gradsync_table_set(t, 0, row, 64), GRADSYNC_E_MISUSE, "read-only");
  CHECK(gradsync_table_get(t, 10, out, 64) == GRADSYNC_OK && out[0] == 1.5f);
  gradsync_table_free(t);

  /* anonymous, seeded uniform: deterministic */
  {
    gradsync_table_options a = GRADSYNC_TABLE_OPTIONS_INIT;
    gradsync_table *x = NULL, *y = NULL;
    const void *vx = NULL, *vy = NULL;
    size_t bx = 0, by = 0;
    a.mode = GRADSYNC_TABLE_ANONYMOUS;
    a.rows = 10;
    a.dim = 7;
    a.init = GRADSYNC_TABLE_INIT_UNIFORM;
    a.seed = 3;
    CHECK_STATUS(gradsync_table_open(&x, NULL, &a), GRADSYNC_OK);
    CHECK_STATUS(gradsync_table_open(&y, NULL, &a), GRADSYNC_OK);
    CHECK_STATUS_MSG(gradsync_table_open(&t2, path, &a), GRADSYNC_E_INVALID_ARG, "no path");
    CHECK(gradsync_table_view(x, &vx, &bx) == GRADSYNC_OK && gradsync_table_view(y, &vy, &by) == GRADSYNC_OK);
    CHECK(bx == 280 && memcmp(vx, vy, bx) == 0);
    CHECK(((const float*)vx)[0] >= -0.5f && ((const float*)vx)[0] <= 0.5f);
    CHECK_STATUS(gradsync_table_flush(x), GRADSYNC_OK);
    gradsync_table_free(x);
    gradsync_table_free(y);
  }

  unlink(path);
  rmdir(dir);
  return check_report("capi table");
}
