// SPDX-License-Identifier: Apache-2.0
#include "codec/codec.hpp"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "common/error.hpp"

namespace gradsync::codec {
namespace {

inline uint32_t bits_of(float f) noexcept {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float float_of(uint32_t u) noexcept {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// ---- element conversions, written branch-free so the loops below vectorise ----

[[gnu::always_inline]] inline uint16_t bigdl_encode(uint32_t x) noexcept {
  uint32_t h = x >> 16;
  // Truncating a NaN whose payload is only in the low half would give Inf: set the quiet bit.
  const bool nan = (x & 0x7fffffffu) > 0x7f800000u;
  h |= (nan & ((h & 0x7fu) == 0)) ? 0x40u : 0u;
  return static_cast<uint16_t>((h >> 8) | (h << 8));  // big-endian, as BigDL writes it
}
[[gnu::always_inline]] inline uint32_t bigdl_decode(uint16_t h) noexcept {
  const uint32_t v = static_cast<uint32_t>((h >> 8) | (h << 8)) & 0xffffu;
  return v << 16;
}
[[gnu::always_inline]] inline uint16_t bf16_encode(uint32_t x) noexcept {
  const bool nan = (x & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(nan ? ((x >> 16) | 0x40u) : rounded);
}
[[gnu::always_inline]] inline uint32_t bf16_decode(uint16_t h) noexcept { return static_cast<uint32_t>(h) << 16; }

template <class Enc>
[[gnu::always_inline]] inline void encode_loop(const float* __restrict src, size_t n, uint16_t* __restrict dst,
                                               Enc enc) noexcept {
  for (size_t i = 0; i < n; ++i) dst[i] = enc(bits_of(src[i]));
}
template <class Dec>
[[gnu::always_inline]] inline void decode_loop(const uint16_t* __restrict src, size_t n, float* __restrict dst,
                                               Dec dec) noexcept {
  for (size_t i = 0; i < n; ++i) dst[i] = float_of(dec(src[i]));
}

// AVX2 encoders written out: the compiler's own vectorisation of the element functions above
// needs about twice the instructions, which shows when the core is shared. The scalar element
// functions finish the tails, so both paths give the same bits.
__attribute__((target("avx2"))) inline __m256i pack_16(__m256i lo, __m256i hi) noexcept {
  // 32-bit lanes holding values <= 0xffff -> 16 uint16 in order.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
}

__attribute__((target("avx2"))) inline __m256i bf16_rne_8(__m256i x) noexcept {
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb);
  // Unordered compare of x with itself: all ones exactly for NaN (one instruction, no exception).
  const __m256 f = _mm256_castsi256_ps(x);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_or_si256(x, _mm256_set1_epi32(0x00400000));
  return _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
}

__attribute__((target("avx2"))) inline __m256i bigdl_trunc_8(__m256i x) noexcept {
  // A NaN that truncation would turn into Inf: exponent all ones, bits 16-22 zero, low half non-zero.
  const __m256i inf_high =
      _mm256_cmpeq_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fff0000)), _mm256_set1_epi32(0x7f800000));
  const __m256i low_zero = _mm256_cmpeq_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0xffff)), _mm256_setzero_si256());
  const __m256i fix = _mm256_and_si256(_mm256_andnot_si256(low_zero, inf_high), _mm256_set1_epi32(0x40));
  return _mm256_or_si256(_mm256_srli_epi32(x, 16), fix);
}

__attribute__((target("avx2"))) void encode_bf16_avx2(const float* s, size_t n, uint16_t* d) noexcept {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i a = bf16_rne_8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
    const __m256i b = bf16_rne_8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), pack_16(a, b));
  }
  for (; i < n; ++i) d[i] = bf16_encode(bits_of(s[i]));
}

