#include "comm/transport/shm/shm_communicator.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "comm/reduce.hpp"
#include "comm/transport/shm/segment.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "common/wait.hpp"

namespace gradsync::comm {
namespace {

using shm::BufferOffsets;
using shm::Clock;
using shm::Header;
using shm::Descriptor;
using shm::kChunkBytes;
using shm::kStageDepth;
using shm::kMaxTableBuffers;
using shm::kNoOffset;
using shm::kSmallBytes;
using shm::Segment;
using shm::RankSlot;
using shm::stop_code;
using shm::stop_epoch;
using shm::stop_rank;
using shm::stop_reason;
using shm::StopReason;

// While waiting, peers' liveness is checked this often (a dead peer is reported within it).
constexpr auto kLivenessInterval = std::chrono::milliseconds(10);

// Results bigger than the caches are copied out with non-temporal stores: the destination is
// written once and not read back soon, so this saves the read-for-ownership of every line (a third
// of the copy path's memory traffic). Smaller results stay in cache for the caller.
constexpr uint64_t kStreamingBytes = 8u << 20;

void copy_streaming(char* dst, const char* src, size_t bytes) noexcept {
#if defined(__SSE2__)
  const size_t head = std::min(bytes, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  bytes -= head;
  size_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, bytes - i);
  _mm_sfence();
#else
  std::memcpy(dst, src, bytes);
#endif
}

// The fused list seen as one concatenated vector of elements.
class Concat {
 public:
  Concat(std::span<const BufferRef> buffers, size_t elem) : buffers_(buffers), elem_(elem) {
    starts_.reserve(buffers.size() + 1);
    uint64_t total = 0;
    for (const auto& b : buffers) {
      starts_.push_back(total);
      total += b.count;
    }
    starts_.push_back(total);
  }
  uint64_t total() const { return starts_.back(); }
  const char* send(size_t i) const { return static_cast<const char*>(buffers_[i].send); }
  char* recv(size_t i) const { return static_cast<char*>(buffers_[i].recv); }
  uint64_t start(size_t i) const { return starts_[i]; }

  // f(buffer index, first element within it, last, position of that first element in [begin, end)).
  template <class F>
  void for_range(uint64_t begin, uint64_t end, F&& f) const {
    if (begin >= end) return;
    size_t i = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin()) - 1;
    for (; i < buffers_.size() && starts_[i] < end; ++i) {
      const uint64_t lo = std::max(begin, starts_[i]), hi = std::min(end, starts_[i + 1]);
      if (lo < hi) f(i, lo - starts_[i], hi - starts_[i], lo - begin);
    }
  }
  void gather(uint64_t begin, uint64_t end, char* dst) const {
    for_range(begin, end, [&](size_t i, uint64_t a, uint64_t b, uint64_t at) {
      std::memcpy(dst + at * elem_, static_cast<const char*>(buffers_[i].send) + a * elem_, (b - a) * elem_);
    });
  }
  void scatter(uint64_t begin, uint64_t end, const char* src, bool streaming) const {
    for_range(begin, end, [&](size_t i, uint64_t a, uint64_t b, uint64_t at) {
      char* dst = static_cast<char*>(buffers_[i].recv) + a * elem_;
      if (streaming) {
        copy_streaming(dst, src + at * elem_, (b - a) * elem_);
      } else {
        std::memcpy(dst, src + at * elem_, (b - a) * elem_);
      }
    });
  }

 private:
  std::span<const BufferRef> buffers_;
  size_t elem_;
  std::vector<uint64_t> starts_;
};

class ShmCommunicator final : public Communicator {
 public:
  explicit ShmCommunicator(const Options& options)
      : options_(options),
        segment_(Segment::join(options.name, options.rank, options.size, Clock::now() + options.timeout)) {}

  int rank() const noexcept override { return options_.rank; }
  int size() const noexcept override { return options_.size; }
  Transport transport() const noexcept override { return Transport::Shm; }

  void allreduce(std::span<const BufferRef> buffers, DType dtype, ReduceOp op) override;
  void broadcast(void* buf, size_t count, DType dtype, int root) override;
  void allgather(const void* send, void* recv, size_t total, DType dtype) override;
  void reduce_scatter(const void* send, void* recv, size_t total, DType dtype, ReduceOp op) override;
  void alltoall(const void* send, void* recv, size_t total, DType dtype) override;
  void barrier() override;
  void abort() noexcept override;
  void reset() override;
  void* alloc(size_t bytes) override { return segment_->allocate(bytes); }
  void dealloc(void* p) override {
    GS_REQUIRE(segment_->deallocate(p), GRADSYNC_E_INVALID_ARG,
               "pointer {} was not allocated by this communicator (or was already freed)", p);
  }

