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

namespace {

#if defined(__x86_64__)
struct Anchor {
  uint64_t tsc;
  int64_t ns;
};

// A (TSC, steady_clock) pair: the TSC halfway between two reads bracketing steady_clock's, the
// tightest of three tries (an interrupt inside the bracket would put the pair off by up to its
// length).
Anchor read_anchor() noexcept {
  Anchor a{};
  uint64_t width = ~uint64_t{0};
  for (int i = 0; i < 3; ++i) {
    const uint64_t before = __rdtsc();
    const int64_t ns = WaitClock::now().time_since_epoch().count();
    const uint64_t w = __rdtsc() - before;
    if (w < width) width = w, a = {before + w / 2, ns};
  }
  return a;
}
#endif

}  // namespace

StampClock::StampClock(bool use_tsc) noexcept : tsc_(use_tsc && tsc_is_kernel_clock()) {
#if defined(__x86_64__)
  if (tsc_) {
    static const Anchor first = read_anchor();
    tsc0_ = first.tsc;
    ns0_ = first.ns;
  }
#endif
}

StampClock::time_point StampClock::reanchor() noexcept {
#if defined(__x86_64__)
  const Anchor now = read_anchor();
  if (now.tsc < tsc0_ || now.ns < ns0_) {
    tsc_ = false;
    mult_ = 0;
    return time_point(WaitClock::duration(now.ns));
  }
  const uint64_t ticks = now.tsc - tsc0_;
  // Too short a baseline for a scale (a new clock early in the process, or one measuring again):
  // the anchor stays, and the baseline grows.
  if (ticks < kMinBaselineTicks) return time_point(WaitClock::duration(now.ns));
  const auto mult = static_cast<uint64_t>((static_cast<unsigned __int128>(now.ns - ns0_) << 32) / ticks);
  if (mult >= (uint64_t{16} << 32)) {
    tsc_ = false;
    mult_ = 0;
  } else if (mult_ != 0 && (mult > mult_ + (mult_ >> 10) || mult < mult_ - (mult_ >> 10))) {
    mult_ = 0;
  } else {
    mult_ = mult;
  }
  tsc0_ = now.tsc;
  ns0_ = now.ns;
  return time_point(WaitClock::duration(now.ns));
#else
  return WaitClock::now();
#endif
}

}  // namespace gradsync
