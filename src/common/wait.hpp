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
// in `sleepers` before re-checking the condition and sleeping on `value`.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace gradsync {

// The futex word and its sleeper count: put one per cache line in shared structures.
struct alignas(64) WaitWord {
  std::atomic<uint32_t> value{0};
  std::atomic<uint32_t> sleepers{0};
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free to be shared");

enum class WaitResult { Ready, Timeout, Aborted };

using WaitClock = std::chrono::steady_clock;

namespace wait_detail {
// Sleeps while *word == expected, at most `timeout`; wakes early on FUTEX_WAKE or a signal.
void futex_wait(const std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) noexcept;
void futex_wake_all(const std::atomic<uint32_t>* word) noexcept;
void cpu_relax() noexcept;
}  // namespace wait_detail

// How long to spin and how often to yield before sleeping. The spin is bounded in time, and short:
// a peer on another core publishes within a microsecond or two, while on 2 cores shared by 4-8
// ranks (or by other processes) every spinning microsecond is stolen from the rank being waited
// for. Yielding is kept to a few rounds: under load sched_yield hands the core to whatever else is
// runnable, possibly for a whole time slice, while a futex sleeper is woken first.
struct WaitPolicy {
  std::chrono::nanoseconds spin{20000};
  uint32_t yields = 2;
};

// For waits where the ranks outnumber the cores: nobody we wait for can run while we spin.
inline constexpr WaitPolicy kOversubscribedWait{std::chrono::nanoseconds{1000}, 1};

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
                      const std::atomic<uint32_t>* abort = nullptr, uint32_t abort_mask = ~0u,
                      WaitPolicy policy = {}) {
  auto aborted = [&] { return abort != nullptr && (abort->load(std::memory_order_seq_cst) & abort_mask) != 0; };
  if (ready()) return WaitResult::Ready;
  if (policy.spin.count() > 0) {
    const auto spin_until = WaitClock::now() + policy.spin;
    for (uint32_t i = 1;; ++i) {
      if (ready()) return WaitResult::Ready;
      if (aborted()) return WaitResult::Aborted;
      wait_detail::cpu_relax();
      if ((i & 7) == 0 && WaitClock::now() >= spin_until) break;
    }
  }
  for (uint32_t i = 0; i < policy.yields; ++i) {
    if (ready()) return WaitResult::Ready;
    if (aborted()) return WaitResult::Aborted;
    std::this_thread::yield();
  }
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

}  // namespace gradsync
