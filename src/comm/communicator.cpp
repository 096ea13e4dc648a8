// SPDX-License-Identifier: Apache-2.0
#include "comm/communicator.hpp"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "common/error.hpp"
#include "common/fnv.hpp"
#include "common/random.hpp"

namespace gradsync::comm {

// The staged form of comm::weighted_mean (reduce.hpp) for transports that move data through a
// sum allreduce: each rank's contribution in double (+0 for weight 0), the weights beside them,
// summed in rank order, divided once. The same operations in the same order, so the same bits.
void Communicator::weighted_mean(const void* send, void* recv, size_t count, DType dtype, uint64_t weight,
                                 uint64_t* total_weight) {
  GS_REQUIRE(dtype == DType::F32 || dtype == DType::F64, GRADSYNC_E_INVALID_ARG,
             "weighted mean needs f32 or f64, got {}", dtype_name(dtype));
  // Weights travel as doubles beside the products: exact for counts below 2^53.
  GS_REQUIRE(weight <= (uint64_t{1} << 53), GRADSYNC_E_INVALID_ARG, "weight {} exceeds 2^53", weight);
  windowed_weighted_mean(send, recv, count, dtype, weight, total_weight, kWeightedWindow, [&](double* data, size_t n) {
    const BufferRef buffer{data, data, n};
    allreduce(std::span<const BufferRef>(&buffer, 1), DType::F64, ReduceOp::Sum);
  });
}

double* Communicator::weighted_staging(size_t n) {
  if (weighted_staging_.size() < n) weighted_staging_.resize(n);
  return weighted_staging_.data();
}

void Communicator::windowed_weighted_mean(const void* send, void* recv, size_t count, DType dtype, uint64_t weight,
                                          uint64_t* total_weight, size_t window,
                                          const std::function<void(double* data, size_t n)>& sum,
                                          std::optional<double> known_total) {
  const double w = static_cast<double>(weight);
  double* staged = weighted_staging(std::min(count, window) + 1);
  size_t lo = 0;
  do {
    const size_t len = std::min(window, count - lo);
    if (weight == 0) {
      std::fill(staged, staged + len, 0.0);
    } else if (dtype == DType::F32) {
      const float* in = static_cast<const float*>(send) + lo;
      for (size_t i = 0; i < len; ++i) staged[i] = w * static_cast<double>(in[i]);
    } else {
      const double* in = static_cast<const double*>(send) + lo;
      for (size_t i = 0; i < len; ++i) staged[i] = w * in[i];
    }
    staged[len] = w;
    sum(staged, known_total ? len : len + 1);
    // Every window sums the same weights in the same order: every rank sees the same total in each.
    const double total = known_total ? *known_total : staged[len];
    if (lo == 0) {
      if (total_weight != nullptr) *total_weight = static_cast<uint64_t>(total);
      GS_REQUIRE(total > 0.0, GRADSYNC_E_ZERO_WEIGHT, "total weight (sample count) over {} ranks is 0", size());
      // A group of one leaves the data as it is, bit for bit (w * x / w would quiet a signalling NaN).
      if (size() == 1) {
        if (count > 0 && send != recv) std::memmove(recv, send, count * dtype_size(dtype));
        return;
      }
    }
    if (dtype == DType::F32) {
      float* out = static_cast<float*>(recv) + lo;
      for (size_t i = 0; i < len; ++i) out[i] = static_cast<float>(staged[i] / total);
    } else {
      double* out = static_cast<double*>(recv) + lo;
      for (size_t i = 0; i < len; ++i) out[i] = staged[i] / total;
    }
    lo += len;
  } while (lo < count);
}

Communicator::~Communicator() {
  for (void* p : allocations_) std::free(p);
}

void Communicator::allreduce_mixed(std::span<const BufferRef> buffers, std::span<const DType> dtypes, ReduceOp op) {
  uint64_t h = fnv1a64(&op, sizeof op);
  for (size_t i = 0; i < buffers.size(); ++i) {
    const uint64_t entry[2] = {buffers[i].count, static_cast<uint64_t>(dtypes[i])};
    h = fnv1a64(entry, sizeof entry, h);
  }
  // min over ranks of h and of ~h: both come back unchanged on every rank exactly when every rank
  // holds the same h (~ reverses the order), so every rank reaches the same verdict.
  int64_t agree[2] = {static_cast<int64_t>(h), static_cast<int64_t>(~h)};
  const BufferRef check{agree, agree, 2};
  allreduce(std::span(&check, 1), DType::I64, ReduceOp::Min);
  GS_REQUIRE(agree[0] == static_cast<int64_t>(h) && agree[1] == static_cast<int64_t>(~h), GRADSYNC_E_MISMATCH,
             "allreduce over mixed dtypes: the ranks passed different lists of buffers (their counts, dtypes or "
             "order, or the op, differ); no buffer was changed");
  std::vector<BufferRef> group;
  for (DType t : {DType::F32, DType::F64, DType::I32, DType::I64, DType::BF16, DType::F16}) {
    group.clear();
    for (size_t i = 0; i < buffers.size(); ++i)
      if (dtypes[i] == t) group.push_back(buffers[i]);
    if (!group.empty()) allreduce(group, t, op);
  }
}

std::span<const size_t> Communicator::rule_counts(size_t total) {
  const auto n = static_cast<uint64_t>(size());
  partition_counts_.resize(n);
  for (uint64_t r = 0; r < n; ++r) partition_counts_[r] = partition(total, n, r).len;
  return partition_counts_;
}

void Communicator::allgather(const void* send, void* recv, size_t total, DType dtype) {
  allgatherv(send, recv, rule_counts(total), dtype);
}

void Communicator::reduce_scatter(const void* send, void* recv, size_t total, DType dtype, ReduceOp op) {
  reduce_scatterv(send, recv, rule_counts(total), dtype, op, std::nullopt);
}

void Communicator::reduce_to(const void* send, void* recv, size_t count, DType dtype, ReduceOp op, int root) {
  std::vector<size_t> counts(static_cast<size_t>(size()), 0);
  // An out-of-range root moves nothing: the round refuses it on every rank before any data moves.
  if (root >= 0 && root < size()) counts[static_cast<size_t>(root)] = count;
  reduce_scatterv(send, recv, counts, dtype, op, root);
}

void Communicator::alltoall(const void* send, void* recv, size_t total, DType dtype) {
  const auto n = static_cast<uint64_t>(size());
  Routes routes(Collective::Alltoall, -1, n);
  for (uint64_t d = 0; d < n; ++d) {
    const Part p = partition(total, n, d);
    for (uint64_t s = 0; s < n; ++s) {
      routes.count[routes.at(s, d)] = p.len;
      routes.send_displ[routes.at(s, d)] = p.start;
      routes.recv_displ[routes.at(s, d)] = s * p.len;
    }
  }
  exchange(send, recv, routes, dtype);
}

void Communicator::gather(const void* send, void* recv, size_t count, DType dtype, int root) {
  const auto n = static_cast<uint64_t>(size());
  Routes routes(Collective::Gather, root, n);
  // An out-of-range root moves nothing: the round refuses it on every rank.
  if (root >= 0 && root < size()) {
    const auto r = static_cast<uint64_t>(root);
    for (uint64_t s = 0; s < n; ++s) {
      routes.count[routes.at(s, r)] = count;
      routes.recv_displ[routes.at(s, r)] = s * count;
    }
  }
  exchange(send, recv, routes, dtype);
}

void Communicator::scatter(const void* send, void* recv, size_t count, DType dtype, int root) {
  const auto n = static_cast<uint64_t>(size());
  Routes routes(Collective::Scatter, root, n);
  if (root >= 0 && root < size()) {
    const auto r = static_cast<uint64_t>(root);
    for (uint64_t d = 0; d < n; ++d) {
      routes.count[routes.at(r, d)] = count;
      routes.send_displ[routes.at(r, d)] = d * count;
    }
  }
  exchange(send, recv, routes, dtype);
}

namespace {

// One rank's side of an exchange as the round of counts carries it: what it called, then its
// counts and displacements, n each.
enum RowField : uint64_t { kForm, kRoot, kDtype, kHeader };
enum RowPart : uint64_t { kSendCounts, kSendDispls, kRecvCounts, kRecvDispls, kParts };

std::string side(const uint64_t* row) {
  const auto form = static_cast<Collective>(row[kForm]);
  const auto root = static_cast<int64_t>(row[kRoot]);
  std::string s = fmt::format("{}v of {}", collective_name(form), dtype_name(static_cast<DType>(row[kDtype])));
  if (form == Collective::Gather) s += fmt::format(" to root {}", root);
  if (form == Collective::Scatter) s += fmt::format(" from root {}", root);
  return s;
}

}  // namespace

Routes Communicator::agree_routes(Collective form, int root, DType dtype, std::span<const size_t> send_counts,
                                  std::span<const size_t> send_displs, std::span<const size_t> recv_counts,
                                  std::span<const size_t> recv_displs) {
  const auto n = static_cast<uint64_t>(size());
  const uint64_t width = kHeader + kParts * n;
  std::vector<uint64_t> rows(n * width);
  uint64_t* mine = &rows[static_cast<uint64_t>(rank()) * width];
  mine[kForm] = static_cast<uint64_t>(form);
  mine[kRoot] = static_cast<uint64_t>(static_cast<int64_t>(root));
  mine[kDtype] = static_cast<uint64_t>(dtype);
  for (uint64_t r = 0; r < n; ++r) {
    mine[kHeader + kSendCounts * n + r] = send_counts[r];
    mine[kHeader + kSendDispls * n + r] = send_displs[r];
    mine[kHeader + kRecvCounts * n + r] = recv_counts[r];
    mine[kHeader + kRecvDispls * n + r] = recv_displs[r];
  }
  allgather(nullptr, rows.data(), rows.size(), DType::I64);

  // Every rank holds the same rows, so every rank reaches the same verdict.
  auto row = [&](uint64_t r) { return &rows[r * width]; };
  auto field = [&](uint64_t r, RowPart part, uint64_t i) { return row(r)[kHeader + part * n + i]; };
  for (uint64_t r = 1; r < n; ++r) {
    GS_REQUIRE(std::equal(row(r), row(r) + kHeader, row(0)), GRADSYNC_E_MISMATCH,
               "rank {} called {} but rank 0 called {}", r, side(row(r)), side(row(0)));
  }
  GS_REQUIRE(form == Collective::Alltoall || (root >= 0 && root < size()), GRADSYNC_E_OUT_OF_RANGE,
             "{}: root {} is out of range [0, {})", side(row(0)), root, n);
  for (uint64_t s = 0; s < n; ++s) {
    for (uint64_t d = 0; d < n; ++d) {
      const uint64_t sent = field(s, kSendCounts, d), expected = field(d, kRecvCounts, s);
      GS_REQUIRE(sent == expected, GRADSYNC_E_MISMATCH,
                 "{}: rank {} sends {} elements to rank {}, but rank {} expects {} from rank {}; nothing was moved",
                 side(row(0)), s, sent, d, d, expected, s);
    }
  }
  Routes routes(form, root, n);
  for (uint64_t s = 0; s < n; ++s) {
    for (uint64_t d = 0; d < n; ++d) {
      routes.count[routes.at(s, d)] = field(s, kSendCounts, d);
      routes.send_displ[routes.at(s, d)] = field(s, kSendDispls, d);
      routes.recv_displ[routes.at(s, d)] = field(d, kRecvDispls, s);
    }
  }
  return routes;
}

void Communicator::alltoallv(const void* send, std::span<const size_t> send_counts, std::span<const size_t> send_displs,
                             void* recv, std::span<const size_t> recv_counts, std::span<const size_t> recv_displs,
                             DType dtype) {
  const Routes routes =
      agree_routes(Collective::Alltoall, -1, dtype, send_counts, send_displs, recv_counts, recv_displs);
  exchange(send, recv, routes, dtype);
}

namespace {

// Counts packed in rank order: their prefix sums.
std::vector<size_t> packed(std::span<const size_t> counts) {
  std::vector<size_t> displs(counts.size());
  size_t at = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    displs[r] = at;
    at += counts[r];
  }
  return displs;
}

}  // namespace

