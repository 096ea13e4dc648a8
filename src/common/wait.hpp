// SPDX-License-Identifier: Apache-2.0
#pragma once
// Waiting for a condition published through atomics, within a process AND across processes that
// share memory (the words may live in a shared-memory segment).
//
// A waiter spins briefly (the condition usually arrives within a microsecond when every rank has
// a core), then yields (ranks may outnumber cores), then sleeps in the kernel on a 32-bit futex
// word. The futex is a shared one (no FUTEX_PRIVATE_FLAG): libstdc++'s std::atomic::wait uses
// private futexes, which a process never receives from another. Every wait has a deadline.
//
// Protocol (a Dekker pair, so a wake is never lost and nobody pays a syscall when nobody sleeps):
//   waker:   publish the condition (seq_cst store or RMW), then notify(word)
//   waiter:  wait_until(word, ready, deadline [, abort flag])
// notify() bumps word.value and issues FUTEX_WAKE only when word.sleepers > 0; a sleeper registers
// in `sleepers` before re-checking the condition and sleeping on `value`. A part of the condition
// may also be published with a release store, if a seq_cst RMW on a word that ready() reads
// first (seq_cst) follows it before notify(): the pair then goes through that word (the round
// engine's arrival counts and its barrier word).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <optional>
#include <ratio>
#include <span>
#include <string>
#include <thread>

#include "common/cpu_relax.hpp"

