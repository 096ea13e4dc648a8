// SPDX-License-Identifier: Apache-2.0
#pragma once
// The outer loop of every wait for peers, written once: slices of waiting, and between them, in
// this order, the checks that end a wait that is not ready:
//   ready (the slice's own condition) -> stop word (the slice's abort condition) -> interrupt ->
//   liveness of the peers -> straggler log -> deadline.
// A slice is the caller's own way of waiting (a futex wait on shared words, polls of MPI requests,
// a lock tried again and again: polled()) until a time point; it ends Ready, Aborted (its stop
// condition holds) or Timeout (the time came).
#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

#include "common/wait.hpp"

namespace gradsync {

enum class WaitEnd { Ready, Stopped, Interrupted, PeerGone, Deadline };

// slice(until) -> WaitResult; interrupted() -> bool (the process wants out: a signal); gone() ->
// bool (a peer is known dead), called every `liveness` at most; report(waited) logs a long wait;
// expired() -> bool, called when `deadline` has passed: true ends the wait (Deadline), false
// keeps waiting with whatever deadline it set. The first slice runs whatever the deadline.
template <class Slice, class Interrupted, class Gone, class Report, class Expired>
WaitEnd bounded_wait(Slice&& slice, Interrupted&& interrupted, Gone&& gone, Report&& report, Expired&& expired,
                     WaitClock::time_point& deadline, std::chrono::nanoseconds liveness,
                     WaitClock::time_point started = WaitClock::now()) {
  auto next_report = started + kStragglerReportAfter;
  for (auto now = started;; now = WaitClock::now()) {
    // The slice ends in time for the next check that is due (liveness may be nanoseconds::max()).
    auto until = std::min(deadline, next_report);
    if (until > now && liveness < until - now) until = now + std::chrono::duration_cast<WaitClock::duration>(liveness);
    switch (slice(until)) {
      case WaitResult::Ready: return WaitEnd::Ready;
      case WaitResult::Aborted: return WaitEnd::Stopped;
      case WaitResult::Timeout: break;
    }
    if (interrupted()) return WaitEnd::Interrupted;
    if (gone()) return WaitEnd::PeerGone;
    now = WaitClock::now();
    if (now >= next_report) {
      report(now - started);
      next_report = now + kStragglerReportEvery;
    }
    if (now >= deadline && expired()) return WaitEnd::Deadline;
  }
}

// The hooks of a wait that has nothing to check there: no interrupt, no peer to watch, nothing to
// log (wait_never, wait_silent), and a deadline that ends it (wait_ends).
inline constexpr auto wait_never = [] { return false; };
inline constexpr auto wait_silent = [](std::chrono::nanoseconds) {};
inline constexpr auto wait_ends = [] { return true; };

// A slice for a condition that can only be polled (a lock to try, a file to look at):
// poll() -> WaitResult (Timeout: not yet) until it says more or `until` comes, sleeping `first`
// between polls at first and twice as long each time after, at most `most`. It polls at least once.
template <class Poll>
auto polled(Poll&& poll, std::chrono::nanoseconds first, std::chrono::nanoseconds most) {
  return [poll = std::forward<Poll>(poll), pause = first, most](WaitClock::time_point until) mutable {
    for (;;) {
      if (const WaitResult r = poll(); r != WaitResult::Timeout) return r;
      const auto now = WaitClock::now();
      if (now >= until) return WaitResult::Timeout;
      std::this_thread::sleep_for(std::min(std::chrono::duration_cast<WaitClock::duration>(pause), until - now));
      pause = std::min(pause * 2, most);
    }
  };
}

// A peer's death that would explain a failure is given this long to show before the failure is
// reported as it is: a process being killed loses its memory and its connections before the kernel
// drops its locks and reaps it.
inline constexpr std::chrono::milliseconds kDeathGrace{250};

// Whether gone() holds within kDeathGrace, polled every millisecond.
template <class Gone>
bool gone_within_grace(Gone&& gone) {
  auto poll = [&] { return gone() ? WaitResult::Ready : WaitResult::Timeout; };
  auto deadline = WaitClock::now() + kDeathGrace;
  return bounded_wait(polled(poll, std::chrono::milliseconds(1), std::chrono::milliseconds(1)), wait_never, wait_never,
                      wait_silent, wait_ends, deadline, std::chrono::nanoseconds::max()) == WaitEnd::Ready;
}

}  // namespace gradsync
