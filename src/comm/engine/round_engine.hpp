// SPDX-License-Identifier: Apache-2.0
#pragma once
// The round protocol, written once for every transport whose ranks share memory (threads,
// shared-memory processes): agreement, call signatures, deadlines, abort, reset, peer death and
// the errors that report them. The collectives (algorithms/) call it; the transports (transport/)
// only provide a Fabric.
//
// A collective is one round: each rank publishes a Descriptor of its call in its slot (by round
// parity), then meets the others at the round's arrival barrier. Barriers are counted over the
// group's life (ControlArea::barrier; each rank's own count in RankSlot::arrivals); a round may
// have more (a completion barrier while peers use this rank's buffers, one per staged block on the
// copy path).
//
// Every barrier is DECIDED once for all ranks, on one group word (ControlArea::barrier; see
// barrier_state in control.hpp): each rank arrives by adding one to it, and a rank that saw an
// abort, its deadline or a dead peer replaces it, by CAS, with a failure naming the barrier, unless
// the count reached the barrier first. Whichever came first holds for every rank, so no rank
// returns OK for a call that another rank reports failed:
// - a failure naming a LATER barrier leaves this one gone ahead: no rank gets past a barrier that
//   failed (it must reset first, and reset needs every rank, this one included);
// - a rank that fails between barriers (the copy pipeline) fails the next barrier before it
//   throws, so its peers fail there too instead of completing without it.
// A barrier that goes ahead costs each rank one atomic add and the polls of one line, as a plain
// counting barrier does: no decision to write. Each rank also records its own count in its slot,
// where a wait finds the ranks it is waiting for.
// After a failure the stop word (first cause wins) makes every call fail fast until reset()
// realigns the ranks: every rank adopts the largest round and barrier counts posted, so the next
// call is the same call on every rank, and the barrier word resumes from there (a failure it
// recovers from cleared). A reset is decided once for all ranks as well (reset_state): it either
// happens for every rank or fails for every rank that asked.
//
// tests/model/round.pml models this protocol (decisions, resets, stops) and spin checks it over
// every interleaving of completion, abort, timeout, reset and death (tests/model/check.sh).
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "comm/call_signature.hpp"
#include "comm/engine/control.hpp"
#include "comm/engine/fabric.hpp"
#include "comm/telemetry.hpp"
#include "comm/types.hpp"
#include "common/bounded_wait.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "common/wait.hpp"

namespace gradsync::comm {

class RoundEngine {
 public:
  struct Round {
    uint64_t number;  // the call's number on this communicator (1, 2, ...), the same on every rank
    uint64_t parity;  // which of the two descriptor and inline areas this round uses
    // Set at the round's first wait that outlasts its first polls (a clock read that a rank whose
    // peers are there, or come within those polls, never pays).
    mutable WaitClock::time_point deadline{};
    bool all_direct;  // every rank's buffers are reachable by its peers (kDirectShared)
    bool any_direct;  // some rank's are
    bool all_cross;   // every rank reaches every peer's process memory (kDirectCrossProcess)
  };

  // interrupt is asked while waits last (InterruptCheck); it and telemetry (which hears of each
  // round's arrival wait) must outlive the engine.
  RoundEngine(Fabric& fabric, int rank, int size, std::chrono::milliseconds timeout, bool check_mismatch,
              const InterruptCheck& interrupt, Telemetry& telemetry);

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const ControlArea& control() const noexcept { return control_; }
  Fabric& fabric() const noexcept { return fabric_; }

  // Throws the group's failure when it is stopped (abort, timeout, dead or departed peer).
  void fail_fast();
  // Publishes d (after publish(parity) has filled this rank's inline area or address table; a rank
  // may also fill its inline area later in the round, before a barrier that precedes the peers'
  // reads), meets every rank at the arrival barrier and decides the round. Throws on a failed
  // round, and E_MISMATCH (or the argument's error) on every rank alike when the calls disagree.
  template <class Publish>
  Round begin(const Descriptor& d, Publish&& publish);
  // A barrier inside a round. When peers may still be using this rank's private buffers
  // (`hold_buffers` on a fabric whose peers use private memory, or in a round whose peers copy to
  // and from this process: `cross_process`), it waits for them whatever the deadline or an abort
  // says: returning would let a peer write into freed memory.
  void barrier(const Round& round, Collective what, bool hold_buffers, bool cross_process = false);
  // Waits for a condition on the peers' copy-path counters. On abort, deadline or a dead peer it
  // decides the round's next barrier failed, so every rank fails the round, then throws.
  template <class Ready>
  void wait_for(Ready&& ready, const Round& round, const char* what);

