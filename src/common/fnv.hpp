// SPDX-License-Identifier: Apache-2.0
#pragma once
// FNV-1a 64: the library's one hash of bytes (file header checksums, call signatures, configuration
// words that ranks compare). Not cryptographic: it tells honest disagreement apart, and a hostile
// peer or file can at worst make a check pass that the data's own bounds checks still guard.
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

}  // namespace gradsync
