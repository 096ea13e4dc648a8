// SPDX-License-Identifier: Apache-2.0
#include "comm/transport/hier/hier_communicator.hpp"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "comm/call_signature.hpp"
#include "comm/reduce.hpp"
#include "comm/transport/shm/shm_communicator.hpp"
#include "comm/verdict.hpp"
#include "common/error.hpp"
#include "common/fnv.hpp"
#include "common/log.hpp"
#include "common/random.hpp"

namespace gradsync::comm {
namespace {

// Below this many payload bytes one flat MPI call (a single rendezvous that carries small data
// itself) beats three levels of rounds.
constexpr uint64_t kFlatBytes = 16 * 1024;

// The cross-host level of 2 hosts exchanges slices in windows of this many bytes (the scratch copy
// of the other host's window is this large at most).
constexpr size_t kCrossWindowBytes = size_t{16} << 20;

// The pairs that levels reduce at full precision: floats combine in their own type at every step
// (the levels change only the order, which the topology fixes), integer sums wrap alike in any
// order, and min and max are exact. Half types and the integer mean accumulate wider than their
// type, so a level's rounding would lose what the flat fold keeps: they go flat.
bool levels_preserve(DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::F32:
    case DType::F64: return true;
    case DType::I32:
    case DType::I64: return op != ReduceOp::Mean;
    case DType::BF16:
    case DType::F16: return false;
  }
  return false;
}

uint64_t total_of(std::span<const size_t> counts) {
  uint64_t n = 0;
  for (size_t c : counts) n += c;
  return n;
}

template <class T>
void divide(void* data, size_t count, size_t n) {
  T* p = static_cast<T*>(data);
  for (size_t i = 0; i < count; ++i) p[i] = p[i] / static_cast<T>(n);
}

class HierCommunicator final : public Communicator {
 public:
  HierCommunicator(std::unique_ptr<Communicator> world, const Options& options)
      : world_(std::move(world)),
        topology_independent_(options.topology_independent),
        check_mismatch_(options.check_mismatch) {
    const Topology& t = world_->topology();
    one_host_ = t.num_hosts == 1;
    even_ = std::all_of(t.rank_host.begin(), t.rank_host.end(),
                        [&](int h) { return std::count(t.rank_host.begin(), t.rank_host.end(), h) == t.local_size; });
    // One name per host for the shared-memory level, the same on that host's ranks: world rank
    // 0's nonce, and the host index (hosts that a label makes distinct may share one /dev/shm).
    uint64_t nonce = world_->rank() == 0 ? random_nonce() : 0;
    world_->broadcast(&nonce, 1, DType::I64, 0);
    Options local = options;
    local.transport = Transport::Shm;
    local.name = fmt::format("gs-h{:016x}.{}", nonce, t.host);
    local.rank = t.local_rank;
    local.size = t.local_size;
    local_ = create_shm_communicator(local);
    // The cross-host level: the ranks of one local rank (leaderless), or the hosts' local rank 0.
    const int color = even_ ? t.local_rank : (t.local_rank == 0 ? 0 : kNoColor);
    cross_ = world_->split(color, t.host);
    GS_LOG_DEBUG("hierarchical transport: rank {} of {}: local rank {} of {} on host {} of {} ({})", world_->rank(),
                 world_->size(), t.local_rank, t.local_size, t.host, t.num_hosts,
                 even_ ? "leaderless" : "hosts of different sizes: local rank 0 carries its host");
  }

  int rank() const noexcept override { return world_->rank(); }
  int size() const noexcept override { return world_->size(); }
  Transport transport() const noexcept override { return Transport::Hier; }

  void allreduce(std::span<const BufferRef> buffers, DType dtype, ReduceOp op) override {
    telemetry_.measure(Collective::Allreduce, payload_bytes(buffers, dtype), [&] {
      const bool flat = topology_independent_ || size() == 1 || !levels_preserve(dtype, op) ||
                        payload_bytes(buffers, dtype) <= kFlatBytes;
      if (flat || one_host_) return flat_level().allreduce(buffers, dtype, op);
      ++calls_;
      require_same_call(allreduce_call(buffers, dtype, op));
      try {
        for (const BufferRef& b : buffers) allreduce_levels(b, dtype, op);
      } catch (const Error&) {
        // A level that failed on this rank leaves peers waiting in another level: stop them all
        // now rather than at their deadlines. The group then needs a reset, as after any failure.
        abort();
        throw;
      }
    });
  }

