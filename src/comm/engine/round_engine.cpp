// SPDX-License-Identifier: Apache-2.0
#include "comm/engine/round_engine.hpp"

#include <sched.h>

#include <algorithm>
#include <thread>

#include "comm/verdict.hpp"
#include "common/log.hpp"

namespace gradsync::comm {

RoundEngine::RoundEngine(Fabric& fabric, int rank, int size, std::chrono::milliseconds timeout, bool check_mismatch,
                         const InterruptCheck& interrupt, Telemetry& telemetry)
    : fabric_(fabric),
      control_(fabric.control()),
      rank_(rank),
      size_(size),
      timeout_(timeout),
      check_mismatch_(check_mismatch),
      interrupt_(interrupt),
      telemetry_(telemetry),
      stamps_(static_cast<size_t>(size)),
      waiter_(size, fabric.cpus()) {
  // Pinning each rank to a CPU of its own is common, and so is an affinity (taskset, a cpuset)
  // that leaves fewer CPUs than ranks: say which the group found, as it decides how waits go.
  GS_LOG_DEBUG("{}: rank {} of {} joined; {} of the ranks can each have a CPU of its own, so waits {}", group_name(),
               rank, size, fabric.cpus(),
               waiter_.oversubscribed() ? "yield (ranks outnumber CPUs)" : "spin while the awaited rank runs");
}

std::string RoundEngine::group_name() const {
  return fmt::format("{} group '{}'", transport_name(fabric_.transport()), fabric_.group());
}

std::string RoundEngine::where(uint64_t call) const { return fmt::format("{} call {}", group_name(), call); }

void RoundEngine::stop(StopReason reason, int rank) noexcept {
  raise_stop(words().stop_word, reason, rank);
  if (reason == StopReason::PeerDied) fabric_.close_group();
  notify(words().wake);
}

bool RoundEngine::decide(uint64_t index) noexcept {
  std::atomic<uint64_t>& word = control_.barrier();
  uint64_t cur = word.load(std::memory_order_seq_cst);
  for (;;) {
    switch (barrier_state(cur, index, static_cast<uint64_t>(size_))) {
      case BarrierState::WentAhead: return true;
      case BarrierState::Fell: return false;
      case BarrierState::Open: break;
    }
    if (word.compare_exchange_weak(cur, barrier_failure(index), std::memory_order_seq_cst)) return false;
  }
}

void RoundEngine::arrive() noexcept {
  note_cpu();
  // This rank's own count first: a peer that finds it knows this rank is done with the steps
  // before the barrier (its writes into peers' buffers among them), which is what a wait holding
  // its buffers after a failure or a death needs. The add may still be to come then; it changes
  // nothing there (that wait decides the barrier by the word alone, and an add after a failure
  // counts above it).
  // A release store, not a seq_cst one (an xchg, 3% of a small round): the add after it is a
  // full barrier, and every wait reads the word before any count, so a waiter either reads the
  // add, and with it this count, or registered as a sleeper before, and notify() sees it.
  control_.slot(rank_).arrivals.store(++barriers_, std::memory_order_release);
  // seq_cst: publishes this rank's writes (stamp, descriptor, inline data) to whoever sees the count.
  control_.barrier().fetch_add(1, std::memory_order_seq_cst);
  notify(words().wake);
}

void RoundEngine::resume_barriers(uint64_t b) noexcept {
  std::atomic<uint64_t>& word = control_.barrier();
  const uint64_t complete = b * static_cast<uint64_t>(size_);
  uint64_t cur = word.load(std::memory_order_seq_cst);
  // A failure of b or before, or a count short of b's, is what the ranks recover from; a later
  // failure or a count past b's belongs to a call after this reset.
  auto behind = [&] { return barrier_fell(cur) ? barrier_failed_at(cur) <= b : cur < complete; };
  while (behind() && !word.compare_exchange_weak(cur, complete, std::memory_order_seq_cst)) {
  }
}

RoundEngine::Waited RoundEngine::wait_barrier(uint64_t target, WaitClock::time_point& deadline, WaitMode mode,
                                              const char* what, uint64_t call, Paused* paused) {
  const auto size = static_cast<uint64_t>(size_);
  auto counter = [&](int r) { return control_.slot(r).arrivals.load(std::memory_order_seq_cst); };
  auto settled = [&] {
    const BarrierState state = barrier_state(control_.barrier().load(std::memory_order_seq_cst), target, size);
    if (mode != WaitMode::Hold) return state != BarrierState::Open;
    if (state == BarrierState::WentAhead) return true;
    // A barrier that fell, once every rank is past it (arrived, or left the round: fail_round).
    if (state == BarrierState::Open) return false;
    for (int r = 0; r < size_; ++r) {
      if (counter(r) < target) return false;
    }
    return true;
  };
  return wait_all(settled, counter, target, deadline, mode, what, call, paused);
}

void RoundEngine::note_cpu() noexcept {
  if (waiter_.oversubscribed()) return;
  // Written only when it changed, so that peers keep the line in their caches.
  std::atomic<int32_t>& cpu = control_.slot(rank_).cpu;
  const int now = sched_getcpu();
  if (cpu.load(std::memory_order_relaxed) != now) cpu.store(now, std::memory_order_relaxed);
}

bool RoundEngine::awaited_on_this_cpu(uint64_t target) const noexcept {
  if (waiter_.oversubscribed()) return false;  // the waits yield anyway
  const int cpu = sched_getcpu();
  for (int r = 0; r < size_; ++r) {
    const RankSlot& s = control_.slot(r);
    // The CPU first: its line stays in this cache, while the count's is the one its owner writes next.
    if (r != rank_ && s.cpu.load(std::memory_order_relaxed) == cpu &&
        s.arrivals.load(std::memory_order_relaxed) < target) {
      return true;
    }
  }
  return false;
}

bool RoundEngine::check_peers() {
  bool gone = false;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_ || fabric_.alive(r)) continue;
    if (dead_rank_ < 0) dead_rank_ = r;
    stop(StopReason::PeerDied, r);
    dead_.resize(static_cast<size_t>(size_), 0);
    dead_[static_cast<size_t>(r)] = 1;
    gone = true;
  }
  return gone;
}