void Communicator::gatherv(const void* send, size_t send_count, void* recv, std::span<const size_t> recv_counts,
                           DType dtype, int root) {
  const auto n = static_cast<size_t>(size());
  const std::vector<size_t> zeros(n, 0);
  std::vector<size_t> send_counts(n, 0);
  if (root >= 0 && root < size()) send_counts[static_cast<size_t>(root)] = send_count;
  const bool at_root = root == rank();
  const std::vector<size_t> recv_displs = at_root ? packed(recv_counts) : zeros;
  const Routes routes = agree_routes(Collective::Gather, root, dtype, send_counts, zeros,
                                     at_root ? recv_counts : std::span<const size_t>(zeros), recv_displs);
  exchange(send, recv, routes, dtype);
}

void Communicator::scatterv(const void* send, std::span<const size_t> send_counts, void* recv, size_t recv_count,
                            DType dtype, int root) {
  const auto n = static_cast<size_t>(size());
  const std::vector<size_t> zeros(n, 0);
  std::vector<size_t> recv_counts(n, 0);
  if (root >= 0 && root < size()) recv_counts[static_cast<size_t>(root)] = recv_count;
  const bool at_root = root == rank();
  const std::vector<size_t> send_displs = at_root ? packed(send_counts) : zeros;
  const Routes routes =
      agree_routes(Collective::Scatter, root, dtype, at_root ? send_counts : std::span<const size_t>(zeros),
                   send_displs, recv_counts, zeros);
  exchange(send, recv, routes, dtype);
}