  const Descriptor& desc(int r, uint64_t parity) const noexcept { return control_.slot(r).desc[parity]; }
  // Copy-path chunks of every allreduce so far (the same count on every rank); reset aligns it.
  uint64_t chunks() const noexcept { return chunks_; }
  void set_chunks(uint64_t c) noexcept { chunks_ = c; }
  // Publishes a copy-path counter of this rank and wakes the waiters.
  void publish(std::atomic<uint64_t> RankSlot::*counter, uint64_t value) noexcept {
    note_cpu();
    (control_.slot(rank_).*counter).store(value, std::memory_order_seq_cst);
    notify(control_.words().wake);
  }

  // Rank r published a buffer that this rank may not touch (ControlArea::reach): the group fails
  // this round on every rank (its next barrier is decided failed) and stops; throws E_CORRUPT.
  [[noreturn]] void refuse_peer_buffer(const Round& round, int r, uint64_t address, uint64_t bytes);
  // The same for a round whose peers copy to and from this rank's process (Round::all_cross), where
  // a copy with rank r failed: r died (thrown as such), or its range [address, +bytes) was not
  // there (`lies` says where it was looked for; E_CORRUPT). This rank leaves only once no live
  // peer copies into its process any more.
  [[noreturn]] void refuse_peer_range(const Round& round, Collective what, int r, uint64_t address, uint64_t bytes,
                                      const char* lies);

  // Runs body, one collective. Once it calls hold_round() (its round is agreed, and any check that
  // every rank makes alike is passed), the rest of the call is the round's: an exception that
  // leaves body from there on fails the round for every rank (fail_round). A failure of the round
  // itself is decided already; failing its next barrier again changes nothing. A catch, not a
  // guard object asking std::uncaught_exceptions(): a try block costs nothing until something is
  // thrown, while that runtime call costs a few percent of a small collective.
  template <class Body>
  void run_call(Body&& body) {
    const bool outer = std::exchange(held_, false);
    try {
      body();
    } catch (...) {
      if (held_) fail_round();
      held_ = outer;
      throw;
    }
    held_ = outer;
  }
  void hold_round() noexcept { held_ = true; }

  // This rank leaves its round by an error of its own: the group stops, and the round's next
  // barrier fails for every rank. Otherwise its peers would wait there until their deadline, or,
  // worse, count this rank's next call as its arrival there and return OK without its part.
  void fail_round() noexcept;
  void abort() noexcept;
  void reset();
  // This rank is leaving (its communicator is being freed): peers waiting on it fail.
  void leave() noexcept;

 private:
  enum class Waited { Ready, Stopped, TimedOut, PeerDied };
  // What ends a wait besides its condition: the stop word, the deadline and a dead peer
  // (Abortable); the deadline and a dead peer (Deadline); only a dead peer, after the live peers
  // are there (Hold: peers are using this rank's buffers).
  enum class WaitMode { Abortable, Deadline, Hold };

  GroupWords& words() const noexcept { return control_.words(); }
  void stop(StopReason reason, int rank) noexcept;
  // Barrier `index`'s verdict, the same for every rank: true when it went ahead. One still open is
  // failed now: only a rank giving up on it finds it so (a wait that ended ready finds it decided).
  bool decide(uint64_t index) noexcept;
  void arrive() noexcept;
  // After a reset every rank resumes from barrier b: the barrier word becomes b's complete count,
  // unless an arrival past b was counted already or a later barrier failed (a rank that left the
  // reset first and went on).
  void resume_barriers(uint64_t b) noexcept;
  // Waits until settled(), or, once a peer is known dead, until counter(r) >= target for every live
  // rank r; see WaitMode for what else ends it. A wait that lasts logs, now and then, the ranks
  // whose counter is short of target at `what` of call `call`. *paused (when given) says how long
  // the wait took: none, within the first polls, or longer.
  enum class Paused { No, Briefly, Long };
  template <class Settled, class Counter>
  Waited wait_all(Settled&& settled, Counter&& counter, uint64_t target, WaitClock::time_point& deadline, WaitMode mode,
                  const char* what, uint64_t call, Paused* paused = nullptr);
  // Waits at barrier `target`, which this rank has arrived at: until it is decided (went ahead or
  // fell), or, in Hold mode, until it went ahead, or fell with every rank past it (arrived, or out
  // of the round by fail_round), or a peer died with every live one past it.
  Waited wait_barrier(uint64_t target, WaitClock::time_point& deadline, WaitMode mode, const char* what, uint64_t call,
                      Paused* paused = nullptr);
  void report_stragglers(const std::vector<int>& missing, const char* what, uint64_t call,
                         std::chrono::nanoseconds waited) const;
  // The deadline of a wait that starts `now`, unless one is set already.
  void start_deadline(WaitClock::time_point& deadline, WaitClock::time_point now = WaitClock::now()) const noexcept {
    if (deadline == WaitClock::time_point{}) deadline = deadline_after(timeout_, now);
  }
  // Records the CPU this rank runs on, for peers' awaited_on_this_cpu.
  void note_cpu() noexcept;
  // Whether a rank that has not reached barrier `target` was last seen on this thread's CPU (any
  // peer, for target ~0: within a round's steps every peer may be the one awaited).
  bool awaited_on_this_cpu(uint64_t target) const noexcept;
  // The liveness check of a wait slice that ended without its condition; true if a peer is gone.
  bool check_peers();
  void verify(const Round& round);
  // The multi-rank part of reset(): decides the reset with the peers; returns the stop word it
  // recovers from (the newest any rank saw when it asked).
  uint32_t reset_together();
  // target: the barrier the wait was at, or 0 for a wait between barriers (wait_for), where what
  // stalled is the peers' progress rather than their arrival.
  [[noreturn]] void throw_failed(Waited why, const char* what, uint64_t call, uint64_t target);
  [[noreturn]] void throw_stopped(bool waiting, uint64_t call);
  [[noreturn]] void throw_dead(int r);
  [[noreturn]] void throw_gone(int r, uint64_t call);
  std::string group_name() const;
  std::string where(uint64_t call) const;

