// SPDX-License-Identifier: Apache-2.0
#include "dataparallel/dataparallel.hpp"

#include <algorithm>
#include <array>

#include "common/error.hpp"

namespace gradsync::dataparallel {

void round_robin_fill(uint64_t samples, uint64_t workers, uint64_t worker, uint64_t* out) noexcept {
  const uint64_t count = round_robin_count(samples, workers, worker);
  for (uint64_t i = 0; i < count; ++i) out[i] = worker + i * workers;
}

MergeResult weighted_merge(std::span<const float* const> grads, std::span<const size_t> lens,
                           std::span<const uint64_t> counts, const double* losses, float* out, size_t out_len) {
  const size_t workers = grads.size();
  GS_REQUIRE(workers > 0, GRADSYNC_E_INVALID_ARG, "no workers to merge");
  GS_REQUIRE(out != nullptr || out_len == 0, GRADSYNC_E_INVALID_ARG, "out is NULL for {} elements", out_len);
  uint64_t total = 0;
  for (size_t i = 0; i < workers; ++i) {
    GS_REQUIRE(lens[i] == out_len, GRADSYNC_E_MISMATCH,
               "worker {} gradient has {} elements, but the output has {}", i, lens[i], out_len);
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

  // Chunks small enough for L1 keep the double accumulator hot while each worker's slice streams
  // through; every chunk is read from all workers before it is written, so out may alias a gradient.
  constexpr size_t kChunk = 1024;
  std::array<double, kChunk> acc;
  for (size_t begin = 0; begin < out_len; begin += kChunk) {
    const size_t len = std::min(kChunk, out_len - begin);
    std::fill_n(acc.begin(), len, 0.0);
    for (size_t i = 0; i < workers; ++i) {
      if (counts[i] == 0) continue;
      const double w = static_cast<double>(counts[i]);
      const float* g = grads[i] + begin;
      for (size_t j = 0; j < len; ++j) acc[j] += w * static_cast<double>(g[j]);
    }
    for (size_t j = 0; j < len; ++j) out[begin + j] = static_cast<float>(acc[j] / total_weight);
  }
  return MergeResult{losses != nullptr ? loss_sum / total_weight : 0.0, total};
}

}  // namespace gradsync::dataparallel