namespace gradsync {

// The futex word and its sleeper count: put one per cache line in shared structures.
struct alignas(64) WaitWord {
  std::atomic<uint32_t> value{0};
  std::atomic<uint32_t> sleepers{0};
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free to be shared");

enum class WaitResult { Ready, Timeout, Aborted };

using WaitClock = std::chrono::steady_clock;

// A wait this long is logged (a warning naming the ranks not there, where the wait can tell), and
// again every interval: a group forming or a collective waiting on a late rank is never silent.
inline constexpr auto kStragglerReportAfter = std::chrono::seconds(5);
inline constexpr auto kStragglerReportEvery = std::chrono::seconds(10);

// now + timeout, saturating: a timeout of up to INT64_MAX ms is a deadline that never passes
// rather than an overflow into the past. Computed in the clock's own ticks: the headroom left
// after now, converted down to milliseconds (truncating, so a timeout below it always fits).
static_assert(std::ratio_less_equal_v<WaitClock::period, std::milli>, "deadline_after converts ms to ticks");
inline WaitClock::time_point deadline_after(std::chrono::milliseconds timeout,
                                            WaitClock::time_point now = WaitClock::now()) noexcept {
  using Ticks = WaitClock::duration;
  if (timeout <= std::chrono::milliseconds::zero()) return now;
  const Ticks::rep since = now.time_since_epoch().count();
  // A clock before its epoch has at least the whole positive range ahead of it.
  const Ticks::rep room =
      since >= 0 ? std::numeric_limits<Ticks::rep>::max() - since : std::numeric_limits<Ticks::rep>::max();
  if (timeout >= std::chrono::duration_cast<std::chrono::milliseconds>(Ticks(room))) {
    return WaitClock::time_point::max();
  }
  return now + std::chrono::duration_cast<Ticks>(timeout);
}

namespace wait_detail {
// Sleeps while *word == expected, at most `timeout`; wakes early on FUTEX_WAKE or a signal.
void futex_wait(const std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) noexcept;
void futex_wake_all(const std::atomic<uint32_t>* word) noexcept;
// A set of CPUs, as a bitmap of cpu_set_t's 1024 in a layout that shared memory can hold.
struct CpuMask {
  uint64_t bits[16] = {};
  // How many CPUs, at least 1 (an empty set is no CPU count to divide work by).
  int count() const noexcept;
};
// The CPUs the calling thread may run on (its affinity mask, as taskset and cpusets set it); where
// that cannot be read, the first hardware_concurrency CPUs. CPU c counts as CPU c mod 1024: a mask
// has 1024 bits, so two CPUs past 1023 may count as one, never one as two.
CpuMask usable_cpu_mask() noexcept;
// The CPU time that the calling thread's cgroups allow, in whole CPUs (quota / period, rounded
// down, at least 1): the least over its cgroup and the ancestors visible to it, under cgroup v2
// (cpu.max) or v1 (cpu.cfs_quota_us); 0 when none sets a limit or none can be read. A container
// limited to 2 CPUs' time on a 64-CPU host is the common case: ranks that spun there would be
// throttled for the rest of each quota period. Every path read is prefixed with `root` ("" for
// this system; tests pass a tree of their own).
int cgroup_cpu_limit(const std::string& root = "") noexcept;
// How many CPUs the calling thread may count on: its mask's, at most its cgroups' limit; at least 1.
int usable_cpus() noexcept;
// How many of the ranks whose affinities are `masks` can each run on a CPU of its own: the size of
// a largest matching of ranks to the CPUs of their masks (not the size of their union: two ranks
// pinned to one CPU share it however many CPUs a third rank may use), at most the least of
// `limits` (each rank's cgroup_cpu_limit, 0 for none; empty: none). At least 1. A quota is shared
// by every rank in its cgroup, and the ranks of one host's group almost always share one (a
// container); ranks in separate cgroups with quotas of their own count as sharing the least,
// which errs toward yielding, never toward spinning into a throttled quota.
int ranks_with_own_cpu(std::span<const CpuMask> masks, std::span<const int> limits = {}) noexcept;
}  // namespace wait_detail

// How long to spin, then how long to yield, before sleeping. Both are bounded in time, and the
// yielding stops early after one yield that kept this thread off the core for longer than
// slow_yield: somebody else ran a whole time slice, so yielding again would only lose another.
struct WaitPolicy {
  std::chrono::nanoseconds spin{20000};
  std::chrono::nanoseconds yield_for{5000};
  std::chrono::nanoseconds slow_yield{std::chrono::nanoseconds::max()};
};

// How a wait went: the phase it ended in (ready, aborted or timed out), and whether it left the
// yield phase because of a slow yield.
enum class WaitPhase { Spin, Yield, Sleep };
struct WaitTrace {
  WaitPhase ended_in = WaitPhase::Spin;
  bool slow_yield = false;
};

// Makes waiters on `word` re-check their condition. Call after publishing the condition (seq_cst).
// Costs one load when nobody sleeps: the bump and the syscall happen only for registered sleepers,
// which re-check the condition after registering, so no wake-up is lost.
inline void notify(WaitWord& word) noexcept {
  if (word.sleepers.load(std::memory_order_seq_cst) != 0) {
    word.value.fetch_add(1, std::memory_order_seq_cst);
    wait_detail::futex_wake_all(&word.value);
  }
}

// Waits until ready() returns true (Ready), the deadline passes (Timeout), or (*abort & abort_mask)
// is non-zero (Aborted; abort is checked after ready, so a condition that holds always wins).
// ready() must read with seq_cst loads, and whoever makes it true (or sets *abort) must publish with
// a seq_cst store or RMW and then call notify(word): the two seq_cst pairs make a lost wake-up
// impossible (on x86 seq_cst loads are plain loads).
template <class Ready>
WaitResult wait_until(WaitWord& word, Ready&& ready, WaitClock::time_point deadline,
                      const std::atomic<uint32_t>* abort = nullptr, uint32_t abort_mask = ~0u, WaitPolicy policy = {},
                      WaitTrace* trace = nullptr) {
  auto aborted = [&] { return abort != nullptr && (abort->load(std::memory_order_seq_cst) & abort_mask) != 0; };
  WaitTrace trace_sink;
  WaitTrace& how = trace != nullptr ? *trace : trace_sink;
  how = WaitTrace{};
  if (ready()) return WaitResult::Ready;
  if (policy.spin.count() > 0) {
    const auto spin_until = WaitClock::now() + policy.spin;
    for (uint32_t i = 1;; ++i) {
      if (ready()) return WaitResult::Ready;
      if (aborted()) return WaitResult::Aborted;
      cpu_relax();
      if ((i & 7) == 0 && WaitClock::now() >= spin_until) break;
    }
  }
  how.ended_in = WaitPhase::Yield;
  if (policy.yield_for.count() > 0) {
    auto now = WaitClock::now();
    const auto yield_until = now + policy.yield_for;
    do {
      if (ready()) return WaitResult::Ready;
      if (aborted()) return WaitResult::Aborted;
      std::this_thread::yield();
      const auto before = now;
      now = WaitClock::now();
      if (now - before > policy.slow_yield) {
        how.slow_yield = true;
        if (ready()) return WaitResult::Ready;  // (still a slow yield: the caller learns from it)
        break;
      }
    } while (now < yield_until);
  }
  how.ended_in = WaitPhase::Sleep;
  for (;;) {
    // Registration, then the re-check of the condition: both seq_cst, the Dekker half of notify().
    word.sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = word.value.load(std::memory_order_seq_cst);
    WaitResult result;
    bool done = true;
    if (ready()) {
      result = WaitResult::Ready;
    } else if (aborted()) {
      result = WaitResult::Aborted;
    } else {
      const auto now = WaitClock::now();
      if (now >= deadline) {
        result = WaitResult::Timeout;
      } else {
        done = false;
        wait_detail::futex_wait(&word.value, seen, deadline - now);
      }
    }
    word.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (done) return result;
  }
}

// wait_until with budgets that adapt to how the machine behaves, for one waiter (a rank) that
// waits many times for the same peers.
// - Spinning pays when the awaited rank runs on another core (a wake from a futex sleep costs
//   ~25 us on an idle core). A wait that ends while spinning doubles the spin budget; one that
//   gets past it halves it, down to nothing (on a loaded machine the awaited rank is rarely
//   running while we spin; measured round trips grow from ~3 us without spinning to ~110 us with
//   20 us of spin).
// - Yielding pays when ranks outnumber cores: the awaited rank is runnable on OUR core, and a yield
//   lets it run at once (a 4-rank round on 2 cores takes ~2 us instead of ~35 us of futex
//   hand-offs). It does not pay when other processes hold the cores: a yield then hands one of them
//   a whole time slice. So yielding stops at the first slow yield (> kSlowYield off the core), and
//   the next waits skip it; a wait that yields in vain halves the budget; a wait that ends while
//   yielding restores the full budget (500 us when ranks outnumber cores, a token 2 us otherwise).
// - Otherwise the waiter sleeps on the futex.
// Every 64th wait that outlasts its first polls (poll_briefly) probes with a short spin and the full
// yield budget, so both come back when the machine changes. Not thread-safe: one per waiting thread.
class AdaptiveWait {
 public:
  // ranks: how many threads or processes of the group run on this host; cpus: how many of them can
  // each have a CPU of its own (fewer than ranks: they outnumber the CPUs).
  explicit AdaptiveWait(int ranks, int cpus = wait_detail::usable_cpus()) noexcept
      : oversubscribed_(ranks > cpus),
        max_spin_(oversubscribed_ ? std::chrono::nanoseconds{0} : kMaxSpin),
        max_yield_(oversubscribed_ ? kMaxYield : kProbeYield),
        spin_(max_spin_ / 4),
        yield_(max_yield_) {}