void RoundEngine::fail_fast() {
  if (stop_reason(words().stop_word.load(std::memory_order_acquire)) != StopReason::None)
    throw_stopped(false, round_ + 1);
}

void RoundEngine::barrier(const Round& round, Collective what, bool hold_buffers, bool cross_process) {
  const bool hold = hold_buffers && (cross_process || fabric_.peers_use_private_memory());
  arrive();
  const uint64_t target = barriers_;
  const Waited waited = wait_barrier(target, round.deadline, hold ? WaitMode::Hold : WaitMode::Abortable,
                                     collective_name(what), round.number);
  if (waited == Waited::TimedOut) stop(StopReason::Timeout, rank_);
  if (!decide(target)) throw_failed(waited, collective_name(what), round.number, target);
}

// Every rank sees the same descriptors, so every rank reaches the same verdict and nothing is
// written on a disagreement.
void RoundEngine::verify(const Round& round) {
  // Every rank's call alike, as it nearly always is: rank 0's arguments stand for all (its
  // verdict names rank 0, as the full check would), except a weighted mean's weights, which differ.
  const CallSignature& first = desc(0, round.parity).call;
  bool alike = first.collective != Collective::WeightedMean;
  for (int r = 1; r < size_ && alike; ++r) alike = desc(r, round.parity).call == first;
  if (alike && first == judged_) return;
  verify_round([&] { return group_name(); }, round.number, size_, alike ? 1 : size_, check_mismatch_,
               [&](int r) -> const CallSignature& { return desc(r, round.parity).call; },
               [&](int r) { return desc(r, round.parity).weight; });
  if (alike) judged_ = first;
}

