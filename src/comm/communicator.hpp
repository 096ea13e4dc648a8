// SPDX-License-Identifier: Apache-2.0
#pragma once
// The communicator: the one interface that every transport (threads, shared memory, MPI)
// implements, and that the C API in capi/capi_comm.cpp and the sharded parameter sit on.
//
// Contract for implementations (the C API documents the same to users):
// - Buffers are borrowed for the duration of a call; nothing is kept after it returns.
// - send == recv means in place.
// - Reductions combine ranks in rank order (0, 1, ..., n-1) so every rank gets the same bits,
//   whatever the arrival order.
// - Arguments have been validated by the caller of the virtual (non-null buffers for count > 0,
//   known dtype/op, root in range); implementations validate what needs the peers: ranks that
//   disagree get Error(GRADSYNC_E_MISMATCH) on every rank, naming both sides.
// - Every wait is bounded by options.timeout (Error(GRADSYNC_E_TIMEOUT)); abort() may be called
//   from any thread and makes every waiter and later call throw Error(GRADSYNC_E_ABORTED) until
//   reset() (collective) succeeds.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "comm/telemetry.hpp"
#include "comm/topology.hpp"
#include "comm/types.hpp"
#include "common/dtype.hpp"
#include "common/partition.hpp"

namespace gradsync::comm {

class Communicator;

// What a shrink (Communicator::shrink) gives a survivor.
struct ShrinkResult {
  std::unique_ptr<Communicator> comm;  // the survivors' group
  std::vector<int> failed;             // ranks of the old group that are out, ascending
  int attempts = 0;                    // agreements made: more than 1 when a member was lost meanwhile
  std::chrono::nanoseconds agree{0}, form{0};
};

// What a grow (Communicator::grow, comm::join) gives a member or a joiner.
struct GrowResult {
  std::unique_ptr<Communicator> comm;  // the grown group
  int old_size = 0, new_size = 0;      // the joiners' ranks are [old_size, new_size)
  int64_t first_member_id = 0;         // joiner j's member id is first_member_id + j
  std::chrono::nanoseconds agree{0}, form{0};
};

class Communicator {
 public:
  virtual ~Communicator();

  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  virtual Transport transport() const noexcept = 0;

  // Fused allreduce: the result equals one allreduce per buffer.
  virtual void allreduce(std::span<const BufferRef> buffers, DType dtype, ReduceOp op) = 0;
  virtual void broadcast(void* buf, size_t count, DType dtype, int root) = 0;
  // recv holds total elements; this rank's part (partition rule) comes from send, or is already
  // in recv when send == nullptr. allgatherv with the partition rule's counts.
  void allgather(const void* send, void* recv, size_t total, DType dtype);
  // Rank r's part is counts[r] elements (size() entries, any of them 0), at the sum of the counts
  // before it in recv; send holds counts[rank()] elements or is nullptr (in place).
  virtual void allgatherv(const void* send, void* recv, std::span<const size_t> counts, DType dtype) = 0;
  // send holds total elements; recv receives this rank's part (it may alias send at that offset).
  // reduce_scatterv with the partition rule's counts.
  void reduce_scatter(const void* send, void* recv, size_t total, DType dtype, ReduceOp op);
  // Rank r receives the reduction of the counts[r] elements after the counts before it.
  // root: a rooted reduce's root (reduce()), which the round judges and names; none otherwise.
  virtual void reduce_scatterv(const void* send, void* recv, std::span<const size_t> counts, DType dtype, ReduceOp op,
                               std::optional<int> root) = 0;
  // A rooted reduce: reduce_scatterv with every count but root's 0 (recv is read at root only).
  // The root is judged inside the round, so a root that one rank gets wrong fails every rank.
  void reduce_to(const void* send, void* recv, size_t count, DType dtype, ReduceOp op, int root);

