// SPDX-License-Identifier: Apache-2.0
#include "comm/transport/hier/hier_communicator.hpp"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "comm/call_signature.hpp"
#include "comm/reduce.hpp"
#include "comm/transport/shm/segment.hpp"
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

uint64_t total_of(std::span<const size_t> counts) {
  uint64_t n = 0;
  for (size_t c : counts) n += c;
  return n;
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
    // One name per host for the shared-memory level, the same on that host's ranks (level_name).
    nonce_ = world_->rank() == 0 ? random_nonce() : 0;
    world_->broadcast(&nonce_, 1, DType::I64, 0);
    Options local = options;
    local.transport = Transport::Shm;
    local.name = level_name(t.host);
    local.rank = t.local_rank;
    local.size = t.local_size;
    local_ = create_shm_communicator(local);
    // The cross-host level: the ranks of one local rank (leaderless), or the hosts' local rank 0.
    const int color = even_ ? t.local_rank : (t.local_rank == 0 ? 0 : kNoColor);
    cross_ = world_->split(color, t.host);
    // A cross-host peer lost on another host shows nowhere in this rank's cross group (only
    // across that host's shared memory); whoever sees it aborts the whole group (run_levels), and
    // the MPI level's notices end the cross level's waits too, as a loss would.
    if (cross_ != nullptr) cross_->set_stop_check([w = world_.get()] { return w->stopped_by_peer(); });
    plan_parts();
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
      require_same_call(allreduce_call(buffers, dtype, op));
      run_levels([&] {
        for (const BufferRef& b : buffers) allreduce_levels(b, dtype, op);
      });
    });
  }

  // The rest run flat (over MPI, or over the host's shared memory when it is the whole group),
  // measured here so that this communicator's statistics count them.
  void broadcast(void* buf, size_t count, DType dtype, int root) override {
    const uint64_t bytes = count * dtype_size(dtype);
    telemetry_.measure(Collective::Broadcast, bytes, [&] {
      if (one_host_ || size() == 1 || bytes <= kFlatBytes) return flat_level().broadcast(buf, count, dtype, root);
      require_same_call(broadcast_call(count, dtype, root));
      // Every rank passed this root (checked above), so every rank refuses it alike.
      GS_REQUIRE(root >= 0 && root < size(), GRADSYNC_E_OUT_OF_RANGE,
                 "hier group: broadcast from root {} of a group of {} ranks", root, size());
      run_levels([&] { broadcast_levels(static_cast<std::byte*>(buf), count, dtype, root); });
    });
  }
  void allgatherv(const void* send, void* recv, std::span<const size_t> counts, DType dtype) override {
    const uint64_t bytes = total_of(counts) * dtype_size(dtype);
    telemetry_.measure(Collective::Allgather, bytes, [&] {
      if (one_host_ || size() == 1 || bytes <= kFlatBytes) return flat_level().allgatherv(send, recv, counts, dtype);
      require_same_call(allgather_call(counts, dtype));
      run_levels([&] { allgather_levels(send, static_cast<std::byte*>(recv), counts, dtype); });
    });
  }
  // A rooted reduce (root set) runs flat: its one part would cross hosts through one rank per host.
  void reduce_scatterv(const void* send, void* recv, std::span<const size_t> counts, DType dtype, ReduceOp op,
                       std::optional<int> root) override {
    const uint64_t bytes = total_of(counts) * dtype_size(dtype);
    telemetry_.measure(Collective::ReduceScatter, bytes, [&] {
      const bool flat = topology_independent_ || size() == 1 || root.has_value() || !levels_preserve(dtype, op) ||
                        bytes <= kFlatBytes;
      if (flat || one_host_) return flat_level().reduce_scatterv(send, recv, counts, dtype, op, root);
      require_same_call(reduce_scatter_call(counts, dtype, op, root));
      run_levels([&] { reduce_scatter_levels(send, static_cast<std::byte*>(recv), counts, dtype, op); });
    });
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
  // Collective over every level, in one order on every rank: the MPI level first, so that the
  // cross level's reset is not stopped by the notices of the abort being recovered from.
  void reset() override {
    world_->reset();
    local_->reset();
    if (cross_ != nullptr) cross_->reset();
  }
  // The levels are stopped (calls blocked in them return), the MPI level agrees on the lost ranks
  // and forms the survivors' MPI group (mpi_shrink.cpp: bounded), and the levels are built over it
  // as for a new group: a fresh shared-memory segment per host (the old one is left by its
  // survivors when the old group is freed; the last removes its name). Where a whole host was lost
  // and the survivors share this one, the MPI level formed them a shared-memory group, which is
  // what the levels would make of a one-host group: it is the result (its identity is the MPI
  // level's, which is this group's).
  ShrinkResult shrink() override {
    local_->abort();
    if (cross_ != nullptr) cross_->abort();
    ShrinkResult result = world_->shrink();
    // A host whose ranks are all lost has nobody left to remove its level's segment name; where
    // that host shares this one's /dev/shm (hosts made by labels), the survivors do.
    const Topology& was = world_->topology();
    for (int h = 0; h < was.num_hosts; ++h) {
      bool all_lost = true;
      for (size_t r = 0; r < was.rank_host.size(); ++r)
        if (was.rank_host[r] == h)
          all_lost &= std::binary_search(result.failed.begin(), result.failed.end(), static_cast<int>(r));
      if (all_lost) shm::remove_segment_name(level_name(h));
    }
    if (result.comm->transport() != Transport::Mpi) return result;
    const auto levels_start = std::chrono::steady_clock::now();
    result.comm = levels_over(std::move(result.comm), fmt::format("shrink of the hier group: rank {}: the survivors' "
                                                                  "MPI group was formed (lost rank(s) {})",
                                                                  rank(), fmt::join(result.failed, ", ")));
    result.form += std::chrono::steady_clock::now() - levels_start;
    return result;
  }
  // The MPI level grows (mpi_grow.cpp: the joiners spawned, they build these levels too), and the
  // levels are built over the grown MPI group as a shrink builds them.
  GrowResult grow(const std::string& join_name, int joiners) override {
    GrowResult result = world_->grow(join_name, joiners);
    const auto levels_start = std::chrono::steady_clock::now();
    result.comm = levels_over(std::move(result.comm),
                              fmt::format("grow of the hier group: rank {}: the grown MPI group was formed ({} "
                                          "joiner(s) by '{}')",
                                          rank(), joiners, join_name));
    result.form += std::chrono::steady_clock::now() - levels_start;
    return result;
  }
  const char* progress_thread_refused() const noexcept override { return world_->progress_thread_refused(); }
  // The MPI level's notices: every level's failure reaches the peers through it (run_levels).
  Stop stopped_by_peer() noexcept override { return world_->stopped_by_peer(); }
  // Every call goes through world_'s check (flat) or this group's own (levels), but on one host
  // through the shared-memory group's, whose check compares calls alone.
  bool carries_call_words() const noexcept override { return !one_host_; }
  void carry_call_word(uint64_t word) noexcept override { call_word_ = word; }
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
  // The levels over a new MPI group of this group's (a shrink's survivors, a grow's members and
  // joiners), built as for a new group, with the MPI group's identity. Every wait there is bounded
  // but the cross level's MPI_Comm_create_group: a rank lost inside it would leave the others there
  // for good, so it runs under the watchdog. `formed` says what came before, for a failure's message.
  std::unique_ptr<Communicator> levels_over(std::unique_ptr<Communicator> mpi_level, const std::string& formed) {
    const Topology topology = mpi_level->topology();
    const int64_t id = mpi_level->member_id(), next_id = mpi_level->next_member_id();
    mpi_level->guard_forming(true);
    std::unique_ptr<HierCommunicator> made;
    try {
      made = std::make_unique<HierCommunicator>(std::move(mpi_level), group_options());
    } catch (const Error& err) {
      fail(err.status(),
           "{}, but its shared-memory and cross-host levels could not be built (a rank lost meanwhile?): {}", formed,
           err.what());
    }
    made->world_->guard_forming(false);
    pass_identity(*made, group_options(), topology);
    made->take_identity(id, next_id);
    return made;
  }

  // What runs flat: on one host its shared-memory group, which is the whole group in the same rank
  // order (local rank = world rank there) and folds in rank order, so no data moves through MPI;
  // otherwise MPI. A word that a group over this one gave the call goes with it.
  Communicator& flat_level() noexcept {
    Communicator& flat = one_host_ ? *local_ : *world_;
    if (const uint64_t word = std::exchange(call_word_, 0); word != 0) flat.carry_call_word(word);
    return flat;
  }

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

  // How the parts of a reduce-scatter or an all-gather travel. Rank r's part crosses hosts with its
  // carrier, a local rank on each host: r's own local rank where hosts have equal sizes (each
  // host's rank of that local rank then holds the whole part's host sum, and the carriers of one
  // local rank form a cross group), local rank 0 otherwise. A carrier holds its parts in a buffer
  // of its own in the order (host, rank), so that each cross member's parts lie together as the
  // cross group's collectives want them. The shared-memory level takes the group's ranks in runs
  // of consecutive ranks whose parts reach their carriers in that order (one local collective per
  // run): one run where ranks alternate over hosts, one per host where each host's ranks are
  // consecutive, at most one per rank on any layout. Fixed by the topology, the same on every rank.
  void plan_parts() {
    const Topology& t = world_->topology();
    const auto n = static_cast<size_t>(size());
    std::vector<int> local_of(n), seen(static_cast<size_t>(t.num_hosts), 0);
    carrier_.resize(n);
    for (size_t r = 0; r < n; ++r) {
      local_of[r] = seen[static_cast<size_t>(t.rank_host[r])]++;
      carrier_[r] = even_ ? local_of[r] : 0;
      if (t.rank_host[r] == t.host) host_ranks_.push_back(static_cast<int>(r));
    }
    cross_world_.assign(static_cast<size_t>(t.num_hosts), -1);
    for (size_t r = 0; r < n; ++r) {
      if (local_of[r] == (even_ ? t.local_rank : 0))
        cross_world_[static_cast<size_t>(t.rank_host[r])] = static_cast<int>(r);
    }
    carried_order_.resize(n);
    for (size_t r = 0; r < n; ++r) carried_order_[r] = static_cast<int>(r);
    std::stable_sort(carried_order_.begin(), carried_order_.end(), [&](int a, int b) {
      const auto ua = static_cast<size_t>(a), ub = static_cast<size_t>(b);
      return std::pair(carrier_[ua], t.rank_host[ua]) < std::pair(carrier_[ub], t.rank_host[ub]);
    });
    std::vector<int> next(n, -1);  // the rank after r in its carrier's buffer
    for (size_t i = 0; i + 1 < n; ++i) {
      const auto a = static_cast<size_t>(carried_order_[i]), b = static_cast<size_t>(carried_order_[i + 1]);
      if (carrier_[a] == carrier_[b]) next[a] = static_cast<int>(b);
    }
    size_t start = 0;
    for (size_t r = 1; r <= n; ++r) {
      if (r < n && (carrier_[r] > carrier_[r - 1] || next[r - 1] == static_cast<int>(r))) continue;
      runs_.emplace_back(start, r);
      start = r;
    }
  }

  // One call's parts placed for the levels: where each lies in the caller's buffers and in its
  // carrier's, what this rank carries, and how that divides among its cross group's members.
  struct Placement {
    std::vector<size_t> offset, slot;
    std::vector<size_t> cross_counts;  // this carrier's parts by cross member (host); empty if it carries none
    size_t carried = 0;
  };
  Placement place(std::span<const size_t> counts) const {
    const Topology& t = world_->topology();
    const auto n = static_cast<size_t>(size());
    Placement p;
    p.offset.resize(n);
    p.slot.resize(n);
    for (size_t r = 1; r < n; ++r) p.offset[r] = p.offset[r - 1] + counts[r - 1];
    const int mine = carrier_[static_cast<size_t>(rank())];
    const bool carries = cross_ != nullptr;
    if (carries) p.cross_counts.assign(static_cast<size_t>(t.num_hosts), 0);
    size_t at = 0;
    for (size_t i = 0; i < n; ++i) {
      const auto r = static_cast<size_t>(carried_order_[i]);
      if (i > 0 && carrier_[static_cast<size_t>(carried_order_[i - 1])] != carrier_[r]) at = 0;
      p.slot[r] = at;
      at += counts[r];
      if (carries && carrier_[r] == mine) p.cross_counts[static_cast<size_t>(t.rank_host[r])] += counts[r];
    }
    p.carried = total_of(p.cross_counts);
    return p;
  }

  // The shared-memory level's counts of one run: what each local rank carries of it; and where
  // this rank's share of it sits in its carrier buffer.
  size_t run_counts(std::pair<size_t, size_t> run, std::span<const size_t> counts, const Placement& p,
                    std::vector<size_t>& local_counts) const {
    local_counts.assign(static_cast<size_t>(local_->size()), 0);
    size_t slot = SIZE_MAX;
    for (size_t r = run.first; r < run.second; ++r) {
      local_counts[static_cast<size_t>(carrier_[r])] += counts[r];
      if (carrier_[r] == local_->rank() && slot == SIZE_MAX) slot = p.slot[r];
    }
    return slot == SIZE_MAX ? 0 : slot;
  }

  std::byte* carried_buffer(size_t bytes) {
    if (carried_.size() < std::max<size_t>(bytes, 64)) carried_.resize(std::max<size_t>(bytes, 64));
    return carried_.data();
  }

  // Each host reduces every part over its ranks into the part's carrier (in local rank order), the
  // carriers reduce their parts across hosts (in host order) as hier_cross_reduce_scatter does, and
  // where hosts differ in size local rank 0 hands its host's ranks their parts: the order of the
  // levels' allreduce, so a part has the bits of that allreduce's slice.
  void reduce_scatter_levels(const void* send, std::byte* recv, std::span<const size_t> counts, DType dtype,
                             ReduceOp op) {
    const ReduceOp level_op = op == ReduceOp::Mean ? ReduceOp::Sum : op;
    const size_t es = dtype_size(dtype);
    const Placement p = place(counts);
    std::byte* carried = carried_buffer(p.carried * es);
    std::vector<size_t> local_counts;
    for (const auto& run : runs_) {
      const size_t slot = run_counts(run, counts, p, local_counts);
      if (total_of(local_counts) == 0) continue;
      local_->reduce_scatterv(static_cast<const std::byte*>(send) + p.offset[run.first] * es, carried + slot * es,
                              local_counts, dtype, level_op, std::nullopt);
    }
    const size_t mine = counts[static_cast<size_t>(rank())];
    if (even_) {
      hier_cross_reduce_scatter(*cross_, carried, p.cross_counts, recv, dtype, level_op, scratch_);
    } else {
      const Topology& t = world_->topology();
      std::byte* host_part = carried;
      if (cross_ != nullptr) {
        for (int h = 0; h < t.host; ++h) host_part += p.cross_counts[static_cast<size_t>(h)] * es;
        hier_cross_reduce_scatter(*cross_, carried, p.cross_counts, host_part, dtype, level_op, scratch_);
      }
      Routes routes(Collective::Scatter, 0, static_cast<uint64_t>(local_->size()));
      for (size_t l = 0; l < host_ranks_.size(); ++l) {
        const auto r = static_cast<size_t>(host_ranks_[l]);
        routes.count[routes.at(0, l)] = counts[r];
        routes.send_displ[routes.at(0, l)] = p.slot[r] - p.slot[static_cast<size_t>(host_ranks_[0])];
      }
      local_->exchange(host_part, recv, routes, dtype);
    }
    if (op == ReduceOp::Mean) finish_mean(recv, mine, dtype);
  }

  // With hosts of equal sizes each rank carries its own part to its cross group (one MPI exchange,
  // so each part crosses to each other host once), then each host's ranks share what they carry
  // (in place, run by run). Otherwise local rank 0 gathers its host's parts, the hosts' ranks 0
  // all-gather them, and each broadcasts the whole over its host. Bits are moved, never combined.
  void allgather_levels(const void* send, std::byte* recv, std::span<const size_t> counts, DType dtype) {
    const size_t es = dtype_size(dtype);
    const Placement p = place(counts);
    const auto me = static_cast<size_t>(rank());
    std::byte* own = recv + p.offset[me] * es;
    if (send == own) send = nullptr;
    if (even_) {
      // The exchange wants its two buffers apart: in place, the own part goes from a copy.
      const void* from = send;
      if (from == nullptr) from = std::memcpy(carried_buffer(counts[me] * es), own, counts[me] * es);
      if (send != nullptr) std::memcpy(own, send, counts[me] * es);
      const auto hosts = static_cast<uint64_t>(cross_->size());
      Routes routes(Collective::Alltoall, -1, hosts);
      for (uint64_t s = 0; s < hosts; ++s) {
        const auto r = static_cast<size_t>(cross_world_[s]);
        for (uint64_t d = 0; d < hosts; ++d) {
          if (d == s) continue;
          routes.count[routes.at(s, d)] = counts[r];
          routes.recv_displ[routes.at(s, d)] = p.offset[r];
        }
      }
      cross_->exchange(from, recv, routes, dtype);
      std::vector<size_t> local_counts;
      for (const auto& run : runs_) {
        run_counts(run, counts, p, local_counts);
        if (total_of(local_counts) == 0) continue;
        local_->allgatherv(nullptr, recv + p.offset[run.first] * es, local_counts, dtype);
      }
      return;
    }
    std::byte* carried = carried_buffer(p.carried * es);
    Routes gather(Collective::Gather, 0, static_cast<uint64_t>(local_->size()));
    for (size_t l = 0; l < host_ranks_.size(); ++l) {
      const auto r = static_cast<size_t>(host_ranks_[l]);
      gather.count[gather.at(l, 0)] = counts[r];
      gather.recv_displ[gather.at(l, 0)] = p.slot[r];
    }
    local_->exchange(send != nullptr ? send : own, carried, gather, dtype);
    if (cross_ != nullptr) {
      cross_->allgatherv(nullptr, carried, p.cross_counts, dtype);
      for (size_t r = 0; r < p.offset.size(); ++r)
        std::memcpy(recv + p.offset[r] * es, carried + p.slot[r] * es, counts[r] * es);
    }
    local_->broadcast(recv, total_of(counts), dtype, 0);
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
  // A word from a group over this one (carry_call_word) counts as part of the call.
  void require_same_call(const CallSignature& mine) {
    ++calls_;
    const uint64_t word = std::exchange(call_word_, 0);
    if (!check_mismatch_) return;
    const int64_t h = signature_word(mine) ^ static_cast<int64_t>(mix64(word) >> 1);
    std::array<int64_t, 2> extremes{h, -h};
    const BufferRef b{extremes.data(), extremes.data(), extremes.size()};
    world_->allreduce(std::span<const BufferRef>(&b, 1), DType::I64, ReduceOp::Max);
    if (extremes[0] == -extremes[1]) return;
    require_same_gathered_calls([&] { return fmt::format("hier group (rank {} of {})", rank(), size()); }, calls_, mine,
                                size(),
                                [&](const int64_t* word, int64_t* all, size_t words) {
                                  world_->allgather(word, all, words * static_cast<size_t>(size()), DType::I64);
                                });
    // Every rank's call alike here: the words differed, and every rank saw the same hashes.
    fail(GRADSYNC_E_MISMATCH,
         "hier group (rank {} of {}) call {}: the ranks made this same call for different calls of the group built "
         "over this one",
         rank(), size(), calls_);
  }

  // A level that failed on this rank leaves peers waiting in another level: stop them all now
  // rather than at their deadlines. The group then needs a reset, as after any failure. The
  // level's message names its own ranks: the caller gets them as this group's too.
  template <class Levels>
  void run_levels(const Levels& levels) {
    try {
      levels();
    } catch (const Error& e) {
      abort();
      throw Error(e.status(),
                  fmt::format("{} [in the levels of this hier group of {}: the shared-memory level's ranks "
                              "0, 1, ... are the group's {}; the cross-host level's are the group's {}]",
                              e.what(), size(), fmt::join(host_ranks_, ", "), fmt::join(cross_world_, ", ")));
    }
  }

  void finish_mean(void* data, size_t count, DType dtype) const {
    divide_by(dtype, data, count, static_cast<size_t>(size()));
  }

  // Host h's shared-memory level: rank 0's nonce and the host (hosts that labels make distinct
  // may share one /dev/shm).
  std::string level_name(int h) const { return fmt::format("gs-h{:016x}.{}", nonce_, h); }
  uint64_t nonce_ = 0;
  std::unique_ptr<Communicator> world_, local_, cross_;
  bool even_ = true;
  bool one_host_ = false;
  uint64_t call_word_ = 0;  // carry_call_word's, for the next call
  bool topology_independent_ = false;
  bool check_mismatch_ = true;
  uint64_t calls_ = 0;              // the calls in levels, for messages
  std::vector<std::byte> scratch_;  // the cross-host level's copy of the other host's slice
  // The parts' travel (plan_parts): every rank's carrier, the ranks in their carriers' buffer
  // order, the shared-memory level's runs [first, last), this host's ranks in local order, and
  // the world rank of each member of this rank's cross group.
  std::vector<int> carrier_, carried_order_, host_ranks_, cross_world_;
  std::vector<std::pair<size_t, size_t>> runs_;
  std::vector<std::byte> carried_;  // what this rank carries across hosts
};

}  // namespace

