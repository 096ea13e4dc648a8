// SPDX-License-Identifier: Apache-2.0
#pragma once
// The library's one partition rule (BigDL's): part i of n elements over p parts starts at
// i*(n/p) + min(i, n%p) and holds n/p + (i < n%p) elements. n < p gives empty trailing parts.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

namespace gradsync {

struct Part {
  uint64_t start;
  uint64_t len;
};

// Precondition: parts > 0 and index < parts (callers at the ABI validate).
constexpr Part partition(uint64_t n, uint64_t parts, uint64_t index) noexcept {
  const uint64_t base = n / parts, extra = n % parts;
  return Part{index * base + std::min(index, extra), base + (index < extra ? 1 : 0)};
}

// Parts packed in rank order (the v-collectives' layout): part r holds counts[r] elements after the
// parts before it. Fills out[0, counts.size()) and returns the total.
inline uint64_t pack_parts(std::span<const size_t> counts, Part* out) noexcept {
  uint64_t at = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    out[r] = Part{at, counts[r]};
    at += counts[r];
  }
  return at;
}

}  // namespace gradsync
