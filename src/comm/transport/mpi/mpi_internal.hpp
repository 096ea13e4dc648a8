// SPDX-License-Identifier: Apache-2.0
#pragma once
// The MPI transport's communicator, as its two units share it: mpi_communicator.cpp joins the
// group and runs the round protocol (the exchange that opens every call, its verdict, aborts,
// deadlines, reset), and mpi_collectives.cpp moves each collective's data once its round has
// begun. Also the records that travel between ranks as raw bytes.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "comm/call_signature.hpp"
#include "comm/communicator.hpp"
#include "comm/transport/mpi/mpi_api.hpp"
#include "comm/transport/mpi/mpi_runtime.hpp"
#include "comm/types.hpp"
#include "common/dtype.hpp"
#include "common/liveness_links.hpp"

namespace gradsync::comm::mpi {

using Clock = std::chrono::steady_clock;

// MPI counts and displacements are int: no call moves more than this many elements, and a
// collective whose counts or displacements would not fit goes pairwise in pieces (see pairwise).
// GRADSYNC_MPI_MAX_COUNT lowers the limit, so that tests run those paths without 2^31 elements;
// every rank must give the same value (checked when the communicator is created).
constexpr size_t kMaxMpiCount = size_t{1} << 30;

// What a rank is about to do; every rank compares every rank's before moving data.
struct Fingerprint {
  uint64_t seq = 0;  // the call's number on this communicator
  CallSignature call;
};
static_assert(std::is_trivially_copyable_v<Fingerprint> && sizeof(Fingerprint) == 48,
              "the fingerprint is exchanged as raw bytes");

struct PeerInfo {
  uint64_t ns_key;
  int64_t pid;
  uint64_t max_count;  // GRADSYNC_MPI_MAX_COUNT as this rank read it
  uint64_t host_key;   // a hash of the rank's host identity (comm/topology.hpp)
  int64_t world_rank;  // in MPI_COMM_WORLD: messages about a subgroup's ranks name it too
};

// What every rank contributes to the exchange that opens each call: a key of what it is about to
// do, when it arrived, a weighted mean's weight, and, on the small path, its data (an entry: this
// header, then the data from kHeaderArea). Small, since it travels with every call; ranks whose keys
// differ then exchange their whole fingerprints (Details) to name the difference.
struct Header {
  uint64_t key;  // key_of(the call's fingerprint)
  // When the rank arrived, in the system clock (ranks may be on different hosts, whose monotonic
  // clocks share no origin): the group's statistics compare the ranks' arrivals.
  int64_t arrived_ns;
  uint64_t weight;  // a weighted mean's weight, judged by every rank (0 for other calls)
  uint32_t bytes;   // the data that follows the header (the small path), or 0
  // In the first entry of a message (always its sender's own): how many more pieces of the message
  // follow this first one, so that the receiver posts their receives (read nowhere else).
  uint32_t more;
};
static_assert(std::is_trivially_copyable_v<Header> && sizeof(Header) == 32, "the header is sent as raw bytes");
// Where a rank's data starts in its entry: 16-byte aligned for the reduction kernels (entries are
// padded to 16 bytes and laid back to back).
constexpr size_t kHeaderArea = 32;
struct Details {
  Fingerprint fp;
  uint64_t weight;
  uint64_t word;  // the call word of a group built over this one (Communicator::carry_call_word)
};
static_assert(std::is_trivially_copyable_v<Details> && sizeof(Details) == 64, "details are sent as raw bytes");

// The exchange's memory: the entries this rank holds, back to back (its own first, then those it
// received, in the order they came), where each rank's entry is, and the requests.
// Held by a shared_ptr so that an abandoned exchange's memory can be buried with its requests.
struct Exchange {
  std::vector<std::byte> table;
  std::vector<size_t> at;  // by rank: the entry's offset in table (with the doubling, 0: this rank's own)
  std::vector<MPI_Request> requests;
  // Room for every rank's largest entry, and once more: a rank that takes no part in the doubling
  // receives the whole table behind its own entry. Requests: up to a send in pieces and a receive
  // per peer.
  // direct: every rank's entry in a slot of its own, by rank (every rank sends to every peer).
  Exchange(int ranks, size_t capacity, bool direct)
      : table((static_cast<size_t>(ranks) + 1) * (kHeaderArea + capacity)),
        at(static_cast<size_t>(ranks), 0),
        requests(std::max<size_t>(8, 5 * static_cast<size_t>(ranks)), mpi::lib().request_null) {
    if (direct)
      for (size_t r = 0; r < at.size(); ++r) at[r] = r * (kHeaderArea + capacity);
  }
  Header& header(int r) noexcept { return *reinterpret_cast<Header*>(table.data() + at[static_cast<size_t>(r)]); }
  std::byte* data(int r) noexcept { return table.data() + at[static_cast<size_t>(r)] + kHeaderArea; }
  std::vector<Details> details;  // only when the keys differ
};

// Who this rank swaps entries with in the exchange: recursive doubling over the largest power of
// two of ranks, each of the others (the lowest even ranks) sending its entry to the odd rank above
// it first and receiving the whole table from it last, as MPI's own recursive doubling does. Fixed
// by the group's size and this rank, the same for every call, so the messages pair up whatever the
// calls are; each rank sends ceil-or-floor log2(size) messages instead of one to every peer.
struct Doubling {
  // Every rank is on one host: instead, every rank sends its entry to every peer at once. Over
  // shared memory, with ranks that outnumber the cores, the doubling's steps (each waits for its
  // partner to be scheduled) cost more than the extra messages.
  bool direct = false;
  int extra = -1;             // a rank outside the doubling: the one it serves (receives from first, sends to last)
  bool outside = false;       // this rank is outside: it sends to `extra` and receives the table from it
  std::vector<int> partners;  // by step
  // By step: the ranks whose entries the partner sends, in its order. The last: for a rank outside,
  // the whole table as `extra` holds it.
  std::vector<std::vector<int>> ranks;
};

// An abort notice: why its sender gave up (abort, timeout, a dead peer), the rank that started it
// (the sender may be forwarding it), and the first call of the group that the sender will not
// post: that call can complete nowhere, earlier ones still can.
struct Notice {
  int64_t status = 0;
  int64_t subject = -1;
  int64_t stop_at = 0;
  int source = -1;
};

// MPI's text for an error code.
std::string mpi_error_string(int rc);

// Memory that an abandoned MPI request may still write (or read) if the late rank ever arrives:
// kept alive until the process ends, since MPI cannot cancel a collective.
void bury(std::shared_ptr<void> memory);

// Ends the job with MPI_Abort, logging `why`, unless destroyed before `deadline`: around a blocking
// MPI call that a member lost inside it (or a whole host lost, its daemon too) leaves waiting
// forever, and nothing else can end: a shrink's MPI_Comm_create_group, a grow's spawn and merge.
// Around MPI's initialisation (before_init), where MPI_Abort cannot be called yet, it ends this
// process alone (_Exit(1)): a joiner whose members are gone.
class Watchdog {
 public:
  Watchdog(Clock::time_point deadline, std::string why, bool before_init = false);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

// The communicators a join or a reset duplicates, one after the other: the first `made` of them
// are complete, and while posted > made the next one is posted and pending (an interrupted join or
// reset, which the next one resumes rather than posts again).
struct FreshComms {
  MPI_Comm base = mpi::lib().comm_null;
  MPI_Comm comm = mpi::lib().comm_null;
  MPI_Comm ctl = mpi::lib().comm_null;
  MPI_Request requests[3] = {mpi::lib().request_null, mpi::lib().request_null, mpi::lib().request_null};
  size_t posted = 0, made = 0;
};

class MpiCommunicator;

// Marks its scope as this rank's blocking MPI transfer of a committed call, which nothing can
// interrupt: a peer seen dead meanwhile ends the job (TransferWatch) rather than leave the
// survivors in MPI forever. For the calls whose data did not come with the exchange.
class InTransfer {
 public:
  explicit InTransfer(MpiCommunicator& c) noexcept;
  ~InTransfer();
  InTransfer(const InTransfer&) = delete;
  InTransfer& operator=(const InTransfer&) = delete;

