// SPDX-License-Identifier: Apache-2.0
/* The codecs through the C ABI: BigDL's acceptance values, compressed add into a slice, bounds. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "gradsync/gradsync.h"

int main(void) {
  const float in[7] = {1.111111f, 2.111111f, 3.111111f, 4.111111f, 5.111111f, -4.111111f, 0.1f};
  const float expected[7] = {1.109375f, 2.109375f, 3.109375f, 4.09375f, 5.09375f, -4.09375f, 0.099609375f};
  const float a[5] = {1, 2, 3, 4, 5}, b[5] = {2, 3, 4, 5, 6};
  uint16_t enc[7], ea[5], eb[5];
  float out[7];
  float acc[5] = {0, 0, 0, 0, 0};
  int i, codec;

  /* BigDL's values, bit-exact */
  CHECK_STATUS(gradsync_codec_encode(GRADSYNC_CODEC_BIGDL_FP16, in, 7, enc, 7), GRADSYNC_OK);
  CHECK_STATUS(gradsync_codec_decode(GRADSYNC_CODEC_BIGDL_FP16, enc, 7, 0, out, 7), GRADSYNC_OK);
  for (i = 0; i < 7; ++i) CHECK(out[i] == expected[i]);

  for (codec = GRADSYNC_CODEC_BIGDL_FP16; codec <= GRADSYNC_CODEC_FP16; ++codec) {
    /* integers round-trip; [1..5] + [2..6] -> [3,5,7,9,11]; slice (1, 2) -> [1,5,7,4,5] */
    CHECK_STATUS(gradsync_codec_encode(codec, a, 5, ea, 5), GRADSYNC_OK);
    CHECK_STATUS(gradsync_codec_encode(codec, b, 5, eb, 5), GRADSYNC_OK);
    CHECK_STATUS(gradsync_codec_decode(codec, ea, 5, 0, out, 5), GRADSYNC_OK);
    CHECK(memcmp(out, a, sizeof a) == 0);
    {
      uint16_t whole[5], slice[5];
      const float sum[5] = {3, 5, 7, 9, 11}, sliced[5] = {1, 5, 7, 4, 5};
      memcpy(whole, ea, sizeof whole);
      memcpy(slice, ea, sizeof slice);
      CHECK_STATUS(gradsync_codec_add(codec, whole, 5, 0, eb, 5), GRADSYNC_OK);
      CHECK_STATUS(gradsync_codec_decode(codec, whole, 5, 0, out, 5), GRADSYNC_OK);
      CHECK(memcmp(out, sum, sizeof sum) == 0);
      CHECK_STATUS(gradsync_codec_add(codec, slice, 5, 1, eb + 1, 2), GRADSYNC_OK);
      CHECK_STATUS(gradsync_codec_decode(codec, slice, 5, 0, out, 5), GRADSYNC_OK);
      CHECK(memcmp(out, sliced, sizeof sliced) == 0);
    }
    /* decoding a sub-range */
    CHECK_STATUS(gradsync_codec_decode(codec, eb, 5, 3, out, 2), GRADSYNC_OK);
    CHECK(out[0] == 5.0f && out[1] == 6.0f);
  }

  /* accumulate into floats (eb holds the last codec of the loop, FP16) */
  CHECK_STATUS(gradsync_codec_accumulate(GRADSYNC_CODEC_FP16, acc, 5, 2, eb, 3), GRADSYNC_OK);
  CHECK(acc[0] == 0 && acc[1] == 0 && acc[2] == 2 && acc[3] == 3 && acc[4] == 4);

  /* NaN and Inf survive */
  {
    const float specials[2] = {INFINITY, NAN};
    CHECK_STATUS(gradsync_codec_encode(GRADSYNC_CODEC_FP16, specials, 2, enc, 2), GRADSYNC_OK);
    CHECK_STATUS(gradsync_codec_decode(GRADSYNC_CODEC_FP16, enc, 2, 0, out, 2), GRADSYNC_OK);
    CHECK(isinf(out[0]) && isnan(out[1]));
  }

  /* bad input: past the end, small destination, unknown codec, NULL buffers */
  CHECK_STATUS(gradsync_codec_decode(GRADSYNC_CODEC_BF16, ea, 5, 4, out, 2), GRADSYNC_E_INVALID_ARG);
  CHECK_MESSAGE("elements [4, 6) run past the end of the 5-element");
  CHECK_STATUS(gradsync_codec_decode(GRADSYNC_CODEC_BF16, ea, 5, 6, out, 0), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_codec_decode(GRADSYNC_CODEC_BF16, ea, 5, (size_t)-1, out, 2), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_codec_add(GRADSYNC_CODEC_BF16, ea, 5, 4, eb, 2), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_codec_accumulate(GRADSYNC_CODEC_BF16, acc, 5, 5, eb, 1), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_codec_encode(GRADSYNC_CODEC_BF16, a, 5, enc, 4), GRADSYNC_E_BUFS);
  CHECK_MESSAGE("capacity is 4");
  CHECK_STATUS(gradsync_codec_encode(7, a, 5, enc, 5), GRADSYNC_E_INVALID_ARG);
  CHECK_MESSAGE("unknown codec 7");
  CHECK_STATUS(gradsync_codec_encode(GRADSYNC_CODEC_NONE, a, 5, enc, 5), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_codec_encode(GRADSYNC_CODEC_BF16, NULL, 5, enc, 5), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_codec_decode(GRADSYNC_CODEC_BF16, NULL, 5, 0, out, 1), GRADSYNC_E_INVALID_ARG);
  CHECK_STATUS(gradsync_codec_encode(GRADSYNC_CODEC_BF16, a, (size_t)-1, enc, (size_t)-1), GRADSYNC_E_INVALID_ARG);
  CHECK_MESSAGE("too large");
  /* zero elements is fine, even with NULL buffers */
  CHECK_STATUS(gradsync_codec_encode(GRADSYNC_CODEC_BF16, NULL, 0, NULL, 0), GRADSYNC_OK);

  return check_report("codec C API");
}