  // The first polls of a wait that would spin, before it reads the clock (a read costs ~25 ns,
  // as much as a whole small round between two cores, and a wait that ends here needs no
  // deadline): at most kBriefPolls, and no more than the spin budget pays for (at ~25 ns a
  // pause), so that one within them is a success of the spin phase. Ready or Aborted when the
  // wait ended within them, nullopt when the caller goes on to operator().
  template <class Ready>
  std::optional<WaitResult> poll_briefly(Ready&& ready, const std::atomic<uint32_t>* abort = nullptr,
                                         uint32_t abort_mask = ~0u, bool peer_on_this_cpu = false) {
    if (oversubscribed_ || peer_on_this_cpu) return std::nullopt;
    const int64_t polls = std::min<int64_t>(kBriefPolls, spin_.count() / 25);
    for (int64_t i = 0; i < polls; ++i) {
      if (ready()) {
        spin_ = std::min(spin_ * 2, max_spin_);
        return WaitResult::Ready;
      }
      if (abort != nullptr && (abort->load(std::memory_order_seq_cst) & abort_mask) != 0) return WaitResult::Aborted;
      cpu_relax();
    }
    return std::nullopt;
  }

  // peer_on_this_cpu: the awaited rank was last seen on the CPU this thread runs on (the kernel
  // tends to wake a sleeper on its waker's CPU, and two ranks that wake each other through futexes
  // can stay paired on one CPU). Spinning then only delays it and sleeping costs a wake-up per
  // round, while a yield lets it run at once: such a wait yields, and teaches the budgets nothing.
  template <class Ready>
  WaitResult operator()(WaitWord& word, Ready&& ready, WaitClock::time_point deadline,
                        const std::atomic<uint32_t>* abort = nullptr, uint32_t abort_mask = ~0u,
                        bool peer_on_this_cpu = false) {
    // Already there: says nothing about whether waiting actively pays (counting it as a success
    // would let the last arriver's spin budget grow and then burn a shared core when it is first).
    if (ready()) return WaitResult::Ready;
    if (peer_on_this_cpu && !oversubscribed_) {
      return wait_until(word, ready, deadline, abort, abort_mask,
                        WaitPolicy{std::chrono::nanoseconds{0}, kMaxYield, kSlowYield});
    }
    const bool probe = (++waits_ & 63) == 0;
    const WaitPolicy policy{probe ? std::max(spin_, std::min(kProbeSpin, max_spin_)) : spin_,
                            probe ? max_yield_ : yield_, kSlowYield};
    WaitTrace trace;
    const auto start = WaitClock::now();
    const WaitResult result = wait_until(word, ready, deadline, abort, abort_mask, policy, &trace);
    if (trace.ended_in == WaitPhase::Spin) {
      spin_ = std::min(std::max(policy.spin, spin_ * 2), max_spin_);
    } else if (const auto took = WaitClock::now() - start;
               trace.ended_in == WaitPhase::Sleep && result == WaitResult::Ready && took <= max_spin_) {
      // A sleep that a spin within the budget would have caught: most of it was the futex wake-up
      // itself. Without this, two ranks that both fell asleep once keep waking each other through
      // the kernel (~20 us a round instead of ~0.2 us), since neither ever spins long enough for the
      // other, still asleep, to answer: the run stays slow for good.
      spin_ = std::min(std::max(std::chrono::duration_cast<std::chrono::nanoseconds>(took), spin_ * 2), max_spin_);
    } else if (!probe) {
      spin_ = spin_ / 2 < std::chrono::nanoseconds{100} ? std::chrono::nanoseconds{0} : spin_ / 2;
    }
    if (trace.slow_yield) {
      yield_ = std::chrono::nanoseconds{0};
    } else if (trace.ended_in == WaitPhase::Yield) {
      yield_ = max_yield_;
    } else if (trace.ended_in == WaitPhase::Sleep && !probe) {
      yield_ = yield_ / 2 < std::chrono::nanoseconds{100} ? std::chrono::nanoseconds{0} : yield_ / 2;
    }
    return result;
  }