__attribute__((target("avx2"))) void encode_bigdl_avx2(const float* s, size_t n, uint16_t* d) noexcept {
  // Big-endian: swap the two bytes of every 16-bit lane.
  const __m256i swap = _mm256_setr_epi8(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14, 1, 0, 3, 2, 5, 4, 7, 6, 9,
                                        8, 11, 10, 13, 12, 15, 14);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i a = bigdl_trunc_8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
    const __m256i b = bigdl_trunc_8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm256_shuffle_epi8(pack_16(a, b), swap));
  }
  for (; i < n; ++i) d[i] = bigdl_encode(bits_of(s[i]));
}
void encode_bigdl_base(const float* s, size_t n, uint16_t* d) noexcept { encode_loop(s, n, d, bigdl_encode); }
__attribute__((target("avx2"))) void decode_bigdl_avx2(const uint16_t* s, size_t n, float* d) noexcept {
  decode_loop(s, n, d, bigdl_decode);
}
void decode_bigdl_base(const uint16_t* s, size_t n, float* d) noexcept { decode_loop(s, n, d, bigdl_decode); }
void encode_bf16_base(const float* s, size_t n, uint16_t* d) noexcept { encode_loop(s, n, d, bf16_encode); }
__attribute__((target("avx2"))) void decode_bf16_avx2(const uint16_t* s, size_t n, float* d) noexcept {
  decode_loop(s, n, d, bf16_decode);
}
void decode_bf16_base(const uint16_t* s, size_t n, float* d) noexcept { decode_loop(s, n, d, bf16_decode); }

// AVX-512 paths (16 lanes, narrowing stores; bf16 rounding by the AVX512-BF16 instruction). They
// give the same bits as the scalar definitions: vcvtneps2bf16 rounds to nearest even and quiets
// NaN exactly as bf16_encode does, but reads denormal inputs as zero, so a block holding a
// denormal takes the integer path instead.
#define GS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -Wmaybe-uninitialized
// reports wrongly (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

GS_AVX512 void encode_bf16_avx512(const float* s, size_t n, uint16_t* d) noexcept {
  const __m512i exponent = _mm512_set1_epi32(0x7f800000), magnitude = _mm512_set1_epi32(0x7fffffff);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(s + i);
    const __m512i bits = _mm512_castps_si512(x);
    const __mmask16 denormal = _mm512_testn_epi32_mask(bits, exponent) & _mm512_test_epi32_mask(bits, magnitude);
    if (denormal == 0) {
      const __m256bh h = _mm512_cvtneps_pbh(x);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), reinterpret_cast<const __m256i&>(h));
    } else {
      for (size_t k = i; k < i + 16; ++k) d[k] = bf16_encode(bits_of(s[k]));
    }
  }
  for (; i < n; ++i) d[i] = bf16_encode(bits_of(s[i]));
}

GS_AVX512 void encode_bigdl_avx512(const float* s, size_t n, uint16_t* d) noexcept {
  const __m256i swap = _mm256_setr_epi8(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14, 1, 0, 3, 2, 5, 4, 7, 6, 9,
                                        8, 11, 10, 13, 12, 15, 14);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i x = _mm512_loadu_si512(s + i);
    // Truncation turns a NaN into Inf when bits 16-22 are zero and the low half is not: set the quiet bit.
    const __mmask16 inf_high =
        _mm512_cmpeq_epi32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fff0000)), _mm512_set1_epi32(0x7f800000));
    const __mmask16 fix = inf_high & _mm512_test_epi32_mask(x, _mm512_set1_epi32(0xffff));
    const __m512i h =
        _mm512_mask_or_epi32(_mm512_srli_epi32(x, 16), fix, _mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm256_shuffle_epi8(_mm512_cvtepi32_epi16(h), swap));
  }
  for (; i < n; ++i) d[i] = bigdl_encode(bits_of(s[i]));
}

GS_AVX512 void decode_bf16_avx512(const uint16_t* s, size_t n, float* d) noexcept {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
    _mm512_storeu_si512(d + i, _mm512_slli_epi32(wide, 16));
  }
  for (; i < n; ++i) d[i] = float_of(bf16_decode(s[i]));
}

GS_AVX512 void decode_bigdl_avx512(const uint16_t* s, size_t n, float* d) noexcept {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
    // wide lane = 0x0000HHLL as stored (LL = first byte = high byte of the bf16): swap and shift.
    const __m512i swapped = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(wide, _mm512_set1_epi32(0xff)), 24),
                                            _mm512_slli_epi32(_mm512_srli_epi32(wide, 8), 16));
    _mm512_storeu_si512(d + i, swapped);
  }
  for (; i < n; ++i) d[i] = float_of(bigdl_decode(s[i]));
}

#pragma GCC diagnostic pop