namespace {

// Two hosts: each member sends the other the part that the other keeps (give) and both fold host
// 0's copy then host 1's into out (keep's place, or apart): the bits of the rank-order reduction
// over the two, in one exchange where a reduce-scatter and an all-gather over MPI cost two
// collectives. In windows, so that the copy held is bounded as the rank-order allreduce's is.
void exchange_fold(Communicator& cross, const std::byte* give, size_t give_count, const std::byte* keep,
                   size_t keep_count, std::byte* out, DType dtype, ReduceOp op, std::vector<std::byte>& scratch) {
  const size_t es = dtype_size(dtype);
  const size_t window = std::max<size_t>(kCrossWindowBytes / es, 1);
  const size_t held = std::max<size_t>(std::min(keep_count, window), 1) * es;
  if (scratch.size() < held) scratch.resize(held);
  const auto me = static_cast<uint64_t>(cross.rank()), other = 1 - me;
  Routes routes(Collective::Alltoall, -1, 2);
  for (size_t lo = 0; lo < std::max(give_count, keep_count); lo += window) {
    const size_t g = lo < give_count ? std::min(window, give_count - lo) : 0;
    const size_t k = lo < keep_count ? std::min(window, keep_count - lo) : 0;
    routes.count[routes.at(me, other)] = g;
    routes.count[routes.at(other, me)] = k;
    cross.exchange(give + lo * es, scratch.data(), routes, dtype);
    const std::byte* mine = keep + lo * es;
    const std::array<const void*, 2> sources =
        me == 0 ? std::array<const void*, 2>{mine, scratch.data()} : std::array<const void*, 2>{scratch.data(), mine};
    reduce(dtype, op, sources.data(), sources.size(), out + lo * es, 0, k);
  }
}

}  // namespace

