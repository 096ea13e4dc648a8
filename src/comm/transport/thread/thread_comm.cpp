// The thread transport: ranks are threads of one process that form a group by name.
//
// Design (against the seed, kizzasi's ThreadedGradientSync: one global mutex, a shared accumulator
// filled in arrival order, a condition variable, a copy back):
// - Each rank owns a cache-line-padded slot where it publishes a descriptor of its call (collective,
//   counts, dtype, op, root, buffer pointers) and its progress (the index of the last barrier it
//   reached). Nobody writes another rank's slot; there is no lock around data.
// - Round r: arrival barrier 2r, then either everything agrees or every rank throws E_MISMATCH (the
//   verdict is computed from the same descriptors on every rank, so it is identical and nothing is
//   written). Then each rank reduces ITS OWN slice (partition rule over the concatenation of all
//   buffers) straight from the peers' send buffers, in rank order, and writes it into every rank's
//   recv buffer. Element i is read and written only by the owner of its slice, all reads of a
//   block before any write, so in place needs no extra phase: every byte is read once and written
//   once. A completion barrier 2r+1 keeps every caller in the call while peers touch its buffers.
// - Small allreduces (<= kInlineBytes) copy into the slot instead and every rank reduces the whole
//   (tiny) vector itself, in rank order: one barrier per call instead of two. Slots are double
//   buffered by round parity: a rank writes round r+2's copy only after everyone arrived at r+1,
//   i.e. after everyone finished reading round r.
// - Barrier waits spin briefly, yield, then sleep on a futex (common/wait.hpp), so 4 or 8 ranks on
//   2 cores do not collapse. Each wait has the deadline options.timeout.
// - Timeout and abort are decided per round by one CAS on `decision`: either the round is committed
//   (every rank arrived; everyone runs it, even if an abort comes later) or aborted (nobody touches
//   any buffer). Without it a rank could time out and return while a late peer that saw everyone
//   arrived reads its buffers. After an abort or timeout, calls fail fast with E_ABORTED until
//   reset() (collective) realigns the rounds and clears the state.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/call_signature.hpp"
#include "comm/communicator.hpp"
#include "comm/reduce.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "common/wait.hpp"

namespace gradsync::comm {
namespace {

// What a rank called in one round. Pointers are valid while the caller is inside the call.
struct Descriptor {
  CallSignature call;
  uint64_t round = 0;
  uint64_t weight = 0;  // weighted_mean: this rank's sample count
  const BufferRef* bufs = nullptr;
  const void* send = nullptr;
  void* recv = nullptr;
};

constexpr size_t kInlineBytes = 4096;
constexpr size_t kCacheLine = 64;

struct alignas(kCacheLine) Slot {
  // Index of the last barrier this rank reached; only its owner writes it.
  std::atomic<uint64_t> progress{0};
  alignas(kCacheLine) Descriptor desc[2];
  // Reset rendezvous: the epoch this rank asks for, and its round counter at that moment
  // (double-buffered by epoch parity, like the descriptors).
  alignas(kCacheLine) std::atomic<uint32_t> reset_request{0};
  uint64_t reset_snapshot[2] = {0, 0};
  std::atomic<uint32_t> left{0};
  alignas(kCacheLine) std::byte inline_data[2][kInlineBytes];
};

// state bits: aborted, and whether the abort was a timeout; the epoch (number of completed resets)
// above them, so that a slow rank finishing an old reset never clears a newer abort.
constexpr uint32_t kAborted = 1, kTimedOut = 2, kEpochShift = 2;

struct Group {
  Group(std::string n, int s) : name(std::move(n)), size(s), slots(new Slot[static_cast<size_t>(s)]), present(s, 0) {}

  const std::string name;
  const int size;
  std::unique_ptr<Slot[]> slots;
  WaitWord doorbell;
  // (round << 1) | aborted, for the latest round whose fate is decided.
  alignas(kCacheLine) std::atomic<uint64_t> decision{0};
  alignas(kCacheLine) std::atomic<uint32_t> state{0};
  std::atomic<uint32_t> formed{0};

