// SPDX-License-Identifier: Apache-2.0
#include "comm/transport/threaded/threaded_communicator.hpp"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/call_signature.hpp"
#include "comm/reduce.hpp"
#include "comm/verdict.hpp"
#include "common/bounded_wait.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "common/random.hpp"
#include "common/wait.hpp"

namespace gradsync::comm {
namespace {

// The flat fold (half types, the integer mean, topology_independent) gathers every rank's
// contribution: in windows of about this many bytes over all ranks together.
constexpr size_t kFlatWindowBytes = size_t{4} << 20;

constexpr int kMaxThreads = 256;

// The largest single-buffer allreduce whose call check is folded into the lane's call.
constexpr uint64_t kFoldBytes = 64 * 1024;

// The process-level group of one process (the lane), shared by its threads and called by the
// team's rank 0 only. Made by the team's rank 0 (a new group, a split, a shrink, a grow, a join);
// status and message say why it could not be, for the other threads to report.
struct Lane {
  std::unique_ptr<Communicator> comm;
  std::vector<int> proc_of;  // every rank's process (lane rank), by rank (a new group's only)
  // A shrink's outcome, from thread 0 to its siblings: the lane's (its comm moved to `comm`), with
  // `failed` as the old group's ranks, and a nonce that names the new teams apart from any earlier
  // group's.
  ShrinkResult shrunk;
  uint64_t nonce = 0;
  // A grow's outcome (members and joiners alike): the ranks before it, the joiners' first member
  // id, the lane's phase times, and the grown group's name (the lane's: the join name).
  int old_ranks = 0;
  int64_t first_member_id = 0;
  std::chrono::nanoseconds agree{0}, form{0};
  std::string name;
  int status = 0;
  std::string message;
  // Whether the lane's call check can take a word (Communicator::carry_call_word), as thread 0
  // found it for every thread (checked_levels).
  bool carries_words = false;
  // The stops of this process's levels, counted, and the last one: whether it was a timeout, and
  // its message. A thread that meets an abort tells from them what brought it (run_levels).
  std::mutex stop_lock;
  uint64_t stops = 0;
  bool stop_timed_out = false;
  std::string stop_message;
};

// The team's rank 0 hands its threads a shared object it made: by address, through the team (one
// address space), then a barrier so that the object outlives every copy being taken.
template <class T>
std::shared_ptr<T> share(Communicator& team, std::shared_ptr<T> made) {
  auto address = static_cast<int64_t>(reinterpret_cast<intptr_t>(&made));
  team.broadcast(&address, 1, DType::I64, 0);
  std::shared_ptr<T> taken = *reinterpret_cast<std::shared_ptr<T>*>(static_cast<intptr_t>(address));
  team.barrier();
  return taken;
}

// What the team's rank 0 makes of the lane (`make` fills a Lane: a new group's, a shrink's, a
// grow's), handed to every thread of the team; its failure is every thread's, its siblings naming
// what thread 0 could not do (`what`).
//
// The making may outlast the team's timeout by its own bounds (a shrink's agreement takes an
// attempt per rank found lost, each up to a timeout; a grow spawns processes), so the siblings do
// not wait for it in a team call, whose deadline would stop the team under thread 0's feet. The
// team first shares a handoff (every thread calls this within a timeout of the others, or that
// call fails them all), then the siblings wait on it for as long as thread 0 takes: every wait of
// the making is bounded, and thread 0 publishes whatever it ends in, an exception of any kind
// included (published as thread 0 unwinds, with no outcome: its siblings then fail alike). The
// siblings take no abort or interrupt meanwhile: they could only leave before the new group's
// team, which thread 0 would then wait for.
struct Handoff {
  WaitWord word;
  std::atomic<uint32_t> published{0};
  std::shared_ptr<Lane> made;  // null: thread 0 left by an exception other than Error
};
template <class Make>
std::shared_ptr<Lane> made_by_thread0(Communicator& team, const char* what, const Make& make) {
  const std::shared_ptr<Handoff> handoff = share(team, team.rank() == 0 ? std::make_shared<Handoff>() : nullptr);
  if (team.rank() == 0) {
    struct Publish {
      Handoff& h;
      ~Publish() {
        h.published.store(1, std::memory_order_seq_cst);
        notify(h.word);
      }
    } publish{*handoff};
    auto made = std::make_shared<Lane>();
    try {
      make(*made);
    } catch (const Error& e) {
      made->comm.reset();
      made->status = e.status();
      made->message = e.what();
    }
    handoff->made = std::move(made);
  } else {
    auto ready = [&] { return handoff->published.load(std::memory_order_seq_cst) != 0; };
    auto deadline = WaitClock::time_point::max();
    bounded_wait([&](WaitClock::time_point until) { return wait_until(handoff->word, ready, until); }, wait_never,
                 wait_never,
                 [&](std::chrono::nanoseconds waited) {
                   GS_LOG_WARN("thread {} of this process: waiting {} s for thread 0 to {}", team.rank(),
                               std::chrono::duration_cast<std::chrono::seconds>(waited).count(), what);
                 },
                 wait_ends, deadline, std::chrono::nanoseconds::max());
    if (handoff->made == nullptr)
      fail(GRADSYNC_E_INTERNAL, "thread 0 of this process could not {}: it ended with an unexpected exception", what);
  }
  const std::shared_ptr<Lane>& shared = handoff->made;
  if (shared->status != 0) {
    throw Error(shared->status, team.rank() == 0
                                    ? shared->message
                                    : fmt::format("thread 0 of this process could not {}: {}", what, shared->message));
  }
  return shared;
}

// Every process's thread count, by lane rank, reported over a lane just made (a new group's, a
// grow's). report_threads: a new group's layout from them, checked.
std::vector<int64_t> reported_threads(Communicator& lane, int threads) {
  std::vector<int64_t> counts(static_cast<size_t>(lane.size()));
  const int64_t mine = threads;
  lane.allgather(&mine, counts.data(), counts.size(), DType::I64);
  return counts;
}
void report_threads(Lane& made, int threads) {
  made.proc_of = lay_out_ranks(reported_threads(*made.comm, threads), made.comm->rank(), threads);
}

// A grown lane (`made`, thread 0 of a member or a joiner; member_procs: the processes before the
// grow): the processes report their thread counts over it, and the members' first process hands
// every joiner the group's layout before the grow (old_proc_of, each rank's process; a joiner
// passes none), the first member id the joiners take and the grown group's name. The grown group
// keeps its members' ranks (comm.h), whatever their layout (a shrink's or a split's), and lays
// out the joiners' threads after them, process by process.
void meet_grown(Lane& made, int threads, int member_procs, std::span<const int> old_proc_of, int64_t first_id) {
  Communicator& lane = *made.comm;
  const std::vector<int64_t> counts = reported_threads(lane, threads);
  std::array<int64_t, 2> words{static_cast<int64_t>(old_proc_of.size()), first_id};
  lane.broadcast(words.data(), words.size(), DType::I64, 0);
  const int64_t old_ranks = words[0];
  GS_REQUIRE(old_ranks >= 1 && old_ranks <= int64_t{member_procs} * kMaxThreads && words[1] >= old_ranks &&
                 words[1] <= (int64_t{1} << 53),
             GRADSYNC_E_CORRUPT,
             "threads as ranks: grow: the members' first process sent a group of {} ranks of {} processes and member "
             "ids from {} (a peer's word gone bad)",
             old_ranks, member_procs, words[1]);
  std::vector<int64_t> layout(static_cast<size_t>(old_ranks));
  std::copy(old_proc_of.begin(), old_proc_of.end(), layout.begin());
  lane.broadcast(layout.data(), layout.size(), DType::I64, 0);
  made.proc_of = lay_out_grown(counts, layout, lane.rank(), threads, member_procs);
  made.old_ranks = static_cast<int>(old_ranks);
  made.first_member_id = words[1];
  made.name = lane.group_options().name;
}

class ThreadedCommunicator final : public Communicator {
 public:
  // proc_of: every rank's process (its lane rank), by rank; a process's ranks, in rank order, are
  // its team's ranks in order.
  ThreadedCommunicator(std::unique_ptr<Communicator> team, std::shared_ptr<Lane> lane, std::vector<int> proc_of,
                       int rank, const Options& options)
      : team_(std::move(team)),
        lane_(std::move(lane)),
        proc_of_(std::move(proc_of)),
        rank_(rank),
        transport_(options.transport),
        topology_independent_(options.topology_independent),
        check_mismatch_(options.check_mismatch) {
    const auto n = proc_of_.size();
    procs_.resize(static_cast<size_t>(*std::max_element(proc_of_.begin(), proc_of_.end()) + 1));
    team_of_.resize(n);
    for (size_t r = 0; r < n; ++r) {
      auto& members = procs_[static_cast<size_t>(proc_of_[r])];
      team_of_[r] = static_cast<int>(members.size());
      members.push_back(static_cast<int>(r));
    }
    my_proc_ = proc_of_[static_cast<size_t>(rank_)];
    GS_REQUIRE(team_->rank() == team_of_[static_cast<size_t>(rank_)] &&
                   team_->size() == static_cast<int>(procs_[static_cast<size_t>(my_proc_)].size()) &&
                   lane_->comm->rank() == my_proc_ && lane_->comm->size() == static_cast<int>(procs_.size()),
               GRADSYNC_E_INTERNAL, "threads as ranks: rank {} is thread {} of {} in process {} of {}, not as laid out",
               rank_, team_->rank(), team_->size(), lane_->comm->rank(), lane_->comm->size());
    GS_LOG_DEBUG("threads as ranks: rank {} of {}: thread {} of {} in process {} of {}", rank_, n, team_->rank(),
                 team_->size(), my_proc_, procs_.size());
  }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return static_cast<int>(proc_of_.size()); }
  Transport transport() const noexcept override { return transport_; }