  // The rest run flat (over MPI, or over the host's shared memory when it is the whole group),
  // measured here so that this communicator's statistics count them.
  void broadcast(void* buf, size_t count, DType dtype, int root) override {
    const uint64_t bytes = count * dtype_size(dtype);
    telemetry_.measure(Collective::Broadcast, bytes, [&] {
      if (one_host_ || size() == 1 || bytes <= kFlatBytes) return flat_level().broadcast(buf, count, dtype, root);
      ++calls_;
      require_same_call(broadcast_call(count, dtype, root));
      // Every rank passed this root (checked above), so every rank refuses it alike.
      GS_REQUIRE(root >= 0 && root < size(), GRADSYNC_E_OUT_OF_RANGE,
                 "hier group: broadcast from root {} of a group of {} ranks", root, size());
      try {
        broadcast_levels(static_cast<std::byte*>(buf), count, dtype, root);
      } catch (const Error&) {
        abort();  // as for the allreduce: peers in another level stop now, not at their deadlines
        throw;
      }
    });
  }
  void allgatherv(const void* send, void* recv, std::span<const size_t> counts, DType dtype) override {
    telemetry_.measure(Collective::Allgather, total_of(counts) * dtype_size(dtype),
                       [&] { flat_level().allgatherv(send, recv, counts, dtype); });
  }
  void reduce_scatterv(const void* send, void* recv, std::span<const size_t> counts, DType dtype, ReduceOp op,
                       std::optional<int> root) override {
    telemetry_.measure(Collective::ReduceScatter, total_of(counts) * dtype_size(dtype),
                       [&] { flat_level().reduce_scatterv(send, recv, counts, dtype, op, root); });
  }
  void exchange(const void* send, void* recv, const Routes& routes, DType dtype) override {
    uint64_t sent = 0;
    for (size_t d = 0; d < routes.n; ++d) sent += routes.count[routes.at(static_cast<uint64_t>(rank()), d)];
    telemetry_.measure(Collective::Alltoall, sent * dtype_size(dtype),
                       [&] { flat_level().exchange(send, recv, routes, dtype); });
  }
  void barrier() override {
    telemetry_.measure(Collective::Barrier, 0, [&] { flat_level().barrier(); });
  }
  void weighted_mean(const void* send, void* recv, size_t count, DType dtype, uint64_t weight,
                     uint64_t* total_weight) override {
    telemetry_.measure(Collective::WeightedMean, count * dtype_size(dtype),
                       [&] { flat_level().weighted_mean(send, recv, count, dtype, weight, total_weight); });
  }
  void abort() noexcept override {
    world_->abort();
    local_->abort();
    if (cross_ != nullptr) cross_->abort();
  }
  // Collective over every level, in one order on every rank.
  void reset() override {
    local_->reset();
    if (cross_ != nullptr) cross_->reset();
    world_->reset();
  }
  const char* progress_thread_refused() const noexcept override { return world_->progress_thread_refused(); }
  // The host's shared-memory level is the one with a mapping of the child's own.
  void release_after_fork() noexcept override {
    world_->release_after_fork();
    local_->release_after_fork();
    if (cross_ != nullptr) cross_->release_after_fork();
  }
  void set_interrupt(InterruptCheck check) noexcept override {
    Communicator::set_interrupt(check);
    world_->set_interrupt(check);
    local_->set_interrupt(check);
    if (cross_ != nullptr) cross_->set_interrupt(check);
  }

 protected:
  // The subgroup's MPI group, and the levels built on it as for a new group.
  std::unique_ptr<Communicator> make_subgroup(const Subgroup& sub) override {
    return std::make_unique<HierCommunicator>(world_->form_subgroup(sub), group_options());
  }

 private:
  // What runs flat: on one host its shared-memory group, which is the whole group in the same rank
  // order (local rank = world rank there) and folds in rank order, so no data moves through MPI;
  // otherwise MPI.
  Communicator& flat_level() const noexcept { return one_host_ ? *local_ : *world_; }

  void allreduce_levels(const BufferRef& b, DType dtype, ReduceOp op) {
    const ReduceOp level_op = op == ReduceOp::Mean ? ReduceOp::Sum : op;
    const size_t es = dtype_size(dtype);
    auto* recv = static_cast<std::byte*>(b.recv);
    if (even_) {
      const Part mine = local_->my_part(b.count);
      std::byte* slice = recv + mine.start * es;
      local_->reduce_scatter(b.send, slice, b.count, dtype, level_op);
      hier_cross_allreduce(*cross_, slice, mine.len, dtype, level_op, scratch_);
      if (op == ReduceOp::Mean) finish_mean(slice, mine.len, dtype);
      local_->allgather(nullptr, recv, b.count, dtype);
    } else {
      local_->reduce_to(b.send, recv, b.count, dtype, level_op, 0);
      if (cross_ != nullptr) {
        hier_cross_allreduce(*cross_, recv, b.count, dtype, level_op, scratch_);
        if (op == ReduceOp::Mean) finish_mean(recv, b.count, dtype);
      }
      local_->broadcast(recv, b.count, dtype, 0);
    }
  }