  std::mutex reason_mutex;
  std::string reason;  // why the group is aborted; guarded by reason_mutex

  // Membership, guarded by the registry mutex.
  std::vector<char> present;
  int joined = 0;
  int members = 0;

  void set_aborted(bool timeout, const std::string& why) {
    {
      std::lock_guard lock(reason_mutex);
      uint32_t s = state.load(std::memory_order_acquire);
      if ((s & kAborted) == 0) {
        reason = why;
        while ((s & kAborted) == 0 &&
               !state.compare_exchange_weak(s, s | kAborted | (timeout ? kTimedOut : 0), std::memory_order_seq_cst)) {
        }
      }
    }
    notify(doorbell);
  }

  std::string abort_reason() {
    std::lock_guard lock(reason_mutex);
    return reason;
  }
};

struct Registry {
  std::mutex mutex;
  std::map<std::string, std::shared_ptr<Group>> groups;
};

Registry& registry() {
  // Never destroyed: communicators freed from static destructors of other libraries must find it.
  static Registry* r = new Registry;
  return *r;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out + "]";
}

// One pointer per rank without a heap allocation for the usual group sizes (collectives of small
// buffers are dominated by fixed costs).
template <class T>
class PerRank {
 public:
  explicit PerRank(int n) : size_(static_cast<size_t>(n)) {
    if (size_ > kInline) heap_.resize(size_);
  }
  T* data() noexcept { return size_ > kInline ? heap_.data() : inline_; }
  T& operator[](size_t i) noexcept { return data()[i]; }
  size_t size() const noexcept { return size_; }

 private:
  static constexpr size_t kInline = 16;
  size_t size_;
  T inline_[kInline] = {};
  std::vector<T> heap_;
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(const Options& options, std::shared_ptr<Group> group)
      : group_(std::move(group)), rank_(options.rank), size_(options.size), timeout_(options.timeout),
        check_mismatch_(options.check_mismatch) {}

  ~ThreadCommunicator() override { leave(); }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  Transport transport() const noexcept override { return Transport::Thread; }

  void allreduce(std::span<const BufferRef> buffers, DType dtype, ReduceOp op) override;
  void broadcast(void* buf, size_t count, DType dtype, int root) override;
  void allgather(const void* send, void* recv, size_t total, DType dtype) override;
  void reduce_scatter(const void* send, void* recv, size_t total, DType dtype, ReduceOp op) override;
  void alltoall(const void* send, void* recv, size_t total, DType dtype) override;
  void barrier() override;
  void weighted_mean(const void* send, void* recv, size_t count, DType dtype, uint64_t weight,
                     uint64_t* total_weight) override;
  void abort() noexcept override;
  void reset() override;

 private:
  Slot& slot(int r) const noexcept { return group_->slots[static_cast<size_t>(r)]; }
  Slot& mine() const noexcept { return slot(rank_); }

  void fail_if_aborted(const char* what) const;
  [[noreturn]] void throw_round_aborted(const Descriptor& d) const;
  // Publishes d (round filled in) and waits for every rank; returns the round once committed and
  // agreed. Throws E_TIMEOUT/E_ABORTED (round aborted) or E_MISMATCH/E_UNSUPPORTED (agreed by all).
  uint64_t begin_round(Descriptor d, std::span<const BufferRef> inline_from = {});
  void arrive(uint64_t index) noexcept;
  bool all_reached(uint64_t index) const noexcept;
  void verify(uint64_t round) const;
  // Second barrier of a round with a data phase: every peer that passed the arrival is computing and
  // cannot block, so this waits for it whatever the deadline or an abort says (returning early would
  // leave a peer writing into our caller's buffers).
  void finish_round(uint64_t round);
  void leave() noexcept;