  void allreduce(std::span<const BufferRef> buffers, DType dtype, ReduceOp op) override {
    telemetry_.measure(Collective::Allreduce, payload_bytes(buffers, dtype), [&] {
      // Folded, one buffer's sum is staged on thread 0 (allreduce_levels): above kFoldBytes that
      // copy costs more than the lane round the fold saves.
      const bool foldable = !flat_for(dtype, op) && (buffers.size() > 1 || payload_bytes(buffers, dtype) <= kFoldBytes);
      checked_levels(allreduce_call(buffers, dtype, op), foldable, [&] { allreduce_levels(buffers, dtype, op); });
    });
  }
  void broadcast(void* buf, size_t count, DType dtype, int root) override {
    telemetry_.measure(Collective::Broadcast, count * dtype_size(dtype), [&] {
      require_same_call(broadcast_call(count, dtype, root));
      GS_REQUIRE(root >= 0 && root < size(), GRADSYNC_E_OUT_OF_RANGE,
                 "threaded group: broadcast from root {} of a group of {} ranks", root, size());
      run_levels([&] { broadcast_levels(static_cast<std::byte*>(buf), count, dtype, root); });
    });
  }
  void allgatherv(const void* send, void* recv, std::span<const size_t> counts, DType dtype) override {
    const uint64_t bytes = std::accumulate(counts.begin(), counts.end(), uint64_t{0}) * dtype_size(dtype);
    telemetry_.measure(Collective::Allgather, bytes, [&] {
      checked_levels(allgather_call(counts, dtype), true,
                     [&] { allgather_levels(send, static_cast<std::byte*>(recv), counts, dtype); });
    });
  }
  void reduce_scatterv(const void* send, void* recv, std::span<const size_t> counts, DType dtype, ReduceOp op,
                       std::optional<int> root) override {
    const uint64_t bytes = std::accumulate(counts.begin(), counts.end(), uint64_t{0}) * dtype_size(dtype);
    telemetry_.measure(Collective::ReduceScatter, bytes, [&] {
      // A root is judged by the group: the explicit check first (the rooted reduce folds flat).
      if (root.has_value()) {
        require_same_call(reduce_scatter_call(counts, dtype, op, root));
        // Every rank passed this root (checked above), so every rank refuses it alike.
        GS_REQUIRE(*root >= 0 && *root < size(), GRADSYNC_E_OUT_OF_RANGE,
                   "threaded group: reduce to root {} of a group of {} ranks", *root, size());
        return run_levels([&] { reduce_scatter_levels(send, static_cast<std::byte*>(recv), counts, dtype, op, root); });
      }
      checked_levels(reduce_scatter_call(counts, dtype, op, root), !flat_for(dtype, op),
                     [&] { reduce_scatter_levels(send, static_cast<std::byte*>(recv), counts, dtype, op, root); });
    });
  }
  void exchange(const void* send, void* recv, const Routes& routes, DType dtype) override {
    uint64_t sent = 0;
    for (size_t d = 0; d < routes.n; ++d) sent += routes.count[routes.at(static_cast<uint64_t>(rank()), d)];
    telemetry_.measure(Collective::Alltoall, sent * dtype_size(dtype), [&] {
      // A gather's or scatter's root: judged by the group in the explicit check (the base's round of
      // counts took it as every rank passed it, so this rank's root is every rank's once they agree).
      const bool rooted = routes.form != Collective::Alltoall;
      if (rooted) {
        require_same_call(exchange_call(routes, dtype));
        GS_REQUIRE(routes.root >= 0 && routes.root < size(), GRADSYNC_E_OUT_OF_RANGE,
                   "threaded group: {} with root {} in a group of {} ranks", collective_name(routes.form), routes.root,
                   size());
      }
      const auto levels = [&] {
        exchange_levels(static_cast<const std::byte*>(send), static_cast<std::byte*>(recv), routes, dtype);
      };
      if (rooted) return run_levels(levels);
      checked_levels(exchange_call(routes, dtype), true, levels);
    });
  }
  // Its rounds are the check's where it has one (checked_levels), else the levels' own barriers.
  void barrier() override {
    telemetry_.measure(Collective::Barrier, 0, [&] {
      checked_levels(barrier_call(), true, [&] {
        // The explicit check met every rank (no rank leaves its allreduce before all have arrived);
        // a folded check's team round met the team's.
        if (check_mismatch_ && !folding_) return;
        if (!folding_) team_->barrier();
        if (voice()) lane_call([&] { lane().barrier(); });
        if (folding_) {
          calls_agree();
        } else {
          team_->barrier();
        }
      });
    });
  }
  void weighted_mean(const void* send, void* recv, size_t count, DType dtype, uint64_t weight,
                     uint64_t* total_weight) override {
    telemetry_.measure(Collective::WeightedMean, count * dtype_size(dtype), [&] {
      // Judged by the group: a weight one rank gets wrong fails every rank, naming it.
      const bool heavy = weight > (uint64_t{1} << 53);
      checked_levels(
          weighted_mean_call(count, dtype), false, [] {}, heavy, weight);
      GS_REQUIRE(dtype == DType::F32 || dtype == DType::F64, GRADSYNC_E_INVALID_ARG,
                 "weighted mean needs f32 or f64, got {}", dtype_name(dtype));
      // The products summed in rank order (comm.h), by the flat fold. Only the sums run in levels:
      // a total weight of 0 fails every rank alike after them.
      windowed_weighted_mean(send, recv, count, dtype, weight, total_weight, kWeightedWindow,
                             [&](double* data, size_t n) {
                               run_levels([&] { flat_fold(data, n, DType::F64, ReduceOp::Sum, 0, n, data); });
                             });
    });
  }