void* Communicator::alloc(size_t bytes) {
  constexpr size_t kAlign = 4096;
  GS_REQUIRE(bytes <= std::numeric_limits<size_t>::max() - kAlign, GRADSYNC_E_NOMEM, "cannot allocate {} bytes", bytes);
  void* p = std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  GS_REQUIRE(p != nullptr, GRADSYNC_E_NOMEM, "cannot allocate {} bytes", bytes);
  allocations_.insert(p);
  return p;
}

void Communicator::dealloc(void* p) {
  GS_REQUIRE(allocations_.erase(p) == 1, GRADSYNC_E_INVALID_ARG,
             "pointer {} was not allocated by this communicator (or was already freed)", p);
  std::free(p);
}

void Communicator::establish(const Options& options) {
  group_options_ = options;
  group_options_.forming_abandoned = nullptr;
  member_id_ = rank();  // options.rank where the caller gives it; on MPI the rank comes from MPI
  next_member_id_ = size();
  topology_ = detect_topology(
      rank(), size(), [this](const void* mine, void* all, size_t total) { allgather(mine, all, total, DType::I64); },
      options.host_label, shares_memory());
  telemetry_.forget();
}

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
  // Every rank's color and key, and rank 0's nonce: it makes the subgroups' names differ from
  // those of an earlier group of the same name whose subgroups may still live.
  const std::array<int64_t, 3> mine{color, key, static_cast<int64_t>(random_nonce())};
  const auto n = static_cast<size_t>(size());
  std::vector<int64_t> all(3 * n);
  allgather(mine.data(), all.data(), all.size(), DType::I64);
  const uint64_t split_number = ++splits_;
  for (size_t r = 0; r < n; ++r) {
    GS_REQUIRE(all[3 * r] >= kNoColor, GRADSYNC_E_INVALID_ARG,
               "split: rank {} passed color {}; a color is >= 0, or {} for no subgroup", r, all[3 * r], kNoColor);
  }
  return split_by(all, color, split_number);
}