  template <class Ready>
  WaitResult timed_wait(Ready&& ready, WaitClock::time_point deadline, const std::atomic<uint32_t>* abort = nullptr,
                        uint32_t mask = ~0u) {
    return waiter_(group_->doorbell, ready, deadline, abort, mask);
  }

  const Descriptor& desc_of(int r, uint64_t round) const noexcept { return slot(r).desc[round & 1]; }

  std::shared_ptr<Group> group_;
  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  const bool check_mismatch_;
  uint64_t round_ = 0;
  AdaptiveWait waiter_{size_};
};

void ThreadCommunicator::fail_if_aborted(const char* what) const {
  const uint32_t s = group_->state.load(std::memory_order_acquire);
  if (s & kAborted) {
    fail(GRADSYNC_E_ABORTED, "{} on rank {} of group '{}': the group is aborted ({}); call reset() on every rank or free it",
         what, rank_, group_->name, group_->abort_reason());
  }
}

void ThreadCommunicator::throw_round_aborted(const Descriptor& d) const {
  // The rank that aborted the round records why right after its CAS; give it a moment.
  for (int i = 0; i < 100000 && (group_->state.load(std::memory_order_acquire) & kAborted) == 0; ++i) {
    std::this_thread::yield();
  }
  const uint32_t s = group_->state.load(std::memory_order_acquire);
  const std::string why = group_->abort_reason();
  if (s & kTimedOut) {
    fail(GRADSYNC_E_TIMEOUT, "{} (call {}) on rank {} of group '{}' failed: {}", collective_name(d.call.collective),
         d.round, rank_, group_->name, why);
  }
  fail(GRADSYNC_E_ABORTED, "{} (call {}) on rank {} of group '{}' failed: the group was aborted ({})",
       collective_name(d.call.collective), d.round, rank_, group_->name, why);
}

// Only the rank that completes the barrier wakes the sleepers: waking them at every arrival would
// make each of N-1 sleepers wake, find the barrier incomplete and sleep again, N times per round
// (a thundering herd that costs most when ranks outnumber cores). No wake-up is lost: the stores
// and the loads are seq_cst, so the last rank to store `index` sees everyone else's.
void ThreadCommunicator::arrive(uint64_t index) noexcept {
  mine().progress.store(index, std::memory_order_seq_cst);
  if (all_reached(index)) notify(group_->doorbell);
}

bool ThreadCommunicator::all_reached(uint64_t index) const noexcept {
  for (int r = 0; r < size_; ++r) {
    if (slot(r).progress.load(std::memory_order_seq_cst) < index) return false;
  }
  return true;
}

uint64_t ThreadCommunicator::begin_round(Descriptor d, std::span<const BufferRef> inline_from) {
  fail_if_aborted(collective_name(d.call.collective));
  const uint64_t round = ++round_;
  d.round = round;
  Slot& me = mine();
  me.desc[round & 1] = d;
  if (!inline_from.empty()) {
    std::byte* out = me.inline_data[round & 1];
    const size_t elem = dtype_size(static_cast<DType>(d.call.dtype));
    for (const auto& b : inline_from) {
      if (b.count == 0) continue;
      std::memcpy(out, b.send, b.count * elem);
      out += b.count * elem;
    }
  }
  const uint64_t index = 2 * round;
  arrive(index);

  const auto deadline = WaitClock::now() + timeout_;
  const WaitResult waited = timed_wait([&] { return all_reached(index); }, deadline, &group_->state, kAborted);

  // One CAS decides the round for everyone: committed if every rank arrived, aborted otherwise.
  const uint64_t want = waited == WaitResult::Ready ? 0 : 1;
  uint64_t cur = group_->decision.load(std::memory_order_acquire);
  uint64_t outcome;
  for (;;) {
    if ((cur >> 1) >= round) {
      outcome = cur & 1;
      break;
    }
    if (group_->decision.compare_exchange_weak(cur, (round << 1) | want, std::memory_order_acq_rel)) {
      outcome = want;
      if (want == 1 && waited == WaitResult::Timeout) {
        std::vector<int> missing;
        for (int r = 0; r < size_; ++r) {
          if (slot(r).progress.load(std::memory_order_acquire) < index) missing.push_back(r);
        }
        group_->set_aborted(true, fmt::format("rank(s) {} did not arrive at {} (call {}) within {} ms", rank_list(missing),
                                              collective_name(d.call.collective), round, timeout_.count()));
      } else if (want == 1) {
        // Aborted by abort() or a leaving rank: the state already says why; wake the others.
        notify(group_->doorbell);
      }
      break;
    }
  }
  if (outcome == 1) throw_round_aborted(d);
  if (check_mismatch_) verify(round);
  const CallSignature& agreed = desc_of(0, round).call;
  const auto dtype = static_cast<DType>(agreed.dtype);
  if ((agreed.collective == Collective::Allreduce || agreed.collective == Collective::ReduceScatter) &&
      !reducible(dtype)) {
    fail(GRADSYNC_E_UNSUPPORTED, "{} of {} is not supported (f32, f64, i32, i64 are)",
         collective_name(agreed.collective), dtype_name(dtype));
  }
  return round;
}

void ThreadCommunicator::verify(uint64_t round) const {
  require_same_calls([&] { return fmt::format("group '{}'", group_->name); }, round, size_,
                     [&](int r) -> const CallSignature& { return desc_of(r, round).call; });
}

void ThreadCommunicator::finish_round(uint64_t round) {
  const uint64_t index = 2 * round + 1;
  arrive(index);
  auto deadline = WaitClock::now() + timeout_;
  while (timed_wait([&] { return all_reached(index); }, deadline) != WaitResult::Ready) {
    GS_LOG_WARN("group '{}' rank {}: peers still computing call {} after {} ms; waiting for them to finish with "
                "this rank's buffers",
                group_->name, rank_, round, timeout_.count());
    deadline = WaitClock::now() + timeout_;
  }
}

void ThreadCommunicator::allreduce(std::span<const BufferRef> buffers, DType dtype, ReduceOp op) {
  uint64_t total = 0;
  for (const auto& b : buffers) total += b.count;
  if (size_ == 1) {
    fail_if_aborted("allreduce");
    GS_REQUIRE(reducible(dtype), GRADSYNC_E_UNSUPPORTED, "allreduce of {} is not supported (f32, f64, i32, i64 are)",
               dtype_name(dtype));
    for (const auto& b : buffers) copy(dtype, b.send, b.recv, 0, b.count);
    return;
  }
  Descriptor d;
  d.call = allreduce_call(buffers, dtype, op);
  d.bufs = buffers.data();
  const size_t elem = dtype_size(dtype);

  if (total * elem <= kInlineBytes) {
    // Small: everyone reduces the whole vector from the slots' copies; no second barrier.
    const uint64_t round = begin_round(d, buffers);
    PerRank<const void*> src(size_);
    size_t offset = 0;
    for (const auto& b : buffers) {
      for (int r = 0; r < size_; ++r) src[static_cast<size_t>(r)] = slot(r).inline_data[round & 1] + offset;
      reduce(dtype, op, src.data(), src.size(), b.recv, 0, b.count);
      offset += b.count * elem;
    }
    // Reading the slots is done before this rank arrives at the next round, which is what lets
    // peers reuse this parity two rounds later.
    return;
  }

  const uint64_t round = begin_round(d);
  const Part part = my_part(total);
  PerRank<const void*> srcs(size_);
  PerRank<void*> dsts(size_);
  uint64_t offset = 0;
  for (size_t j = 0; j < buffers.size(); ++j) {
    const uint64_t cnt = buffers[j].count;
    const uint64_t lo = std::max(part.start, offset), hi = std::min(part.start + part.len, offset + cnt);
    if (lo < hi) {
      // This rank's own recv first: the reduced block lands there and is copied on from cache.
      for (int i = 0; i < size_; ++i) {
        const int r = (rank_ + i) % size_;
        const BufferRef& peer = desc_of(r, round).bufs[j];
        srcs[static_cast<size_t>(r)] = peer.send;
        dsts[static_cast<size_t>(i)] = peer.recv;
      }
      reduce_to_all(dtype, op, srcs.data(), srcs.size(), dsts.data(), dsts.size(), lo - offset, hi - offset);
    }
    offset += cnt;
    if (offset >= part.start + part.len) break;
  }
  finish_round(round);
}

void ThreadCommunicator::broadcast(void* buf, size_t count, DType dtype, int root) {
  if (size_ == 1) {
    fail_if_aborted("broadcast");
    return;
  }
  Descriptor d;
  d.call = broadcast_call(count, dtype, root);
  d.recv = buf;
  const uint64_t round = begin_round(d);
  const Part part = my_part(count);
  if (part.len > 0) {
    PerRank<void*> dsts(size_ - 1);
    size_t k = 0;
    for (int r = 0; r < size_; ++r) {
      if (r != root) dsts[k++] = desc_of(r, round).recv;
    }
    copy_to_all(dtype, desc_of(root, round).recv, dsts.data(), dsts.size(), part.start, part.start + part.len);
  }
  finish_round(round);
}

void ThreadCommunicator::allgather(const void* send, void* recv, size_t total, DType dtype) {
  const Part part = my_part(total);
  const size_t elem = dtype_size(dtype);
  if (size_ == 1) {
    fail_if_aborted("allgather");
    if (send != nullptr) copy(dtype, send, recv, 0, total);
    return;
  }
  Descriptor d;
  d.call = allgather_call(total, dtype);
  d.send = send != nullptr ? send : static_cast<const std::byte*>(recv) + part.start * elem;
  d.recv = recv;
  const uint64_t round = begin_round(d);
  if (part.len > 0) {
    PerRank<void*> dsts(size_);
    for (int r = 0; r < size_; ++r) {
      dsts[static_cast<size_t>(r)] = static_cast<std::byte*>(desc_of(r, round).recv) + part.start * elem;
    }
    copy_to_all(dtype, d.send, dsts.data(), dsts.size(), 0, part.len);
  }
  finish_round(round);
}

void ThreadCommunicator::reduce_scatter(const void* send, void* recv, size_t total, DType dtype, ReduceOp op) {
  const Part part = my_part(total);
  const size_t elem = dtype_size(dtype);
  if (size_ == 1) {
    fail_if_aborted("reduce_scatter");
    GS_REQUIRE(reducible(dtype), GRADSYNC_E_UNSUPPORTED,
               "reduce_scatter of {} is not supported (f32, f64, i32, i64 are)", dtype_name(dtype));
    if (total > 0) std::memmove(recv, send, total * elem);  // NULL buffers are allowed for 0 elements
    return;
  }
  Descriptor d;
  d.call = reduce_scatter_call(total, dtype, op);
  d.send = send;
  d.recv = recv;
  const uint64_t round = begin_round(d);
  if (part.len > 0) {
    PerRank<const void*> srcs(size_);
    for (int r = 0; r < size_; ++r) {
      srcs[static_cast<size_t>(r)] = static_cast<const std::byte*>(desc_of(r, round).send) + part.start * elem;
    }
    reduce(dtype, op, srcs.data(), srcs.size(), recv, 0, part.len);
  }
  finish_round(round);
}

// Each rank pulls its part of every peer's send into its own recv: peers' buffers are only read,
// and the completion barrier keeps them alive while others read them.
void ThreadCommunicator::alltoall(const void* send, void* recv, size_t total, DType dtype) {
  const Part part = my_part(total);
  const size_t elem = dtype_size(dtype);
  if (size_ == 1) {
    fail_if_aborted("alltoall");
    if (total > 0) std::memcpy(recv, send, total * elem);
    return;
  }
  Descriptor d;
  d.call = alltoall_call(total, dtype);
  d.send = send;
  d.recv = recv;
  const uint64_t round = begin_round(d);
  if (part.len > 0) {
    auto* out = static_cast<std::byte*>(recv);
    for (int r = 0; r < size_; ++r) {
      const auto* from = static_cast<const std::byte*>(desc_of(r, round).send) + part.start * elem;
      std::memcpy(out + static_cast<size_t>(r) * part.len * elem, from, part.len * elem);
    }
  }
  finish_round(round);
}

void ThreadCommunicator::barrier() {
  if (size_ == 1) {
    fail_if_aborted("barrier");
    return;
  }
  Descriptor d;
  d.call = barrier_call();
  begin_round(d);
}

// Σ wᵢ·sendᵢ / Σ wᵢ in one pass: each slice owner multiplies and sums in double, in rank order, and
// writes the rounded result to every rank. The same operations in the same order as the default
// (stage w·x in double, sum-allreduce, divide), so the bits are the same, without the staging
// buffer or the double-width traffic.
void ThreadCommunicator::weighted_mean(const void* send, void* recv, size_t count, DType dtype, uint64_t weight,
                                       uint64_t* total_weight) {
  GS_REQUIRE(dtype == DType::F32 || dtype == DType::F64, GRADSYNC_E_INVALID_ARG,
             "weighted mean needs f32 or f64, got {}", dtype_name(dtype));
  if (size_ == 1) {
    fail_if_aborted("weighted_mean");
    Communicator::weighted_mean(send, recv, count, dtype, weight, total_weight);
    return;
  }
  const size_t elem = dtype_size(dtype);
  Descriptor d;
  d.call = weighted_mean_call(count, dtype);
  d.send = send;
  d.recv = recv;
  d.weight = weight;
  const bool small = count * elem <= kInlineBytes;
  const BufferRef staged{send, recv, count};
  const uint64_t round = small ? begin_round(d, std::span<const BufferRef>(&staged, 1)) : begin_round(d);

  // Every rank checks the same weights, so every rank fails alike and nothing is read or written
  // (which is also why no completion barrier is needed on these paths).
  uint64_t total = 0;
  for (int r = 0; r < size_; ++r) {
    const uint64_t w = desc_of(r, round).weight;
    if (w > (uint64_t{1} << 53)) {
      fail(GRADSYNC_E_INVALID_ARG, "weighted_mean (call {}): rank {} passed weight {}, which exceeds 2^53", round, r, w);
    }
    total += w;
  }
  if (total_weight != nullptr) *total_weight = total;
  if (total == 0) {
    fail(GRADSYNC_E_ZERO_WEIGHT, "total weight (sample count) over {} ranks is 0", size_);
  }
  const double denom = static_cast<double>(total);
  std::vector<double> w(static_cast<size_t>(size_));
  std::vector<const std::byte*> src(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) w[static_cast<size_t>(r)] = static_cast<double>(desc_of(r, round).weight);

  // Writes out[i - begin] for i in [begin, end) from the sources (each indexed from element 0).
  auto combine = [&](auto* out, size_t begin, size_t end) {
    using T = std::remove_pointer_t<decltype(out)>;
    constexpr size_t kBlock = 512;
    double acc[kBlock];
    for (size_t lo = begin; lo < end; lo += kBlock) {
      const size_t len = std::min(kBlock, end - lo);
      const T* s0 = reinterpret_cast<const T*>(src[0]) + lo;
      for (size_t j = 0; j < len; ++j) acc[j] = w[0] * static_cast<double>(s0[j]);
      for (size_t r = 1; r < src.size(); ++r) {
        const T* sr = reinterpret_cast<const T*>(src[r]) + lo;
        const double wr = w[r];
        for (size_t j = 0; j < len; ++j) acc[j] += wr * static_cast<double>(sr[j]);
      }
      T* o = out + (lo - begin);
      for (size_t j = 0; j < len; ++j) o[j] = static_cast<T>(acc[j] / denom);
    }
  };

  if (small) {
    for (int r = 0; r < size_; ++r) src[static_cast<size_t>(r)] = slot(r).inline_data[round & 1];
    if (dtype == DType::F32) combine(static_cast<float*>(recv), 0, count);
    else combine(static_cast<double*>(recv), 0, count);
    return;
  }
  const Part part = my_part(count);
  if (part.len > 0) {
    for (int r = 0; r < size_; ++r) src[static_cast<size_t>(r)] = static_cast<const std::byte*>(desc_of(r, round).send);
    // Into this rank's recv, then on to the others from cache, block by block.
    const size_t block = kBlockBytes / elem;
    for (size_t lo = part.start; lo < part.start + part.len; lo += block) {
      const size_t hi = std::min<size_t>(part.start + part.len, lo + block);
      std::byte* mine_out = static_cast<std::byte*>(recv) + lo * elem;
      if (dtype == DType::F32) combine(reinterpret_cast<float*>(mine_out), lo, hi);
      else combine(reinterpret_cast<double*>(mine_out), lo, hi);
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) continue;
        std::memcpy(static_cast<std::byte*>(desc_of(r, round).recv) + lo * elem, mine_out, (hi - lo) * elem);
      }
    }
  }
  finish_round(round);
}

