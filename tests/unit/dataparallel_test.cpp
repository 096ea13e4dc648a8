// SPDX-License-Identifier: Apache-2.0
// Data-parallel helpers below the C ABI: the round-robin deal and the weighted merge.
#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "common/error.hpp"
#include "common/partition.hpp"
#include "dataparallel/dataparallel.hpp"

using namespace gradsync::dataparallel;

namespace {
struct Workers {
  std::vector<std::vector<float>> grads;
  std::vector<uint64_t> counts;
  std::vector<double> losses;
  std::vector<const float*> ptrs() const {
    std::vector<const float*> p;
    for (auto& g : grads) p.push_back(g.data());
    return p;
  }
  std::vector<size_t> lens() const {
    std::vector<size_t> l;
    for (auto& g : grads) l.push_back(g.size());
    return l;
  }
  MergeResult merge(std::vector<float>& out) const {
    auto p = ptrs();
    auto l = lens();
    return weighted_merge(p, l, counts, losses.empty() ? nullptr : losses.data(), out.data(), out.size());
  }
};
}  // namespace

TEST_CASE("round robin: (10, 3) and edge cases", "[dataparallel]") {
  const std::vector<std::vector<uint64_t>> expected = {{0, 3, 6, 9}, {1, 4, 7}, {2, 5, 8}};
  for (uint64_t k = 0; k < 3; ++k) {
    std::vector<uint64_t> out(round_robin_count(10, 3, k));
    round_robin_fill(10, 3, k, out.data());
    CHECK(out == expected[k]);
  }
  CHECK(round_robin_count(0, 4, 0) == 0);
  CHECK(round_robin_count(2, 5, 1) == 1);
  CHECK(round_robin_count(2, 5, 2) == 0);
  CHECK(round_robin_count(std::numeric_limits<uint64_t>::max(), 1, 0) == std::numeric_limits<uint64_t>::max());
}

TEST_CASE("round robin and partition each cover every sample exactly once", "[dataparallel]") {
  for (uint64_t n : {0u, 1u, 7u, 100u, 1001u})
    for (uint64_t p : {1u, 2u, 3u, 8u, 150u}) {
      std::vector<int> seen_rr(n, 0), seen_part(n, 0);
      uint64_t next_start = 0;
      for (uint64_t k = 0; k < p; ++k) {
        std::vector<uint64_t> idx(round_robin_count(n, p, k));
        round_robin_fill(n, p, k, idx.data());
        for (uint64_t i : idx) seen_rr.at(i)++;
        const auto part = gradsync::partition(n, p, k);
        CHECK(part.start == next_start);
        next_start += part.len;
        for (uint64_t i = part.start; i < part.start + part.len; ++i) seen_part.at(i)++;
      }
      CHECK(next_start == n);
      for (uint64_t i = 0; i < n; ++i) {
        CHECK(seen_rr[i] == 1);
        CHECK(seen_part[i] == 1);
      }
    }
}

TEST_CASE("weighted merge: the issue's examples", "[dataparallel]") {
  Workers a{{{2, 4}, {2, 4}}, {10, 10}, {1.0, 1.0}};
  std::vector<float> out(2);
  auto r = a.merge(out);
  CHECK(out == std::vector<float>{2, 4});
  CHECK(r.mean_loss == 1.0);
  CHECK(r.total_count == 20);

  Workers b{{{4}, {0}}, {1, 3}, {2.0, 0.0}};
  std::vector<float> out1(1);
  r = b.merge(out1);
  CHECK(out1[0] == 1.0f);
  CHECK(r.mean_loss == 0.5);
  CHECK(r.total_count == 4);
}

TEST_CASE("weighted merge: errors write nothing", "[dataparallel]") {
  std::vector<float> out = {-1, -1};
  Workers zero{{{1, 2}, {3, 4}}, {0, 0}, {1, 1}};
  CHECK(status_of([&] { zero.merge(out); }) == GRADSYNC_E_ZERO_WEIGHT);
  Workers ragged{{{1, 2}, {3, 4, 5}}, {1, 1}, {}};
  CHECK(status_of([&] { ragged.merge(out); }) == GRADSYNC_E_MISMATCH);
  Workers overflow{{{1, 2}, {3, 4}}, {std::numeric_limits<uint64_t>::max(), 1}, {}};
  CHECK(status_of([&] { overflow.merge(out); }) == GRADSYNC_E_INVALID_ARG);
  Workers none{};
  CHECK(status_of([&] { none.merge(out); }) == GRADSYNC_E_INVALID_ARG);
  CHECK(out == std::vector<float>{-1, -1});
}

TEST_CASE("weighted merge: a worker with count 0 is skipped, even with NaN", "[dataparallel]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Workers w{{{nan, nan}, {3, 5}}, {0, 2}, {std::nan(""), 4.0}};
  std::vector<float> out(2);
  auto r = w.merge(out);
  CHECK(out == std::vector<float>{3, 5});
  CHECK(r.mean_loss == 4.0);
  CHECK(r.total_count == 2);
}

TEST_CASE("weighted merge: long vectors, in place, same bits every run", "[dataparallel]") {
  const size_t n = 3000;  // crosses the internal chunk size
  Workers w;
  w.counts = {3, 1, 7};
  for (size_t i = 0; i < 3; ++i) {
    w.grads.emplace_back(n);
    for (size_t j = 0; j < n; ++j) w.grads[i][j] = std::sin(float(j * (i + 1)));
  }
  std::vector<float> out(n);
  w.merge(out);
  for (size_t j = 0; j < n; j += 97) {
    double expected = 0;
    for (size_t i = 0; i < 3; ++i) expected += double(w.counts[i]) * double(w.grads[i][j]);
    CHECK(out[j] == static_cast<float>(expected / 11.0));
  }
  // In place into worker 1's gradient gives identical bits.
  auto ptrs = w.ptrs();
  auto lens = w.lens();
  weighted_merge(ptrs, lens, w.counts, nullptr, w.grads[1].data(), n);
  CHECK(std::memcmp(w.grads[1].data(), out.data(), n * sizeof(float)) == 0);
}