 private:
  MpiCommunicator& c_;
};

class MpiCommunicator final : public Communicator {
 public:
  // parent: the MPI communicator to duplicate; comm_null for the one options name.
  MpiCommunicator(const Options& options, MPI_Comm parent);
  ~MpiCommunicator() override;

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  Transport transport() const noexcept override { return Transport::Mpi; }

  void allreduce(std::span<const BufferRef> buffers, DType dtype, ReduceOp op) override;
  void broadcast(void* buf, size_t count, DType dtype, int root) override;
  void allgatherv(const void* send, void* recv, std::span<const size_t> counts, DType dtype) override;
  void reduce_scatterv(const void* send, void* recv, std::span<const size_t> counts, DType dtype, ReduceOp op,
                       std::optional<int> root) override;
  void exchange(const void* send, void* recv, const Routes& routes, DType dtype) override;
  void barrier() override;
  void abort() noexcept override;
  Stop stopped_by_peer() noexcept override;
  void guard_forming(bool on) noexcept override { guard_forming_ = on; }
  bool carries_call_words() const noexcept override { return true; }
  void carry_call_word(uint64_t word) noexcept override { call_word_ = word; }
  void reset() override;
  // After a lost member, under mpirun --enable-recovery (mpi_shrink.cpp, tests/model/mpi_shrink.pml).
  ShrinkResult shrink() override;
  // Spawns the joiners and merges them in (mpi_grow.cpp).
  GrowResult grow(const std::string& join_name, int joiners) override;
  // A joiner's side: in a process that a grow spawned (comm::join).
  static GrowResult join(const Options& options);
  // The shrink's survivors' group where a whole host was lost and every survivor is on this one: a
  // shared-memory group named from `nonce`, formed without MPI (collective over sub's members).
  std::unique_ptr<Communicator> form_on_host(const Subgroup& sub, uint64_t nonce);
  void weighted_mean(const void* send, void* recv, size_t count, DType dtype, uint64_t weight,
                     uint64_t* total_weight) override;
  // The progress thread calls MPI while the host's threads may too (other communicators, its own
  // MPI traffic), which only MPI_THREAD_MULTIPLE allows.
  const char* progress_thread_refused() const noexcept override {
    return mpi::thread_level() == MPI_THREAD_MULTIPLE
               ? nullptr
               : "non-blocking calls need MPI_THREAD_MULTIPLE, and MPI was initialised with a lower thread level "
                 "(initialise it with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...), or let gradsync do it)";
  }