void hier_cross_allreduce(Communicator& cross, void* data, size_t count, DType dtype, ReduceOp op,
                          std::vector<std::byte>& scratch) {
  if (cross.size() != 2) {
    const BufferRef b{data, data, count};
    return cross.allreduce(std::span<const BufferRef>(&b, 1), dtype, op);
  }
  auto* d = static_cast<std::byte*>(data);
  exchange_fold(cross, d, count, d, count, d, dtype, op, scratch);
}

void hier_cross_reduce_scatter(Communicator& cross, const void* data, std::span<const size_t> counts, void* out,
                               DType dtype, ReduceOp op, std::vector<std::byte>& scratch) {
  if (cross.size() != 2) return cross.reduce_scatterv(data, out, counts, dtype, op, std::nullopt);
  const auto* d = static_cast<const std::byte*>(data);
  const size_t es = dtype_size(dtype);
  const std::byte* first = d;
  const std::byte* second = d + counts[0] * es;
  const bool me0 = cross.rank() == 0;
  exchange_fold(cross, me0 ? second : first, counts[me0 ? 1 : 0], me0 ? first : second, counts[me0 ? 0 : 1],
                static_cast<std::byte*>(out), dtype, op, scratch);
}

std::unique_ptr<Communicator> make_hierarchical_communicator(std::unique_ptr<Communicator> world,
                                                             const Options& options) {
  return std::make_unique<HierCommunicator>(std::move(world), options);
}

}  // namespace gradsync::comm