void RoundEngine::throw_failed(Waited why, const char* what, uint64_t call, uint64_t target) {
  if (why == Waited::PeerDied) throw_gone(dead_rank_, call);
  // A timeout at a barrier, this rank's or a peer's: name the ranks that had not arrived, as every
  // waiter saw. Not the rank that timed out: it was waiting (in the copy pipeline, its count is
  // short of the barrier it failed for its peers).
  const uint32_t stop = words().stop_word.load(std::memory_order_acquire);
  if (target != 0 && stop_reason(stop) == StopReason::Timeout) {
    std::vector<int> missing;
    for (int r = 0; r < size_; ++r) {
      if (r != stop_rank(stop) && control_.slot(r).arrivals.load(std::memory_order_acquire) < target) {
        missing.push_back(r);
      }
    }
    if (!missing.empty()) {
      fail(GRADSYNC_E_TIMEOUT, "{}: timed out: rank(s) [{}] did not arrive at {} within {} ms", where(call),
           fmt::join(missing, ", "), what, timeout_.count());
    }
  }
  throw_stopped(true, call);
}

void RoundEngine::report_stragglers(const std::vector<int>& missing, const char* what, uint64_t call,
                                    std::chrono::nanoseconds waited) const {
  GS_LOG_WARN("{} {}: rank {} waiting {} s for rank(s) {}", where(call), what, rank_,
              std::chrono::duration_cast<std::chrono::seconds>(waited).count(), fmt::join(missing, ", "));
}

void RoundEngine::throw_dead(int r) {
  fail(GRADSYNC_E_REMOTE, "rank {} (pid {}) of {} group '{}' died; free the group and form a new one", r,
       fabric_.pid(r), transport_name(fabric_.transport()), fabric_.group());
}

// Rank r is gone. The stop word knows better who went first and how: a rank that saw r die and then
// freed its communicator looks gone too, but r is the one to name.
void RoundEngine::throw_gone(int r, uint64_t call) {
  const uint32_t code = words().stop_word.load(std::memory_order_acquire);
  if (stop_reason(code) == StopReason::PeerDied) throw_dead(stop_rank(code));
  if (stop_reason(code) == StopReason::Left) throw_stopped(true, call);
  throw_dead(r);
}

void RoundEngine::throw_stopped(bool waiting, uint64_t call) {
  uint32_t code = words().stop_word.load(std::memory_order_acquire);
  // A barrier failed by a peer: its stop is published before the failure.
  const int who = stop_rank(code);
  const int pid = who >= 0 && who < size_ ? fabric_.pid(who) : 0;
  const std::string w = where(call);
  switch (stop_reason(code)) {
    case StopReason::PeerDied: throw_dead(who);
    case StopReason::Timeout:
      if (waiting) {
        fail(GRADSYNC_E_TIMEOUT, "{}: timed out (rank {} waited {} ms for a peer); reset or free the group", w, who,
             timeout_.count());
      }
      fail(GRADSYNC_E_ABORTED, "{}: the group is stopped after a timeout (seen by rank {}); reset or free it", w, who);
    case StopReason::Left:
      fail(GRADSYNC_E_ABORTED,
           "{}: rank {} left the group (its communicator was freed, pid {}); free the group and "
           "form a new one",
           w, who, pid);
    case StopReason::Corrupt:
      fail(GRADSYNC_E_CORRUPT,
           "{}: rank {} stopped the group: a peer published a buffer outside the group's shared "
           "heaps (a member gone bad); reset or free it",
           w, who);
    case StopReason::Failed:
      fail(GRADSYNC_E_ABORTED,
           "{}: rank {} (pid {}) failed in the middle of a call (an error of its own, reported "
           "there); reset or free the group",
           w, who, pid);
    case StopReason::Shrinking:
      fail(GRADSYNC_E_ABORTED,
           "{}: rank {} (pid {}) is shrinking the group after a lost member; call "
           "gradsync_comm_shrink on every rank",
           w, who, pid);
    case StopReason::Aborted:
    case StopReason::None: break;
  }
  fail(GRADSYNC_E_ABORTED,
       "{}: the group was aborted (abort() called on rank {}, pid {}); call reset() on every rank "
       "or free it",
       w, who, pid);
}

void RoundEngine::abort() noexcept { stop(StopReason::Aborted, rank_); }

void RoundEngine::fail_round() noexcept {
  stop(StopReason::Failed, rank_);
  decide(barriers_ + 1);
  // Past that barrier, as far as peers holding their buffers for it can tell: this rank touches
  // none of theirs any more (reset sets the count again).
  control_.slot(rank_).arrivals.store(barriers_ + 1, std::memory_order_seq_cst);
  notify(words().wake);
}

