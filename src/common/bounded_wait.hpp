// SPDX-License-Identifier: Apache-2.0
#pragma once
// The outer loop of every wait for peers, written once: slices of waiting, and between them, in
// this order, the checks that end a wait that is not ready:
//   ready (the slice's own condition) -> stop word (the slice's abort condition) -> interrupt ->
//   liveness of the peers -> straggler log -> deadline.
// A slice is the caller's own way of waiting (a futex wait on shared words, polls of MPI requests)
// until a time point; it ends Ready, Aborted (its stop condition holds) or Timeout (the time came).
#include <algorithm>
#include <chrono>

#include "common/wait.hpp"

namespace gradsync {

enum class WaitEnd { Ready, Stopped, Interrupted, PeerGone, Deadline };

// slice(until) -> WaitResult; interrupted() -> bool (the process wants out: a signal); gone() ->
// bool (a peer is known dead), called every `liveness` at most; report(waited) logs a long wait;
// expired() -> bool, called when `deadline` has passed: true ends the wait (Deadline), false
// keeps waiting with whatever deadline it set.
template <class Slice, class Interrupted, class Gone, class Report, class Expired>
WaitEnd bounded_wait(Slice&& slice, Interrupted&& interrupted, Gone&& gone, Report&& report, Expired&& expired,
                     WaitClock::time_point& deadline, std::chrono::nanoseconds liveness,
                     WaitClock::time_point started = WaitClock::now()) {
  auto next_report = started + kStragglerReportAfter;
  for (auto now = started;; now = WaitClock::now()) {
    switch (slice(std::min(deadline, now + liveness))) {
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

}  // namespace gradsync
