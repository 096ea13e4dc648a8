// SPDX-License-Identifier: Apache-2.0
#pragma once
// Helpers of data-parallel training that need no communication: which samples a worker owns,
// and how per-worker updates merge into one (weighted by each worker's sample count).
#include <cstddef>
#include <cstdint>
#include <span>

#include "common/partition.hpp"

namespace gradsync::dataparallel {

// Number of indices worker `worker` gets from a round-robin deal of `samples` over `workers`:
// worker k gets k, k + workers, k + 2*workers, ... (kizzasi's partition_indices).
// Precondition: workers > 0, worker < workers.
constexpr uint64_t round_robin_count(uint64_t samples, uint64_t workers, uint64_t worker) noexcept {
  return samples > worker ? (samples - worker - 1) / workers + 1 : 0;
}

// Writes round_robin_count(...) indices to out (which must hold that many).
void round_robin_fill(uint64_t samples, uint64_t workers, uint64_t worker, uint64_t* out) noexcept;

struct MergeResult {
  double mean_loss;      // sum w_i loss_i / sum w_i (0 when no losses were given)
  uint64_t total_count;  // sum w_i
};

// out[j] = sum_i w_i g_i[j] / sum_i w_i, accumulated in double in worker order 0, 1, ..., so the
// result is the same bits on every run. Workers with w_i = 0 are skipped entirely (their
// gradient may be garbage, e.g. NaN from an empty batch). out may alias any gradient.
// Throws INVALID_ARG (no workers, NULL gradient, count overflow), MISMATCH (lengths differ from
// out_len), ZERO_WEIGHT (sum w_i == 0). Nothing is written on error.
MergeResult weighted_merge(std::span<const float* const> grads, std::span<const size_t> lens,
                           std::span<const uint64_t> counts, const double* losses, float* out, size_t out_len);

// The same in double, summed as if in twice double precision (a compensated dot product, every
// count split exactly) and rounded once: the error is at most one rounding of the result plus
// (4·workers·2^-53)^2 times the sum of |count_i·g_i|, so within a relative 1e-12 of the exact
// weighted mean unless the terms cancel by more than about 10^18 / workers^2.
MergeResult weighted_merge(std::span<const double* const> grads, std::span<const size_t> lens,
                           std::span<const uint64_t> counts, const double* losses, double* out, size_t out_len);

}  // namespace gradsync::dataparallel