 protected:
  // MPI_Comm_create_group over the members only (the parent's other ranks need not take part),
  // then a communicator duplicated from it, as create duplicates the host's.
  std::unique_ptr<Communicator> make_subgroup(const Subgroup& subgroup) override;

 private:
  // What a call's exchange carries besides its header: the small path's data.
  struct Payload {
    std::span<const BufferRef> buffers;
    size_t elem;
  };
  // Inline: it runs at every poll of a wait. peer: the rank a point-to-point call addressed.
  void check(int rc, const char* call, int peer = -1) {
    if (rc != MPI_SUCCESS) [[unlikely]]
      fail_mpi(rc, call, peer);
  }
  [[noreturn]] void fail_mpi(int rc, const char* call, int peer);
  // At the start of call `call`: fails if this rank was aborted, or heard a notice, telling the
  // peers (once) that it will not post this call.
  void throw_if_aborted(uint64_t call, Clock::time_point now);
  // The call's exchange (see "The round protocol" above its definition in mpi_communicator.cpp),
  // verified; `payload`
  // travels with it when it fits (packed_ then tells). commit: a barrier follows, for the calls
  // that move their data through MPI's blocking collectives.
  void arrive(const CallSignature& call, Payload payload = {}, uint64_t weight = 0, bool commit = true);
  // How a wait treats an abort on this rank and its peers' notices: Setup (joining, reset) ends on
  // a local abort and does not watch notices; Round (a call's exchange) and Commit (its commit
  // barrier), posted, are committed: a local abort takes effect at the next call, and only a
  // notice that this call can complete nowhere, a dead peer or the deadline end them. Round also
  // ends on the stop check (set_stop_check), Commit never: a peer whose commit completed may be in
  // MPI's blocking collective already, waiting for this rank (tests/model/mpi_round.pml).
  enum class Mode { Setup, Round, Commit };
  // Polls requests to completion. On the deadline, an abort, a notice or a dead peer (as `mode`
  // says): buries keepalive (the memory the requests use), aborts the communicator, tells the
  // peers, and throws. `label` names the wait when fp is null; otherwise the fingerprint does.
  // `start`: when the wait began, if the caller has just read the clock.
  void wait(MPI_Request* requests, int n, Clock::time_point deadline, const char* label, const Fingerprint* fp,
            const std::shared_ptr<void>& keepalive, Mode mode, std::optional<Clock::time_point> start = std::nullopt);
  // One step of the exchange: sends this rank's first send_bytes of table to `to` (if >= 0) and
  // receives into table at `at` from `from` (if >= 0) the entries of `ranks`, in two pieces when
  // the sender says so; returns where the received entries end.
  size_t swap(Exchange& ex, int to, size_t send_bytes, int from, size_t at, const std::vector<int>& ranks,
              const Fingerprint& fp, Clock::time_point deadline, Clock::time_point start);
  size_t entry_bytes(uint32_t data_bytes) const noexcept;
  // The exchange of a group on one host (Doubling::direct): this rank's entry of `own` bytes to every
  // peer, every peer's into its slot.
  void send_to_all(Exchange& ex, size_t own, const Fingerprint& fp, Clock::time_point deadline,
                   Clock::time_point start);
  // Duplicates of `from` for the collectives and the notices (and first a base, with_base).
  // Duplicates from `from` into fresh (base only with_base), going on where an earlier call on
  // the same fresh stopped: a failed join or reset keeps its fresh for the next one to resume.
  void duplicate(const std::shared_ptr<FreshComms>& fresh, MPI_Comm from, bool with_base, Clock::time_point deadline,
                 const char* label);
  void abandon(std::shared_ptr<void> keepalive, const std::string& reason, int status, int subject, uint64_t stop_at);
  void send_notices(int status, int subject, uint64_t stop_at) noexcept;
  [[noreturn]] void fail_on_notice(const std::shared_ptr<void>& keepalive, const std::string& what, uint64_t call);
  // After an exchange whose keys differ: every rank sends every peer its whole fingerprint, and
  // all throw the same verdict naming the ranks.
  [[noreturn]] void explain_mismatch(const Fingerprint& fp, uint64_t weight, uint64_t word, Clock::time_point deadline);
  void renew_exchange();
  // The barrier that commits a call to MPI's blocking collectives (arrive).
  void commit_barrier(const Fingerprint& fp, Clock::time_point deadline);
  void post_notice_receive();
  // Takes in the notices that have arrived, keeping the one with the earliest stop_at, and the
  // first death a notice reports (heard_dead_).
  void poll_notices();
  std::string notice_reason() const;
  void retire_control() noexcept;
  // A peer known dead (seen, or heard of: heard_dead_), or -1; death_of says how it is known.
  int dead_peer() const noexcept;
  std::string death_of(int dead) const;
  // Whether peer r is known dead: a process of this host (and PID namespace) that is gone, a peer
  // elsewhere whose liveness link ended, or the death a notice reported (the shrink starts from it,
  // and nothing more is sent to it).
  bool peer_dead(int r) const noexcept;
  bool pid_dead(int r) const noexcept;
  void link_peers(Clock::time_point deadline);
  // Set by a shrink while it forms the survivors' group: make_subgroup's blocking
  // MPI_Comm_create_group then runs under a watchdog that ends the job with MPI_Abort at this time.
  std::optional<Clock::time_point> create_deadline_;
  bool guard_forming_ = false;  // guard_forming(): the watchdog at the timeout from the call's start
  bool deterministic_for(DType dtype, ReduceOp op) const noexcept;
  // The system clock's time at steady time `now`, in ns, from an offset read again every 100 ms
  // (one clock read per call instead of two; the stamps only compare arrivals).
  int64_t system_time_ns(Clock::time_point now) noexcept;

