// SPDX-License-Identifier: Apache-2.0
/* Data-parallel helpers through the C ABI: the examples and bad input. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "gradsync/gradsync.h"

static void test_partition(void) {
  const uint64_t expected[3][2] = {{0, 4}, {4, 3}, {7, 3}};
  uint64_t start = 99, len = 99;
  uint32_t i;
  for (i = 0; i < 3; ++i) {
    CHECK_STATUS(gradsync_partition(10, 3, i, &start, &len), GRADSYNC_OK);
    CHECK(start == expected[i][0] && len == expected[i][1]);
  }
  CHECK(gradsync_partition(5, 3, 2, &start, &len) == GRADSYNC_OK && start == 4 && len == 1);
  CHECK(gradsync_partition(2, 5, 4, &start, &len) == GRADSYNC_OK && start == 2 && len == 0); /* N < P */
  CHECK(gradsync_partition(UINT64_MAX, 1, 0, &start, &len) == GRADSYNC_OK && start == 0 && len == UINT64_MAX);
  start = len = 99;
  CHECK_STATUS_MSG(gradsync_partition(10, 3, 3, &start, &len), GRADSYNC_E_OUT_OF_RANGE, "part 3 out of range [0, 3)");
  CHECK_STATUS_MSG(gradsync_partition(10, 0, 0, &start, &len), GRADSYNC_E_INVALID_ARG, "parts must be > 0");
  CHECK(start == 99 && len == 99);
  CHECK_STATUS_MSG(gradsync_partition(10, 3, 0, NULL, &len), GRADSYNC_E_INVALID_ARG, "NULL");
  CHECK_STATUS_MSG(gradsync_partition(10, 3, 0, &start, NULL), GRADSYNC_E_INVALID_ARG, "NULL");
}

static void test_round_robin(void) {
  const uint64_t expected[3][4] = {{0, 3, 6, 9}, {1, 4, 7, 0}, {2, 5, 8, 0}};
  const size_t sizes[3] = {4, 3, 3};
  uint64_t out[8];
  size_t needed = 0;
  uint32_t k;
  for (k = 0; k < 3; ++k) {
    CHECK(gradsync_split_round_robin(10, 3, k, NULL, 0, &needed) == GRADSYNC_E_BUFS && needed == sizes[k]);
    CHECK(gradsync_split_round_robin(10, 3, k, out, 8, &needed) == GRADSYNC_OK && needed == sizes[k]);
    CHECK(memcmp(out, expected[k], sizes[k] * sizeof(uint64_t)) == 0);
  }
  out[0] = 77;
  CHECK_STATUS_MSG(gradsync_split_round_robin(10, 3, 0, out, 3, &needed), GRADSYNC_E_BUFS,
                   "gets 4 indices but out holds only 3");
  CHECK(needed == 4 && out[0] == 77); /* nothing written */
  CHECK(gradsync_split_round_robin(0, 3, 2, NULL, 0, &needed) == GRADSYNC_OK && needed == 0);
  CHECK(gradsync_split_round_robin(2, 5, 4, NULL, 0, &needed) == GRADSYNC_OK && needed == 0);
  CHECK_STATUS_MSG(gradsync_split_round_robin(10, 0, 0, out, 8, &needed), GRADSYNC_E_INVALID_ARG,
                   "workers must be > 0");
  CHECK_STATUS_MSG(gradsync_split_round_robin(10, 3, 3, out, 8, &needed), GRADSYNC_E_OUT_OF_RANGE,
                   "worker 3 out of range [0, 3)");
  CHECK_STATUS_MSG(gradsync_split_round_robin(10, 3, 0, out, 8, NULL), GRADSYNC_E_INVALID_ARG, "needed");
  CHECK_STATUS_MSG(gradsync_split_round_robin(10, 3, 0, NULL, 8, &needed), GRADSYNC_E_INVALID_ARG, "out is NULL");
  /* A huge sample count is only a size, never an allocation. */
  CHECK_STATUS(gradsync_split_round_robin(UINT64_MAX, 1, 0, NULL, 0, &needed), GRADSYNC_E_BUFS);
  CHECK(needed == SIZE_MAX);
}

