// SPDX-License-Identifier: Apache-2.0
#pragma once
// The library's hashes. FNV-1a 64: of bytes (file header checksums, call signatures, configuration
// words that ranks compare). mix64: of one word (keys made of numbers, row ids). Not cryptographic: it tells honest
// disagreement apart, and a hostile peer or file can at worst make a check pass that the data's own bounds checks still
// guard.
#include <cstddef>
#include <cstdint>

namespace gradsync {

inline constexpr uint64_t kFnvBasis = 0xcbf29ce484222325ull;

// Continues hash h over n bytes at data (start with kFnvBasis).
inline uint64_t fnv1a64(const void* data, size_t n, uint64_t h = kFnvBasis) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

// splitmix64's finaliser: a bijection of 64-bit words (0 maps to 0) whose every output bit depends
// on every input bit.
inline constexpr uint64_t mix64(uint64_t x) noexcept {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace gradsync
