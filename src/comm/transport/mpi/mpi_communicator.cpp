// SPDX-License-Identifier: Apache-2.0
// The MPI transport's group and round protocol: joining, the exchange that opens every call and
// its verdict, abort notices, the bounded waits, reset and subgroups (mpi_internal.hpp).
#include "comm/transport/mpi/mpi_communicator.hpp"

#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/call_signature.hpp"
#include "comm/topology.hpp"
#include "comm/transport/mpi/mpi_internal.hpp"
#include "comm/transport/mpi/mpi_runtime.hpp"
#include "comm/verdict.hpp"
#include "common/bounded_wait.hpp"
#include "common/error.hpp"
#include "common/fnv.hpp"
#include "common/liveness.hpp"
#include "common/liveness_links.hpp"
#include "common/log.hpp"
#include "common/wait.hpp"

namespace gradsync::comm::mpi {
namespace {

size_t max_mpi_count() {
  const char* v = std::getenv("GRADSYNC_MPI_MAX_COUNT");
  if (v == nullptr || *v == '\0') return kMaxMpiCount;
  char* end = nullptr;
  errno = 0;
  const unsigned long long x = std::strtoull(v, &end, 10);
  GS_REQUIRE(errno == 0 && *end == '\0' && x >= 1 && x <= kMaxMpiCount && v[0] != '-', GRADSYNC_E_INVALID_ARG,
             "GRADSYNC_MPI_MAX_COUNT must be an integer in [1, {}], got '{}'", kMaxMpiCount, v);
  return static_cast<size_t>(x);
}

constexpr int kAbortTag = 7001;
constexpr int kSplitTag = 7002;
// How often the polling loop looks at peers' liveness, and when it starts sleeping between polls.
constexpr auto kLivenessPeriod = std::chrono::milliseconds(100);
// The transfer watch (TransferWatch): how long a blocking transfer may go on once a peer of it is
// seen dead, and how many looks without a transfer before the watch sleeps.
constexpr auto kStuckGrace = std::chrono::seconds(1);
constexpr int kQuietLooks = 10;
// How long the ranks of a new group may take to set their liveness links up (a few round trips
// between ranks that have just met in an allgather): past it, a peer without one is seen dead only
// at the deadline.
constexpr auto kLinkSetup = std::chrono::seconds(10);
constexpr auto kSpinPhase = std::chrono::milliseconds(2);

std::string describe(const Fingerprint& f) { return fmt::format("{} (call {})", describe(f.call), f.seq); }

int64_t world_rank() {
  int r = -1;
  mpi::lib().Comm_rank(mpi::lib().comm_world, &r);
  return r;
}

// Processes of one kernel and one PID namespace can see each other's PIDs: a key for that.
uint64_t pid_namespace_key() {
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  struct stat st {};
  const uint64_t ns = ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
  if (boot_id.empty() || ns == 0) return 0;  // unknown: never compare PIDs
  return std::hash<std::string>{}(boot_id) ^ (ns * 0x9E3779B97F4A7C15ull);
}

// The key of a fingerprint is key_of(hash_of(its call), its number): equal fingerprints give equal
// keys; calls of different numbers differ always (mix64 is a bijection), and different calls differ
// but with probability 2^-64. The call's hash is kept for the next call, which is nearly always the
// same (a loop of allreduces), so that a call costs one mix instead of a dozen.
uint64_t hash_of(const CallSignature& c) noexcept {
  uint64_t words[sizeof(CallSignature) / 8];
  std::memcpy(words, &c, sizeof words);
  uint64_t h = 0x6a09e667f3bcc908ull;
  for (uint64_t w : words) h = mix64(h ^ mix64(w));
  return h;
}
uint64_t key_of(uint64_t call_hash, uint64_t seq) noexcept { return mix64(call_hash ^ mix64(seq)); }

// The small path: an allreduce of at most this many bytes per rank, and at most kPackBudget over the
// group, travels inside the exchange and every rank folds the contributions in rank order. Every
// rank computes the same limit from the group's size, so a message never exceeds the receive
// posted for it, even when the ranks' calls differ.
constexpr size_t kPackBytes = size_t{16} << 10;
constexpr size_t kPackBudget = size_t{64} << 10;
constexpr int kExchangeTag = 7003;
// A message of entries a little longer than Open MPI's shared-memory eager limit (4 KiB with its
// own header: an allreduce of 1K floats) would go by rendezvous, a single copy through
// process_vm_readv and an acknowledgement back, which costs more than eager messages of the same
// bytes: such a message to a peer on the same host goes in pieces of kPiece bytes (the last one
// shorter), up to kMaxPieces of them (more pieces were measured slower than a rendezvous). Its first header says how
// many pieces follow, and the receiver posts their receives once the first has come, so that the pieces pair up
// whatever the ranks' calls were. Longer messages go whole (for them one rendezvous costs less than the pieces), and so
// do messages to other hosts (over TCP a 4 KiB message is eager already).
constexpr size_t kPiece = 4032;
constexpr size_t kMaxPieces = 2;
// How many pieces a message of `total` bytes goes in.
constexpr size_t pieces_of(size_t total) noexcept {
  return total > kPiece && total <= kMaxPieces * kPiece ? (total + kPiece - 1) / kPiece : 1;
}
constexpr int kDetailsTag = 7004;
constexpr int kCommitTag = 7006;

// The exchange's partners (Doubling, mpi_internal.hpp). The lowest 2 * rest ranks pair up, the even
// one of each pair outside the doubling; the others take part under numbers 0 .. pow2 - 1. host(r):
// rank r's host (the same table on every rank, so every rank plans the same steps).
// The entries a rank sends double at every step, so the steps whose partners are on other hosts
// go first, while each message still holds the fewest entries: at 2 hosts x 2 the TCP step carries
// one entry and the shared-memory step two, not the other way round (the order of the bits is
// free: any order of them gives every rank every entry).
Doubling plan_doubling(int rank, int size, const std::function<uint64_t(int)>& host) {
  bool one_host = true;
  for (int r = 1; r < size; ++r) one_host &= host(r) == host(0);
  if (one_host) return Doubling{.direct = true};
  int pow2 = 1;
  while (pow2 * 2 <= size) pow2 *= 2;
  const int rest = size - pow2;
  const auto rank_of = [&](int q) { return q < rest ? 2 * q + 1 : q + rest; };
  int steps = 0;
  while ((1 << steps) < pow2) ++steps;
  // bits[k]: the bit that step k flips, the bits whose pairs cross hosts most often first.
  std::vector<int> bits(static_cast<size_t>(steps)), crossing(static_cast<size_t>(steps), 0);
  for (int b = 0; b < steps; ++b) {
    bits[static_cast<size_t>(b)] = b;
    for (int q = 0; q < pow2; ++q) crossing[static_cast<size_t>(b)] += host(rank_of(q)) != host(rank_of(q ^ (1 << b)));
  }
  std::stable_sort(bits.begin(), bits.end(),
                   [&](int a, int b) { return crossing[static_cast<size_t>(a)] > crossing[static_cast<size_t>(b)]; });
  // The entries rank_of(q) holds after `done` steps, in its order: its own, the rank it serves,
  // then those of each step's partner.
  const std::function<std::vector<int>(int, int)> held = [&](int q, int done) {
    if (done == 0) {
      std::vector<int> own{rank_of(q)};
      if (q < rest) own.push_back(rank_of(q) - 1);
      return own;
    }
    std::vector<int> mine = held(q, done - 1), theirs = held(q ^ (1 << bits[static_cast<size_t>(done - 1)]), done - 1);
    mine.insert(mine.end(), theirs.begin(), theirs.end());
    return mine;
  };
  Doubling d;
  if (rank < 2 * rest && rank % 2 == 0) {
    d.outside = true;
    d.extra = rank + 1;
    d.ranks.push_back(held(rank / 2, steps));
    return d;
  }
  const int q = rank < 2 * rest ? rank / 2 : rank - rest;
  if (q < rest) d.extra = rank - 1;
  for (int k = 0; k < steps; ++k) {
    const int partner = q ^ (1 << bits[static_cast<size_t>(k)]);
    d.partners.push_back(rank_of(partner));
    d.ranks.push_back(held(partner, k));
  }
  return d;
}

}  // namespace

// Ends the job when a rank is stuck in MPI's blocking transfer of a call and a peer of that call
// is seen dead (by PID or liveness link): MPI cannot interrupt the transfer, and under
// --enable-recovery nothing else would end it (measured: docs/mpi.md). One thread per process,
// started by the first transfer; it looks every liveness period while transfers run and sleeps
// once none has for a second. A transfer is looked into once it has lasted a whole period (the
// same odd count at two looks), so the calls themselves pay two atomic increments and a load; the
// job ends when the same transfer is still running kStuckGrace after a peer was first seen dead
// (a rank whose remaining steps did not need the dead one finishes within it).
class TransferWatch {
 public:
  static TransferWatch& get() {
    static auto* watch = new TransferWatch();  // never destroyed: its thread may outlive exit's destructors
    return *watch;
  }
  void add(MpiCommunicator* c) {
    std::lock_guard lock(mutex_);
    comms_.push_back({c, 0});
  }
  void remove(MpiCommunicator* c) noexcept {
    std::lock_guard lock(mutex_);
    std::erase_if(comms_, [c](const Entry& e) { return e.comm == c; });
  }
  // After a transfer's count turned odd (seq_cst, as awake_ is read): either the watch sees the
  // odd count, or this sees it asleep and wakes it.
  void started() noexcept {
    if (awake_.load()) return;
    try {
      std::lock_guard lock(mutex_);
      if (!thread_started_) {
        std::thread([this] { run(); }).detach();
        thread_started_ = true;
      }
      awake_ = true;
    } catch (...) {
      return;  // no thread: this transfer goes unwatched, as every one did before
    }
    wake_.notify_one();
  }