  // The exchange (alltoall, alltoallv, gather, scatter and their v-forms): the part rank s sends
  // rank d moves from s's send buffer into d's recv buffer, as routes say. Every rank passes the
  // same routes; send and recv do not overlap; any dtype (nothing is combined).
  virtual void exchange(const void* send, void* recv, const Routes& routes, DType dtype) = 0;
  // send holds total elements, split into size() parts by the partition rule: part j goes to rank j.
  // recv receives size() blocks of this rank's part length, rank i's block at i * my_part(total).len.
  void alltoall(const void* send, void* recv, size_t total, DType dtype);
  // Counts and displacements of this rank's own (MPI_Alltoallv's, in elements, size() entries
  // each). One small round first gives every rank every rank's, so that ranks that disagree (s
  // sends c elements to d, d expects c' from s) all get E_MISMATCH before anything moves.
  void alltoallv(const void* send, std::span<const size_t> send_counts, std::span<const size_t> send_displs, void* recv,
                 std::span<const size_t> recv_counts, std::span<const size_t> recv_displs, DType dtype);
  // count elements from every rank into root's recv, in rank order; recv is read at root only.
  void gather(const void* send, void* recv, size_t count, DType dtype, int root);
  // send_count elements from every rank; root's recv_counts say how many it expects from each
  // (one round of counts first, as alltoallv); parts packed in rank order at root.
  void gatherv(const void* send, size_t send_count, void* recv, std::span<const size_t> recv_counts, DType dtype,
               int root);
  // root's send holds size() * count elements; rank r receives block r.
  void scatter(const void* send, void* recv, size_t count, DType dtype, int root);
  // root's send holds send_counts[r] elements for rank r, packed in rank order; every rank says
  // how many it expects (one round of counts first, as alltoallv).
  void scatterv(const void* send, std::span<const size_t> send_counts, void* recv, size_t recv_count, DType dtype,
                int root);
  virtual void barrier() = 0;
  virtual void abort() noexcept = 0;
  virtual void reset() = 0;

  // A fused allreduce over buffers of several dtypes, the same bits as one allreduce per buffer:
  // one small round first compares a hash of every rank's list (counts, dtypes, op), so ranks that
  // disagree all fail with E_MISMATCH before any buffer is touched; then one fused allreduce per
  // dtype present, in the order of the DType values. Written once, above the transports.
  void allreduce_mixed(std::span<const BufferRef> buffers, std::span<const DType> dtypes, ReduceOp op);

  // Σ wᵢ·sendᵢ / Σ wᵢ for F32/F64, products summed in double in rank order. The default builds it
  // from one fused allreduce; a transport may do better.
  virtual void weighted_mean(const void* send, void* recv, size_t count, DType dtype, uint64_t weight,
                             uint64_t* total_weight);

  // Memory for this group's buffers (bytes > 0), valid until dealloc() or the communicator's end.
  // The shared-memory transport places it in the group's segment, where peers read it directly
  // (zero copy); the default is ordinary page-aligned memory.
  virtual void* alloc(size_t bytes);
  // Frees a pointer from alloc(); Error(GRADSYNC_E_INVALID_ARG) for any other pointer.
  virtual void dealloc(void* p);

  // Which ranks share a host; the same on every rank (comm/topology.hpp).
  const Topology& topology() const noexcept { return topology_; }

  // MPI_Comm_split: collective over this group. Ranks passing the same color >= 0 form a new
  // group, ordered by key, then by their rank here; color kNoColor gives nullptr. The new group has
  // this one's transport and options, and its topology is this one's restricted to its members.
  // A color below kNoColor on any rank fails every rank with E_INVALID_ARG naming it.
  static constexpr int kNoColor = -1;
  std::unique_ptr<Communicator> split(int color, int key);

  // A subgroup of this group as split() decides it: this rank's place in it, and its members'
  // ranks here in subgroup rank order.
  struct Subgroup {
    int rank;
    std::vector<int> members;
    std::string name;  // a name no other group of this parent's has, for transports that meet by name
    std::function<std::string()> abandoned;  // Options::forming_abandoned of the members' create()
  };
  // The second half of split(): this rank's communicator of the subgroup, with its options and
  // topology. Collective over the members only, which all pass the same subgroup.
  std::unique_ptr<Communicator> form_subgroup(const Subgroup& subgroup);