  // Every level of this process: the team's peers and, through the lane, the other processes.
  void abort() noexcept override {
    record_stop(false, "aborted");
    team_->abort();
    lane_->comm->abort();
  }
  // Collective over every rank: the team first, so that no thread of this process is still in a
  // failing call that stops its lane (run_levels), then each thread its own lane.
  void reset() override {
    team_->reset();
    if (Communicator* mine = active_lane()) mine->reset();
    stopped_.clear();
  }
  // Every thread of every surviving process calls it. A lost process takes all of its threads'
  // ranks; a living process loses none, so its team stays whole and is only reset. Thread 0
  // shrinks the lane (the lane transport's shrink: the survivors agree on the lost processes,
  // bounded by the deadline); every thread then builds the new group over a new team, laid out
  // as the old one without the lost processes.
  ShrinkResult shrink() override {
    team_->reset();
    std::shared_ptr<Lane> shared = made_by_thread0(*team_, "shrink the group's process-level group", [&](Lane& made) {
      made.shrunk = lane().shrink();
      made.comm = std::move(made.shrunk.comm);
      made.carries_words = made.comm->carries_call_words();
      // One nonce for the whole group (the lane's rank 0's): the new teams are named apart from
      // any earlier group's, as split's subgroups are.
      auto nonce = static_cast<int64_t>(made.comm->rank() == 0 ? random_nonce() : 0);
      made.comm->broadcast(&nonce, 1, DType::I64, 0);
      made.nonce = static_cast<uint64_t>(nonce);
      // The old group's ranks that are out: every thread of every lost process.
      std::vector<int> failed;
      for (size_t r = 0; r < proc_of_.size(); ++r)
        if (std::binary_search(made.shrunk.failed.begin(), made.shrunk.failed.end(), proc_of_[r]))
          failed.push_back(static_cast<int>(r));
      made.shrunk.failed = std::move(failed);
    });
    std::unique_ptr<Communicator> team = new_team(group_options().name, 's', shared->nonce);
    // The layout is the old one without the lost processes: the survivors keep their order (the
    // new ranks), and the processes theirs (the new lane's ranks, which the constructor checks).
    std::vector<int> survivors;
    for (int r = 0; r < size(); ++r)
      if (!std::binary_search(shared->shrunk.failed.begin(), shared->shrunk.failed.end(), r)) survivors.push_back(r);
    std::vector<bool> alive(procs_.size(), false);
    for (int r : survivors) alive[static_cast<size_t>(proc_of_[static_cast<size_t>(r)])] = true;
    std::vector<int> process_now(procs_.size(), -1);  // by old process: its new lane rank
    for (size_t p = 0, next = 0; p < alive.size(); ++p)
      if (alive[p]) process_now[p] = static_cast<int>(next++);
    std::vector<int> proc_of;
    for (int r : survivors) proc_of.push_back(process_now[static_cast<size_t>(proc_of_[static_cast<size_t>(r)])]);
    const int new_rank = static_cast<int>(std::find(survivors.begin(), survivors.end(), rank_) - survivors.begin());
    auto group =
        std::make_unique<ThreadedCommunicator>(std::move(team), shared, std::move(proc_of), new_rank, group_options());
    pass_identity(*group, group_options(), topology().restricted(survivors, new_rank));
    group->take_identity(member_id(), next_member_id());
    ShrinkResult result;
    result.comm = std::move(group);
    result.failed = shared->shrunk.failed;
    result.attempts = shared->shrunk.attempts;
    result.agree = shared->shrunk.agree;
    result.form = shared->shrunk.form;
    return result;
  }
  // Every thread of every member process calls it; `joiners` counts processes (MPI starts
  // processes), each of whose threads joins (join_threaded_communicator). Thread 0 grows the lane
  // (the lane transport's grow: spawn, merge, commit); the processes then meet over the grown lane
  // (meet_grown), and every thread builds the grown group over a new team.
  GrowResult grow(const std::string& join_name, int joiners) override {
    std::shared_ptr<Lane> shared = made_by_thread0(*team_, "grow the group's process-level group", [&](Lane& made) {
      GrowResult grown = lane().grow(join_name, joiners);
      made.comm = std::move(grown.comm);
      made.carries_words = made.comm->carries_call_words();
      made.agree = grown.agree;
      made.form = grown.form;
      made.nonce = random_nonce();
      meet_grown(made, static_cast<int>(threads()), static_cast<int>(procs_.size()), proc_of_, next_member_id());
    });
    std::unique_ptr<Communicator> team = new_team(shared->name, 'g', shared->nonce);
    Options o = group_options();
    o.name = shared->name;
    return settle_grown(std::move(team), shared, o, member_id());
  }

  // The grown group, on every thread of a member (own_id: its member id) or a joiner: laid out as
  // meet_grown said, with the members' ids kept and the joiners' new, its topology detected, and
  // committed by one barrier, whose outcome is every rank's.
  static GrowResult settle_grown(std::unique_ptr<Communicator> team, std::shared_ptr<Lane> lane, const Options& o,
                                 std::optional<int64_t> own_id) {
    const auto formed_start = std::chrono::steady_clock::now();
    std::vector<int> proc_of = lane->proc_of;
    const auto first = std::find(proc_of.begin(), proc_of.end(), lane->comm->rank()) - proc_of.begin();
    const int rank = static_cast<int>(first) + team->rank();
    auto group = std::make_unique<ThreadedCommunicator>(std::move(team), lane, std::move(proc_of), rank, o);
    const int64_t joined = group->size() - lane->old_ranks;
    group->establish(o);  // ids by rank, as a new group's: the grow's below
    group->take_identity(own_id.value_or(lane->first_member_id + (rank - lane->old_ranks)),
                         lane->first_member_id + joined);
    group->barrier();
    GrowResult result;
    result.old_size = lane->old_ranks;
    result.new_size = group->size();
    result.first_member_id = lane->first_member_id;
    result.agree = lane->agree;
    result.form = lane->form + (std::chrono::steady_clock::now() - formed_start);
    result.comm = std::move(group);
    return result;
  }
  const char* progress_thread_refused() const noexcept override {
    const Communicator* mine = active_lane();
    return mine != nullptr ? mine->progress_thread_refused() : team_->progress_thread_refused();
  }
  void release_after_fork() noexcept override {
    team_->release_after_fork();
    if (Communicator* mine = active_lane()) mine->release_after_fork();
  }
  void set_interrupt(InterruptCheck check) noexcept override {
    Communicator::set_interrupt(check);
    team_->set_interrupt(check);
    if (Communicator* mine = active_lane()) mine->set_interrupt(check);
  }