void ThreadCommunicator::abort() noexcept {
  try {
    group_->set_aborted(false, fmt::format("abort() called on rank {}", rank_));
  } catch (...) {
    // Out of memory for the message: abort without one rather than not at all.
    group_->state.fetch_or(kAborted, std::memory_order_seq_cst);
    notify(group_->doorbell);
  }
}

void ThreadCommunicator::reset() {
  Group& g = *group_;
  const uint32_t target = (g.state.load(std::memory_order_acquire) >> kEpochShift) + 1;
  if (size_ > 1) {
    Slot& me = mine();
    me.reset_snapshot[target & 1] = round_;
    me.reset_request.store(target, std::memory_order_seq_cst);
    notify(g.doorbell);
    std::string gone;
    auto everyone = [&] {
      for (int r = 0; r < size_; ++r) {
        if (slot(r).left.load(std::memory_order_seq_cst)) {
          gone = std::to_string(r);
          return true;
        }
        if (slot(r).reset_request.load(std::memory_order_seq_cst) < target) return false;
      }
      return true;
    };
    const WaitResult waited = wait_until(g.doorbell, everyone, WaitClock::now() + timeout_);
    if (waited != WaitResult::Ready || !gone.empty()) {
      me.reset_request.store(target - 1, std::memory_order_seq_cst);
      if (!gone.empty()) {
        fail(GRADSYNC_E_ABORTED, "reset of group '{}' on rank {}: rank {} has left the group; free every rank and form a new one",
             g.name, rank_, gone);
      }
      std::vector<int> missing;
      for (int r = 0; r < size_; ++r) {
        if (slot(r).reset_request.load(std::memory_order_acquire) < target) missing.push_back(r);
      }
      fail(GRADSYNC_E_TIMEOUT, "reset of group '{}' on rank {}: rank(s) {} did not call reset within {} ms", g.name,
           rank_, rank_list(missing), timeout_.count());
    }
    uint64_t base = 0;
    for (int r = 0; r < size_; ++r) base = std::max(base, slot(r).reset_snapshot[target & 1]);
    round_ = base;
  }
  std::lock_guard lock(g.reason_mutex);
  uint32_t s = g.state.load(std::memory_order_acquire);
  while ((s >> kEpochShift) < target) {
    if (g.state.compare_exchange_weak(s, target << kEpochShift, std::memory_order_seq_cst)) {
      g.reason.clear();
      break;
    }
  }
}