std::unique_ptr<Communicator> Communicator::split_by(std::span<const int64_t> table, int color, uint64_t split_number) {
  if (color == kNoColor) return nullptr;
  return form_subgroup(subgroup_of(table, color, split_number));
}

Communicator::Subgroup Communicator::subgroup_of(std::span<const int64_t> table, int color,
                                                 uint64_t split_number) const {
  const size_t n = table.size() / 3;
  Subgroup sub;
  for (size_t r = 0; r < n; ++r)
    if (table[3 * r] == color) sub.members.push_back(static_cast<int>(r));
  std::stable_sort(sub.members.begin(), sub.members.end(), [&](int a, int b) {
    return table[3 * static_cast<size_t>(a) + 1] < table[3 * static_cast<size_t>(b) + 1];
  });
  const auto at = std::find(sub.members.begin(), sub.members.end(), rank());
  sub.rank = at == sub.members.end() ? -1 : static_cast<int>(at - sub.members.begin());
  // The parent's name cut to 40 bytes, a dot and a hash of what makes this subgroup unique: within
  // the name limit, and as valid a segment name as the parent's.
  const uint64_t words[3] = {static_cast<uint64_t>(table[2]), split_number, static_cast<uint64_t>(color)};
  uint64_t h = fnv1a64(group_options_.name.data(), group_options_.name.size());
  h = fnv1a64(words, sizeof words, h);
  sub.name = fmt::format("{}.{:016x}", group_options_.name.substr(0, 40), h);
  return sub;
}

