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

StampClock::time_point StampClock::reanchor() noexcept {
#if defined(__x86_64__)
  // The process's first anchor, the baseline of every clock's scale: the older, the finer.
  static const Anchor base = read_anchor();
  const Anchor now = read_anchor();
  if (now.tsc < base.tsc || now.ns < base.ns) {
    // The TSC went back (a CPU not in step with the others, a resume): not a clock to scale.
    tsc_ = false;
    mult_ = 0;
  } else if (now.tsc - base.tsc >= kMinBaselineTicks) {
    const auto mult =
        static_cast<uint64_t>((static_cast<unsigned __int128>(now.ns - base.ns) << 32) / (now.tsc - base.tsc));
    // A scale that moved by more than 0.1% is not drift: the TSC jumped. (One above 16 ns a tick
    // is no TSC at all.)
    if ((mult_ != 0 && (mult > mult_ + (mult_ >> 10) || mult < mult_ - (mult_ >> 10))) || mult >= (uint64_t{16} << 32)) {
      tsc_ = false;
      mult_ = 0;
    } else {
      mult_ = mult;
    }
  }
  tsc0_ = now.tsc;
  ns0_ = now.ns;
  return time_point(WaitClock::duration(now.ns));
#else
  return WaitClock::now();
#endif
}

}  // namespace gradsync
