// SPDX-License-Identifier: Apache-2.0
#include "common/stamp_clock.hpp"

#include <cstdio>
#include <cstring>

namespace gradsync {

bool tsc_is_kernel_clock() noexcept {
#if defined(__x86_64__)
  static const bool is = [] {
    std::FILE* f = std::fopen("/sys/devices/system/clocksource/clocksource0/current_clocksource", "r");
    if (f == nullptr) return false;
    char name[32] = {};
    const bool read = std::fgets(name, sizeof name, f) != nullptr;
    std::fclose(f);
    return read && std::strcmp(name, "tsc\n") == 0;
  }();
  return is;
#else
  return false;
#endif
}

StampClock::StampClock(bool use_tsc) noexcept : tsc_(use_tsc && tsc_is_kernel_clock()) {}

StampClock::time_point StampClock::reanchor() noexcept {
#if defined(__x86_64__)
  // The pair: the TSC halfway between two reads bracketing steady_clock's, the tightest of three
  // tries (an interrupt inside the bracket would make the anchor off by up to its length).
  time_point now{};
  uint64_t tsc = 0, width = ~uint64_t{0};
  for (int i = 0; i < 3; ++i) {
    const uint64_t before = __rdtsc();
    const time_point t = WaitClock::now();
    const uint64_t w = __rdtsc() - before;
    if (w < width) width = w, tsc = before + w / 2, now = t;
  }
  const int64_t ns = now.time_since_epoch().count();
  if (base_ns_ == 0 || tsc <= base_tsc_ || ns <= base_ns_) {
    // The first anchor, or the TSC went back (a CPU that is not in step, a resume): start over.
    base_tsc_ = tsc;
    base_ns_ = ns;
    mult_ = 0;
  } else if (tsc - base_tsc_ >= kMinBaselineTicks) {
    const auto mult = static_cast<uint64_t>((static_cast<unsigned __int128>(ns - base_ns_) << 32) / (tsc - base_tsc_));
    // A scale that moved by more than 0.1% is not drift: the TSC jumped (a suspend, a migration
    // to another host). Measure it again from here. (One above 16 ns a tick is no TSC at all.)
    if ((mult_ != 0 && (mult > mult_ + (mult_ >> 10) || mult < mult_ - (mult_ >> 10))) || mult >= (uint64_t{16} << 32)) {
      base_tsc_ = tsc;
      base_ns_ = ns;
      mult_ = 0;
    } else {
      mult_ = mult;
    }
  }
  tsc0_ = tsc;
  ns0_ = ns;
  return now;
#else
  return WaitClock::now();
#endif
}

}  // namespace gradsync
