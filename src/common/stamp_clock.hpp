// SPDX-License-Identifier: Apache-2.0
#pragma once
// steady_clock readings at the price of one instruction, for the statistics of every call (a
// small collective takes ~170 ns, and two clock_gettime calls cost ~45 ns of it).
//
// Where the kernel keeps time with the TSC itself (its clocksource is "tsc", which it only is
// when the counter is invariant and synchronised across CPUs), a reading is the TSC scaled to
// steady_clock's nanoseconds from an anchor, a (TSC, steady_clock) pair read together. The anchor
// is renewed once it is kReanchorTicks old, and the scale is the ratio of the two clocks between
// the last two anchors: it follows NTP's slewing of steady_clock (at most 0.05%), and a reading
// stays within some tens of ns of steady_clock, comparable with readings of other threads and
// processes of the host. A new clock starts from the process's first anchor, so it has a scale at
// once. A scale that moved by more than 0.1% is no slewing but a jump of the TSC (a suspend, a
// migration to another host): it is measured again, the readings meanwhile steady_clock's. A TSC
// that went back, or that ticks slower than 1/16 GHz, is not used again. Anywhere else a reading
// is steady_clock::now().
//
// Not thread-safe: used by one call at a time (a communicator's calls are ordered, whichever
// thread makes them).
#include <cstdint>
#include <ratio>
#include <type_traits>

#include "common/wait.hpp"

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace gradsync {

static_assert(std::is_same_v<WaitClock::period, std::nano>, "readings are scaled to nanoseconds");

class StampClock {
 public:
  using time_point = WaitClock::time_point;

  // use_tsc: whether the TSC may be used at all (tests compare both ways); it is used only where
  // tsc_is_kernel_clock().
  explicit StampClock(bool use_tsc = true) noexcept;

  time_point now() noexcept {
#if defined(__x86_64__)
    if (mult_ != 0) {
      const uint64_t since = __rdtsc() - tsc0_;
      if (since < kReanchorTicks)
        return time_point(WaitClock::duration(ns0_ + static_cast<int64_t>((since * mult_) >> 32)));
    }
    if (tsc_) return reanchor();
#endif
    return WaitClock::now();
  }

  // Whether readings come from the TSC (once the first two anchors gave a scale).
  bool scaled() const noexcept { return mult_ != 0; }

 private:
  // ~22 ms at 3 GHz: short enough that a scale off by a few ppm moves a reading by a few tens of
  // ns, long enough that renewing costs nothing (three steady_clock reads per anchor).
  static constexpr uint64_t kReanchorTicks = uint64_t{1} << 26;
  // The shortest baseline a scale is taken from (~1.4 ms at 3 GHz): two anchors' ~10 ns of jitter
  // over it are below 1.5e-5 (over the usual 22 ms, below 1e-6).
  static constexpr uint64_t kMinBaselineTicks = uint64_t{1} << 22;

  time_point reanchor() noexcept;

  bool tsc_ = false;
  uint64_t mult_ = 0;  // ns per tick, 32.32 fixed point; 0 while there is no scale
  uint64_t tsc0_ = 0;  // the anchor: where readings count from, and the next scale's baseline
  int64_t ns0_ = 0;
};

// Whether the kernel's clocksource is the TSC (read once per process).
bool tsc_is_kernel_clock() noexcept;

}  // namespace gradsync