 private:
  static constexpr std::chrono::nanoseconds kMaxSpin{50000};
  // 1-3 us of polls (a pause takes 10-40 ns): a small round between ranks on their own cores.
  static constexpr int64_t kBriefPolls = 64;
  static constexpr std::chrono::nanoseconds kProbeSpin{2000};
  // With a core per rank a yield is only a slower spin (or a gift to another process), so it is
  // kept to a token; with ranks outnumbering cores it is how the awaited rank gets to run.
  static constexpr std::chrono::nanoseconds kMaxYield{500000};
  static constexpr std::chrono::nanoseconds kProbeYield{2000};
  static constexpr std::chrono::nanoseconds kSlowYield{100000};
  const bool oversubscribed_;
  const std::chrono::nanoseconds max_spin_;
  const std::chrono::nanoseconds max_yield_;
  std::chrono::nanoseconds spin_;
  std::chrono::nanoseconds yield_;
  uint64_t waits_ = 0;

 public:
  // Ranks outnumber their CPUs (the constructor's cpus): waits yield rather than spin, whatever else
  // is known.
  bool oversubscribed() const noexcept { return oversubscribed_; }
  // The current budgets, for tests.
  std::chrono::nanoseconds spin_budget() const noexcept { return spin_; }
  std::chrono::nanoseconds yield_budget() const noexcept { return yield_; }
  std::chrono::nanoseconds max_yield_budget() const noexcept { return max_yield_; }
};

}  // namespace gradsync
