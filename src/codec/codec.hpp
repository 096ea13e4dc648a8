// SPDX-License-Identifier: Apache-2.0
#pragma once
// 16-bit codecs for gradients on the wire. Every codec stores one uint16_t per float.
//
// - BigdlFp16: what BigDL calls "FP16" (FP16CompressedTensor): the high 16 bits of the float
//   (bfloat16 by truncation) stored big-endian, so a buffer read from BigDL decodes bit-exactly.
//   The one deviation: a NaN whose payload lives only in the low 16 bits would truncate to Inf;
//   we set the quiet bit instead, so NaN stays NaN.
// - Bf16: bfloat16 rounded to nearest even, native byte order; NaN becomes a quiet NaN.
// - Fp16: IEEE binary16 rounded to nearest even (F16C when the CPU has it, otherwise a scalar
//   path that gives the same bits); overflow gives Inf, NaN stays NaN.
#include <cstddef>
#include <cstdint>

#include "gradsync/codec.h"

namespace gradsync::codec {

enum class Codec : int32_t {
  None = GRADSYNC_CODEC_NONE,
  BigdlFp16 = GRADSYNC_CODEC_BIGDL_FP16,
  Bf16 = GRADSYNC_CODEC_BF16,
  Fp16 = GRADSYNC_CODEC_FP16,
};

const char* codec_name(Codec c) noexcept;
// Validating conversion from the int32_t that crosses the C ABI (None allowed only if allow_none).
Codec to_codec(int32_t value, bool allow_none);

// dst[i] = encode(src[i]).
void encode(Codec c, const float* src, size_t n, uint16_t* dst) noexcept;
// dst[i] = decode(src[i]).
void decode(Codec c, const uint16_t* src, size_t n, float* dst) noexcept;
// dst[i] += decode(src[i]) in f32 (exact decode, one f32 rounding per add).
void accumulate(Codec c, const uint16_t* src, size_t n, float* dst) noexcept;
// dst[i] += scale * decode(src[i]) in f32 (multiply, then add: no fused multiply-add, so every
// machine gives the same bits).
void accumulate_scaled(Codec c, const uint16_t* src, size_t n, float scale, float* dst) noexcept;
// dst[i] = encode(decode(dst[i]) + decode(src[i])): BigDL's compressed add (for BigdlFp16 this is
// bit-exact to BigDL, which truncates the f32 sum).
void add_encoded(Codec c, uint16_t* dst, const uint16_t* src, size_t n) noexcept;
// Encodes src + residual into dst and leaves in residual what the encoding lost
// (error feedback): residual[i] = (src[i] + residual[i]) - decode(dst[i]).
void encode_with_feedback(Codec c, const float* src, size_t n, float* residual, uint16_t* dst) noexcept;

// Whether the Fp16 codec uses the F16C instructions on this machine.
bool fp16_uses_f16c() noexcept;

// The instruction-set paths, each giving the same bits; encode()/decode() pick the fastest this
// machine has. Tests run every available path through these.
enum class Path : int { Portable = 0, Avx2 = 1, Avx512 = 2 };
bool path_available(Path path) noexcept;
void encode_via(Path path, Codec c, const float* src, size_t n, uint16_t* dst) noexcept;
void decode_via(Path path, Codec c, const uint16_t* src, size_t n, float* dst) noexcept;

// Scalar reference conversions (also used for tails), exposed for tests.
uint16_t float_to_half_scalar(float f) noexcept;
float half_to_float_scalar(uint16_t h) noexcept;

}  // namespace gradsync::codec