 protected:
  // Each process's thread 0 forms the lanes of every subgroup with a rank on its process, over
  // its lane, in color order on every process (MPI_Comm_create_group is collective over a
  // subgroup's processes: two processes that share subgroups form them in the same order), and
  // hands each to the subgroup's threads here. So any split works, whichever threads a subgroup
  // takes on each process, and no MPI communicator is used by two threads at once: a subgroup's
  // lane is called by its rank 0 on the process only.
  std::unique_ptr<Communicator> split_by(std::span<const int64_t> table, int color, uint64_t split_number) override {
    std::vector<int64_t> colors;  // of the subgroups with a rank on this process, ascending
    for (int r : my_ranks()) colors.push_back(table[3 * static_cast<size_t>(r)]);
    std::sort(colors.begin(), colors.end());
    colors.erase(std::unique(colors.begin(), colors.end()), colors.end());
    colors.erase(std::remove(colors.begin(), colors.end(), int64_t{kNoColor}), colors.end());
    auto made = std::make_shared<std::vector<std::shared_ptr<Lane>>>();
    if (voice()) {
      for (const int64_t c : colors) {
        const Subgroup sub = subgroup_of(table, static_cast<int>(c), split_number);
        const std::vector<int> procs = processes_of(sub.members);
        const auto q = std::find(procs.begin(), procs.end(), my_proc_) - procs.begin();
        auto lane_of = std::make_shared<Lane>();
        try {
          lane_of->comm = (lane().form_subgroup(Subgroup{static_cast<int>(q), procs, sub.name + ".l", sub.abandoned}));
          lane_of->carries_words = lane_of->comm->carries_call_words();
        } catch (const Error& e) {
          lane_of->status = e.status();
          lane_of->message = e.what();
        }
        made->push_back(std::move(lane_of));
      }
    }
    const auto shared = share(*team_, voice() ? made : nullptr);
    if (color == kNoColor) return nullptr;
    split_lane_ = (*shared)[static_cast<size_t>(std::find(colors.begin(), colors.end(), color) - colors.begin())];
    return form_subgroup(subgroup_of(table, color, split_number));
  }

  // split_by's second half, through form_subgroup: the subgroup's threads here form their team, and
  // take the lane thread 0 formed.
  std::unique_ptr<Communicator> make_subgroup(const Subgroup& sub) override {
    GS_REQUIRE(split_lane_ != nullptr, GRADSYNC_E_INTERNAL, "threaded group: a subgroup is formed by split() only");
    const std::shared_ptr<Lane> formed = std::move(split_lane_);
    if (formed->status != 0) {
      throw Error(formed->status, voice() ? formed->message
                                          : fmt::format("split of a threaded group: thread 0 of this process could not "
                                                        "form the subgroup's process-level group: {}",
                                                        formed->message));
    }
    const std::vector<int> procs = processes_of(sub.members);
    std::vector<int> proc_of(sub.members.size()), mine;  // mine: this process's threads, in subgroup order
    for (size_t i = 0; i < sub.members.size(); ++i) {
      const auto r = static_cast<size_t>(sub.members[i]);
      proc_of[i] = static_cast<int>(std::find(procs.begin(), procs.end(), proc_of_[r]) - procs.begin());
      if (proc_of_[r] == my_proc_) mine.push_back(team_of_[r]);
    }
    const auto my_thread = static_cast<int>(std::find(mine.begin(), mine.end(), team_->rank()) - mine.begin());
    std::unique_ptr<Communicator> team = team_->form_subgroup(Subgroup{my_thread, mine, sub.name, sub.abandoned});
    return std::make_unique<ThreadedCommunicator>(std::move(team), formed, std::move(proc_of), sub.rank,
                                                  group_options());
  }

 private:
  bool voice() const noexcept { return team_->rank() == 0; }
  // A team of this process's threads for a group made of this one (a shrink's, a grow's), named
  // apart from any earlier group's by the nonce.
  std::unique_ptr<Communicator> new_team(const std::string& name, char tag, uint64_t nonce) {
    std::vector<int> members(threads());
    std::iota(members.begin(), members.end(), 0);
    return team_->form_subgroup(
        Subgroup{team_->rank(), members, fmt::format("{}.{}{:x}", name.substr(0, 40), tag, nonce), nullptr});
  }
  Communicator& lane() const noexcept { return *lane_->comm; }
  // The processes of these ranks, in the order of their first rank here.
  std::vector<int> processes_of(const std::vector<int>& ranks) const {
    std::vector<int> procs;
    for (int r : ranks) {
      const int p = proc_of_[static_cast<size_t>(r)];
      if (std::find(procs.begin(), procs.end(), p) == procs.end()) procs.push_back(p);
    }
    return procs;
  }
  // The lane, where this thread calls it: the team's rank 0.
  Communicator* active_lane() const noexcept { return voice() ? lane_->comm.get() : nullptr; }
  size_t threads() const noexcept { return static_cast<size_t>(team_->size()); }
  const std::vector<int>& my_ranks() const noexcept { return procs_[static_cast<size_t>(my_proc_)]; }

  std::byte* stage(std::vector<std::byte>& s, size_t bytes) {
    if (s.size() < bytes) s.resize(bytes);
    return s.data();
  }

  // The team's gather (to its rank 0) or scatter (from it) of sizes[l] elements of member l,
  // packed in team order from element `base` of rank 0's buffer.
  Routes team_routes(Collective form, std::span<const size_t> sizes, size_t base = 0) const {
    Routes routes(form, 0, threads());
    for (size_t l = 0, at = base; l < threads(); at += sizes[l], ++l) {
      const size_t k = form == Collective::Gather ? routes.at(l, 0) : routes.at(0, l);
      routes.count[k] = sizes[l];
      (form == Collective::Gather ? routes.recv_displ : routes.send_displ)[k] = at;
    }
    return routes;
  }

  // A call's parts (counts by rank) in the caller's rank order and process-major, as the lane moves
  // them: each process's parts together, its ranks in team order.
  struct Blocks {
    std::vector<size_t> offset;       // rank r's part in rank order, size() + 1 entries
    std::vector<size_t> proc_count;   // process p's parts together
    std::vector<size_t> proc_offset;  // where they start process-major, processes + 1 entries
    std::vector<size_t> mine;         // this process's ranks' counts, in team order
  };
  Blocks blocks_of(std::span<const size_t> counts) const {
    Blocks b;
    b.offset.assign(counts.size() + 1, 0);
    for (size_t r = 0; r < counts.size(); ++r) b.offset[r + 1] = b.offset[r] + counts[r];
    b.proc_count.assign(procs_.size(), 0);
    b.proc_offset.assign(procs_.size() + 1, 0);
    for (size_t p = 0; p < procs_.size(); ++p) {
      for (int r : procs_[p]) b.proc_count[p] += counts[static_cast<size_t>(r)];
      b.proc_offset[p + 1] = b.proc_offset[p] + b.proc_count[p];
    }
    for (int r : my_ranks()) b.mine.push_back(counts[static_cast<size_t>(r)]);
    return b;
  }
  // Every rank's part from rank order (in) into process-major order (out), or back.
  void regroup(const Blocks& b, std::span<const size_t> counts, const std::byte* in, std::byte* out,
               bool to_process_major, size_t es) const {
    for (size_t p = 0; p < procs_.size(); ++p) {
      size_t at = b.proc_offset[p];
      for (int r : procs_[p]) {
        const auto u = static_cast<size_t>(r);
        const size_t from = to_process_major ? b.offset[u] : at, to = to_process_major ? at : b.offset[u];
        if (counts[u] > 0) std::memcpy(out + to * es, in + from * es, counts[u] * es);
        at += counts[u];
      }
    }
  }