void RoundEngine::refuse_peer_buffer(const Round& round, int r, uint64_t address, uint64_t bytes) {
  stop(StopReason::Corrupt, rank_);
  decide(barriers_ + 1);
  fail(GRADSYNC_E_CORRUPT,
       "{}: rank {} published a buffer [{:#x}, +{}) outside the group's shared heaps; the group "
       "is stopped (reset or free it)",
       where(round.number), r, address, bytes);
}

void RoundEngine::refuse_peer_range(const Round& round, Collective what, int r, uint64_t address, uint64_t bytes,
                                    const char* lies) {
  // A process being killed loses its memory before the kernel drops its lock: its death is given
  // a moment to show before its range is called corrupt.
  const bool gone = gone_within_grace([&] { return !fabric_.alive(r); });
  if (gone) {
    check_peers();
  } else {
    stop(StopReason::Corrupt, rank_);
  }
  // The round's next barrier falls, and this rank counts as past it (as fail_round has it), so
  // peers holding their buffers know it copies no more; then it holds its own likewise.
  decide(barriers_ + 1);
  control_.slot(rank_).arrivals.store(barriers_ + 1, std::memory_order_seq_cst);
  notify(words().wake);
  wait_barrier(barriers_ + 1, round.deadline, WaitMode::Hold, collective_name(what), round.number);
  if (gone) throw_gone(r, round.number);
  fail(GRADSYNC_E_CORRUPT, "{}: rank {} published a buffer [{:#x}, +{}) {}; the group is stopped (reset or free it)",
       where(round.number), r, address, bytes, lies);
}

void RoundEngine::leave() noexcept {
  raise_stop(words().stop_word, StopReason::Left, rank_);
  notify(words().wake);
}

void RoundEngine::reset() {
  GroupWords& g = words();
  uint32_t from = 0;
  if (size_ > 1) {
    from = reset_together();
  } else {
    from = g.stop_word.load(std::memory_order_acquire);
    barriers_ = std::max(barriers_, barrier_spent(control_.barrier().load(std::memory_order_seq_cst), 1));
    resume_barriers(barriers_);
    control_.slot(rank_).arrivals.store(barriers_, std::memory_order_seq_cst);
  }
  // Judged on the stop the ranks reset from, not on the word now: a rank that returned from this
  // reset may already have freed its communicator (a Left stop), and that belongs to the next
  // call, or this rank would fail a reset that its peer reported done.
  if (stop_reason(from) == StopReason::PeerDied) throw_dead(stop_rank(from));
  if (stop_reason(from) == StopReason::Left) throw_stopped(false, round_ + 1);
  // Clear the stop the ranks recovered from, and nothing newer: a stop raised since (perhaps seen
  // already by a rank that left the reset first) has another generation, so the CAS leaves it.
  // Every rank clears before it returns, so none starts its next call on the old stop.
  uint32_t expected = from;
  if (stop_reason(from) != StopReason::None) {
    g.stop_word.compare_exchange_strong(expected, stop_cleared(from), std::memory_order_seq_cst);
  }
}