  // The root's host spreads the data over shared memory; then, with hosts of equal size, each
  // local rank carries its own slice from the root's host to the others (no leader) and each host
  // all-gathers it; with hosts of different sizes, local rank 0 of each host carries it all. A
  // broadcast moves bits unchanged, so the result is the flat broadcast's on any layout.
  void broadcast_levels(std::byte* buf, size_t count, DType dtype, int root) {
    const Topology& t = world_->topology();
    const int root_host = t.rank_host[static_cast<size_t>(root)];
    const auto root_local = static_cast<int>(std::count(t.rank_host.begin(), t.rank_host.begin() + root, root_host));
    if (t.host == root_host) local_->broadcast(buf, count, dtype, root_local);
    // A cross-level group is keyed by host: its rank r is host r's member.
    if (even_) {
      const Part mine = local_->my_part(count);
      cross_->broadcast(buf + mine.start * dtype_size(dtype), mine.len, dtype, root_host);
      local_->allgather(nullptr, buf, count, dtype);
    } else {
      if (cross_ != nullptr) cross_->broadcast(buf, count, dtype, root_host);
      if (t.host != root_host) local_->broadcast(buf, count, dtype, 0);
    }
  }

  // Every rank's call, compared before any level starts: the levels see only their own ranks, so
  // ranks that disagree across hosts would otherwise fail at different levels (or wait for each
  // other until the deadline). One small allreduce of the signature's hash (it travels inside the
  // MPI rendezvous: one round trip); only when the hashes differ are the signatures gathered, to
  // name both sides. Ranks that disagree all get E_MISMATCH, and the next call works.
  void require_same_call(const CallSignature& mine) {
    if (!check_mismatch_) return;
    const auto h = static_cast<int64_t>(fnv1a64(&mine, sizeof mine) >> 1);
    std::array<int64_t, 2> extremes{h, -h};
    const BufferRef b{extremes.data(), extremes.data(), extremes.size()};
    world_->allreduce(std::span<const BufferRef>(&b, 1), DType::I64, ReduceOp::Max);
    if (extremes[0] == -extremes[1]) return;
    constexpr size_t kWords = sizeof(CallSignature) / sizeof(int64_t);
    std::array<int64_t, kWords> word{};
    std::memcpy(word.data(), &mine, sizeof mine);
    std::vector<int64_t> all(kWords * static_cast<size_t>(size()));
    world_->allgather(word.data(), all.data(), all.size(), DType::I64);
    std::vector<CallSignature> calls(static_cast<size_t>(size()));
    std::memcpy(static_cast<void*>(calls.data()), all.data(), calls.size() * sizeof(CallSignature));
    require_same_calls([&] { return fmt::format("hier group (rank {} of {})", rank(), size()); }, calls_, size(),
                       [&](int r) -> const CallSignature& { return calls[static_cast<size_t>(r)]; });
  }

  void finish_mean(void* data, size_t count, DType dtype) const {
    const auto n = static_cast<size_t>(size());
    if (dtype == DType::F32) divide<float>(data, count, n);
    if (dtype == DType::F64) divide<double>(data, count, n);
  }

  std::unique_ptr<Communicator> world_, local_, cross_;
  bool even_ = true;
  bool one_host_ = false;
  bool topology_independent_ = false;
  bool check_mismatch_ = true;
  uint64_t calls_ = 0;              // the hierarchical allreduces, for messages
  std::vector<std::byte> scratch_;  // the cross-host level's copy of the other host's slice
};

}  // namespace

void hier_cross_allreduce(Communicator& cross, void* data, size_t count, DType dtype, ReduceOp op,
                          std::vector<std::byte>& scratch) {
  if (cross.size() != 2) {
    const BufferRef b{data, data, count};
    return cross.allreduce(std::span<const BufferRef>(&b, 1), dtype, op);
  }
  // Two hosts: each sends its slice to the other in one exchange and both fold host 0's copy then
  // host 1's, the bits of the rank-order allreduce (whose reduce-scatter and all-gather over MPI
  // cost two collectives where one does). In windows, so that the copy held is bounded as that
  // allreduce's is.
  const size_t es = dtype_size(dtype);
  const size_t window = std::max<size_t>(kCrossWindowBytes / es, 1);
  if (scratch.size() < std::min(count, window) * es) scratch.resize(std::min(count, window) * es);
  Routes routes(Collective::Alltoall, -1, 2);
  for (size_t lo = 0; lo < count; lo += window) {
    const size_t m = std::min(window, count - lo);
    std::byte* mine = static_cast<std::byte*>(data) + lo * es;
    routes.count[routes.at(0, 1)] = m;
    routes.count[routes.at(1, 0)] = m;
    cross.exchange(mine, scratch.data(), routes, dtype);
    const std::array<const void*, 2> sources = cross.rank() == 0 ? std::array<const void*, 2>{mine, scratch.data()}
                                                                 : std::array<const void*, 2>{scratch.data(), mine};
    reduce(dtype, op, sources.data(), sources.size(), mine, 0, m);
  }
}

std::unique_ptr<Communicator> make_hierarchical_communicator(std::unique_ptr<Communicator> world,
                                                             const Options& options) {
  return std::make_unique<HierCommunicator>(std::move(world), options);
}

}  // namespace gradsync::comm