  // Collective over the survivors after this group lost a member (comm/membership.hpp): they
  // agree on one failed set and form a group of the others, with dense ranks in the old order.
  // Transports that cannot survive a lost process fail with E_UNSUPPORTED saying why.
  virtual ShrinkResult shrink();
  // Collective over this group, with `joiners` new ranks meeting it by join_name (comm::join):
  // the grown group, this group's members first in their order, then the joiners by index
  // (comm/membership.hpp; over MPI, transport/mpi/mpi_grow.cpp).
  virtual GrowResult grow(const std::string& join_name, int joiners);
  // A member of this group that is gone for good (its process died, or it freed its communicator),
  // described for a message; empty while every member is there, or where the transport cannot tell.
  virtual std::string lost_member() const { return {}; }
  // The options this group was established with (a grown group's joiners take the members').
  const Options& group_options() const noexcept { return group_options_; }
  // This member's stable id: its rank in the group it was created in, kept by the groups shrunk,
  // grown or split from it. A joiner's is one the group never used: next_member_id() and above.
  int64_t member_id() const noexcept { return member_id_; }
  int64_t next_member_id() const noexcept { return next_member_id_; }

  Part my_part(size_t total) const noexcept {
    return partition(total, static_cast<uint64_t>(size()), static_cast<uint64_t>(rank()));
  }

  // Why this communicator's calls may not run on a thread of the library's own (the progress
  // thread of the non-blocking calls), or nullptr when they may.
  virtual const char* progress_thread_refused() const noexcept { return nullptr; }

  // In a process forked from the one that created it, instead of the destructor (which would
  // leave the group, join threads that exist only in the parent, or call MPI): releases what is
  // this process's alone, such as the shared-memory transport's mapping, and touches nothing the
  // group shares. The object is never used or destroyed afterwards. By default there is nothing.
  virtual void release_after_fork() noexcept {}

  // Set while no call runs (the C API's one-call-at-a-time rule makes that so).
  virtual void set_interrupt(InterruptCheck check) noexcept { interrupt_ = check; }

  // Statistics and timeline of this communicator's calls (comm/telemetry.hpp).
  Telemetry& telemetry() noexcept { return telemetry_; }

  // Why a peer stopped this group (it aborted it, or announced a lost member), as a status and a
  // message; status 0 while none has, or where the transport does not hear of it between calls.
  // On the calling thread, between or inside this group's calls.
  using Stop = std::pair<int, std::string>;
  virtual Stop stopped_by_peer() noexcept { return {0, {}}; }
  // Asked while a call of this group waits for its peers, by a group built over it (the
  // hierarchical transport's levels, whose peers may be stopped in another level): a status other
  // than 0 ends the wait, even a committed one, as a peer's loss would. Transports whose own abort
  // already releases every waiting peer (shm) do not ask it. Set while no call runs.
  virtual void set_stop_check(std::function<Stop()> check) { stop_check_ = std::move(check); }
  // While on, this group's subgroups form under a watchdog where their forming cannot be
  // abandoned (MPI_Comm_create_group), as a shrink's survivors' group does: the job ends rather
  // than hang on a member lost meanwhile. Where forming is bounded anyway, nothing changes.
  virtual void guard_forming(bool on) noexcept { (void)on; }
  // A group built over this one (threads as ranks) folds its own call check into the call it makes
  // here: the next collective's call check compares `word` on every rank as part of the call, so
  // ranks whose words differ get E_MISMATCH as ranks whose calls differ do, and the group stays
  // usable. The call consumes it. Only where carries_call_words(); set between calls, on the
  // calling thread.
  virtual bool carries_call_words() const noexcept { return false; }
  virtual void carry_call_word(uint64_t word) noexcept { (void)word; }

 protected:
  friend std::unique_ptr<Communicator> create(const Options& options);
  friend std::unique_ptr<Communicator> over_levels(std::unique_ptr<Communicator> world, const Options& options);
  friend GrowResult join(const Options& options);
  friend class Membership;  // a grown group takes its ids and options from the group it grew from

  // The rest of split(), once every rank's color, key and nonce are known (`table`: 3 words per
  // rank; rank 0's nonce is word 2): this rank's subgroup, or nullptr for kNoColor. Every rank
  // calls it, with a color or not. Transports whose subgroups need ranks outside them to form
  // (threads as ranks: each process's thread 0 forms the process-level groups of all the
  // process's subgroups) override it.
  virtual std::unique_ptr<Communicator> split_by(std::span<const int64_t> table, int color, uint64_t split_number);
  // The subgroup of `color` in split()'s table: members by key, then rank; its name; this rank's
  // place in it (-1 when not a member).
  Subgroup subgroup_of(std::span<const int64_t> table, int color, uint64_t split_number) const;
  // Makes this rank's communicator of the subgroup; every member calls it at once.
  virtual std::unique_ptr<Communicator> make_subgroup(const Subgroup& subgroup) = 0;
  // The options of a group of this transport that forms the subgroup by its name.
  Options subgroup_options(const Subgroup& subgroup) const;
  // Whether the ranks share memory by construction (threads of one process, processes of one
  // segment): then detecting the topology needs no probe.
  virtual bool shares_memory() const noexcept { return false; }
  // After the transport has joined: keeps the options for subgroups, detects the topology
  // (collective), and forgets the statistics of doing so.
  void establish(const Options& options);