// Every rank asks for the open attempt of the epoch with its counts; the attempt is decided once,
// by a CAS on reset_state: closed when some rank saw every request (the reset happened, for every
// rank), or moved to the next attempt by a rank whose deadline passed first (it failed, for every
// rank that asked; they all call reset again and meet at the next attempt). So no rank goes on
// from a reset that another rank reports failed: it would run one call more than that rank.
uint32_t RoundEngine::reset_together() {
  GroupWords& g = words();
  uint64_t state = g.reset_state.load(std::memory_order_seq_cst);
  while (!reset_code_open(state)) {
    const uint64_t opened = reset_code(reset_code_epoch(state) + 1, 0, true);
    if (g.reset_state.compare_exchange_weak(state, opened, std::memory_order_seq_cst)) state = opened;
  }
  const uint32_t epoch = reset_code_epoch(state);
  const uint32_t attempt = reset_code_attempt(state);
  // A barrier that fell before this rank arrived at it (a pipeline that failed between barriers)
  // is spent too: the next round must use a later one.
  const uint64_t spent =
      barrier_spent(control_.barrier().load(std::memory_order_seq_cst), static_cast<uint64_t>(size_));
  RankSlot& me = control_.slot(rank_);
  constexpr auto relaxed = std::memory_order_relaxed;
  me.reset_rounds[epoch & 1].store(round_, relaxed);
  me.reset_arrivals[epoch & 1].store(std::max(barriers_, spent), relaxed);
  me.reset_chunks[epoch & 1].store(std::max({chunks_, me.staged.load(), me.reduced.load(), me.drained.load()}),
                                   relaxed);
  me.reset_stop[epoch & 1].store(g.stop_word.load(std::memory_order_seq_cst), relaxed);
  me.reset_request.store(state, std::memory_order_seq_cst);
  notify(g.wake);

  auto posted = [&](int r) { return control_.slot(r).reset_request.load(std::memory_order_seq_cst) == state; };
  // A decided attempt counts as "everyone there", so the wait ends as soon as it is decided.
  auto counter = [&](int r) { return uint64_t{posted(r) || g.reset_state.load(std::memory_order_seq_cst) != state}; };
  auto settled = [&] {
    for (int r = 0; r < size_; ++r) {
      if (counter(r) == 0) return false;
    }
    return true;
  };
  WaitClock::time_point deadline{};
  const Waited waited = wait_all(settled, counter, 1, deadline, WaitMode::Deadline, "reset", round_ + 1);
  if (waited == Waited::PeerDied) throw_gone(dead_rank_, round_ + 1);
  std::vector<int> missing;
  for (int r = 0; r < size_; ++r) {
    if (!posted(r)) missing.push_back(r);
  }
  // Every rank adopts the largest counts posted: the same figures on every rank, once all posted.
  uint64_t rounds = 0, arrivals = 0, chunks = 0;
  uint32_t from = 0;
  auto adopt = [&] {
    from = control_.slot(0).reset_stop[epoch & 1].load(relaxed);
    for (int r = 0; r < size_; ++r) {
      const RankSlot& s = control_.slot(r);
      const uint32_t stop = s.reset_stop[epoch & 1].load(relaxed);
      if (stop_newer(stop, from)) from = stop;
      rounds = std::max(rounds, s.reset_rounds[epoch & 1].load(relaxed));
      arrivals = std::max(arrivals, s.reset_arrivals[epoch & 1].load(relaxed));
      chunks = std::max(chunks, s.reset_chunks[epoch & 1].load(relaxed));
    }
  };
  if (missing.empty()) {
    // Before the verdict: a rank that reads "closed" starts its next call on the barrier word.
    // Every post of this attempt is in, so what is adopted here is what the reset goes on with.
    adopt();
    resume_barriers(arrivals);
  }
  uint64_t cur = state;
  const uint64_t verdict = missing.empty() ? reset_code(epoch, attempt, false) : reset_code(epoch, attempt + 1, true);
  if (g.reset_state.compare_exchange_strong(cur, verdict, std::memory_order_seq_cst)) cur = verdict;
  notify(g.wake);
  const bool closed = reset_code_epoch(cur) > epoch || !reset_code_open(cur);
  if (!closed) {
    if (missing.empty()) {
      fail(GRADSYNC_E_TIMEOUT,
           "reset of {} group '{}' on rank {}: a peer gave up waiting for the others; call reset "
           "again on every rank",
           transport_name(fabric_.transport()), fabric_.group(), rank_);
    }
    fail(GRADSYNC_E_TIMEOUT, "reset of {} group '{}' on rank {}: rank(s) {} did not call reset within {} ms",
         transport_name(fabric_.transport()), fabric_.group(), rank_, fmt::join(missing, ", "), timeout_.count());
  }
  if (!missing.empty()) adopt();  // closed by a peer that saw every post this rank missed
  round_ = rounds;
  barriers_ = arrivals;
  chunks_ = chunks;
  me.arrivals.store(arrivals, std::memory_order_seq_cst);
  me.staged.store(chunks, std::memory_order_seq_cst);
  me.reduced.store(chunks, std::memory_order_seq_cst);
  me.drained.store(chunks, std::memory_order_seq_cst);
  return from;
}

}  // namespace gradsync::comm