 private:
  struct Round {
    uint64_t number;
    uint64_t parity;
    Clock::time_point deadline;
    bool all_zero_copy;
  };
  enum class Waited { Ready, Stopped, TimedOut, PeerDied };

  Header& header() const { return segment_->header(); }
  // Fails fast when the group has stopped; publishes `d` (and, through `publish`, any inline data
  // or buffer offsets), meets the others, and decides the round. Throws E_MISMATCH on every rank
  // when the descriptors disagree.
  Round begin_round(Descriptor d, const std::function<void(uint64_t parity)>& publish);
  // begin_round for a collective whose peers read this rank's whole send buffer (bytes long): it is
  // copied into the small area when small, or published as an offset when it lies in the segment.
  Round begin_round_reading(const CallSignature& call, const void* send, uint64_t bytes);
  // One barrier inside a round. Abortable barriers (the copy path: peers only touch the staging
  // area) return on abort or timeout; the others (zero copy: peers are using this rank's buffers)
  // wait for every live peer whatever the deadline says.
  void arrive_and_wait(const Round& round, Collective what, bool abortable);
  // The copy path of reduce_scatter and alltoall: in step k every rank stages block k of every
  // part of `in` (part j in slot j, `block` elements each) and consumes block k-1 of its own part
  // from every rank's stage: consume(first element, length, from) with from[r] rank r's slot.
  template <class Consume>
  void exchange_parts(const Round& round, Collective what, const char* in, uint64_t total, size_t es,
                      Consume&& consume);
  void arrive();
  // Waits until counter(r) >= target for every rank r. `stop` (the stop word, or nullptr) makes
  // the wait return when set; `outlive_deadline` waits past the deadline (logging) while the
  // peers live, and after a peer's death waits for the live ones before reporting it.
  template <class Counter>
  Waited wait_all(WaitWord& word, Counter&& counter, uint64_t target, Clock::time_point deadline,
                  const std::atomic<uint32_t>* stop, bool outlive_deadline);
  // Abortable wait for any condition on the peers' counters (the copy-path pipeline).
  template <class Ready>
  void wait_ready(Ready&& ready, Clock::time_point deadline, const char* what);
  void stop(StopReason reason, int rank) noexcept;
  [[noreturn]] void throw_stopped(bool waiting);
  [[noreturn]] void throw_dead(int r);
  // Rank r is gone (its lock is free). The stop word knows better who went first and how: a rank
  // that saw r die and then freed its communicator looks gone too, but r is the one to name.
  [[noreturn]] void throw_gone(int r);
  [[noreturn]] void throw_timeout(Collective what, uint64_t target);
  void fail_fast() {
    if (header().stop_word.load(std::memory_order_acquire) != 0) throw_stopped(false);
  }
  char* at(uint64_t offset) const { return segment_->base() + offset; }

