/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file codec.h
 * @brief 16-bit codecs for gradients on the wire: array in, array out, vectorised.
 *
 * Each codec stores one 16-bit element per float (the encoded buffer is `count` elements of
 * 2 bytes; sizes and offsets below count elements, not bytes).
 * - GRADSYNC_CODEC_BIGDL_FP16: what Intel BigDL calls "FP16" (FP16CompressedTensor): bfloat16 by
 *   truncation, stored big-endian. Bit-exact to BigDL, so its buffers can be read and written.
 *   1.111111 encodes to 1.109375, 0.1 to 0.099609375; integers up to 256 round-trip exactly.
 * - GRADSYNC_CODEC_BF16: bfloat16 rounded to nearest even, native byte order.
 * - GRADSYNC_CODEC_FP16: IEEE binary16 rounded to nearest even (F16C instructions when the CPU
 *   has them, otherwise a scalar path giving the same bits); magnitudes of 65520 and above
 *   become Inf.
 * In every codec NaN stays NaN and ±Inf stays ±Inf. Buffers are caller-owned and borrowed for the
 * duration of the call only.
 */
#ifndef GRADSYNC_CODEC_H
#define GRADSYNC_CODEC_H

#include <stddef.h>
#include <stdint.h>
#include "gradsync/export.h"

GRADSYNC_BEGIN_DECL

/** Codecs (int32_t values; also the `compress` field of gradsync_shard_options). */
typedef enum gradsync_codec {
  GRADSYNC_CODEC_NONE = 0,       /**< no compression (accepted by the sharded parameter only) */
  GRADSYNC_CODEC_BIGDL_FP16 = 1, /**< BigDL's "FP16": bfloat16 by truncation, big-endian */
  GRADSYNC_CODEC_BF16 = 2,       /**< bfloat16, round to nearest even */
  GRADSYNC_CODEC_FP16 = 3        /**< IEEE half, round to nearest even */
} gradsync_codec;

/**
 * @brief Encode count floats: dst[i] = encode(src[i]).
 * @param[in] codec a 16-bit codec (not GRADSYNC_CODEC_NONE)
 * @param[in] src count floats
 * @param count floats in src
 * @param[out] dst room for dst_capacity encoded elements (2 bytes each)
 * @param dst_capacity elements dst can hold (at least count)
 * @retval GRADSYNC_E_INVALID_ARG unknown codec, NULL buffer for count > 0
 * @retval GRADSYNC_E_BUFS dst_capacity < count (nothing written)
 * @threadsafety any
 */
GRADSYNC_API int gradsync_codec_encode(int32_t codec, const float* src, size_t count, void* dst, size_t dst_capacity);

/**
 * @brief Decode elements [offset, offset + count) of an encoded buffer of src_count elements.
 * @param codec a 16-bit codec
 * @param[in] src src_count encoded elements
 * @param src_count encoded elements in src
 * @param offset the first element to decode
 * @param[out] dst count floats
 * @param count elements to decode
 * @retval GRADSYNC_E_INVALID_ARG unknown codec, NULL buffer, or the range runs past the end of src
 *         (nothing written)
 * @threadsafety any
 */
GRADSYNC_API int gradsync_codec_decode(int32_t codec, const void* src, size_t src_count, size_t offset, float* dst,
                                       size_t count);

/**
 * @brief BigDL's compressed add: dst[offset + i] = encode(decode(dst[offset + i]) + decode(src[i]))
 *        for i < count, summed in f32 and rounded once (for BIGDL_FP16 bit-exact to BigDL's
 *        FP16CompressedTensor.add(data, offset, length)).
 * @param codec a 16-bit codec
 * @param[in,out] dst dst_count encoded elements
 * @param dst_count encoded elements in dst
 * @param offset the first element of dst to add to
 * @param[in] src count encoded elements (may not overlap dst)
 * @param count elements of src
 * @retval GRADSYNC_E_INVALID_ARG unknown codec, NULL buffer, or [offset, offset + count) runs past
 *         the end of dst (nothing written)
 * @threadsafety any
 */
GRADSYNC_API int gradsync_codec_add(int32_t codec, void* dst, size_t dst_count, size_t offset, const void* src,
                                    size_t count);

/**
 * @brief Accumulate encoded data into floats: dst[offset + i] += decode(src[i]) in f32, for i < count.
 *        Summing many encoded gradients this way rounds each sum once in f32, never to 16 bits.
 * @param codec a 16-bit codec
 * @param[in,out] dst dst_count floats
 * @param dst_count floats in dst
 * @param offset the first element of dst to add to
 * @param[in] src count encoded elements
 * @param count elements of src
 * @retval GRADSYNC_E_INVALID_ARG unknown codec, NULL buffer, or the range runs past the end of dst
 * @threadsafety any
 */
GRADSYNC_API int gradsync_codec_accumulate(int32_t codec, float* dst, size_t dst_count, size_t offset, const void* src,
                                           size_t count);

GRADSYNC_END_DECL

#endif /* GRADSYNC_CODEC_H */
