// SPDX-License-Identifier: Apache-2.0
// C shims of the data-parallel helpers (include/gradsync/dataparallel.h).
#include <limits>
#include <span>

#include "capi/guard.hpp"
#include "common/partition.hpp"
#include "dataparallel/dataparallel.hpp"
#include "gradsync/dataparallel.h"

using gradsync::capi::guard;

namespace {

template <typename T>
void merge(const T* const* grads, const size_t* lens, const uint64_t* counts, const double* losses, size_t workers,
           T* out, size_t out_len, double* mean_loss, uint64_t* total_count) {
  GS_REQUIRE(workers > 0, GRADSYNC_E_INVALID_ARG, "workers must be > 0");
  GS_REQUIRE(grads != nullptr, GRADSYNC_E_INVALID_ARG, "grads array is NULL");
  GS_REQUIRE(lens != nullptr, GRADSYNC_E_INVALID_ARG, "lens array is NULL");
  GS_REQUIRE(counts != nullptr, GRADSYNC_E_INVALID_ARG, "counts array is NULL");
  GS_REQUIRE(mean_loss == nullptr || losses != nullptr, GRADSYNC_E_INVALID_ARG,
             "mean_loss requested but losses is NULL");
  const auto result = gradsync::dataparallel::weighted_merge(std::span(grads, workers), std::span(lens, workers),
                                                             std::span(counts, workers), losses, out, out_len);
  if (mean_loss != nullptr) *mean_loss = result.mean_loss;
  if (total_count != nullptr) *total_count = result.total_count;
}

}  // namespace

extern "C" {

GRADSYNC_API int gradsync_partition(uint64_t n, uint32_t parts, uint32_t index, uint64_t* start, uint64_t* len) {
  return guard(__func__, [&] {
    GS_REQUIRE(start != nullptr && len != nullptr, GRADSYNC_E_INVALID_ARG, "start or len out-parameter is NULL");
    GS_REQUIRE(parts > 0, GRADSYNC_E_INVALID_ARG, "parts must be > 0");
    GS_REQUIRE(index < parts, GRADSYNC_E_OUT_OF_RANGE, "part {} out of range [0, {})", index, parts);
    const gradsync::Part p = gradsync::partition(n, parts, index);
    *start = p.start;
    *len = p.len;
  });
}

GRADSYNC_API int gradsync_split_round_robin(uint64_t samples, uint32_t workers, uint32_t worker, uint64_t* out,
                                            size_t capacity, size_t* needed) {
  return guard(__func__, [&] {
    GS_REQUIRE(needed != nullptr, GRADSYNC_E_INVALID_ARG, "needed out-parameter is NULL");
    GS_REQUIRE(workers > 0, GRADSYNC_E_INVALID_ARG, "workers must be > 0");
    GS_REQUIRE(worker < workers, GRADSYNC_E_OUT_OF_RANGE, "worker {} out of range [0, {})", worker, workers);
    GS_REQUIRE(out != nullptr || capacity == 0, GRADSYNC_E_INVALID_ARG, "out is NULL with capacity {}", capacity);
    const uint64_t count = gradsync::dataparallel::round_robin_count(samples, workers, worker);
    // On a 64-bit size_t this always fits; on 32-bit targets a huge count cannot be reported.
    GS_REQUIRE(count <= std::numeric_limits<size_t>::max(), GRADSYNC_E_INVALID_ARG,
               "worker {} would get {} indices, more than size_t can count", worker, count);
    *needed = static_cast<size_t>(count);
    GS_REQUIRE(capacity >= count, GRADSYNC_E_BUFS, "worker {} gets {} indices but out holds only {}", worker, count,
               capacity);
    gradsync::dataparallel::round_robin_fill(samples, workers, worker, out);
  });
}

GRADSYNC_API int gradsync_weighted_merge_f32(const float* const* grads, const size_t* lens, const uint64_t* counts,
                                             const double* losses, size_t workers, float* out, size_t out_len,
                                             double* mean_loss, uint64_t* total_count) {
  return guard(__func__, [&] { merge(grads, lens, counts, losses, workers, out, out_len, mean_loss, total_count); });
}

GRADSYNC_API int gradsync_weighted_merge_f64(const double* const* grads, const size_t* lens, const uint64_t* counts,
                                             const double* losses, size_t workers, double* out, size_t out_len,
                                             double* mean_loss, uint64_t* total_count) {
  return guard(__func__, [&] { merge(grads, lens, counts, losses, workers, out, out_len, mean_loss, total_count); });
}

}  // extern "C"