  Options options_;
  std::unique_ptr<Segment> segment_;
  uint64_t round_ = 0;
  uint64_t barriers_ = 0;
  uint64_t chunks_ = 0;  // copy-path chunks of every allreduce so far (the same count on every rank)
  AdaptiveWait waiter_{options_.size};
  int dead_rank_ = -1;
};

void ShmCommunicator::stop(StopReason reason, int rank) noexcept {
  uint32_t expected = 0;
  const uint32_t code = stop_code(reason, rank, header().reset_epoch.load(std::memory_order_acquire));
  header().stop_word.compare_exchange_strong(expected, code, std::memory_order_seq_cst);
  if (reason == StopReason::PeerDied) segment_->close_group();
  notify(header().barrier_wake);
}

void ShmCommunicator::throw_gone(int r) {
  const uint32_t code = header().stop_word.load(std::memory_order_acquire);
  if (stop_reason(code) == StopReason::PeerDied) throw_dead(stop_rank(code));
  if (stop_reason(code) == StopReason::Left) throw_stopped(true);
  throw_dead(r);
}

void ShmCommunicator::throw_dead(int r) {
  fail(GRADSYNC_E_REMOTE, "rank {} (pid {}) of shm group '{}' died; free the group and form a new one", r,
       segment_->slot(r).pid.load(), segment_->group());
}

void ShmCommunicator::throw_stopped(bool waiting) {
  const uint32_t code = header().stop_word.load(std::memory_order_acquire);
  const int who = stop_rank(code);
  const std::string& g = segment_->group();
  const int pid = who >= 0 && who < size() ? segment_->slot(who).pid.load() : 0;
  switch (stop_reason(code)) {
    case StopReason::PeerDied: throw_dead(who);
    case StopReason::Timeout:
      if (waiting) fail(GRADSYNC_E_TIMEOUT, "shm group '{}' timed out: rank {} waited {} ms for a peer", g, who,
                        options_.timeout.count());
      fail(GRADSYNC_E_ABORTED, "shm group '{}' is stopped after a timeout (seen by rank {}); reset or free it", g, who);
    case StopReason::Left:
      fail(GRADSYNC_E_ABORTED, "rank {} (pid {}) left shm group '{}' (freed its communicator); free the group and "
           "form a new one", who, pid, g);
    case StopReason::Aborted:
    case StopReason::None:
      break;
  }
  fail(GRADSYNC_E_ABORTED, "shm group '{}' was aborted (by rank {}, pid {}); reset or free it", g, who, pid);
}

void ShmCommunicator::throw_timeout(Collective what, uint64_t target) {
  std::vector<int> missing;
  for (int r = 0; r < size(); ++r) {
    if (segment_->slot(r).arrivals.load(std::memory_order_acquire) < target) missing.push_back(r);
  }
  fail(GRADSYNC_E_TIMEOUT, "shm group '{}' timed out: rank(s) {} did not arrive at {} within {} ms", segment_->group(),
       fmt::join(missing, ", "), collective_name(what), options_.timeout.count());
}

template <class Counter>
ShmCommunicator::Waited ShmCommunicator::wait_all(WaitWord& word, Counter&& counter, uint64_t target,
                                                  Clock::time_point deadline, const std::atomic<uint32_t>* stop_word,
                                                  bool outlive_deadline) {
  const int n = size();
  std::vector<char> dead;  // non-abortable waits go on for the live peers once one has died
  auto ready = [&] {
    for (int r = 0; r < n; ++r) {
      if (counter(r) < target && (dead.empty() || !dead[static_cast<size_t>(r)])) return false;
    }
    return true;
  };
  for (;;) {
    const auto slice = std::min(deadline, Clock::now() + kLivenessInterval);
    switch (waiter_(word, ready, slice, stop_word)) {
      case WaitResult::Ready:
        if (dead.empty()) return Waited::Ready;
        return Waited::PeerDied;
      case WaitResult::Aborted: return Waited::Stopped;
      case WaitResult::Timeout: break;
    }
    for (int r = 0; r < n; ++r) {
      if (r == rank() || segment_->alive(r)) continue;
      if (dead_rank_ < 0) dead_rank_ = r;
      stop(StopReason::PeerDied, r);
      if (!outlive_deadline) return Waited::PeerDied;
      dead.resize(static_cast<size_t>(n), 0);
      dead[static_cast<size_t>(r)] = 1;
    }
    if (Clock::now() >= deadline) {
      if (!outlive_deadline) return Waited::TimedOut;
      GS_LOG_WARN("shm group '{}' rank {}: peers still use this rank's buffers after {} ms; waiting for them",
                  segment_->group(), rank(), options_.timeout.count());
      deadline = Clock::now() + options_.timeout;
    }
  }
}

void ShmCommunicator::arrive() {
  // seq_cst: publishes this rank's writes (descriptor, staged data) to whoever sees the count.
  segment_->slot(rank()).arrivals.store(++barriers_, std::memory_order_seq_cst);
  notify(header().barrier_wake);
}

template <class Ready>
void ShmCommunicator::wait_ready(Ready&& ready, Clock::time_point deadline, const char* what) {
  for (;;) {
    const auto slice = std::min(deadline, Clock::now() + kLivenessInterval);
    switch (waiter_(header().barrier_wake, ready, slice, &header().stop_word)) {
      case WaitResult::Ready: return;
      case WaitResult::Aborted: throw_stopped(true);
      case WaitResult::Timeout: break;
    }
    for (int r = 0; r < size(); ++r) {
      if (r == rank() || segment_->alive(r)) continue;
      stop(StopReason::PeerDied, r);
      throw_gone(r);
    }
    if (Clock::now() >= deadline) {
      stop(StopReason::Timeout, rank());
      std::vector<int> behind;
      uint64_t least = ~uint64_t{0};
      for (int r = 0; r < size(); ++r) least = std::min(least, segment_->slot(r).drained.load());
      for (int r = 0; r < size(); ++r) {
        if (segment_->slot(r).drained.load() == least) behind.push_back(r);
      }
      fail(GRADSYNC_E_TIMEOUT, "shm group '{}' timed out: rank(s) {} made no progress in {} within {} ms",
           segment_->group(), fmt::join(behind, ", "), what, options_.timeout.count());
    }
  }
}

void ShmCommunicator::arrive_and_wait(const Round& round, Collective what, bool abortable) {
  arrive();
  const uint64_t target = barriers_;
  auto counter = [&](int r) { return segment_->slot(r).arrivals.load(std::memory_order_acquire); };
  switch (wait_all(header().barrier_wake, counter, target, round.deadline, abortable ? &header().stop_word : nullptr,
                   !abortable)) {
    case Waited::Ready: return;
    case Waited::Stopped: throw_stopped(true);
    case Waited::PeerDied: throw_gone(dead_rank_);
    case Waited::TimedOut:
      stop(StopReason::Timeout, rank());
      throw_timeout(what, target);
  }
}

ShmCommunicator::Round ShmCommunicator::begin_round(Descriptor d, const std::function<void(uint64_t)>& publish) {
  fail_fast();
  Round round{++round_, 0, Clock::now() + options_.timeout, true};
  round.parity = round.number & 1;
  d.round = round.number;
  if (publish) publish(round.parity);
  segment_->slot(rank()).desc[round.parity] = d;
  arrive();
  const uint64_t target = barriers_;
  auto counter = [&](int r) { return segment_->slot(r).arrivals.load(std::memory_order_acquire); };
  const Waited waited = wait_all(header().barrier_wake, counter, target, round.deadline, &header().stop_word, false);
  // The stop is published before the verdict, so whoever reads "aborted" finds the reason.
  if (waited == Waited::TimedOut) stop(StopReason::Timeout, rank());
  const uint64_t want = waited == Waited::Ready ? 0 : 1;
  uint64_t outcome = 0;
  uint64_t cur = header().decision.load(std::memory_order_acquire);
  for (;;) {
    if ((cur >> 1) >= round.number) {
      outcome = cur & 1;
      break;
    }
    if (header().decision.compare_exchange_weak(cur, (round.number << 1) | want, std::memory_order_acq_rel)) {
      outcome = want;
      break;
    }
  }
  if (outcome == 1) {
    // Nobody runs this round. A rank that saw everyone arrive still needs the reason.
    if (waited == Waited::TimedOut) throw_timeout(d.call.collective, target);
    if (waited == Waited::PeerDied) throw_gone(dead_rank_);
    throw_stopped(true);
  }
  // Committed: every rank arrived, and every rank runs the round (even if an abort comes now).
  require_same_calls([&] { return fmt::format("shm group '{}'", segment_->group()); }, round.number, size(),
                     [&](int r) -> const CallSignature& { return segment_->slot(r).desc[round.parity].call; });
  for (int r = 0; r < size(); ++r) round.all_zero_copy &= segment_->slot(r).desc[round.parity].zero_copy != 0;
  return round;
}

ShmCommunicator::Round ShmCommunicator::begin_round_reading(const CallSignature& call, const void* send,
                                                            uint64_t bytes) {
  const bool small = bytes <= kSmallBytes;
  const bool zero_copy = !small && segment_->own_heap_offset(send, bytes) != kNoOffset;
  Descriptor d{};
  d.call = call;
  d.zero_copy = zero_copy ? 1 : 0;
  return begin_round(d, [&](uint64_t parity) {
    if (small) {
      if (bytes > 0) std::memcpy(segment_->small_area(rank(), parity), send, bytes);
    } else if (zero_copy) {
      segment_->table(rank(), parity)[0] = {segment_->own_heap_offset(send, 0), kNoOffset};
    }
  });
}

void ShmCommunicator::allreduce(std::span<const BufferRef> buffers, DType dtype, ReduceOp op) {
  const size_t es = dtype_size(dtype);
  if (size() == 1) {
    fail_fast();
    GS_REQUIRE(reducible(dtype), GRADSYNC_E_UNSUPPORTED, "allreduce does not reduce {} (f32, f64, i32, i64 only)",
               dtype_name(dtype));
    for (const auto& b : buffers) copy(dtype, b.send, b.recv, 0, b.count);
    return;
  }
  const Concat all(buffers, es);
  const uint64_t total = all.total();
  const bool small = total * es <= kSmallBytes;
  bool zero_copy = !small && buffers.size() <= kMaxTableBuffers;
  for (size_t i = 0; i < buffers.size() && zero_copy; ++i) {
    zero_copy = segment_->own_heap_offset(buffers[i].send, buffers[i].count * es) != kNoOffset &&
                segment_->own_heap_offset(buffers[i].recv, buffers[i].count * es) != kNoOffset;
  }
  Descriptor d{};
  d.call = allreduce_call(buffers, dtype, op);
  d.zero_copy = zero_copy ? 1 : 0;
  const Round round = begin_round(d, [&](uint64_t parity) {
    if (small) {
      all.gather(0, total, segment_->small_area(rank(), parity));
    } else if (zero_copy) {
      BufferOffsets* table = segment_->table(rank(), parity);
      for (size_t i = 0; i < buffers.size(); ++i) {
        table[i] = {segment_->own_heap_offset(buffers[i].send, 0), segment_->own_heap_offset(buffers[i].recv, 0)};
      }
    }
  });
  GS_REQUIRE(reducible(dtype), GRADSYNC_E_UNSUPPORTED, "allreduce does not reduce {} (f32, f64, i32, i64 only)",
             dtype_name(dtype));
  const size_t n = static_cast<size_t>(size());
  std::vector<const void*> srcs(n);
  std::vector<void*> dsts(n);

  if (small) {
    for (size_t i = 0; i < buffers.size(); ++i) {
      for (size_t r = 0; r < n; ++r) srcs[r] = segment_->small_area(static_cast<int>(r), round.parity) + all.start(i) * es;
      reduce(dtype, op, srcs.data(), n, buffers[i].recv, 0, buffers[i].count);
    }
    return;
  }

  if (round.all_zero_copy) {
    const Part mine = my_part(total);
    all.for_range(mine.start, mine.start + mine.len, [&](size_t i, uint64_t a, uint64_t b, uint64_t) {
      for (size_t r = 0; r < n; ++r) {
        const BufferOffsets& o = segment_->table(static_cast<int>(r), round.parity)[i];
        srcs[r] = at(o.send);
        dsts[r] = at(o.recv);
      }
      reduce_to_all(dtype, op, srcs.data(), n, dsts.data(), n, a, b);
    });
    // Peers may not reuse their buffers until everyone has written its slice into them.
    arrive_and_wait(round, Collective::Allreduce, false);
    return;
  }

  // Copy path: a pipeline of kStageDepth chunks. Each rank stages chunk j of its input, reduces
  // its slice of chunk j from every rank's stage into the shared result stage, and copies the
  // whole result of chunk j out, each step as soon as its inputs are there and its stage is free,
  // as the peers' counters say. No lockstep: a rank runs ahead while a peer is descheduled.
  const uint64_t per_chunk = kChunkBytes / es;
  const uint64_t chunks = (total + per_chunk - 1) / per_chunk;
  const uint64_t base = chunks_;  // group-wide index of this round's first chunk
  auto chunk_len = [&](uint64_t k) { return std::min(per_chunk, total - k * per_chunk); };
  auto least = [&](std::atomic<uint64_t> RankSlot::*counter) {
    uint64_t m = ~uint64_t{0};
    for (int r = 0; r < size(); ++r) m = std::min(m, (segment_->slot(r).*counter).load(std::memory_order_acquire));
    return m;
  };
  RankSlot& me = segment_->slot(rank());
  auto publish = [&](std::atomic<uint64_t> RankSlot::*counter, uint64_t value) {
    (me.*counter).store(value, std::memory_order_seq_cst);
    notify(header().barrier_wake);
  };
  const bool streaming = total * es >= kStreamingBytes;
  uint64_t staged = 0, reduced = 0, drained = 0;  // this round's chunks done by this rank
  // Stage j+base is free once every rank reduced chunk j+base-depth; the result stage once every
  // rank drained it.
  auto can_stage = [&] { return staged < chunks && least(&RankSlot::reduced) + kStageDepth > base + staged; };
  auto can_reduce = [&] {
    return reduced < staged && least(&RankSlot::staged) > base + reduced &&
           least(&RankSlot::drained) + kStageDepth > base + reduced;
  };
  auto can_drain = [&] { return drained < reduced && least(&RankSlot::reduced) > base + drained; };
  while (drained < chunks) {
    bool moved = false;
    if (can_drain()) {
      // This rank's own slice is already in place (written by its reduction).
      const uint64_t first = drained * per_chunk;
      const Part own = partition(chunk_len(drained), n, static_cast<uint64_t>(rank()));
      const char* out = segment_->out_area(base + drained);
      all.scatter(first, first + own.start, out, streaming);
      all.scatter(first + own.start + own.len, first + chunk_len(drained), out + (own.start + own.len) * es, streaming);
      publish(&RankSlot::drained, base + ++drained);
      moved = true;
    }
    if (can_reduce()) {
      // The own slice comes straight from the caller's buffer (it was never staged), and its result
      // goes straight into the caller's buffer as well as into the result stage for the peers.
      const uint64_t first = reduced * per_chunk;
      const Part own = partition(chunk_len(reduced), n, static_cast<uint64_t>(rank()));
      char* out = segment_->out_area(base + reduced);
      all.for_range(first + own.start, first + own.start + own.len, [&](size_t i, uint64_t a, uint64_t b, uint64_t at) {
        const uint64_t in_chunk = (own.start + at) * es;
        for (size_t r = 0; r < n; ++r) {
          srcs[r] = static_cast<int>(r) == rank() ? all.send(i) + a * es
                                                  : segment_->in_area(static_cast<int>(r), base + reduced) + in_chunk;
        }
        void* dst[2] = {all.recv(i) + a * es, out + in_chunk};
        reduce_to_all(dtype, op, srcs.data(), n, dst, 2, 0, b - a);
      });
      publish(&RankSlot::reduced, base + ++reduced);
      moved = true;
    }
    if (can_stage()) {
      // Only the slices the peers reduce; this rank's own slice is read in place.
      const uint64_t first = staged * per_chunk;
      const Part own = partition(chunk_len(staged), n, static_cast<uint64_t>(rank()));
      char* stage = segment_->in_area(rank(), base + staged);
      all.gather(first, first + own.start, stage);
      all.gather(first + own.start + own.len, first + chunk_len(staged), stage + (own.start + own.len) * es);
      publish(&RankSlot::staged, base + ++staged);
      moved = true;
    }
    if (!moved) wait_ready([&] { return can_drain() || can_reduce() || can_stage(); }, round.deadline, "allreduce");
  }
  chunks_ = base + chunks;
}

void ShmCommunicator::broadcast(void* buf, size_t count, DType dtype, int root) {
  if (size() == 1) return fail_fast();
  const size_t es = dtype_size(dtype);
  const uint64_t bytes = count * es;
  const bool is_root = rank() == root;
  const bool small = bytes <= kSmallBytes;
  const bool zero_copy = !small && is_root && segment_->own_heap_offset(buf, bytes) != kNoOffset;
  Descriptor d{};
  d.call = broadcast_call(count, dtype, root);
  d.zero_copy = zero_copy ? 1 : 0;
  const Round round = begin_round(d, [&](uint64_t parity) {
    if (!is_root) return;
    if (small) {
      if (bytes > 0) std::memcpy(segment_->small_area(rank(), parity), buf, bytes);
    } else if (zero_copy) {
      segment_->table(rank(), parity)[0] = {segment_->own_heap_offset(buf, 0), kNoOffset};
    }
  });
  char* out = static_cast<char*>(buf);
  if (small) {
    if (!is_root && bytes > 0) std::memcpy(out, segment_->small_area(root, round.parity), bytes);
    return;
  }
  if (segment_->slot(root).desc[round.parity].zero_copy != 0) {
    if (!is_root) std::memcpy(out, at(segment_->table(root, round.parity)[0].send), bytes);
    arrive_and_wait(round, Collective::Broadcast, false);
    return;
  }
  // Copy path: the root stages chunk k while the others copy out chunk k-1.
  const uint64_t chunks = (bytes + kChunkBytes - 1) / kChunkBytes;
  auto chunk_bytes = [&](uint64_t k) { return std::min<uint64_t>(kChunkBytes, bytes - k * kChunkBytes); };
  for (uint64_t k = 0; k <= chunks; ++k) {
    if (k >= 1 && !is_root) {
      const uint64_t c = k - 1;
      std::memcpy(out + c * kChunkBytes, segment_->in_area(root, c & 1), chunk_bytes(c));
    }
    if (k < chunks) {
      if (is_root) std::memcpy(segment_->in_area(rank(), k & 1), out + k * kChunkBytes, chunk_bytes(k));
      arrive_and_wait(round, Collective::Broadcast, true);
    }
  }
}

void ShmCommunicator::allgather(const void* send, void* recv, size_t total, DType dtype) {
  const size_t es = dtype_size(dtype);
  const uint64_t n = static_cast<uint64_t>(size());
  const Part mine = my_part(total);
  char* out = static_cast<char*>(recv);
  const char* own = send != nullptr ? static_cast<const char*>(send) : out + mine.start * es;
  if (size() == 1) {
    fail_fast();
    if (send != nullptr) copy(dtype, send, out + mine.start * es, 0, mine.len);
    return;
  }
  if (send != nullptr) copy(dtype, send, out + mine.start * es, 0, mine.len);
  const bool small = total * es <= kSmallBytes;
  const bool zero_copy = !small && segment_->own_heap_offset(own, mine.len * es) != kNoOffset;
  Descriptor d{};
  d.call = allgather_call(total, dtype);
  d.zero_copy = zero_copy ? 1 : 0;
  const Round round = begin_round(d, [&](uint64_t parity) {
    if (small) {
      std::memcpy(segment_->small_area(rank(), parity), own, mine.len * es);
    } else if (zero_copy) {
      segment_->table(rank(), parity)[0] = {segment_->own_heap_offset(own, 0), kNoOffset};
    }
  });
  if (small) {
    for (uint64_t r = 0; r < n; ++r) {
      if (static_cast<int>(r) == rank()) continue;
      const Part p = partition(total, n, r);
      std::memcpy(out + p.start * es, segment_->small_area(static_cast<int>(r), round.parity), p.len * es);
    }
    return;
  }
  if (round.all_zero_copy) {
    for (uint64_t r = 0; r < n; ++r) {
      if (static_cast<int>(r) == rank()) continue;
      const Part p = partition(total, n, r);
      std::memcpy(out + p.start * es, at(segment_->table(static_cast<int>(r), round.parity)[0].send), p.len * es);
    }
    arrive_and_wait(round, Collective::Allgather, false);
    return;
  }
  // Copy path: every rank stages block k of its own part while copying out block k-1 of the others'.
  const uint64_t block = kChunkBytes / es;
  const uint64_t longest = partition(total, n, 0).len;
  const uint64_t steps = (longest + block - 1) / block;
  for (uint64_t k = 0; k <= steps; ++k) {
    if (k >= 1) {
      const uint64_t c = k - 1;
      for (uint64_t r = 0; r < n; ++r) {
        const Part p = partition(total, n, r);
        if (static_cast<int>(r) == rank() || c * block >= p.len) continue;
        const uint64_t len = std::min(block, p.len - c * block);
        std::memcpy(out + (p.start + c * block) * es, segment_->in_area(static_cast<int>(r), c & 1), len * es);
      }
    }
    if (k < steps) {
      if (k * block < mine.len) {
        const uint64_t len = std::min(block, mine.len - k * block);
        std::memcpy(segment_->in_area(rank(), k & 1), own + k * block * es, len * es);
      }
      arrive_and_wait(round, Collective::Allgather, true);
    }
  }
}

void ShmCommunicator::reduce_scatter(const void* send, void* recv, size_t total, DType dtype, ReduceOp op) {
  const size_t es = dtype_size(dtype);
  const size_t n = static_cast<size_t>(size());
  const Part mine = my_part(total);
  const char* in = static_cast<const char*>(send);
  if (size() == 1) {
    fail_fast();
    GS_REQUIRE(reducible(dtype), GRADSYNC_E_UNSUPPORTED, "reduce_scatter does not reduce {} (f32, f64, i32, i64 only)",
               dtype_name(dtype));
    copy(dtype, send, recv, 0, total);
    return;
  }
  const bool small = total * es <= kSmallBytes;
  const Round round = begin_round_reading(reduce_scatter_call(total, dtype, op), send, total * es);
  GS_REQUIRE(reducible(dtype), GRADSYNC_E_UNSUPPORTED, "reduce_scatter does not reduce {} (f32, f64, i32, i64 only)",
             dtype_name(dtype));
  std::vector<const void*> srcs(n);
  if (small) {
    for (size_t r = 0; r < n; ++r)
      srcs[r] = segment_->small_area(static_cast<int>(r), round.parity) + mine.start * es;
    reduce(dtype, op, srcs.data(), n, recv, 0, mine.len);
    return;
  }
  if (round.all_zero_copy) {
    // recv may be this rank's own part of send: the kernel allows dst == a source.
    for (size_t r = 0; r < n; ++r)
      srcs[r] = at(segment_->table(static_cast<int>(r), round.parity)[0].send) + mine.start * es;
    reduce(dtype, op, srcs.data(), n, recv, 0, mine.len);
    arrive_and_wait(round, Collective::ReduceScatter, false);
    return;
  }
  char* out = static_cast<char*>(recv);
  exchange_parts(round, Collective::ReduceScatter, in, total, es,
                 [&](uint64_t first, uint64_t len, const void* const* from) {
                   reduce(dtype, op, from, n, out + first * es, 0, len);
                 });
}

void ShmCommunicator::alltoall(const void* send, void* recv, size_t total, DType dtype) {
  const size_t es = dtype_size(dtype);
  const uint64_t n = static_cast<uint64_t>(size());
  const Part mine = my_part(total);
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  if (size() == 1) {
    fail_fast();
    if (total > 0) std::memcpy(out, in, total * es);
    return;
  }
  const bool small = total * es <= kSmallBytes;
  const Round round = begin_round_reading(alltoall_call(total, dtype), send, total * es);
  if (small || round.all_zero_copy) {
    for (uint64_t r = 0; r < n; ++r) {
      const char* from = small ? segment_->small_area(static_cast<int>(r), round.parity)
                               : at(segment_->table(static_cast<int>(r), round.parity)[0].send);
      if (mine.len > 0) std::memcpy(out + r * mine.len * es, from + mine.start * es, mine.len * es);
    }
    // Zero copy: peers may not reuse their send buffers until everyone has read its part.
    if (!small) arrive_and_wait(round, Collective::Alltoall, false);
    return;
  }
  exchange_parts(round, Collective::Alltoall, in, total, es, [&](uint64_t first, uint64_t len, const void* const* from) {
    for (uint64_t r = 0; r < n; ++r) std::memcpy(out + (r * mine.len + first) * es, from[r], len * es);
  });
}

template <class Consume>
void ShmCommunicator::exchange_parts(const Round& round, Collective what, const char* in, uint64_t total, size_t es,
                                     Consume&& consume) {
  const uint64_t n = static_cast<uint64_t>(size());
  const Part mine = my_part(total);
  const uint64_t block = kChunkBytes / es / n;
  const uint64_t steps = (partition(total, n, 0).len + block - 1) / block;
  std::vector<const void*> from(n);
  for (uint64_t k = 0; k <= steps; ++k) {
    if (k >= 1) {
      const uint64_t c = k - 1;
      if (c * block < mine.len) {
        for (uint64_t r = 0; r < n; ++r) {
          from[r] = segment_->in_area(static_cast<int>(r), c & 1) + static_cast<uint64_t>(rank()) * block * es;
        }
        consume(c * block, std::min(block, mine.len - c * block), from.data());
      }
    }
    if (k < steps) {
      char* stage = segment_->in_area(rank(), k & 1);
      for (uint64_t j = 0; j < n; ++j) {
        const Part p = partition(total, n, j);
        if (k * block >= p.len) continue;
        const uint64_t len = std::min(block, p.len - k * block);
        std::memcpy(stage + j * block * es, in + (p.start + k * block) * es, len * es);
      }
      arrive_and_wait(round, what, true);
    }
  }
}

void ShmCommunicator::barrier() {
  if (size() == 1) return fail_fast();
  Descriptor d{};
  d.call = barrier_call();
  begin_round(d, nullptr);
}

void ShmCommunicator::abort() noexcept { stop(StopReason::Aborted, rank()); }

void ShmCommunicator::reset() {
  Header& h = header();
  const uint32_t target = h.reset_epoch.load(std::memory_order_acquire) + 1;
  if (size() > 1) {
    // Every rank posts its request with its round and barrier counts; once all have, the counts
    // are quiescent and every rank adopts the same maxima. A rank that gives up retracts its
    // request, so a reset can be retried.
    RankSlot& me = segment_->slot(rank());
    me.reset_rounds[target & 1] = round_;
    me.reset_arrivals[target & 1] = barriers_;
    me.reset_chunks[target & 1] = std::max({chunks_, me.staged.load(), me.reduced.load(), me.drained.load()});
    me.reset_request.store(target, std::memory_order_seq_cst);
    notify(h.barrier_wake);
    auto counter = [&](int r) { return uint64_t{segment_->slot(r).reset_request.load(std::memory_order_acquire)}; };
    const Waited waited = wait_all(h.barrier_wake, counter, target, Clock::now() + options_.timeout, nullptr, false);
    if (waited != Waited::Ready) {
      // Only retract if not everyone made it: otherwise the others already went ahead.
      bool all = true;
      for (int r = 0; r < size(); ++r) all &= counter(r) >= target;
      if (!all) me.reset_request.store(target - 1, std::memory_order_seq_cst);
      if (waited == Waited::PeerDied) throw_gone(dead_rank_);
      if (waited == Waited::TimedOut) {
        std::vector<int> missing;
        for (int r = 0; r < size(); ++r) {
          if (counter(r) < target) missing.push_back(r);
        }
        fail(GRADSYNC_E_TIMEOUT, "reset of shm group '{}': rank(s) {} did not call reset within {} ms",
             segment_->group(), fmt::join(missing, ", "), options_.timeout.count());
      }
    }
    uint64_t rounds = 0, arrivals = 0, chunks = 0;
    for (int r = 0; r < size(); ++r) {
      rounds = std::max(rounds, segment_->slot(r).reset_rounds[target & 1]);
      arrivals = std::max(arrivals, segment_->slot(r).reset_arrivals[target & 1]);
      chunks = std::max(chunks, segment_->slot(r).reset_chunks[target & 1]);
    }
    round_ = rounds;
    barriers_ = arrivals;
    chunks_ = chunks;
    me.arrivals.store(arrivals, std::memory_order_seq_cst);
    me.staged.store(chunks, std::memory_order_seq_cst);
    me.reduced.store(chunks, std::memory_order_seq_cst);
    me.drained.store(chunks, std::memory_order_seq_cst);
  }
  const uint32_t code = h.stop_word.load(std::memory_order_acquire);
  if (stop_reason(code) == StopReason::PeerDied) throw_dead(stop_rank(code));
  if (stop_reason(code) == StopReason::Left) throw_stopped(false);
  // Clear only stops older than this reset; a newer abort (from a rank already past it) stays.
  uint32_t epoch = h.reset_epoch.load(std::memory_order_acquire);
  while (static_cast<int32_t>(epoch - target) < 0 &&
         !h.reset_epoch.compare_exchange_weak(epoch, target, std::memory_order_acq_rel)) {
  }
  uint32_t s = h.stop_word.load(std::memory_order_acquire);
  while (s != 0 && ((stop_epoch(s) - (target & 0xfffu)) & 0x800u) != 0 &&
         !h.stop_word.compare_exchange_weak(s, 0, std::memory_order_acq_rel)) {
  }
}

}  // namespace

std::unique_ptr<Communicator> create_shm_communicator(const Options& options) {
  GS_REQUIRE(!options.name.empty(), GRADSYNC_E_INVALID_ARG, "an shm group needs a name");
  return std::make_unique<ShmCommunicator>(options);
}

}  // namespace gradsync::comm