  void allreduce_one(const void* send, void* recv, size_t count, DType dtype, ReduceOp op, bool det);
  // Every rank swaps one block with every other rank, blocks of any size_t length, for the
  // collectives whose counts or displacements do not fit MPI's int. block(peer) gives
  // {send, send count, recv, recv count} of the pair (counts agree across each pair).
  struct Block {
    const void* send;
    size_t send_count;
    void* recv;
    size_t recv_count;
  };
  void pairwise(DType dtype, const std::function<Block(int)>& block);
  void rank_order_allreduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op);
  // rank_order_allreduce of a group of two.
  void swap_fold(const void* send, void* recv, size_t count, DType dtype, ReduceOp op);
  std::byte* scratch(size_t bytes);

  Options options_;
  MPI_Comm base_ = mpi::lib().comm_null;  // never carries traffic: the parent of fresh dups at reset
  MPI_Comm comm_ = mpi::lib().comm_null;  // collectives
  MPI_Comm ctl_ = mpi::lib().comm_null;   // abort notices
  int rank_ = 0;
  int size_ = 1;
  size_t max_count_ = kMaxMpiCount;
  uint64_t seq_ = 0;
  size_t pack_capacity_ = 0;  // the small path's bytes per rank (kPackBytes, kPackBudget)
  std::shared_ptr<Exchange> exchange_;
  std::shared_ptr<void> exchange_keep_;  // the same, as the waits bury it
  bool packed_ = false;                  // the last exchange carried every rank's data
  std::vector<int64_t> stamps_;          // the ranks' arrivals in the last exchange
  std::vector<const void*> sources_;     // the small path's contributions, by rank
  // The last call found alike on every rank and valid: the same call again needs no judging.
  CallSignature judged_{0, 0, 0, static_cast<Collective>(-1)};
  CallSignature keyed_{0, 0, 0, static_cast<Collective>(-1)};  // the last call, and its hash for its key
  uint64_t keyed_hash_ = 0;
  uint64_t call_word_ = 0;  // carry_call_word's, for the next call's key
  std::vector<PeerInfo> peers_;
  std::unique_ptr<LivenessLinks> links_;  // with the peers of other PID namespaces (link_peers)
  // By rank: whether messages of the exchange between this rank and that one may go in two pieces
  // (the same host: a peer over shared memory), the same on both sides.
  std::vector<uint8_t> pieces_;
  Doubling doubling_;
  std::vector<std::byte> staging_;
  std::vector<std::byte> scratch_;

