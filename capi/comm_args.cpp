// SPDX-License-Identifier: Apache-2.0
#include "capi/comm_args.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common/error.hpp"

namespace gradsync::capi {

Part part_of(const CommLink& link, size_t total) {
  return partition(total, static_cast<uint64_t>(link.size()), static_cast<uint64_t>(link.rank()));
}

void require_buffer(const void* p, size_t count, DType dtype, const char* what) {
  GS_REQUIRE(count <= std::numeric_limits<size_t>::max() / 8 / dtype_size(dtype), GRADSYNC_E_INVALID_ARG,
             "{} count {} is too large", what, count);
  GS_REQUIRE(p != nullptr || count == 0, GRADSYNC_E_INVALID_ARG, "{} buffer is NULL for count {}", what, count);
}

void require_aligned(const void* p, DType dtype, const char* what) {
  const size_t es = dtype_size(dtype);
  GS_REQUIRE(reinterpret_cast<uintptr_t>(p) % es == 0, GRADSYNC_E_INVALID_ARG,
             "{} buffer {} is not aligned to its {}-byte elements ({})", what, p, es, dtype_name(dtype));
}

void require_disjoint(const void* a, size_t a_count, const char* a_name, const void* b, size_t b_count,
                      const char* b_name, DType dtype, const void* in_place) {
  const size_t es = dtype_size(dtype);
  const size_t a_bytes = a_count * es, b_bytes = b_count * es;
  if (a_bytes == 0 || b_bytes == 0 || a == in_place) return;
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  GS_REQUIRE(pa + a_bytes <= pb || pb + b_bytes <= pa, GRADSYNC_E_INVALID_ARG,
             "{} [{}, +{} bytes) overlaps {} [{}, +{} bytes); in place, {} must be {}", a_name, a, a_bytes, b_name, b,
             b_bytes, a_name, in_place);
}

comm::BufferRef reducible(const void* send, void* recv, size_t count, DType t) {
  require_buffer(send, count, t, "send");
  require_buffer(recv, count, t, "recv");
  require_aligned(send, t, "send");
  require_aligned(recv, t, "recv");
  require_disjoint(send, count, "send", recv, count, "recv", t, recv);
  return {send, recv, count};
}

RankParts rule_parts(const CommLink& link, size_t total) {
  const auto n = static_cast<uint64_t>(link.size());
  RankParts p;
  p.counts.resize(n);
  for (uint64_t r = 0; r < n; ++r) p.counts[r] = partition(total, n, r).len;
  p.total = total;
  p.mine = part_of(link, total);
  return p;
}

RankParts given_parts(const CommLink& link, const size_t* counts) {
  GS_REQUIRE(counts != nullptr, GRADSYNC_E_INVALID_ARG, "counts is NULL");
  const auto n = static_cast<size_t>(link.size());
  RankParts p;
  p.counts.assign(counts, counts + n);
  for (size_t r = 0; r < n; ++r) {
    GS_REQUIRE(p.counts[r] <= SIZE_MAX - p.total, GRADSYNC_E_INVALID_ARG, "the counts' sum overflows at rank {}", r);
    if (r == static_cast<size_t>(link.rank())) p.mine = {p.total, p.counts[r]};
    p.total += p.counts[r];
  }
  return p;
}

void require_exchange_buffers(const void* send, size_t send_extent, const void* recv, size_t recv_extent, DType t) {
  require_buffer(send, send_extent, t, "send");
  require_buffer(recv, recv_extent, t, "recv");
  require_disjoint(send, send_extent, "send", recv, recv_extent, "recv", t, nullptr);
}

std::vector<size_t> given_counts(const CommLink& link, const size_t* counts, const char* what) {
  GS_REQUIRE(counts != nullptr, GRADSYNC_E_INVALID_ARG, "{} is NULL", what);
  return std::vector<size_t>(counts, counts + link.size());
}

size_t extent_of(const std::vector<size_t>& counts, const size_t* given_displs, std::vector<size_t>& displs,
                 const char* what) {
  displs.resize(counts.size());
  size_t end = 0, packed = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    displs[r] = given_displs != nullptr ? given_displs[r] : packed;
    GS_REQUIRE(counts[r] <= SIZE_MAX - displs[r], GRADSYNC_E_INVALID_ARG,
               "{} part {}: displacement {} + count {} overflows", what, r, displs[r], counts[r]);
    if (counts[r] > 0) end = std::max(end, displs[r] + counts[r]);
    if (given_displs == nullptr) packed += counts[r];
  }
  return end;
}

size_t per_rank(const CommLink& link, size_t count, DType t, const char* what) {
  const auto n = static_cast<size_t>(link.size());
  GS_REQUIRE(count <= std::numeric_limits<size_t>::max() / 8 / dtype_size(t) / n, GRADSYNC_E_INVALID_ARG,
             "{} of {} x {} elements is too large", what, n, count);
  return count * n;
}

}  // namespace gradsync::capi