 private:
  struct Entry {
    MpiCommunicator* comm;
    uint64_t seen;                   // the odd count of the last look, or 0
    Clock::time_point dead_since{};  // when a peer was first seen dead during that transfer
  };
  void run() {
    std::unique_lock lock(mutex_);
    int quiet = 0;
    for (;;) {
      wake_.wait(lock, [this] { return awake_.load(); });
      wake_.wait_for(lock, kLivenessPeriod);
      bool any = false;
      for (Entry& e : comms_) {
        const uint64_t t = e.comm->transfer_.load();
        if ((t & 1) == 0 || e.seen != t) {
          e.seen = t & 1 ? t : 0;
          e.dead_since = {};
          any |= (t & 1) != 0;
          continue;
        }
        any = true;
        const int dead = e.comm->dead_peer();
        if (dead < 0) continue;
        const auto now = Clock::now();
        if (e.dead_since == Clock::time_point{}) e.dead_since = now;
        if (now - e.dead_since < kStuckGrace) continue;
        const auto& peers = e.comm->peers_;
        GS_LOG_ERROR(
            "MPI transport: rank {} (world rank {}): rank {} (world rank {}) died while this rank was inside MPI's "
            "blocking transfer of a call, which nothing can interrupt (the survivors would wait in it forever): "
            "calling MPI_Abort(MPI_COMM_WORLD, 1) to end the job rather than hang",
            e.comm->rank_, peers[static_cast<size_t>(e.comm->rank_)].world_rank, dead,
            peers[static_cast<size_t>(dead)].world_rank);
        mpi::lib().Abort(mpi::lib().comm_world, 1);
      }
      quiet = any ? 0 : quiet + 1;
      if (quiet < kQuietLooks) continue;
      awake_ = false;
      // A transfer that started as the watch decided to sleep saw it awake: look once more.
      for (const Entry& e : comms_)
        if (e.comm->transfer_.load() & 1) awake_ = true;
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<Entry> comms_;
  std::atomic<bool> awake_{false};
  bool thread_started_ = false;
};

InTransfer::InTransfer(MpiCommunicator& c) noexcept : c_(c) {
  c_.transfer_.fetch_add(1);
  TransferWatch::get().started();
}

InTransfer::~InTransfer() { c_.transfer_.fetch_add(1, std::memory_order_release); }

std::string mpi_error_string(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (mpi::lib().Error_string(rc, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", rc);
  return std::string(text, static_cast<size_t>(len));
}

void bury(std::shared_ptr<void> memory) {
  static std::mutex mutex;
  static auto* graveyard = new std::vector<std::shared_ptr<void>>();  // never freed, on purpose
  std::lock_guard lock(mutex);
  graveyard->push_back(std::move(memory));
}

namespace {

// Joins whose duplications of their parent did not all complete (a rank came late, an abort): the
// next join on the same parent goes on with them, as a reset goes on with resetting_, since each
// rank's k-th duplication of a parent matches its peers' k-th. `counted`: its abandoned wait is
// in the runtime's count, which a join that completes it takes back.
struct PendingJoin {
  MPI_Comm parent;
  std::shared_ptr<FreshComms> fresh;
  bool counted;
};
std::mutex g_pending_joins_mutex;
std::vector<PendingJoin>& pending_joins() {
  static auto* joins = new std::vector<PendingJoin>();  // never freed, as the graveyard
  return *joins;
}

}  // namespace

MpiCommunicator::MpiCommunicator(const Options& options, MPI_Comm parent)
    : options_(options), max_count_(max_mpi_count()) {
  mpi::acquire_runtime();
  runtime_acquired_ = true;
  try {
    if (parent == mpi::lib().comm_null && options.mpi_fcomm == INT64_MIN) {
      parent = mpi::lib().comm_world;
    } else if (parent == mpi::lib().comm_null) {
      GS_REQUIRE(options.mpi_fcomm >= INT32_MIN && options.mpi_fcomm <= INT32_MAX, GRADSYNC_E_INVALID_ARG,
                 "mpi_fcomm {} is not a Fortran communicator handle (MPI_Fint range)", options.mpi_fcomm);
      parent = mpi::lib().Comm_f2c(static_cast<MPI_Fint>(options.mpi_fcomm));
      GS_REQUIRE(parent != mpi::lib().comm_null && parent != nullptr, GRADSYNC_E_INVALID_ARG,
                 "mpi_fcomm {} is not a valid MPI communicator (MPI_Comm_f2c gave MPI_COMM_NULL)", options.mpi_fcomm);
      int inter = 0;
      check(mpi::lib().Comm_test_inter(parent, &inter), "MPI_Comm_test_inter");
      GS_REQUIRE(!inter, GRADSYNC_E_INVALID_ARG, "mpi_fcomm {} is an intercommunicator; an intracommunicator is needed",
                 options.mpi_fcomm);
    }
    const auto deadline = deadline_after(options_.timeout);
    // Our own communicators, so our traffic never matches the host's: the base (the parent of
    // reset's), the collectives' and the notices'. Non-blocking dups, so a rank that never joins
    // gives a timeout here too.
    mpi::lib().Comm_rank(parent, &rank_);  // for the messages until the group is formed
    mpi::lib().Comm_size(parent, &size_);
    std::shared_ptr<FreshComms> fresh;
    {
      std::lock_guard lock(g_pending_joins_mutex);
      auto& joins = pending_joins();
      const auto it =
          std::find_if(joins.begin(), joins.end(), [&](const PendingJoin& j) { return j.parent == parent; });
      if (it != joins.end()) {
        fresh = it->fresh;
        if (it->counted) mpi::clear_abandoned();
        joins.erase(it);
      }
    }
    if (!fresh) fresh = std::make_shared<FreshComms>();
    try {
      duplicate(fresh, parent, true, deadline, "joining the MPI group (MPI_Comm_idup)");
    } catch (...) {
      std::lock_guard lock(g_pending_joins_mutex);
      pending_joins().push_back(PendingJoin{parent, fresh, holds_abandoned_});
      holds_abandoned_ = false;
      throw;
    }
    base_ = fresh->base;
    comm_ = fresh->comm;
    ctl_ = fresh->ctl;
    mpi::lib().Comm_rank(base_, &rank_);
    mpi::lib().Comm_size(base_, &size_);

    // Who runs where, so that a dead peer on this host is told apart from a slow one.
    auto info = std::make_shared<std::vector<PeerInfo>>(static_cast<size_t>(size_) + 1);
    (*info)[static_cast<size_t>(size_)] =
        PeerInfo{pid_namespace_key(), static_cast<int64_t>(::getpid()), static_cast<uint64_t>(max_count_),
                 std::hash<std::string>{}(host_identity(options_.host_label)), world_rank()};
    MPI_Request request = mpi::lib().request_null;
    check(mpi::lib().Iallgather(&(*info)[static_cast<size_t>(size_)], sizeof(PeerInfo), mpi::lib().byte, info->data(),
                                sizeof(PeerInfo), mpi::lib().byte, comm_, &request),
          "MPI_Iallgather");
    wait(&request, 1, deadline, "joining the MPI group (exchange of process ids)", nullptr, info, Mode::Setup);
    peers_.assign(info->begin(), info->begin() + size_);
    // Ranks that split transfers differently would pair their pieces wrongly: refuse, on every rank.
    for (int r = 0; r < size_; ++r) {
      GS_REQUIRE(peers_[static_cast<size_t>(r)].max_count == peers_[0].max_count, GRADSYNC_E_MISMATCH,
                 "GRADSYNC_MPI_MAX_COUNT differs between ranks: rank 0 has {}, rank {} has {}", peers_[0].max_count, r,
                 peers_[static_cast<size_t>(r)].max_count);
    }
    link_peers(deadline);
    pack_capacity_ = std::min(kPackBytes, kPackBudget / static_cast<size_t>(size_)) / 64 * 64;
    pieces_.resize(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r)
      pieces_[static_cast<size_t>(r)] =
          peers_[static_cast<size_t>(r)].host_key == peers_[static_cast<size_t>(rank_)].host_key;
    doubling_ = plan_doubling(rank_, size_, [&](int r) { return peers_[static_cast<size_t>(r)].host_key; });
    renew_exchange();
    stamps_.resize(static_cast<size_t>(size_));
    post_notice_receive();
    GS_LOG_DEBUG("MPI transport: rank {} of {} joined (deterministic {}, check_mismatch {}, timeout {} ms)", rank_,
                 size_, options_.deterministic, options_.check_mismatch, options_.timeout.count());
    TransferWatch::get().add(this);  // last: a constructor that throws has no destructor to remove it
  } catch (...) {
    retire_control();
    if (!mpi::finalized()) {
      if (!comm_pending_ && comm_ != mpi::lib().comm_null) mpi::lib().Comm_free(&comm_);
      if (!base_pending_ && base_ != mpi::lib().comm_null) mpi::lib().Comm_free(&base_);
    }
    mpi::release_runtime();
    runtime_acquired_ = false;
    throw;
  }
}

MpiCommunicator::~MpiCommunicator() {
  TransferWatch::get().remove(this);
  if (!mpi::finalized()) {
    retire_control();
    // A communicator with an abandoned collective stays allocated: the request still refers to it.
    if (!comm_pending_ && comm_ != mpi::lib().comm_null) mpi::lib().Comm_free(&comm_);
    if (!base_pending_ && base_ != mpi::lib().comm_null) mpi::lib().Comm_free(&base_);
  }
  // An abandoned collective stays counted: the process ends with MPI_Abort when we own MPI.
  if (holds_abandoned_ && !mpi::we_initialised())
    GS_LOG_WARN(
        "MPI transport: freeing a communicator whose collective was abandoned ({}); MPI_Finalize may wait "
        "forever for the missing rank: end the job with MPI_Abort",
        aborted_reason_);
  if (runtime_acquired_) mpi::release_runtime();
}

void MpiCommunicator::fail_mpi(int rc, const char* call, int peer) {
  // A call fails at once when a peer's connection is reset by its death, which may not show yet
  // (the process not reaped): given a moment, the error names the rank whose death caused it.
  // A death on another host cannot be seen from here, but a send or receive that failed names
  // the rank it addressed, whose connection broke.
  int dead = -1;
  gone_within_grace([&] { return (dead = dead_peer()) >= 0; });
  std::string message = fmt::format("{} failed on rank {}: {}", call, rank_, mpi_error_string(rc));
  if (dead >= 0) {
    message += "; " + death_of(dead);
  } else if (peer >= 0 && peer < size_ && peer != rank_ && !peers_.empty() &&
             peers_[static_cast<size_t>(peer)].host_key != peers_[static_cast<size_t>(rank_)].host_key) {
    message += fmt::format("; the connection to rank {} on another host broke: that rank or its host is lost", peer);
  }
  aborted_ = true;
  aborted_reason_ = message;
  fail(GRADSYNC_E_REMOTE, "{}", message);
}

void MpiCommunicator::post_notice_receive() {
  check(mpi::lib().Irecv(notice_in_, 3, mpi::lib().int64, MPI_ANY_SOURCE, kAbortTag, ctl_, &notice_receive_),
        "MPI_Irecv");
}

void MpiCommunicator::poll_notices() {
  while (notice_receive_ != mpi::lib().request_null) {
    int arrived = 0;
    MPI_Status status;
    check(mpi::lib().Test(&notice_receive_, &arrived, &status), "MPI_Test");
    if (!arrived) return;
    const Notice n{notice_in_[0], notice_in_[1], notice_in_[2], status.MPI_SOURCE};
    if (!notice_ || n.stop_at < notice_->stop_at) notice_ = n;
    if (n.status == GRADSYNC_E_REMOTE && n.subject >= 0 && n.subject < size_ && n.subject != rank_ &&
        heard_dead_.load(std::memory_order_relaxed) < 0) {
      heard_dead_from_ = n.source;
      heard_dead_.store(static_cast<int>(n.subject));
    }
    post_notice_receive();  // a later notice may stop an earlier call
  }
}

std::string MpiCommunicator::notice_reason() const {
  const Notice& n = *notice_;
  if (n.subject == rank_) return "gradsync_comm_abort was called on this rank";
  // A notice names its subject, the rank that started it; the sender may only be forwarding it.
  return n.status == GRADSYNC_E_REMOTE ? fmt::format("rank {} died (reported by rank {})", n.subject, n.source)
         : n.status == GRADSYNC_E_TIMEOUT
             ? fmt::format("rank {} timed out waiting for a rank that did not arrive", n.subject)
             : fmt::format("rank {} aborted the group", n.subject);
}

// Cancels the posted notice receive, lets go of sent notices, frees ctl_.
void MpiCommunicator::retire_control() noexcept {
  std::lock_guard lock(ctl_mutex_);
  if (notice_receive_ != mpi::lib().request_null) {
    mpi::lib().Cancel(&notice_receive_);
    mpi::lib().Wait(&notice_receive_, MPI_STATUS_IGNORE);
  }
  for (MPI_Request& r : notice_sends_)
    if (r != mpi::lib().request_null) mpi::lib().Request_free(&r);
  notice_sends_.clear();
  if (ctl_ != mpi::lib().comm_null) mpi::lib().Comm_free(&ctl_);
}

// Tells every peer that this rank aborted the group and will not post call stop_at (at most once
// per abort: the first reason stands).
void MpiCommunicator::send_notices(int status, int subject, uint64_t stop_at) noexcept {
  std::lock_guard lock(ctl_mutex_);
  if (notices_sent_ || ctl_ == mpi::lib().comm_null || mpi::finalized()) return;
  notices_sent_ = true;
  notice_out_[0] = status;
  notice_out_[1] = subject;
  notice_out_[2] = static_cast<int64_t>(stop_at);
  for (int peer = 0; peer < size_; ++peer) {
    // Not to a peer seen dead, nor to the dead one a forwarded notice names (as the shrink's
    // messages: mpi_shrink.cpp).
    if (peer == rank_ || peer_dead(peer) || (status == GRADSYNC_E_REMOTE && peer == subject)) continue;
    MPI_Request r = mpi::lib().request_null;
    if (mpi::lib().Isend(notice_out_, 3, mpi::lib().int64, peer, kAbortTag, ctl_, &r) == MPI_SUCCESS)
      notice_sends_.push_back(r);
  }
}

void MpiCommunicator::abort() noexcept {
  // Atomically with the owner's posting of a call: a rank that has posted call k is committed to
  // it and will not post k + 1; one that has not will not post k.
  const uint64_t before = state_.fetch_or(1);
  // With MPI_THREAD_MULTIPLE the peers hear of it at once; otherwise the thread that owns the
  // communicator sends the notices at its next poll or call.
  if (mpi::thread_level() == MPI_THREAD_MULTIPLE) send_notices(GRADSYNC_E_ABORTED, rank_, (before >> 1) + 1);
}

Communicator::Stop MpiCommunicator::stopped_by_peer() noexcept {
  try {
    poll_notices();
  } catch (const Error&) {
    // A broken notice channel says nothing here: the calls' own waits report it.
  }
  if (!notice_) return {0, {}};
  return {static_cast<int>(notice_->status), notice_reason()};
}

void MpiCommunicator::throw_if_aborted(uint64_t call, Clock::time_point now) {
  // Notices are taken in by the waits. A rank that comes back after a while (a millisecond: calls
  // in a loop come sooner) looks for them first, so that a notice sent meanwhile fails this call
  // before it is posted; one still in flight is heard in this call's wait.
  if (!aborted_) {
    if (now - last_notice_poll_ > std::chrono::milliseconds(1)) {
      poll_notices();
      last_notice_poll_ = now;
    }
    if (state_.load() & 1) {
      aborted_ = true;
      aborted_reason_ = "gradsync_comm_abort was called on this rank";
      send_notices(GRADSYNC_E_ABORTED, rank_, call);
    } else if (notice_) {
      aborted_ = true;
      aborted_reason_ = notice_reason();
      // Forwarded: a peer committed to this call learns that it can complete nowhere.
      send_notices(static_cast<int>(notice_->status), static_cast<int>(notice_->subject), call);
    }
  }
  if (aborted_)
    fail(GRADSYNC_E_ABORTED,
         "MPI communicator (rank {} of {}) is aborted: {}; call gradsync_comm_reset on every rank, or free it", rank_,
         size_, aborted_reason_);
}

void MpiCommunicator::abandon(std::shared_ptr<void> keepalive, const std::string& reason, int status, int subject,
                              uint64_t stop_at) {
  bury(std::move(keepalive));
  aborted_ = true;
  aborted_reason_ = reason;
  comm_pending_ = true;
  base_pending_ = true;
  // Until a reset recovers the group, the exit handler prefers MPI_Abort to MPI_Finalize: a living
  // peer may be blocked in what we abandon, and with a dead one MPI_Finalize's closing
  // synchronisation can wait forever (seen with mpirun --enable-recovery).
  if (!holds_abandoned_) {
    holds_abandoned_ = true;
    mpi::mark_abandoned();
  }
  send_notices(status, subject, stop_at);
}

// A peer's notice says that call `call`, which this rank waits in, can complete nowhere: report
// what the peer saw, so that a dead rank or a timeout reads the same on every rank.
void MpiCommunicator::fail_on_notice(const std::shared_ptr<void>& keepalive, const std::string& what, uint64_t call) {
  const Notice n = *notice_;
  const int status = static_cast<int>(n.status), subject = static_cast<int>(n.subject);
  if (status == GRADSYNC_E_REMOTE) {
    abandon(keepalive, fmt::format("rank {} died during {}", subject, what), status, subject, call);
    fail(GRADSYNC_E_REMOTE, "{} on rank {}: rank {} has died (reported by rank {})", what, rank_, subject, n.source);
  }
  if (status == GRADSYNC_E_TIMEOUT) {
    abandon(keepalive, fmt::format("{} timed out", what), status, subject, call);
    fail(GRADSYNC_E_TIMEOUT,
         "{} on rank {} of {}: not every rank arrived within the timeout ({} ms; the deadline passed first on rank "
         "{}); the communicator is aborted on every rank",
         what, rank_, size_, options_.timeout.count(), subject);
  }
  if (subject == rank_) {
    abandon(keepalive, fmt::format("gradsync_comm_abort was called on this rank during {}", what), GRADSYNC_E_ABORTED,
            subject, call);
    fail(GRADSYNC_E_ABORTED, "{} on rank {}: aborted by gradsync_comm_abort (a peer had not posted it)", what, rank_);
  }
  abandon(keepalive, fmt::format("rank {} aborted the group during {}", subject, what), GRADSYNC_E_ABORTED, subject,
          call);
  fail(GRADSYNC_E_ABORTED, "{} on rank {}: rank {} aborted the group", what, rank_, subject);
}

void MpiCommunicator::link_peers(Clock::time_point deadline) {
  // Ranks whose PIDs this one cannot see get liveness links (common/liveness_links.hpp): their
  // deaths then show at once rather than at the deadline. Every rank decides alike from peers_.
  std::vector<uint64_t> group(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) {
    const uint64_t key = peers_[static_cast<size_t>(r)].ns_key;
    group[static_cast<size_t>(r)] = key != 0 ? key : ~static_cast<uint64_t>(r);  // unknown: its own
  }
  if (std::all_of(group.begin(), group.end(), [&](uint64_t g) { return g == group[0]; })) return;
  links_ = std::make_unique<LivenessLinks>();
  auto all = std::make_shared<std::vector<LinkAddress>>(static_cast<size_t>(size_) + 1);
  (*all)[static_cast<size_t>(size_)] = links_->address();
  MPI_Request request = mpi::lib().request_null;
  check(mpi::lib().Iallgather(&(*all)[static_cast<size_t>(size_)], sizeof(LinkAddress), mpi::lib().byte, all->data(),
                              sizeof(LinkAddress), mpi::lib().byte, comm_, &request),
        "MPI_Iallgather");
  wait(&request, 1, deadline, "joining the MPI group (exchange of liveness addresses)", nullptr, all, Mode::Setup);
  std::vector<int> dial, accept;
  for (int p : linked_peers(rank_, group)) (p < rank_ ? dial : accept).push_back(p);
  const std::vector<int> missing =
      links_->connect(rank_, std::span<const LinkAddress>(all->data(), static_cast<size_t>(size_)), dial, accept,
                      std::min(deadline, Clock::now() + kLinkSetup));
  GS_LOG_DEBUG("MPI transport: rank {} has liveness links with rank(s) [{}] (dialled) and [{}]", rank_,
               fmt::join(dial, ", "), fmt::join(accept, ", "));
  if (!missing.empty())
    GS_LOG_WARN(
        "MPI transport: rank {} has no liveness link with rank(s) {} (no TCP connection between them came up within "
        "{} s): their death shows here only at the timeout",
        rank_, fmt::join(missing, ", "), std::chrono::duration_cast<std::chrono::seconds>(kLinkSetup).count());
}

bool MpiCommunicator::pid_dead(int r) const noexcept {
  const uint64_t mine = peers_.empty() ? 0 : peers_[static_cast<size_t>(rank_)].ns_key;
  if (mine == 0 || r == rank_ || r < 0 || r >= static_cast<int>(peers_.size())) return false;
  const PeerInfo& p = peers_[static_cast<size_t>(r)];
  return p.ns_key == mine && p.pid > 0 && peer_gone({static_cast<pid_t>(p.pid)});
}

bool MpiCommunicator::peer_dead(int r) const noexcept {
  if (pid_dead(r) || r == heard_dead_.load()) return true;
  if (links_ == nullptr) return false;
  links_->poll();
  return links_->gone(r);
}

int MpiCommunicator::dead_peer() const noexcept {
  const int linked = links_ != nullptr ? links_->poll() : -1;
  for (int r = 0; r < static_cast<int>(peers_.size()); ++r)
    if (r == linked || pid_dead(r)) return r;
  return heard_dead_.load();
}

std::string MpiCommunicator::death_of(int dead) const {
  if (dead == heard_dead_.load() && !pid_dead(dead) && !(links_ != nullptr && links_->gone(dead)))
    return fmt::format("rank {} has died (reported by rank {})", dead, heard_dead_from_);
  return fmt::format("rank {} (pid {}) has died", dead, peers_[static_cast<size_t>(dead)].pid);
}

void MpiCommunicator::wait(MPI_Request* requests, int n, Clock::time_point deadline, const char* label,
                           const Fingerprint* fp, const std::shared_ptr<void>& keepalive, Mode mode,
                           std::optional<Clock::time_point> started) {
  const auto start = started ? *started : Clock::now();
  auto what = [&] { return fp != nullptr ? describe(*fp) : std::string(label); };
  const uint64_t call = fp != nullptr ? fp->seq : seq_ + 1;
  uint64_t polls = 0;
  const mpi::Api& m = mpi::lib();
  // Polls until the requests complete (Ready), an abort or a notice ends the wait (Aborted), or
  // `until`. Spins briefly (the common case is a peer a few microseconds late), then gives the core
  // away: ranks are often oversubscribed, and a long wait gains nothing from spinning.
  auto slice = [&](Clock::time_point until) {
    for (;; ++polls) {
      int done = 0;
      check(m.Testall(n, requests, &done, MPI_STATUSES_IGNORE), "MPI_Testall");
      if (done) return WaitResult::Ready;
      if (mode == Mode::Setup && (state_.load() & 1)) return WaitResult::Aborted;
      if (mode != Mode::Setup) {
        // Committed: this rank's own abort is only announced (without MPI_THREAD_MULTIPLE abort()
        // could not); the call goes on.
        if ((state_.load() & 1) && !notices_sent_) send_notices(GRADSYNC_E_ABORTED, rank_, call + 1);
        if ((polls & 15) == 15) poll_notices();
        if (notice_ && static_cast<uint64_t>(notice_->stop_at) <= call) return WaitResult::Aborted;
      }
      if ((polls & 63) != 63) continue;
      const auto now = Clock::now();
      if (now >= until) return WaitResult::Timeout;
      if (now - start < kSpinPhase) {
        sched_yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  };
  int dead = -1;
  Stop stopped{0, {}};
  const WaitEnd end = bounded_wait(
      slice,
      [&] {
        if (interrupt_()) abort();  // acted on as an abort: at the next poll, as its mode says
        return false;
      },
      [&] {
        if ((dead = dead_peer()) >= 0) return true;
        if (mode == Mode::Round && stop_check_) stopped = stop_check_();
        return stopped.first != 0;
      },
      [&](Clock::duration waited) {
        // MPI does not say which ranks have not posted their part: the late rank is the one not
        // logging this.
        GS_LOG_WARN("{} on rank {} of {}: waiting {} s for the other ranks", what(), rank_, size_,
                    std::chrono::duration_cast<std::chrono::seconds>(waited).count());
      },
      [] { return true; }, deadline, kLivenessPeriod, start);
  switch (end) {
    case WaitEnd::Ready: return;
    case WaitEnd::Stopped:
      if (mode != Mode::Setup) fail_on_notice(keepalive, what(), call);
      [[fallthrough]];
    case WaitEnd::Interrupted:
      abandon(keepalive, fmt::format("gradsync_comm_abort was called on this rank during {}", what()),
              GRADSYNC_E_ABORTED, rank_, call);
      fail(GRADSYNC_E_ABORTED, "{} on rank {}: aborted by gradsync_comm_abort", what(), rank_);
    case WaitEnd::PeerGone:
      if (dead < 0) {
        // Stopped from the group built over this one: its peers here hear of it as an abort.
        abandon(keepalive, fmt::format("{} was stopped: {}", what(), stopped.second), GRADSYNC_E_ABORTED, rank_, call);
        fail(stopped.first, "{} on rank {}: {}", what(), rank_, stopped.second);
      }
      abandon(keepalive, fmt::format("rank {} died during {}", dead, what()), GRADSYNC_E_REMOTE, dead, call);
      fail(GRADSYNC_E_REMOTE, "{} on rank {}: {}", what(), rank_, death_of(dead));
    case WaitEnd::Deadline: break;
  }
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  abandon(keepalive, fmt::format("{} timed out", what()), GRADSYNC_E_TIMEOUT, rank_, call);
  fail(GRADSYNC_E_TIMEOUT,
       "{} on rank {} of {}: not every rank arrived within the timeout ({} ms, waited {} ms); the communicator "
       "is aborted on every rank",
       what(), rank_, size_, options_.timeout.count(), waited);
}

// The round protocol (docs/mpi.md; tests/model/mpi_round.pml checks it over every interleaving,
// with a message sent in two pieces as one: both are posted before the wait that completes them).
// Call k starts with its exchange: every rank's entry (its header and, on the small path, its
// data) reaches every rank by recursive doubling, point to point (Doubling), so every rank holds
// the same table and reaches the same verdict. A rank completes the exchange only once it holds
// every rank's entry, hence only once every rank has posted call k (the exchange is a barrier).
// A rank that has posted its exchange (its first step) is committed to call k, through every step:
// - its own abort (or an interrupt) only sends notices saying it will not post call k + 1, and
//   takes effect at its next call;
// - it abandons the call only on a notice that call k can complete nowhere (its sender had not
//   posted it), a dead peer, or its deadline; it then sends such a notice itself.
// A rank that starts call k aborted, or having heard a notice, never posts it and says so. Hence
// an abort makes every rank fail the same call: k if some rank had not posted k, else k + 1.
// The small path (an allreduce that fits, a barrier) ends with the exchange: no blocking call
// follows, so no wait is unbounded. The other calls move their data through MPI's blocking
// collectives, which no rank may enter alone: they commit first with a barrier, which a rank posts
// only once its exchange has completed (every rank has posted it), and which is abandoned on the
// same terms. The deadline and a death are the exceptions: a rank whose deadline passes (or whose
// peer dies) just as the call completes elsewhere fails it while the others complete it; every
// rank then fails its next call, since the failed rank posts nothing more until the reset. The stop
// check (a group built over this one was stopped) ends an exchange as the deadline may, and never
// a commit, which a peer may have completed and left for MPI's collective.
void MpiCommunicator::arrive(const CallSignature& call, Payload payload, uint64_t weight, bool commit) {
  const uint64_t k = seq_ + 1;  // calls are numbered from 1, as the other transports number their rounds
  const uint64_t word = std::exchange(call_word_, 0);
  // The statistics' clock: steady_clock's time at the price of a TSC read, where it can.
  const auto now = telemetry_.now();
  throw_if_aborted(k, now);
  uint64_t expected = (k - 1) << 1;
  if (!state_.compare_exchange_strong(expected, k << 1)) throw_if_aborted(k, now);  // aborted just now
  seq_ = k;
  const Fingerprint fp{k, call};
  auto where = [] { return std::string("MPI communicator"); };
  packed_ = false;
  if (size_ == 1) {
    const auto own = [&](int) -> const CallSignature& { return fp.call; };
    return verify_round(where, fp.seq, size_, 1, false, own, [&](int) { return weight; });
  }
  size_t bytes = 0;
  for (const BufferRef& b : payload.buffers) bytes += b.count * payload.elem;
  const bool pack = !payload.buffers.empty() && bytes <= pack_capacity_;
  const auto deadline = deadline_after(options_.timeout, now);
  const auto arrived = now;
  // The arrival wait, for the statistics, however it ends.
  struct Waited {
    Telemetry& telemetry;
    Telemetry::Clock::time_point arrived;
    const int64_t* stamps = nullptr;
    int n = 0;
    ~Waited() { telemetry.arrival(arrived, telemetry.now(), stamps, n); }
  } waited{telemetry_, arrived};
  Exchange& ex = *exchange_;
  Header& mine = ex.header(rank_);
  if (!(call == keyed_)) {
    keyed_ = call;
    keyed_hash_ = hash_of(call);
  }
  mine.key = key_of(keyed_hash_ ^ mix64(word), k);  // mix64(0) is 0: no word, the call's own key
  mine.arrived_ns = system_time_ns(now);
  mine.weight = weight;
  mine.bytes = pack ? static_cast<uint32_t>(bytes) : 0;
  mine.more = 0;
  if (pack) {
    std::byte* to = ex.data(rank_);
    for (const BufferRef& b : payload.buffers) {
      if (b.count > 0) std::memcpy(to, b.send, b.count * payload.elem);
      to += b.count * payload.elem;
    }
  }
  // The doubling: in each step this rank sends every entry it holds and receives as many from its
  // partner, so that after the last every rank holds every rank's entry.
  const Doubling& d = doubling_;
  try {
    const size_t own = entry_bytes(mine.bytes);
    if (d.direct) {
      send_to_all(ex, own, fp, deadline, now);
    } else if (d.outside) {
      swap(ex, d.extra, own, d.extra, own, d.ranks[0], fp, deadline, now);
    } else {
      size_t held = own;
      if (d.extra >= 0) held = swap(ex, -1, 0, d.extra, held, std::vector<int>{d.extra}, fp, deadline, now);
      for (size_t k = 0; k < d.partners.size(); ++k)
        held = swap(ex, d.partners[k], held, d.partners[k], held, d.ranks[k], fp, deadline, now);
      if (d.extra >= 0) swap(ex, d.extra, held, -1, held, {}, fp, deadline, now);
    }
  } catch (...) {
    renew_exchange();  // the abandoned requests may still write into the old table: it is buried
    throw;
  }
  for (int r = 0; r < size_; ++r) stamps_[static_cast<size_t>(r)] = ex.header(r).arrived_ns;
  waited.stamps = stamps_.data();
  waited.n = size_;
  // Every rank holds the same table, so every rank reaches the same verdict. Data that travelled
  // with the headers is folded only when every rank's call matches.
  bool same = true, any_packed = false;
  for (int r = 0; r < size_; ++r) {
    same &= ex.header(r).key == mine.key && ex.header(r).bytes == mine.bytes;
    any_packed |= ex.header(r).bytes != 0;
  }
  const bool compare = options_.check_mismatch || any_packed;
  if (!same && compare) explain_mismatch(fp, weight, word, deadline);
  // Calls alike on every rank, as they nearly always are, and judged before: nothing to judge
  // (a weighted mean's weights differ: always judged).
  if (!(same && call == judged_ && call.collective != Collective::WeightedMean)) {
    const auto own = [&](int) -> const CallSignature& { return call; };
    if (same) {
      verify_round(where, fp.seq, size_, size_, false, own, [&](int r) { return ex.header(r).weight; });
      judged_ = call;
    } else {  // check_mismatch off: only this rank's own arguments can be judged
      verify_round(where, fp.seq, size_, 1, false, own, [&](int) { return weight; });
    }
  }
  packed_ = pack;
  if (pack || !commit) return;
  try {
    commit_barrier(fp, deadline);
  } catch (...) {
    renew_exchange();  // its requests array held the abandoned ones
    throw;
  }
}

// The commit is a barrier of empty messages in the exchange's pattern (Doubling), as MPI_Ibarrier
// would be, but at the price of the exchange's own point-to-point steps: Open MPI's Ibarrier, which
// its schedule progresses only inside MPI_Test, cost 2-3 times a one-element allreduce across hosts.
// It completes on a rank only once every rank has posted it, as a barrier must: each step's
// message leaves only after the step before it completed, and a rank outside the doubling hears
// last, from the rank that served it, once that one's doubling is complete.
void MpiCommunicator::commit_barrier(const Fingerprint& fp, Clock::time_point deadline) {
  const mpi::Api& m = mpi::lib();
  MPI_Request* requests = exchange_->requests.data();
  const auto step = [&](int to, int from) {
    int n = 0;
    if (to >= 0) check(m.Isend(nullptr, 0, m.byte, to, kCommitTag, comm_, &requests[n++]), "MPI_Isend", to);
    if (from >= 0) check(m.Irecv(nullptr, 0, m.byte, from, kCommitTag, comm_, &requests[n++]), "MPI_Irecv", from);
    // Empty messages reference no memory of ours.
    wait(requests, n, deadline, nullptr, &fp, nullptr, Mode::Commit);
  };
  const Doubling& d = doubling_;
  if (d.direct) {
    int n = 0;
    for (int s = 1; s < size_; ++s) {
      const int to = rank_ + s < size_ ? rank_ + s : rank_ + s - size_;
      const int from = rank_ >= s ? rank_ - s : rank_ - s + size_;
      check(m.Isend(nullptr, 0, m.byte, to, kCommitTag, comm_, &requests[n++]), "MPI_Isend", to);
      check(m.Irecv(nullptr, 0, m.byte, from, kCommitTag, comm_, &requests[n++]), "MPI_Irecv", from);
    }
    return wait(requests, n, deadline, nullptr, &fp, nullptr, Mode::Commit);
  }
  if (d.outside) return step(d.extra, d.extra);
  if (d.extra >= 0) step(-1, d.extra);
  for (int partner : d.partners) step(partner, partner);
  if (d.extra >= 0) step(d.extra, -1);
}

size_t MpiCommunicator::entry_bytes(uint32_t data_bytes) const noexcept {
  // A peer's count is trusted only up to the group's limit, so that a walk stays in the table.
  return kHeaderArea + (std::min<size_t>(data_bytes, pack_capacity_) + 15) / 16 * 16;
}

void MpiCommunicator::send_to_all(Exchange& ex, size_t own, const Fingerprint& fp, Clock::time_point deadline,
                                  Clock::time_point start) {
  const mpi::Api& m = mpi::lib();
  const size_t slot = kHeaderArea + pack_capacity_;
  std::byte* const mine = reinterpret_cast<std::byte*>(&ex.header(rank_));
  // Every peer is on this host (pieces_ holds for each).
  const size_t pieces = pieces_of(own);
  ex.header(rank_).more = static_cast<uint32_t>(pieces - 1);
  int n = 0;
  for (int s = 1; s < size_; ++s) {
    const int to = rank_ + s < size_ ? rank_ + s : rank_ + s - size_;  // no division on this path
    for (size_t i = 0; i < pieces; ++i)
      check(m.Isend(mine + i * kPiece, static_cast<int>(i + 1 < pieces ? kPiece : own - i * kPiece), m.byte, to,
                    kExchangeTag, comm_, &ex.requests[static_cast<size_t>(n++)]),
            "MPI_Isend", to);
  }
  for (int s = 1; s < size_; ++s) {
    const int from = rank_ >= s ? rank_ - s : rank_ - s + size_;
    check(m.Irecv(&ex.header(from), static_cast<int>(slot), m.byte, from, kExchangeTag, comm_,
                  &ex.requests[static_cast<size_t>(n++)]),
          "MPI_Irecv", from);
  }
  wait(ex.requests.data(), n, deadline, nullptr, &fp, exchange_keep_, Mode::Round, start);
  n = 0;
  for (int from = 0; from < size_; ++from) {
    const uint32_t more = from == rank_ ? 0 : ex.header(from).more;
    if (more == 0 || more >= kMaxPieces || slot <= more * kPiece) continue;
    auto* at = reinterpret_cast<std::byte*>(&ex.header(from));
    for (size_t i = 1; i <= more; ++i)
      check(m.Irecv(at + i * kPiece, static_cast<int>(i < more ? kPiece : slot - i * kPiece), m.byte, from,
                    kExchangeTag, comm_, &ex.requests[static_cast<size_t>(n++)]),
            "MPI_Irecv", from);
  }
  if (n > 0) wait(ex.requests.data(), n, deadline, nullptr, &fp, exchange_keep_, Mode::Round, start);
}

size_t MpiCommunicator::swap(Exchange& ex, int to, size_t send_bytes, int from, size_t at,
                             const std::vector<int>& ranks, const Fingerprint& fp, Clock::time_point deadline,
                             Clock::time_point start) {
  const mpi::Api& m = mpi::lib();
  std::byte* table = ex.table.data();
  int n = 0;
  // Sends first: a peer waiting for this rank hears of it sooner (a message that comes before its
  // receive is posted waits in MPI's queue of unexpected messages).
  if (to >= 0) {
    const size_t pieces = pieces_[static_cast<size_t>(to)] ? pieces_of(send_bytes) : 1;
    ex.header(rank_).more = static_cast<uint32_t>(pieces - 1);  // the message starts with this rank's own entry
    for (size_t i = 0; i < pieces; ++i)
      check(m.Isend(table + i * kPiece, static_cast<int>(i + 1 < pieces ? kPiece : send_bytes - i * kPiece), m.byte, to,
                    kExchangeTag, comm_, &ex.requests[static_cast<size_t>(n++)]),
            "MPI_Isend", to);
  }
  // Room for whatever the partner may send, whatever its call: every entry is at most kHeaderArea +
  // pack_capacity_ bytes, and the table holds one more than the group.
  const size_t room = ex.table.size() - at;
  if (from >= 0)
    check(m.Irecv(table + at, static_cast<int>(room), m.byte, from, kExchangeTag, comm_,
                  &ex.requests[static_cast<size_t>(n++)]),
          "MPI_Irecv", from);
  wait(ex.requests.data(), n, deadline, nullptr, &fp, exchange_keep_, Mode::Round, start);
  if (from < 0) return at;
  Header first;
  std::memcpy(&first, table + at, sizeof first);
  // The other pieces follow their first on the same tag, so MPI pairs them in order. (A count of
  // pieces that this build would not send is not believed: the rest then cannot fit.)
  if (first.more > 0 && first.more < kMaxPieces && room > first.more * kPiece) {
    n = 0;
    for (size_t i = 1; i <= first.more; ++i)
      check(m.Irecv(table + at + i * kPiece, static_cast<int>(i < first.more ? kPiece : room - i * kPiece), m.byte,
                    from, kExchangeTag, comm_, &ex.requests[static_cast<size_t>(n++)]),
            "MPI_Irecv", from);
    wait(ex.requests.data(), n, deadline, nullptr, &fp, exchange_keep_, Mode::Round, start);
  }
  for (int r : ranks) {
    if (r != rank_) ex.at[static_cast<size_t>(r)] = at;
    at += entry_bytes(reinterpret_cast<const Header*>(table + at)->bytes);
  }
  return at;
}

void MpiCommunicator::renew_exchange() {
  exchange_ = std::make_shared<Exchange>(size_, pack_capacity_, doubling_.direct);
  exchange_keep_ = exchange_;
}

void MpiCommunicator::explain_mismatch(const Fingerprint& fp, uint64_t weight, uint64_t word,
                                       Clock::time_point deadline) {
  // Every rank saw the same keys, so every rank comes here for this call, and the messages pair up.
  Exchange& ex = *exchange_;
  ex.details.assign(static_cast<size_t>(size_), Details{});
  ex.details[static_cast<size_t>(rank_)] = Details{fp, weight, word};
  const mpi::Api& m = mpi::lib();
  int at_request = 0;
  for (int s = 1; s < size_; ++s) {
    const int from = (rank_ - s + size_) % size_, to = (rank_ + s) % size_;
    check(m.Irecv(&ex.details[static_cast<size_t>(from)], sizeof(Details), m.byte, from, kDetailsTag, comm_,
                  &ex.requests[static_cast<size_t>(at_request++)]),
          "MPI_Irecv", from);
    check(m.Isend(&ex.details[static_cast<size_t>(rank_)], sizeof(Details), m.byte, to, kDetailsTag, comm_,
                  &ex.requests[static_cast<size_t>(at_request++)]),
          "MPI_Isend", to);
  }
  try {
    wait(ex.requests.data(), at_request, deadline, nullptr, &fp, exchange_keep_, Mode::Round);
  } catch (...) {
    renew_exchange();
    throw;
  }
  auto where = [] { return std::string("MPI communicator"); };
  const Fingerprint& first = ex.details[0].fp;
  for (int r = 1; r < size_; ++r) {
    const uint64_t seq = ex.details[static_cast<size_t>(r)].fp.seq;
    if (seq != first.seq) {
      fail(GRADSYNC_E_MISMATCH, "MPI communicator: rank {} is at call {} but rank 0 at call {} (a rank skipped a call)",
           r, seq, first.seq);
    }
  }
  verify_round(
      where, fp.seq, size_, size_, true,
      [&](int r) -> const CallSignature& { return ex.details[static_cast<size_t>(r)].fp.call; },
      [&](int r) { return ex.details[static_cast<size_t>(r)].weight; });
  for (int r = 1; r < size_; ++r) {
    if (ex.details[static_cast<size_t>(r)].word != ex.details[0].word) {
      fail(GRADSYNC_E_MISMATCH,
           "MPI communicator call {}: rank {} and rank 0 made this same call for different calls of the group built "
           "over this one",
           fp.seq, r);
    }
  }
  // Equal calls whose data differed in size: ranks of different builds (another group limit).
  fail(GRADSYNC_E_MISMATCH,
       "MPI communicator call {}: the ranks sent different amounts of data with the same call "
       "(ranks of different builds?)",
       fp.seq);
}

int64_t MpiCommunicator::system_time_ns(Clock::time_point now) noexcept {
  const auto steady = [](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  };
  if (offset_read_ == Clock::time_point{} || now - offset_read_ > std::chrono::milliseconds(100)) {
    offset_read_ = now;
    system_offset_ns_ =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count() -
        steady(now);
  }
  return steady(now) + system_offset_ns_;
}

// The data and control communicators, duplicated from base_ one after the other, never side by
// side: Open MPI (4.1) agrees on a new context id through collectives on the parent, and two
// agreements in flight on one parent can post those collectives in different orders on different
// ranks when a rank's context ids differ from its peers' (as after an abandoned collective), which
// then never complete.
void MpiCommunicator::duplicate(const std::shared_ptr<FreshComms>& fresh, MPI_Comm from, bool with_base,
                                Clock::time_point deadline, const char* label) {
  const mpi::Api& m = mpi::lib();
  // One at a time: posted together, Open MPI 4.1's duplications were seen to mix two
  // communicators' traffic (mpi:comm_np2 summed another communicator's data).
  std::vector<MPI_Comm*> targets;
  if (with_base) targets.push_back(&fresh->base);
  targets.push_back(&fresh->comm);
  targets.push_back(&fresh->ctl);
  for (size_t k = fresh->made; k < targets.size(); ++k) {
    if (fresh->posted == k) {
      check(m.Comm_idup(from, targets[k], &fresh->requests[k]), "MPI_Comm_idup");
      fresh->posted = k + 1;
    }
    wait(&fresh->requests[k], 1, deadline, label, nullptr, fresh, Mode::Setup);
    fresh->made = k + 1;
    m.Comm_set_errhandler(*targets[k], m.errors_return);
  }
}

void MpiCommunicator::reset() {
  // Fresh communicators duplicated from base_: the duplication is collective, so reset returns
  // only when every rank has called it (a reset that failed on some ranks is called again on
  // every rank, and goes on with its duplications, resetting_). An abandoned request of a call
  // stays with the old communicator, which is never used again, so a late completion cannot be
  // mistaken for a new round.
  // The abort being recovered from must not abort its own recovery; one during the reset does.
  state_.store(0);
  const auto deadline = deadline_after(options_.timeout);
  if (!resetting_) resetting_ = std::make_shared<FreshComms>();
  const std::shared_ptr<FreshComms> fresh = resetting_;
  duplicate(fresh, base_, false, deadline, "reset (MPI_Comm_idup)");
  resetting_.reset();
  retire_control();
  if (!comm_pending_ && comm_ != mpi::lib().comm_null) mpi::lib().Comm_free(&comm_);
  comm_pending_ = false;
  {
    std::lock_guard lock(ctl_mutex_);
    comm_ = fresh->comm;
    ctl_ = fresh->ctl;
    notices_sent_ = false;
  }
  notice_.reset();
  post_notice_receive();
  seq_ = 0;
  aborted_ = false;
  aborted_reason_.clear();
  if (holds_abandoned_) {
    // Every rank got through the reset, so nobody is left blocked in the abandoned collective.
    holds_abandoned_ = false;
    mpi::clear_abandoned();
  }
}

std::unique_ptr<Communicator> MpiCommunicator::make_subgroup(const Subgroup& sub) {
  const mpi::Api& m = mpi::lib();
  // MPI_GROUP_NULL is an object inside libmpi, which this library does not link: track by hand.
  MPI_Group all{}, part{};
  MPI_Comm made = m.comm_null;
  const int rc_all = m.Comm_group(base_, &all);
  const int rc_part = rc_all == MPI_SUCCESS
                          ? m.Group_incl(all, static_cast<int>(sub.members.size()), sub.members.data(), &part)
                          : rc_all;
  // Blocking, as the data transfers are: split()'s exchange has shown that every member is here,
  // a shrink's confirmation round that every member will enter it (its watchdog covers the rest).
  int rc = rc_part;
  if (rc_part == MPI_SUCCESS) {
    std::optional<Watchdog> watchdog;
    auto why = [this](std::chrono::milliseconds waited) {
      return fmt::format(
          "rank {}: MPI_Comm_create_group over a shrink's survivors (or a level of a group formed after a shrink or a "
          "grow) did not return within {} ms: a member was lost inside it, or after it confirmed the group (or its "
          "host was lost with its Open MPI daemon)",
          rank_, waited.count());
    };
    if (create_deadline_) {
      watchdog.emplace(*create_deadline_, why(options_.timeout / 2));
    } else if (guard_forming_) {
      // Its members passed the split's exchange together: one not here within the timeout is lost.
      watchdog.emplace(deadline_after(options_.timeout), why(options_.timeout));
    }
    rc = m.Comm_create_group(base_, part, kSplitTag, &made);
  }
  if (rc_part == MPI_SUCCESS) m.Group_free(&part);
  if (rc_all == MPI_SUCCESS) m.Group_free(&all);
  check(rc, "MPI_Comm_create_group");
  struct Free {
    MPI_Comm& c;
    ~Free() {
      if (c != mpi::lib().comm_null) mpi::lib().Comm_free(&c);
    }
  } free_made{made};
  return std::make_unique<MpiCommunicator>(options_, made);
}

}  // namespace gradsync::comm::mpi

namespace gradsync::comm {

GrowResult join_mpi_group(const Options& options) {
  (void)mpi::lib();
  return mpi::MpiCommunicator::join(options);
}

std::unique_ptr<Communicator> create_mpi_communicator(const Options& options) {
  (void)mpi::lib();  // the plugin, or E_UNSUPPORTED saying what to install, before anything else
  return std::make_unique<mpi::MpiCommunicator>(options, mpi::lib().comm_null);
}

bool mpi_transport_available() noexcept { return mpi::available(); }

}  // namespace gradsync::comm