static void test_weighted_merge(void) {
  const float a[2] = {2, 4}, b[2] = {2, 4};
  const float* grads[2] = {a, b};
  size_t lens[2] = {2, 2};
  uint64_t counts[2] = {10, 10};
  double losses[2] = {1.0, 1.0};
  float out[2] = {0, 0};
  double loss = -1;
  uint64_t total = 0;

  CHECK_STATUS(gradsync_weighted_merge_f32(grads, lens, counts, losses, 2, out, 2, &loss, &total), GRADSYNC_OK);
  CHECK(out[0] == 2.0f && out[1] == 4.0f && loss == 1.0 && total == 20);

  {
    const float c[1] = {4}, d[1] = {0};
    const float* g2[2] = {c, d};
    size_t l2[2] = {1, 1};
    uint64_t n2[2] = {1, 3};
    double loss2[2] = {2.0, 0.0};
    float out1[1] = {0};
    CHECK_STATUS(gradsync_weighted_merge_f32(g2, l2, n2, loss2, 2, out1, 1, &loss, &total), GRADSYNC_OK);
    CHECK(out1[0] == 1.0f && loss == 0.5 && total == 4);
    /* without losses: the gradient and count only */
    CHECK(gradsync_weighted_merge_f32(g2, l2, n2, NULL, 2, out1, 1, NULL, &total) == GRADSYNC_OK && total == 4);
  }

  /* errors: nothing written, never NaN */
  out[0] = out[1] = -1;
  counts[0] = counts[1] = 0;
  CHECK_STATUS_MSG(gradsync_weighted_merge_f32(grads, lens, counts, losses, 2, out, 2, &loss, &total),
                   GRADSYNC_E_ZERO_WEIGHT, "total sample count of 2 workers is 0");
  CHECK(out[0] == -1 && !isnan(out[0]));
  counts[0] = counts[1] = 1;
  lens[1] = 3;
  CHECK_STATUS_MSG(gradsync_weighted_merge_f32(grads, lens, counts, losses, 2, out, 2, &loss, &total),
                   GRADSYNC_E_MISMATCH, "worker 1 gradient has 3 elements, but the output has 2");
  lens[1] = 2;
  CHECK_STATUS_MSG(gradsync_weighted_merge_f32(grads, lens, counts, losses, 0, out, 2, &loss, &total),
                   GRADSYNC_E_INVALID_ARG, "workers must be > 0");
  CHECK_STATUS_MSG(gradsync_weighted_merge_f32(NULL, lens, counts, losses, 2, out, 2, &loss, &total),
                   GRADSYNC_E_INVALID_ARG, "grads array is NULL");
  CHECK_STATUS_MSG(gradsync_weighted_merge_f32(grads, NULL, counts, losses, 2, out, 2, &loss, &total),
                   GRADSYNC_E_INVALID_ARG, "lens array is NULL");
  CHECK_STATUS_MSG(gradsync_weighted_merge_f32(grads, lens, NULL, losses, 2, out, 2, &loss, &total),
                   GRADSYNC_E_INVALID_ARG, "counts array is NULL");
  CHECK_STATUS_MSG(gradsync_weighted_merge_f32(grads, lens, counts, NULL, 2, out, 2, &loss, &total),
                   GRADSYNC_E_INVALID_ARG, "losses is NULL");
  CHECK_STATUS_MSG(gradsync_weighted_merge_f32(grads, lens, counts, losses, 2, NULL, 2, &loss, &total),
                   GRADSYNC_E_INVALID_ARG, "out is NULL");
  counts[0] = UINT64_MAX;
  CHECK_STATUS_MSG(gradsync_weighted_merge_f32(grads, lens, counts, losses, 2, out, 2, &loss, &total),
                   GRADSYNC_E_INVALID_ARG, "overflows");
  counts[0] = 1;
  grads[1] = NULL;
  CHECK_STATUS_MSG(gradsync_weighted_merge_f32(grads, lens, counts, losses, 2, out, 2, &loss, &total),
                   GRADSYNC_E_INVALID_ARG, "worker 1 gradient is NULL");
  CHECK(out[0] == -1 && out[1] == -1);
}

/* f64: exact where f32 rounds (counts near 2^33), counts above 2^53 are not rounded (a naive
   double sum gives 0 for the cancelling pair below), the same checks as f32 on bad input. */
static void test_weighted_merge_f64(void) {
  const uint64_t big = (uint64_t)1 << 33, huge = (uint64_t)1 << 60;
  const double two[1] = {2.0}, three[1] = {3.0}, plus[1] = {1.0}, minus[1] = {-1.0};
  const double* g[2] = {two, three};
  const float twof[1] = {2.0f}, threef[1] = {3.0f};
  const float* gf[2] = {twof, threef};
  size_t lens[2] = {1, 1};
  uint64_t counts[2] = {big, 1}, total = 0;
  double out[1] = {0}, exact = 2.0 + 1.0 / (double)(big + 1);
  float outf[1] = {0};

  CHECK_STATUS(gradsync_weighted_merge_f64(g, lens, counts, NULL, 2, out, 1, NULL, &total), GRADSYNC_OK);
  CHECK(fabs(out[0] - exact) <= 1e-12 * exact && out[0] != 2.0 && total == big + 1);
  CHECK_STATUS(gradsync_weighted_merge_f32(gf, lens, counts, NULL, 2, outf, 1, NULL, &total), GRADSYNC_OK);
  CHECK(outf[0] == 2.0f); /* what f64 is for */

  /* (2^60 + 1)·1 + 2^60·(-1) = 1 exactly; over 2^61 + 1 */
  g[0] = plus, g[1] = minus;
  counts[0] = huge + 1, counts[1] = huge;
  CHECK_STATUS(gradsync_weighted_merge_f64(g, lens, counts, NULL, 2, out, 1, NULL, &total), GRADSYNC_OK);
  exact = 1.0 / 2305843009213693952.0 * (1.0 - 1.0 / 2305843009213693952.0); /* 1/(2^61+1) to ~1e-37 */
  CHECK(fabs(out[0] - exact) <= 1e-12 * exact && total == 2 * huge + 1);

  counts[0] = counts[1] = 0;
  out[0] = -1;
  CHECK_STATUS_MSG(gradsync_weighted_merge_f64(g, lens, counts, NULL, 2, out, 1, NULL, &total), GRADSYNC_E_ZERO_WEIGHT,
                   "total sample count of 2 workers is 0");
  counts[0] = counts[1] = 1;
  lens[1] = 2;
  CHECK_STATUS_MSG(gradsync_weighted_merge_f64(g, lens, counts, NULL, 2, out, 1, NULL, &total), GRADSYNC_E_MISMATCH,
                   "worker 1 gradient has 2 elements, but the output has 1");
  CHECK_STATUS_MSG(gradsync_weighted_merge_f64(NULL, lens, counts, NULL, 2, out, 1, NULL, &total),
                   GRADSYNC_E_INVALID_ARG, "grads array is NULL");
  CHECK(out[0] == -1);
}

int main(void) {
  test_partition();
  test_round_robin();
  test_weighted_merge();
  test_weighted_merge_f64();
  return check_report("dataparallel C API");
}