  // ---- allreduce

  // Whether a reduction of this dtype and op folds flat, in rank order (not through the levels).
  bool flat_for(DType dtype, ReduceOp op) const noexcept {
    return topology_independent_ || !levels_preserve(dtype, op);
  }

  void allreduce_levels(std::span<const BufferRef> buffers, DType dtype, ReduceOp op) {
    if (flat_for(dtype, op)) {
      for (const BufferRef& b : buffers) flat_fold(b.send, b.count, dtype, op, 0, b.count, b.recv);
      return;
    }
    const ReduceOp level_op = op == ReduceOp::Mean ? ReduceOp::Sum : op;
    const size_t es = dtype_size(dtype);
    // Through the team's rank 0 (several buffers packed, one call per level): a slice per thread
    // over its own lane was built and measured slower on every size (bench/mpi/threads_bench.cpp,
    // docs/mpi.md), its threads' MPI calls contending.
    const BufferRef* one = buffers.size() == 1 ? &buffers[0] : nullptr;
    const size_t total = static_cast<size_t>(payload_bytes(buffers, dtype) / es);
    // Folded (checked_levels), thread 0's team sum is staged, and the lane writes the caller's
    // buffer only once its check has passed.
    const bool direct = one != nullptr && !(folding_ && voice());
    std::byte* packed = direct ? static_cast<std::byte*>(one->recv) : stage(packed_, total * es);
    std::byte* result = one != nullptr ? static_cast<std::byte*>(one->recv) : packed;
    const void* send = one != nullptr ? one->send : packed;
    if (one == nullptr) {
      size_t at = 0;
      for (const BufferRef& b : buffers) {
        if (b.count > 0) std::memcpy(packed + at, b.send, b.count * es);
        at += b.count * es;
      }
    }
    team_->reduce_to(send, packed, total, dtype, level_op, 0);
    if (voice()) {
      const BufferRef all{packed, result, total};
      lane_call([&] { lane().allreduce(std::span<const BufferRef>(&all, 1), dtype, level_op); });
      if (op == ReduceOp::Mean && !calls_differ_) divide_by(dtype, result, total, static_cast<size_t>(size()));
    }
    if (!calls_agree()) return;
    team_->broadcast(result, total, dtype, 0);
    if (one == nullptr) {
      size_t at = 0;
      for (const BufferRef& b : buffers) {
        if (b.count > 0) std::memcpy(b.recv, packed + at, b.count * es);
        at += b.count * es;
      }
    }
  }

  // The flat rank-order fold, by every rank of its own: every rank's elements [lo, lo + window)
  // gathered, window by window, and out[i - keep_begin] = the fold of element i for i in
  // [keep_begin, keep_end). The kernels' one fold, so the bits of the thread and shm transports.
  void flat_fold(const void* send, size_t total, DType dtype, ReduceOp op, size_t keep_begin, size_t keep_end,
                 void* out) {
    const size_t es = dtype_size(dtype);
    const auto n = static_cast<size_t>(size());
    const size_t window = std::max<size_t>(kFlatWindowBytes / (n * es), 1);
    std::byte* gathered = stage(flat_, std::min(window, std::max<size_t>(total, 1)) * n * es);
    std::vector<const void*> sources(n);
    std::vector<size_t> counts(n);
    for (size_t lo = 0; lo < total; lo += window) {
      const size_t len = std::min(window, total - lo);
      std::fill(counts.begin(), counts.end(), len);
      allgather_levels(static_cast<const std::byte*>(send) + lo * es, gathered, counts, dtype);
      const size_t b = std::max(lo, keep_begin), e = std::min(lo + len, keep_end);
      if (b >= e) continue;
      for (size_t r = 0; r < n; ++r) sources[r] = gathered + (r * len + (b - lo)) * es;
      reduce(dtype, op, sources.data(), n, static_cast<std::byte*>(out) + (b - keep_begin) * es, 0, e - b);
    }
  }

  // ---- broadcast: the root's team spreads it, the lane carries it between processes, the other
  // processes' teams spread it.

  void broadcast_levels(std::byte* buf, size_t count, DType dtype, int root) {
    const int root_proc = proc_of_[static_cast<size_t>(root)];
    if (my_proc_ == root_proc) team_->broadcast(buf, count, dtype, team_of_[static_cast<size_t>(root)]);
    if (voice()) lane().broadcast(buf, count, dtype, root_proc);
    if (my_proc_ != root_proc) team_->broadcast(buf, count, dtype, 0);
  }

  // ---- allgather: each team gathers its ranks' parts to its rank 0 (process by process, each
  // process's ranks in team order), the lane all-gathers the processes' blocks, rank 0 puts every
  // part in its place and the team takes the whole. Bits move unchanged.

  void allgather_levels(const void* send, std::byte* recv, std::span<const size_t> counts, DType dtype) {
    const size_t es = dtype_size(dtype);
    const Blocks b = blocks_of(counts);
    const size_t total = b.offset.back();
    std::byte* blocks = stage(staged_, std::max<size_t>(total, 1) * es);
    const void* mine = send != nullptr ? send : recv + b.offset[static_cast<size_t>(rank_)] * es;
    team_->exchange(mine, blocks, team_routes(Collective::Gather, b.mine, b.proc_offset[static_cast<size_t>(my_proc_)]),
                    dtype);
    if (voice()) {
      lane_call([&] { lane().allgatherv(nullptr, blocks, b.proc_count, dtype); });
    }
    if (!calls_agree()) return;
    if (voice()) regroup(b, counts, blocks, recv, false, es);
    team_->broadcast(recv, total, dtype, 0);
  }

  // ---- reduce-scatter: in the leader path's allreduce order (the team's fold, then the lane's
  // reduce-scatter of the processes' blocks), each part then handed to its rank by its team.

  void reduce_scatter_levels(const void* send, std::byte* recv, std::span<const size_t> counts, DType dtype,
                             ReduceOp op, std::optional<int> root) {
    const size_t es = dtype_size(dtype);
    const Blocks b = blocks_of(counts);
    const size_t total = b.offset.back();
    const size_t at = b.offset[static_cast<size_t>(rank_)];
    // A rooted reduce too: its root gets the flat fold's bits, as on the hierarchical transport.
    if (root.has_value() || flat_for(dtype, op)) {
      // recv is apart from send or is send's own part, which the fold writes only once it has
      // gathered it.
      return flat_fold(send, total, dtype, op, at, at + counts[static_cast<size_t>(rank_)], recv);
    }
    const ReduceOp level_op = op == ReduceOp::Mean ? ReduceOp::Sum : op;
    std::byte* summed = stage(staged_, std::max<size_t>(total, 1) * es);
    team_->reduce_to(send, summed, total, dtype, level_op, 0);
    const size_t my_block = b.proc_count[static_cast<size_t>(my_proc_)];
    std::byte* block = stage(result_, std::max<size_t>(my_block, 1) * es);
    if (voice()) {
      std::byte* ordered = stage(packed_, std::max<size_t>(total, 1) * es);
      regroup(b, counts, summed, ordered, true, es);
      lane_call([&] { lane().reduce_scatterv(ordered, block, b.proc_count, dtype, level_op, std::nullopt); });
      if (op == ReduceOp::Mean) divide_by(dtype, block, my_block, static_cast<size_t>(size()));
    }
    if (!calls_agree()) return;
    // send (which recv may alias) was read by the team's fold; block is apart from both.
    team_->exchange(block, recv, team_routes(Collective::Scatter, b.mine), dtype);
  }