  Fabric& fabric_;
  const ControlArea& control_;
  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  const bool check_mismatch_;
  const InterruptCheck& interrupt_;
  Telemetry& telemetry_;
  std::vector<int64_t> stamps_;  // the ranks' arrivals in the round just decided
  uint64_t round_ = 0;
  // The last call that every rank made alike and verify() found good: the same call again needs
  // no judging (the verdict is a function of the call and the group's size). Starts as no call.
  CallSignature judged_{0, 0, 0, static_cast<Collective>(-1)};
  uint64_t barriers_ = 0;
  uint64_t chunks_ = 0;
  bool held_ = false;  // the collective in run_call holds its round (hold_round)
  int dead_rank_ = -1;
  std::vector<char> dead_;
  AdaptiveWait waiter_;
};

// While waiting, peers' liveness is checked this often (a dead peer is reported within it).
inline constexpr auto kLivenessInterval = std::chrono::milliseconds(10);

template <class Settled, class Counter>
RoundEngine::Waited RoundEngine::wait_all(Settled&& settled, Counter&& counter, uint64_t target,
                                          WaitClock::time_point& deadline, WaitMode mode, const char* what,
                                          uint64_t call, Paused* paused) {
  dead_.clear();
  auto ready = [&] {
    if (settled()) return true;
    if (dead_.empty()) return false;
    for (int r = 0; r < size_; ++r) {
      if (counter(r) < target && !dead_[static_cast<size_t>(r)]) return false;
    }
    return true;
  };
  if (ready()) return Waited::Ready;
  if (paused != nullptr) *paused = Paused::Briefly;
  const std::atomic<uint32_t>* stop_word = mode == WaitMode::Abortable ? &words().stop_word : nullptr;
  if (const auto brief = waiter_.poll_briefly(ready, stop_word, kStopReasonMask, awaited_on_this_cpu(target))) {
    return *brief == WaitResult::Ready ? Waited::Ready : Waited::Stopped;
  }
  if (paused != nullptr) *paused = Paused::Long;
  const auto started = WaitClock::now();
  start_deadline(deadline, started);
  const WaitEnd end = bounded_wait(
      [&](WaitClock::time_point until) {
        return waiter_(words().wake, ready, until, stop_word, kStopReasonMask, awaited_on_this_cpu(target));
      },
      [&] {
        if (mode != WaitMode::Abortable || !interrupt_()) return false;
        abort();
        return true;
      },
      [&] { return check_peers() && mode != WaitMode::Hold; },
      [&](std::chrono::nanoseconds waited) {
        std::vector<int> missing;
        for (int r = 0; r < size_; ++r) {
          if (counter(r) < target) missing.push_back(r);
        }
        if (!missing.empty()) report_stragglers(missing, what, call, waited);
      },
      [&] {
        if (mode != WaitMode::Hold) return true;
        GS_LOG_WARN("group '{}' rank {}: peers still use this rank's buffers after {} ms; waiting for them",
                    fabric_.group(), rank_, timeout_.count());
        deadline = deadline_after(timeout_);
        return false;
      },
      deadline, kLivenessInterval, started);
  switch (end) {
    case WaitEnd::Ready: return dead_.empty() ? Waited::Ready : Waited::PeerDied;
    case WaitEnd::Stopped:
    case WaitEnd::Interrupted: return Waited::Stopped;
    case WaitEnd::PeerGone: return Waited::PeerDied;
    case WaitEnd::Deadline: break;
  }
  return Waited::TimedOut;
}

template <class Publish>
RoundEngine::Round RoundEngine::begin(const Descriptor& d, Publish&& publish) {
  fail_fast();
  Round round{++round_, 0, {}, true, false, true};
  round.parity = round.number & 1;
  publish(round.parity);
  const auto arrived = telemetry_.now();
  control_.arrival_stamp(rank_, round.parity) = Telemetry::stamp(arrived);
  // A store to a line that peers hold costs this rank a transfer before its arrival can count,
  // and each peer another after it: an unchanged descriptor is left alone.
  Descriptor& mine = control_.slot(rank_).desc[round.parity];
  if (!(mine == d)) mine = d;
  arrive();
  const uint64_t target = barriers_;
  Paused paused = Paused::No;
  const Waited waited = wait_barrier(target, round.deadline, WaitMode::Abortable, collective_name(d.call.collective),
                                     round.number, &paused);
  if (waited == Waited::Ready) {
    // The peers' descriptors and then their inline payloads or address tables (as this rank's
    // call says: the calls agree, or the round fails) are read next: fetched together rather than
    // each cache miss waiting for the one before it.
    for (int r = 0; r < size_; ++r) {
      __builtin_prefetch(&desc(r, round.parity));
      __builtin_prefetch(d.direct != 0 ? static_cast<const void*>(control_.table(r, round.parity))
                                       : control_.inline_area(r, round.parity));
    }
  }
  // The stop is published before the verdict, so whoever reads "failed" finds the reason.
  if (waited == Waited::TimedOut) stop(StopReason::Timeout, rank_);
  const bool went_ahead = decide(target);
  if (!went_ahead) {
    telemetry_.arrival(arrived, paused == Paused::No ? arrived : telemetry_.now(), nullptr, 0);
    throw_failed(waited, collective_name(d.call.collective), round.number, target);
  }
  // Every rank arrived, so every stamp of this parity is this round's.
  int64_t last = 0;
  for (int r = 0; r < size_; ++r) {
    stamps_[static_cast<size_t>(r)] = control_.arrival_stamp(r, round.parity);
    last = std::max(last, stamps_[static_cast<size_t>(r)]);
  }
  // The verdict's time without a clock read where it can be had: the last rank to arrive had it at
  // its arrival, and one whose wait ended within its first polls had it as the last peer arrived
  // (a poll's latency later). Only a longer wait (a yield, a sleep) reads the clock again.
  const auto decided = paused == Paused::Long      ? telemetry_.now()
                       : paused == Paused::Briefly ? WaitClock::time_point(std::chrono::nanoseconds(last))
                                                   : arrived;
  telemetry_.arrival(arrived, decided, stamps_.data(), size_);
  // Went ahead: every rank arrived, and every rank runs the round (even if an abort comes now).
  verify(round);
  for (int r = 0; r < size_; ++r) {
    const uint32_t direct = desc(r, round.parity).direct;
    round.all_direct &= (direct & kDirectShared) != 0;
    round.any_direct |= (direct & kDirectShared) != 0;
    round.all_cross &= (direct & kDirectCrossProcess) != 0;
  }
  return round;
}

template <class Ready>
void RoundEngine::wait_for(Ready&& ready, const Round& round, const char* what) {
  start_deadline(round.deadline);
  const WaitEnd end = bounded_wait(
      [&](WaitClock::time_point until) {
        return waiter_(words().wake, ready, until, &words().stop_word, kStopReasonMask,
                       awaited_on_this_cpu(~uint64_t{0}));
      },
      [&] {
        if (!interrupt_()) return false;
        abort();
        return true;
      },
      [&] { return check_peers(); }, wait_silent, wait_ends, round.deadline, kLivenessInterval);
  Waited why = Waited::Stopped;
  switch (end) {
    case WaitEnd::Ready: return;
    case WaitEnd::Stopped:
    case WaitEnd::Interrupted: break;
    case WaitEnd::PeerGone: why = Waited::PeerDied; break;
    case WaitEnd::Deadline:
      why = Waited::TimedOut;
      stop(StopReason::Timeout, rank_);
      break;
  }
  // The peers meet again at this rank's next barrier: it fails for all of them.
  decide(barriers_ + 1);
  throw_failed(why, what, round.number, 0);
}

}  // namespace gradsync::comm