__attribute__((target("avx,f16c"))) void encode_fp16_f16c(const float* s, size_t n, uint16_t* d) noexcept {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), h);
  }
  for (; i < n; ++i) d[i] = float_to_half_scalar(s[i]);
}
__attribute__((target("avx,f16c"))) void decode_fp16_f16c(const uint16_t* s, size_t n, float* d) noexcept {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  }
  for (; i < n; ++i) d[i] = half_to_float_scalar(s[i]);
}
void encode_fp16_base(const float* s, size_t n, uint16_t* d) noexcept {
  for (size_t i = 0; i < n; ++i) d[i] = float_to_half_scalar(s[i]);
}
void decode_fp16_base(const uint16_t* s, size_t n, float* d) noexcept {
  for (size_t i = 0; i < n; ++i) d[i] = half_to_float_scalar(s[i]);
}

using EncodeFn = void (*)(const float*, size_t, uint16_t*) noexcept;
using DecodeFn = void (*)(const uint16_t*, size_t, float*) noexcept;

struct Kernels {
  EncodeFn encode[4] = {};
  DecodeFn decode[4] = {};
  bool available = false;
};

struct Cpu {
  bool avx2, avx512, f16c;
};

const Cpu& cpu() noexcept {
  static const Cpu c = [] {
    __builtin_cpu_init();
    return Cpu{__builtin_cpu_supports("avx2") != 0,
               __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16"),
               __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx")};
  }();
  return c;
}

// The kernels of one instruction-set path (IEEE half uses F16C on the vector paths).
Kernels make_kernels(Path path) noexcept {
  const Cpu& c = cpu();
  Kernels out;
  switch (path) {
    case Path::Portable:
      out = {{nullptr, encode_bigdl_base, encode_bf16_base, encode_fp16_base},
             {nullptr, decode_bigdl_base, decode_bf16_base, decode_fp16_base},
             true};
      break;
    case Path::Avx2:
      out = {{nullptr, encode_bigdl_avx2, encode_bf16_avx2, encode_fp16_f16c},
             {nullptr, decode_bigdl_avx2, decode_bf16_avx2, decode_fp16_f16c},
             c.avx2 && c.f16c};
      break;
    case Path::Avx512:
      out = {{nullptr, encode_bigdl_avx512, encode_bf16_avx512, encode_fp16_f16c},
             {nullptr, decode_bigdl_avx512, decode_bf16_avx512, decode_fp16_f16c},
             c.avx512 && c.f16c};
      break;
  }
  return out;
}

// The fastest path of this machine, per codec.
const Kernels& kernels() noexcept {
  static const Kernels k = [] {
    const Cpu& c = cpu();
    Kernels out = make_kernels(Path::Portable);
    const int b = static_cast<int>(Codec::BigdlFp16), f = static_cast<int>(Codec::Bf16),
              h = static_cast<int>(Codec::Fp16);
    const Kernels best = make_kernels(c.avx512 ? Path::Avx512 : Path::Avx2);
    if (c.avx512 || c.avx2) {
      for (int i : {b, f}) {
        out.encode[i] = best.encode[i];
        out.decode[i] = best.decode[i];
      }
    }
    if (c.f16c) {
      out.encode[h] = encode_fp16_f16c;
      out.decode[h] = decode_fp16_f16c;
    }
    return out;
  }();
  return k;
}

// Compound operations decode a block at a time into L1-resident scratch, so each byte of the
// caller's buffers is still read once and written once.
constexpr size_t kBlock = 1024;

}  // namespace