  // ---- exchange: each rank packs what it sends by destination (processes in order, their ranks
  // in team order), its team's rank 0 gathers the packs and regroups them by destination process,
  // the lane moves one block between each pair of processes, the receiving rank 0 regroups what
  // arrived by destination rank, its team scatters, each rank unpacks into its places.

  void exchange_levels(const std::byte* send, std::byte* recv, const Routes& routes, DType dtype) {
    const size_t es = dtype_size(dtype);
    const size_t P = procs_.size();
    auto count = [&](int s, int d) {
      return routes.count[routes.at(static_cast<uint64_t>(s), static_cast<uint64_t>(d))];
    };
    // What each of this process's ranks sends (its pack), and receives.
    const std::vector<int>& local = my_ranks();
    std::vector<size_t> sends(threads(), 0), receives(threads(), 0);
    for (size_t l = 0; l < threads(); ++l) {
      for (size_t d = 0; d < routes.n; ++d) {
        sends[l] += count(local[l], static_cast<int>(d));
        receives[l] += count(static_cast<int>(d), local[l]);
      }
    }
    // Pack: by destination process, then rank in team order.
    std::byte* pack = stage(packed_, std::max<size_t>(sends[static_cast<size_t>(team_->rank())], 1) * es);
    size_t at = 0;
    for (const auto& ranks : procs_) {
      for (int d : ranks) {
        const size_t c = count(rank_, d);
        if (c > 0)
          std::memcpy(pack + at * es,
                      send + routes.send_displ[routes.at(static_cast<uint64_t>(rank_), static_cast<uint64_t>(d))] * es,
                      c * es);
        at += c;
      }
    }
    const size_t gathered_total = std::accumulate(sends.begin(), sends.end(), size_t{0});
    const size_t arriving_total = std::accumulate(receives.begin(), receives.end(), size_t{0});
    std::byte* gathered = stage(staged_, std::max<size_t>(gathered_total, 1) * es);
    team_->exchange(pack, gathered, team_routes(Collective::Gather, sends), dtype);
    std::byte* handed = stage(result_, std::max<size_t>(arriving_total, 1) * es);
    if (voice()) {
      // Regroup the packs by destination process: for q, for local source l, q's ranks in order.
      std::byte* outgoing = stage(outgoing_, std::max<size_t>(gathered_total, 1) * es);
      Routes between(Collective::Alltoall, -1, P);  // whatever the caller's form, processes exchange blocks
      std::vector<size_t> pack_at(threads());
      for (size_t l = 0, a = 0; l < threads(); a += sends[l], ++l) pack_at[l] = a;
      size_t o = 0;
      for (size_t q = 0; q < P; ++q) {
        for (size_t l = 0; l < threads(); ++l) {
          for (int d : procs_[q]) {
            const size_t c = count(local[l], d);
            if (c > 0) std::memcpy(outgoing + o * es, gathered + pack_at[l] * es, c * es);
            pack_at[l] += c;
            o += c;
          }
        }
      }
      // Every process's block to every other, as every process computes it alike.
      for (size_t p = 0; p < P; ++p) {
        size_t from_displ = 0;
        for (size_t q = 0; q < P; ++q) {
          size_t c = 0;
          for (int s : procs_[p])
            for (int d : procs_[q]) c += count(s, d);
          between.count[between.at(p, q)] = c;
          between.send_displ[between.at(p, q)] = from_displ;
          from_displ += c;
        }
      }
      for (size_t q = 0; q < P; ++q) {
        size_t to_displ = 0;
        for (size_t p = 0; p < P; ++p) {
          between.recv_displ[between.at(p, q)] = to_displ;
          to_displ += between.count[between.at(p, q)];
        }
      }
      std::byte* arrived = stage(arrived_, std::max<size_t>(arriving_total, 1) * es);
      lane_call([&] { lane().exchange(outgoing, arrived, between, dtype); });
      // Regroup what arrived (by source process, its ranks in order, then this process's ranks)
      // by destination rank: for local l, for p, p's ranks in order.
      std::vector<size_t> hand_at(threads());
      for (size_t l = 0, a = 0; l < threads(); a += receives[l], ++l) hand_at[l] = a;
      size_t from = 0;
      for (size_t p = 0; p < P; ++p) {
        for (int s : procs_[p]) {
          for (size_t l = 0; l < threads(); ++l) {
            const size_t c = count(s, local[l]);
            if (c > 0) std::memcpy(handed + hand_at[l] * es, arrived + from * es, c * es);
            hand_at[l] += c;
            from += c;
          }
        }
      }
    }
    if (!calls_agree()) return;
    std::byte* mine = stage(landing_, std::max<size_t>(receives[static_cast<size_t>(team_->rank())], 1) * es);
    team_->exchange(handed, mine, team_routes(Collective::Scatter, receives), dtype);
    size_t u = 0;
    for (const auto& ranks : procs_) {
      for (int s : ranks) {
        const size_t c = count(s, rank_);
        if (c > 0)
          std::memcpy(recv + routes.recv_displ[routes.at(static_cast<uint64_t>(s), static_cast<uint64_t>(rank_))] * es,
                      mine + u * es, c * es);
        u += c;
      }
    }
  }

  // ---- the call check and failures