void ThreadCommunicator::leave() noexcept {
  bool others = false;
  {
    Registry& reg = registry();
    std::lock_guard lock(reg.mutex);
    Group& g = *group_;
    g.present[static_cast<size_t>(rank_)] = 0;
    mine().left.store(1, std::memory_order_seq_cst);
    others = --g.members > 0;
    if (!others) {
      auto it = reg.groups.find(g.name);
      if (it != reg.groups.end() && it->second == group_) reg.groups.erase(it);
    }
  }
  if (others) {
    try {
      group_->set_aborted(false, fmt::format("rank {} left the group (its communicator was freed)", rank_));
    } catch (...) {
      group_->state.fetch_or(kAborted, std::memory_order_seq_cst);
      notify(group_->doorbell);
    }
  }
}

}  // namespace

std::unique_ptr<Communicator> create_thread_communicator(const Options& options) {
  GS_REQUIRE(options.size >= 1, GRADSYNC_E_INVALID_ARG, "size must be at least 1, got {}", options.size);
  GS_REQUIRE(options.rank >= 0 && options.rank < options.size, GRADSYNC_E_OUT_OF_RANGE, "rank {} out of range [0, {})",
             options.rank, options.size);
  GS_REQUIRE(!options.name.empty(), GRADSYNC_E_INVALID_ARG, "group name is empty");
  GS_REQUIRE(options.timeout.count() > 0, GRADSYNC_E_INVALID_ARG, "timeout must be > 0 ms, got {}",
             options.timeout.count());
  Registry& reg = registry();
  std::shared_ptr<Group> group;
  {
    std::lock_guard lock(reg.mutex);
    auto& entry = reg.groups[options.name];
    if (!entry) entry = std::make_shared<Group>(options.name, options.size);
    group = entry;
    GS_REQUIRE(group->size == options.size, GRADSYNC_E_MISMATCH,
               "rank {} joined group '{}' with size {} but its other members use size {}", options.rank, options.name,
               options.size, group->size);
    const auto r = static_cast<size_t>(options.rank);
    GS_REQUIRE(!group->present[r], GRADSYNC_E_MISUSE, "rank {} has already joined group '{}'", options.rank,
               options.name);
    if (group->formed.load(std::memory_order_relaxed)) {
      std::vector<int> still;
      for (int i = 0; i < group->size; ++i) {
        if (group->present[static_cast<size_t>(i)]) still.push_back(i);
      }
      fail(GRADSYNC_E_MISUSE, "group '{}' is still in use by rank(s) {}; free them before forming it again",
           options.name, rank_list(still));
    }
    group->present[r] = 1;
    ++group->joined;
    ++group->members;
    if (group->joined == group->size) group->formed.store(1, std::memory_order_seq_cst);
  }
  notify(group->doorbell);

  const auto deadline = WaitClock::now() + options.timeout;
  auto formed = [&] { return group->formed.load(std::memory_order_seq_cst) != 0; };
  if (wait_until(group->doorbell, formed, deadline) != WaitResult::Ready) {
    std::lock_guard lock(reg.mutex);
    // Formed is decided under the registry lock: either the last member came in time, or we withdraw.
    if (!group->formed.load(std::memory_order_relaxed)) {
      std::vector<int> missing;
      for (int i = 0; i < group->size; ++i) {
        if (!group->present[static_cast<size_t>(i)]) missing.push_back(i);
      }
      group->present[static_cast<size_t>(options.rank)] = 0;
      --group->joined;
      --group->members;
      if (group->members == 0) {
        auto it = reg.groups.find(options.name);
        if (it != reg.groups.end() && it->second == group) reg.groups.erase(it);
      }
      fail(GRADSYNC_E_TIMEOUT, "rank {} of group '{}': rank(s) {} did not join within {} ms", options.rank,
           options.name, rank_list(missing), options.timeout.count());
    }
  }
  return std::make_unique<ThreadCommunicator>(options, std::move(group));
}

}  // namespace gradsync::comm