uint16_t float_to_half_scalar(float f) noexcept {
  // Round to nearest even, the same bits as F16C's vcvtps2ph with imm 0 (NaN payload kept, quieted).
  uint32_t x = bits_of(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) {
    if (x > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (x >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65536: Inf
  if (x < 0x38800000u) {
    // Subnormal or zero: adding a magic float aligns the 10 kept bits at the bottom, and the FPU
    // rounds to nearest even for us.
    const float magic = float_of(((127 - 15) + (23 - 10) + 1) << 23);
    const uint32_t r = bits_of(float_of(x) + magic) - bits_of(magic);
    return static_cast<uint16_t>(sign | r);
  }
  const uint32_t odd = (x >> 13) & 1u;
  x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + odd;  // rebias and round; may carry into Inf
  return static_cast<uint16_t>(sign | (x >> 13));
}

float half_to_float_scalar(uint16_t h) noexcept {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1f) return float_of(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return float_of(sign | ((exp + 112) << 23) | (mant << 13));
  // Subnormal half: exact as mant * 2^-24.
  const float magnitude = static_cast<float>(mant) * float_of(0x33800000u);
  return float_of(sign | bits_of(magnitude));
}

const char* codec_name(Codec c) noexcept {
  switch (c) {
    case Codec::None: return "none";
    case Codec::BigdlFp16: return "bigdl_fp16";
    case Codec::Bf16: return "bf16";
    case Codec::Fp16: return "fp16";
  }
  return "unknown codec";
}

Codec to_codec(int32_t value, bool allow_none) {
  GS_REQUIRE(value >= GRADSYNC_CODEC_NONE && value <= GRADSYNC_CODEC_FP16, GRADSYNC_E_INVALID_ARG,
             "unknown codec {} (expected 1 bigdl_fp16, 2 bf16 or 3 fp16{})", value, allow_none ? ", or 0 none" : "");
  GS_REQUIRE(allow_none || value != GRADSYNC_CODEC_NONE, GRADSYNC_E_INVALID_ARG,
             "codec 0 (none) has no 16-bit encoding; use 1 bigdl_fp16, 2 bf16 or 3 fp16");
  return static_cast<Codec>(value);
}

bool fp16_uses_f16c() noexcept { return cpu().f16c; }

bool path_available(Path path) noexcept { return make_kernels(path).available; }

void encode_via(Path path, Codec c, const float* src, size_t n, uint16_t* dst) noexcept {
  make_kernels(path).encode[static_cast<int>(c)](src, n, dst);
}

void decode_via(Path path, Codec c, const uint16_t* src, size_t n, float* dst) noexcept {
  make_kernels(path).decode[static_cast<int>(c)](src, n, dst);
}

void encode(Codec c, const float* src, size_t n, uint16_t* dst) noexcept {
  kernels().encode[static_cast<int>(c)](src, n, dst);
}

void decode(Codec c, const uint16_t* src, size_t n, float* dst) noexcept {
  kernels().decode[static_cast<int>(c)](src, n, dst);
}

void accumulate(Codec c, const uint16_t* src, size_t n, float* dst) noexcept {
  const DecodeFn dec = kernels().decode[static_cast<int>(c)];
  alignas(64) float tmp[kBlock];
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t m = std::min(kBlock, n - b);
    dec(src + b, m, tmp);
    float* __restrict out = dst + b;
    for (size_t i = 0; i < m; ++i) out[i] += tmp[i];
  }
}

void accumulate_scaled(Codec c, const uint16_t* src, size_t n, float scale, float* dst) noexcept {
  const DecodeFn dec = kernels().decode[static_cast<int>(c)];
  alignas(64) float tmp[kBlock];
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t m = std::min(kBlock, n - b);
    dec(src + b, m, tmp);
    float* __restrict out = dst + b;
    for (size_t i = 0; i < m; ++i) {
      const float product = scale * tmp[i];
      out[i] += product;
    }
  }
}

void add_encoded(Codec c, uint16_t* dst, const uint16_t* src, size_t n) noexcept {
  const Kernels& k = kernels();
  const DecodeFn dec = k.decode[static_cast<int>(c)];
  const EncodeFn enc = k.encode[static_cast<int>(c)];
  alignas(64) float a[kBlock];
  alignas(64) float b2[kBlock];
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t m = std::min(kBlock, n - b);
    dec(dst + b, m, a);
    dec(src + b, m, b2);
    for (size_t i = 0; i < m; ++i) a[i] += b2[i];
    enc(a, m, dst + b);
  }
}

void encode_with_feedback(Codec c, const float* src, size_t n, float* residual, uint16_t* dst) noexcept {
  const Kernels& k = kernels();
  const DecodeFn dec = k.decode[static_cast<int>(c)];
  const EncodeFn enc = k.encode[static_cast<int>(c)];
  alignas(64) float corrected[kBlock];
  alignas(64) float sent[kBlock];
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t m = std::min(kBlock, n - b);
    float* __restrict res = residual + b;
    const float* __restrict in = src + b;
    for (size_t i = 0; i < m; ++i) corrected[i] = in[i] + res[i];
    enc(corrected, m, dst + b);
    dec(dst + b, m, sent);
    // A non-finite gradient must not poison every later step through its residual.
    for (size_t i = 0; i < m; ++i) {
      const float lost = corrected[i] - sent[i];
      res[i] = (bits_of(lost) & 0x7f800000u) == 0x7f800000u ? 0.0f : lost;
    }
  }
}

}  // namespace gradsync::codec