  // A call's levels, with its check (comm.h: ranks whose calls differ all get E_MISMATCH, and no
  // buffer is written). Every check starts with one round of the team, a max-allreduce of
  // (h, -h, heavy) for h = signature_word(call), so the threads of a process compare their calls
  // whatever each called. Between the processes:
  // - folded, where the lane carries words, the team agrees, and the levels make one lane call
  //   before they hand the result out (`foldable`): thread 0's lane call carries h in the lane's
  //   own check (lane_call), which processes whose calls differ fail alike before the lane moves
  //   data; the levels tell the siblings before they write a caller's buffer (calls_agree). One
  //   lane round in all;
  // - otherwise explicit, before the levels: thread 0 all-reduces the team's words over the lane
  //   (carrying its h where the lane carries words: a process on the folded path meets it there)
  //   and hands them and the lane's verdict to its siblings. It also judges a weighted mean's weights (`heavy`: above
  //   2^53 on any rank fails every rank, naming the first). One lane round more.
  // One process's folded call meets another's explicit round in the lane, whose check fails both.
  // Where calls differ, every rank's signature is gathered to name both sides.
  // (tests/model/threaded_check.pml checks that every rank reaches the same verdict.)
  template <class Levels>
  void checked_levels(const CallSignature& call, bool foldable, const Levels& levels,
                      std::optional<bool> heavy = std::nullopt, uint64_t weight = 0) {
    begin_call();
    if (!check_mismatch_ && !heavy.has_value()) return run_levels(levels);
    const int64_t h = signature_word(call);
    std::array<int64_t, 4> words{h, -h, heavy.value_or(false) ? 1 : 0, 0};  // [3]: the lane found calls differ
    const BufferRef team_words{words.data(), words.data(), 3};
    if (threads() > 1) {
      run_levels([&] { team_->allreduce(std::span<const BufferRef>(&team_words, 1), DType::I64, ReduceOp::Max); });
    }
    const bool team_agrees = words[0] == -words[1];
    const bool carry = check_mismatch_ && lane_->carries_words;
    if (carry && foldable && team_agrees && !heavy.has_value()) {
      lane_word_ = static_cast<uint64_t>(h);
      folding_ = true;
      run_levels(levels);
      folding_ = false;
      if (!calls_differ_) return;
    } else {
      run_levels([&] {
        if (voice()) {
          if (carry) lane_word_ = static_cast<uint64_t>(h);
          lane_call([&] { lane().allreduce(std::span<const BufferRef>(&team_words, 1), DType::I64, ReduceOp::Max); });
          words[3] = calls_differ_ ? 1 : 0;
        }
        if (threads() > 1) team_->broadcast(words.data(), words.size(), DType::I64, 0);
      });
      calls_differ_ = words[3] != 0 || (check_mismatch_ && words[0] != -words[1]);
      if (!calls_differ_ && words[2] != 0) {
        std::vector<uint64_t> weights(static_cast<size_t>(size()));
        std::vector<size_t> ones(static_cast<size_t>(size()), 1);
        run_levels([&] { allgather_levels(&weight, reinterpret_cast<std::byte*>(weights.data()), ones, DType::I64); });
        const auto first =
            std::find_if(weights.begin(), weights.end(), [](uint64_t w) { return w > (uint64_t{1} << 53); });
        fail(GRADSYNC_E_INVALID_ARG,
             "threaded group (rank {} of {}): weighted mean: rank {} passed weight {}, above 2^53", rank(), size(),
             first - weights.begin(), *first);
      }
      if (!calls_differ_) return run_levels(levels);
    }
    name_different_calls(call);
    fail(GRADSYNC_E_MISMATCH, "threaded group (rank {} of {}) call {}: the ranks' calls differ", rank(), size(),
         calls_);
  }
  // The explicit check alone, before levels that need the group's judgement first (a root).
  void require_same_call(const CallSignature& call) {
    checked_levels(call, false, [] {});
  }

  // Thread 0's lane call in a call's levels: it carries the word checked_levels left, and a
  // verdict of the lane's check that the calls differ is kept for the siblings (the lane stays
  // usable).
  template <class Call>
  void lane_call(const Call& call) {
    if (lane_word_ == 0) return call();
    lane().carry_call_word(std::exchange(lane_word_, 0));
    try {
      call();
    } catch (const Error& e) {
      if (e.status() != GRADSYNC_E_MISMATCH) throw;
      calls_differ_ = true;
    }
  }
  // Folding: thread 0 tells its siblings whether the lane's check passed, before the levels write
  // a caller's buffer. Outside a folded call, nothing to tell (and no round).
  bool calls_agree() {
    if (!folding_) return true;
    if (threads() > 1) {
      int64_t differ = calls_differ_ ? 1 : 0;
      team_->broadcast(&differ, 1, DType::I64, 0);
      calls_differ_ = differ != 0;
    }
    return !calls_differ_;
  }

  // Once the group found that its calls differ: every rank's signature, gathered through the
  // levels, names both sides (E_MISMATCH on every rank alike).
  void name_different_calls(const CallSignature& call) {
    require_same_gathered_calls(
        [&] { return fmt::format("threaded group (rank {} of {})", rank(), size()); }, calls_, call, size(),
        [&](const int64_t* word, int64_t* all, size_t words) {
          const std::vector<size_t> counts(static_cast<size_t>(size()), words);
          run_levels([&] { allgather_levels(word, reinterpret_cast<std::byte*>(all), counts, DType::I64); });
        });
  }

  // A level that failed on this thread leaves its peers waiting in another level: stop what needs
  // stopping now rather than leave them to their deadlines (the rules below). Never another
  // thread's lane: its thread may be resetting it already. The group then needs a reset, as after
  // any failure.
  template <class Levels>
  void run_levels(const Levels& levels) {
    try {
      levels();
    } catch (const Error& e) {
      // comm.h: a rank that does not arrive gives every waiting rank the timeout. A timeout stops
      // the team (no thread of this process is left behind in it) but not the lane: an abort there
      // would reach the other processes' threads as an abort, while they meet their own deadlines
      // as timeouts. A failure of this thread's own (a lost peer, a bad buffer) stops its lane too.
      // An abort met during this call after this process recorded a stop is that stop's: reported
      // as it was (a sibling's timeout as the timeout) and, after a failure, passed on to this
      // thread's lane. Any other abort came from a stop that was passed on already, or from a
      // deadline this thread arrived after (it is the late one), and goes no further; where its
      // lane names a peer's timeout, its siblings report that timeout.
      // (tests/model/threaded.pml checks these rules.)
      int status = e.status();
      std::string what = e.what();
      bool pass_on = false;
      Stop lane_stop{0, {}};
      if (Communicator* mine = active_lane(); mine != nullptr && status == GRADSYNC_E_ABORTED)
        lane_stop = mine->stopped_by_peer();
      {
        const std::lock_guard<std::mutex> hold(lane_->stop_lock);
        const bool during = lane_->stops > stops_at_call_;
        if (status == GRADSYNC_E_TIMEOUT) {
          note_stop(true, what);
        } else if (status != GRADSYNC_E_ABORTED) {
          note_stop(false, what);
          pass_on = true;
        } else if (during && lane_->stop_timed_out) {
          status = GRADSYNC_E_TIMEOUT;
          what = lane_->stop_message;
        } else if (during) {
          pass_on = true;
        } else if (lane_stop.first == GRADSYNC_E_TIMEOUT) {
          note_stop(true, lane_stop.second);
        }
      }
      team_->abort();
      if (pass_on) {
        if (Communicator* mine = active_lane()) mine->abort();
      }
      stopped_ = what;
      throw Error(status, fmt::format("{} [in the levels of this threaded group of {}: rank {} is thread {} of {} of "
                                      "process {} of {}]",
                                      what, size(), rank_, team_->rank(), threads(), my_proc_, procs_.size()));
    }
  }

  // Under lane_->stop_lock.
  void note_stop(bool timed_out, const std::string& message) {
    ++lane_->stops;
    lane_->stop_timed_out = timed_out;
    lane_->stop_message = message;
  }
  void record_stop(bool timed_out, const char* message) noexcept {
    try {
      const std::lock_guard<std::mutex> hold(lane_->stop_lock);
      note_stop(timed_out, message);
    } catch (...) {  // NOLINT(bugprone-empty-catch): the stop itself matters more than its record
    }
  }

  // Each call: its number (for messages) and how many stops of this process came before it.
  // After a failed call this rank's calls fail here, at once, until the reset (comm.h): not in a
  // level, whose failure would stop this thread's lane again, as an abort, under a peer of the
  // failed call that still waits there for its own deadline.
  void begin_call() {
    ++calls_;
    lane_word_ = 0;  // what a failed call left
    folding_ = false;
    calls_differ_ = false;
    GS_REQUIRE(stopped_.empty(), GRADSYNC_E_ABORTED,
               "threaded group (rank {} of {}): a call of this rank failed ({}); call reset() on every rank or free "
               "it",
               rank_, size(), stopped_);
    const std::lock_guard<std::mutex> hold(lane_->stop_lock);
    stops_at_call_ = lane_->stops;
  }