  // The default weighted_mean, window by window of at most `window` elements: each window's
  // products in f64 with the weight after them (len + 1 entries) summed in rank order by
  // sum(data, len + 1), then divided by the summed weight (the same bits as one window of all), or
  // by known_total where the transport has it already (then only the len products are summed). The
  // weight is at most 2^53 (checked by the caller). For a transport that judges the call itself
  // and moves the data as it likes.
  void windowed_weighted_mean(const void* send, void* recv, size_t count, DType dtype, uint64_t weight,
                              uint64_t* total_weight, size_t window,
                              const std::function<void(double* data, size_t n)>& sum,
                              std::optional<double> known_total = std::nullopt);
  // The weighted mean's f64 staging of at least n entries: the communicator's own, kept and reused
  // (bounded by the callers' windows). A fresh vector per call was mapped and faulted in anew by
  // every call past glibc's mmap threshold (always past 32 MiB: 32K page faults a call at 16M
  // floats, ~2 us each on a VM, several times the reduction's own time).
  double* weighted_staging(size_t n);
  // The default window: 4 MiB of f64 staging.
  static constexpr size_t kWeightedWindow = size_t{1} << 19;

  InterruptCheck interrupt_;
  std::function<Stop()> stop_check_;
  Telemetry telemetry_;
  // A group made of this one's members (the hierarchical transport's over a shrunk MPI group)
  // takes this member's id, the ids in use and the options, with its own name and topology.
  void pass_identity(Communicator& successor, const Options& options, const Topology& topology) const;
  // A grown group's member: its id (a member's own, or a joiner's new one) and the ids in use.
  void take_identity(int64_t member_id, int64_t next_member_id) noexcept {
    member_id_ = member_id;
    next_member_id_ = next_member_id;
  }

 private:
  int64_t member_id_ = 0;
  int64_t next_member_id_ = 1;  // above every member id this group's history has used
  Options group_options_;
  Topology topology_;
  uint64_t splits_ = 0;                    // split() calls made, the same count on every rank: part of subgroup names
  std::unordered_set<void*> allocations_;  // of the default alloc(), freed with the communicator
  std::vector<size_t> partition_counts_;   // allgather's and reduce_scatter's, reused: no allocation per call
  std::vector<double> weighted_staging_;   // weighted_staging()
  std::span<const size_t> rule_counts(size_t total);
  // The round of counts of alltoallv, gatherv and scatterv: every rank's counts and displacements
  // to every rank, checked alike on every rank (E_MISMATCH, E_OUT_OF_RANGE), as routes.
  Routes agree_routes(Collective form, int root, DType dtype, std::span<const size_t> send_counts,
                      std::span<const size_t> send_displs, std::span<const size_t> recv_counts,
                      std::span<const size_t> recv_displs);
};

// A grow's agreement (Membership::grow, the MPI transport's): every member of `group` allgathers
// its joiner count, the join name's hash and its next member id, then `extra` words of the
// transport's, and every member checks the first three alike (E_MISMATCH naming the first member
// that differs; `described` names the group). Returns the table: member r's words from
// r * (kGrowWords + extra.size()); its kGrowNext is the joiners' first member id.
enum : size_t { kGrowJoiners, kGrowName, kGrowNext, kGrowWords };
std::vector<int64_t> agree_grow(Communicator& group, const std::string& described, const std::string& join_name,
                                int joiners, std::span<const int64_t> extra);

// How a transport forms a group of its own by the options' name (create_thread_communicator,
// create_shm_communicator), before establish(): its groups form their subgroups so, and grow.
using JoinGroup = std::unique_ptr<Communicator> (*)(const Options& options);

}  // namespace gradsync::comm
