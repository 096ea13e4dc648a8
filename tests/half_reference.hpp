// SPDX-License-Identifier: Apache-2.0
#pragma once
// Half-precision conversions written independently of the library's codecs, as the reference of
// the tests: f16 by the compiler's IEEE binary16 type, bf16 by hand (round to nearest even on the
// upper 16 bits of the f32; a NaN stays a quiet NaN).
#include <cstdint>
#include <cstring>

namespace half_reference {

inline uint16_t to_f16(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

inline float from_f16(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

inline uint16_t to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float from_bf16(uint16_t bits) {
  const uint32_t x = uint32_t{bits} << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

}  // namespace half_reference