  std::unique_ptr<Communicator> team_;
  std::shared_ptr<Lane> lane_;
  std::shared_ptr<Lane> split_lane_;     // split_by's lane of this rank's subgroup, for make_subgroup
  std::vector<int> proc_of_, team_of_;   // by rank: its process, its place in its process's team
  std::vector<std::vector<int>> procs_;  // by process: its ranks in team order
  int rank_ = 0, my_proc_ = 0;
  Transport transport_;
  bool topology_independent_ = false;
  bool check_mismatch_ = true;
  uint64_t calls_ = 0;          // for messages
  uint64_t lane_word_ = 0;      // checked_levels' word for this call's lane call (lane_call)
  bool folding_ = false;        // this call's check is folded into its levels (checked_levels)
  bool calls_differ_ = false;   // the lane's check of this call found the processes' calls differ
  uint64_t stops_at_call_ = 0;  // lane_->stops as this call began
  std::string stopped_;         // why this rank's last call failed in the levels, until the reset
  // Staging, kept between calls: packs, the team's gathered parts, results, the flat fold's window.
  std::vector<std::byte> packed_, staged_, result_, landing_, outgoing_, arrived_, flat_;
};

// The threads of one process meet by the group's name and MPI communicator.
std::string team_name(const Options& options) {
  return fmt::format("gs-threads.{}.{:x}", options.name.substr(0, 40), static_cast<uint64_t>(options.mpi_fcomm));
}

// The threads of one process meet in their team: checked options, and the team's.
Options team_options(const Options& options) {
  GS_REQUIRE(options.transport == Transport::Mpi || options.transport == Transport::Hier, GRADSYNC_E_INVALID_ARG,
             "threads as ranks are for the MPI and hierarchical transports (the {} transport's ranks are already "
             "threads or processes of their own)",
             transport_name(options.transport));
  GS_REQUIRE(options.threads >= 1 && options.threads <= kMaxThreads, GRADSYNC_E_INVALID_ARG,
             "threads must be in [1, {}], got {}", kMaxThreads, options.threads);
  GS_REQUIRE(options.thread >= 0 && options.thread < options.threads, GRADSYNC_E_OUT_OF_RANGE,
             "thread {} out of range [0, {})", options.thread, options.threads);
  Options t = options;
  t.transport = Transport::Thread;
  t.name = team_name(options);
  t.rank = options.thread;
  t.size = options.threads;
  t.threads = 0;
  t.thread = 0;
  t.host_label.clear();
  return t;
}

// The lane's options: one rank per process.
Options lane_options(const Options& options) {
  Options l = options;
  l.threads = 0;
  l.thread = 0;
  return l;
}

// The lane made, thread 0 checks what threads as ranks need of it.
void check_lane(const Lane& made) {
  if (const char* why = made.comm->progress_thread_refused()) {
    fail(GRADSYNC_E_UNSUPPORTED, "threads as ranks call MPI from several threads at once, and {}", why);
  }
}

}  // namespace

GrowResult join_threaded_communicator(const Options& options, JoinLane join, MakeGroup make_group) {
  std::unique_ptr<Communicator> team = make_group(team_options(options));
  std::shared_ptr<Lane> lane = made_by_thread0(*team, "join the group's process-level group", [&](Lane& made) {
    GrowResult grown = join(lane_options(options));
    made.comm = std::move(grown.comm);
    check_lane(made);
    made.carries_words = made.comm->carries_call_words();
    made.agree = grown.agree;
    made.form = grown.form;
    meet_grown(made, options.threads, grown.old_size, {}, 0);
  });
  // The members' options, as the lane's join took them (timeout, checks), on this process's threads.
  Options o = lane->comm->group_options();
  o.transport = options.transport;
  o.threads = options.threads;
  o.thread = options.thread;
  o.name = lane->name;
  return ThreadedCommunicator::settle_grown(std::move(team), lane, o, std::nullopt);
}

std::unique_ptr<Communicator> create_threaded_communicator(const Options& options, MakeGroup make_group) {
  std::unique_ptr<Communicator> team = make_group(team_options(options));
  // The team's rank 0 makes the lane, and the processes report their thread counts over it.
  std::shared_ptr<Lane> lane = made_by_thread0(*team, "form the group's process-level group", [&](Lane& made) {
    made.comm = make_group(lane_options(options));
    check_lane(made);
    made.carries_words = made.comm->carries_call_words();
    report_threads(made, options.threads);
  });
  std::vector<int> proc_of = lane->proc_of;
  const int my_process = lane->comm->rank();
  const auto first_rank = std::find(proc_of.begin(), proc_of.end(), my_process) - proc_of.begin();
  return std::make_unique<ThreadedCommunicator>(std::move(team), std::move(lane), std::move(proc_of),
                                                static_cast<int>(first_rank) + options.thread, options);
}

std::vector<int> lay_out_ranks(std::span<const int64_t> reported, int process, int threads) {
  std::vector<int> proc_of;
  for (size_t p = 0; p < reported.size(); ++p) {
    const int64_t count = reported[p];
    GS_REQUIRE(count >= 1 && count <= kMaxThreads, GRADSYNC_E_CORRUPT,
               "threads as ranks: process {} of {} reported {} threads, outside [1, {}] (a peer's word gone bad)", p,
               reported.size(), count, kMaxThreads);
    GS_REQUIRE(static_cast<int>(p) != process || count == threads, GRADSYNC_E_CORRUPT,
               "threads as ranks: this process (process {} of {}) has {} threads, but {} arrived as its count", p,
               reported.size(), threads, count);
    proc_of.insert(proc_of.end(), static_cast<size_t>(count), static_cast<int>(p));
  }
  return proc_of;
}

std::vector<int> lay_out_grown(std::span<const int64_t> reported, std::span<const int64_t> old_proc_of, int process,
                               int threads, int member_procs) {
  const std::vector<int> all = lay_out_ranks(reported, process, threads);
  GS_REQUIRE(member_procs >= 1 && static_cast<size_t>(member_procs) < reported.size(), GRADSYNC_E_CORRUPT,
             "threads as ranks: grow: {} member processes in a grown group of {}", member_procs, reported.size());
  std::vector<int> proc_of;
  std::vector<int64_t> held(static_cast<size_t>(member_procs), 0);
  for (const int64_t p : old_proc_of) {
    GS_REQUIRE(p >= 0 && p < member_procs, GRADSYNC_E_CORRUPT,
               "threads as ranks: grow: the members' layout names process {} of {} (a peer's word gone bad)", p,
               member_procs);
    ++held[static_cast<size_t>(p)];
    proc_of.push_back(static_cast<int>(p));
  }
  for (size_t p = 0; p < held.size(); ++p) {
    GS_REQUIRE(held[p] == reported[p], GRADSYNC_E_CORRUPT,
               "threads as ranks: grow: the members' layout gives process {} {} ranks, but it reported {} threads", p,
               held[p], reported[p]);
  }
  for (const int p : all)
    if (p >= member_procs) proc_of.push_back(p);
  return proc_of;
}

}  // namespace gradsync::comm