  // (calls posted << 1) | aborted: abort() learns atomically whether this rank has posted the call
  // in progress (it is committed to it) or not (its notices say it will not post it).
  std::atomic<uint64_t> state_{0};
  // Odd while this rank is inside MPI's blocking transfer of a call (InTransfer): the transfer
  // watch reads it (mpi_communicator.cpp).
  std::atomic<uint64_t> transfer_{0};
  friend class InTransfer;
  friend class TransferWatch;
  bool aborted_ = false;
  std::string aborted_reason_;
  bool holds_abandoned_ = false;  // counted in the runtime's abandoned total
  // An abandoned request still refers to its communicator, which must then never be freed.
  bool comm_pending_ = false;
  bool base_pending_ = false;
  // A reset whose duplications did not all complete (timeout, abort): the next reset goes on with
  // them. Posting them again would pair each rank's k-th duplication with a peer's (k+1)-th, and
  // the resets would stay one step apart forever.
  std::shared_ptr<FreshComms> resetting_;

  // Abort notices: one receive always posted on ctl_ from any peer; sends once per abort.
  std::mutex ctl_mutex_;
  std::atomic<bool> notices_sent_{false};  // read by the waits without the lock
  int64_t notice_out_[3] = {0, 0, 0};      // a Notice's status, subject, stop_at
  int64_t notice_in_[3] = {0, 0, 0};
  std::optional<Notice> notice_;  // the notice heard with the earliest stop_at, until reset
  // The first rank that a notice reported dead, and its reporter (-1: none). A notice's stop_at
  // says which calls its sender abandons, but a dead rank posts nothing more in any call: a rank
  // still waiting in an earlier one (its message from the dead rank never sent) would otherwise
  // wait for its deadline, where neither its host nor a liveness link shows it that death. So a
  // heard death ends any wait as a seen one does (tests/model/mpi_round.pml: a death ends every
  // wait). Kept through resets: the dead stay dead. Atomic: TransferWatch reads it.
  std::atomic<int> heard_dead_{-1};
  int heard_dead_from_ = -1;
  Clock::time_point last_notice_poll_{};  // the start of the last call that looked for notices
  Clock::time_point offset_read_{};
  int64_t system_offset_ns_ = 0;  // system clock minus steady clock
  MPI_Request notice_receive_ = mpi::lib().request_null;
  std::vector<MPI_Request> notice_sends_;
  bool runtime_acquired_ = false;
};

}  // namespace gradsync::comm::mpi
