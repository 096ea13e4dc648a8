// SPDX-License-Identifier: Apache-2.0
#include "dataparallel/dataparallel.hpp"

#include <algorithm>
#include <array>
#include <cmath>

#include "common/error.hpp"

namespace gradsync::dataparallel {

void round_robin_fill(uint64_t samples, uint64_t workers, uint64_t worker, uint64_t* out) noexcept {
  const uint64_t count = round_robin_count(samples, workers, worker);
  for (uint64_t i = 0; i < count; ++i) out[i] = worker + i * workers;
}

namespace {

// The f32 merge's per-element sum: double, in worker order. Counts above 2^53 round in the
// conversion, harmless next to the float result's own rounding.
struct DoubleSum {
  double s = 0.0;
  void add(uint64_t count, double g) noexcept { s += static_cast<double>(count) * g; }
  double divided_by(uint64_t total) const noexcept { return s / static_cast<double>(total); }
};

// The f64 merge's: a compensated dot product (Ogita, Rump and Oishi's Dot2), as if summed in
// twice double precision and rounded once. A count splits into two 32-bit halves, each exact in
// a double, so no count is rounded; each product is split exactly by fma, each sum by TwoSum.
struct CompensatedSum {
  double s = 0.0, c = 0.0;
  void add_product(double a, double b) noexcept {
    const double p = a * b;
    c += std::fma(a, b, -p);
    const double t = s + p, z = t - s;
    c += (s - (t - z)) + (p - z);
    s = t;
  }
  void add(uint64_t count, double g) noexcept {
    if (count >> 32) add_product(static_cast<double>(count >> 32) * 4294967296.0, g);
    add_product(static_cast<double>(count & 0xffffffffu), g);
  }
  double divided_by(uint64_t total) const noexcept {
    // total as a double pair too, so that a total above 2^53 adds no error of its own.
    const double hi = static_cast<double>(total & ~uint64_t{0xffffffffu}),
                 lo = static_cast<double>(total & 0xffffffffu);
    const double th = hi + lo, tl = lo - (th - hi);
    const double q = (s + c) / th;
    return q - q * tl / th;  // first-order correction for the part of total th dropped
  }
};

template <typename T, typename Sum>
MergeResult merge(std::span<const T* const> grads, std::span<const size_t> lens, std::span<const uint64_t> counts,
                  const double* losses, T* out, size_t out_len) {
  const size_t workers = grads.size();
  GS_REQUIRE(workers > 0, GRADSYNC_E_INVALID_ARG, "no workers to merge");
  GS_REQUIRE(out != nullptr || out_len == 0, GRADSYNC_E_INVALID_ARG, "out is NULL for {} elements", out_len);
  uint64_t total = 0;
  for (size_t i = 0; i < workers; ++i) {
    GS_REQUIRE(lens[i] == out_len, GRADSYNC_E_MISMATCH, "worker {} gradient has {} elements, but the output has {}", i,
               lens[i], out_len);
    GS_REQUIRE(grads[i] != nullptr || out_len == 0, GRADSYNC_E_INVALID_ARG, "worker {} gradient is NULL", i);
    GS_REQUIRE(total <= UINT64_MAX - counts[i], GRADSYNC_E_INVALID_ARG,
               "total sample count overflows 64 bits at worker {}", i);
    total += counts[i];
  }
  GS_REQUIRE(total > 0, GRADSYNC_E_ZERO_WEIGHT, "total sample count of {} workers is 0", workers);
  const double total_weight = static_cast<double>(total);

  double loss_sum = 0.0;
  if (losses != nullptr)
    for (size_t i = 0; i < workers; ++i)
      if (counts[i] != 0) loss_sum += static_cast<double>(counts[i]) * losses[i];

  // Chunks small enough for L1 keep the accumulators hot while each worker's slice streams
  // through; every chunk is read from all workers before it is written, so out may alias a gradient.
  constexpr size_t kChunk = 1024;
  std::array<Sum, kChunk> acc;
  for (size_t begin = 0; begin < out_len; begin += kChunk) {
    const size_t len = std::min(kChunk, out_len - begin);
    std::fill_n(acc.begin(), len, Sum{});
    for (size_t i = 0; i < workers; ++i) {
      if (counts[i] == 0) continue;
      const T* g = grads[i] + begin;
      for (size_t j = 0; j < len; ++j) acc[j].add(counts[i], static_cast<double>(g[j]));
    }
    for (size_t j = 0; j < len; ++j) out[begin + j] = static_cast<T>(acc[j].divided_by(total));
  }
  return MergeResult{losses != nullptr ? loss_sum / total_weight : 0.0, total};
}

}  // namespace

MergeResult weighted_merge(std::span<const float* const> grads, std::span<const size_t> lens,
                           std::span<const uint64_t> counts, const double* losses, float* out, size_t out_len) {
  return merge<float, DoubleSum>(grads, lens, counts, losses, out, out_len);
}

MergeResult weighted_merge(std::span<const double* const> grads, std::span<const size_t> lens,
                           std::span<const uint64_t> counts, const double* losses, double* out, size_t out_len) {
  return merge<double, CompensatedSum>(grads, lens, counts, losses, out, out_len);
}

}  // namespace gradsync::dataparallel