std::unique_ptr<Communicator> Communicator::form_subgroup(const Subgroup& sub) {
  std::unique_ptr<Communicator> child = make_subgroup(sub);
  child->group_options_ = group_options_;
  child->group_options_.name = sub.name;
  child->group_options_.rank = sub.rank;
  child->group_options_.size = static_cast<int32_t>(sub.members.size());
  child->topology_ = topology_.restricted(sub.members, sub.rank);
  child->member_id_ = member_id_;
  child->next_member_id_ = next_member_id_;
  return child;
}

ShrinkResult Communicator::shrink() {
  fail(GRADSYNC_E_UNSUPPORTED, "shrink is not supported on the {} transport", transport_name(transport()));
}

void Communicator::pass_identity(Communicator& successor, const Options& options, const Topology& topology) const {
  successor.group_options_ = options;
  successor.group_options_.forming_abandoned = nullptr;
  successor.topology_ = topology;
  successor.member_id_ = member_id_;
  successor.next_member_id_ = next_member_id_;
}

std::vector<int64_t> agree_grow(Communicator& group, const std::string& described, const std::string& join_name,
                                int joiners, std::span<const int64_t> extra) {
  const size_t words = kGrowWords + extra.size();
  std::vector<int64_t> mine(words);
  mine[kGrowJoiners] = joiners;
  mine[kGrowName] = static_cast<int64_t>(fnv1a64(join_name.data(), join_name.size()));
  mine[kGrowNext] = group.next_member_id();
  std::copy(extra.begin(), extra.end(), mine.begin() + kGrowWords);
  const int n = group.size();
  std::vector<int64_t> all(words * static_cast<size_t>(n));
  if (n == 1) {
    std::copy(mine.begin(), mine.end(), all.begin());
  } else {
    group.allgather(mine.data(), all.data(), all.size(), DType::I64);
  }
  for (int r = 1; r < n; ++r) {
    const int64_t* w = &all[static_cast<size_t>(r) * words];
    GS_REQUIRE(w[kGrowJoiners] == all[kGrowJoiners] && w[kGrowName] == all[kGrowName], GRADSYNC_E_MISMATCH,
               "grow of {}: rank {} grows by {} joiner(s), rank 0 by {}{} (rank {} passed join name '{}')", described,
               r, w[kGrowJoiners], all[kGrowJoiners],
               w[kGrowName] == all[kGrowName] ? "" : ", and they passed different join names", group.rank(), join_name);
    GS_REQUIRE(w[kGrowNext] == all[kGrowNext], GRADSYNC_E_MISMATCH,
               "grow of {}: rank {} counts member ids from {}, rank 0 from {}: they are not one group's members",
               described, r, w[kGrowNext], all[kGrowNext]);
  }
  return all;
}

GrowResult Communicator::grow(const std::string&, int) {
  fail(GRADSYNC_E_UNSUPPORTED, "grow is not supported on the {} transport", transport_name(transport()));
}

Options Communicator::subgroup_options(const Subgroup& sub) const {
  Options o = group_options_;
  o.name = sub.name;
  o.rank = sub.rank;
  o.size = static_cast<int32_t>(sub.members.size());
  o.forming_abandoned = sub.abandoned;
  return o;
}

}  // namespace gradsync::comm
