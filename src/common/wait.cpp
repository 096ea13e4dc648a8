// SPDX-License-Identifier: Apache-2.0
#include "common/wait.hpp"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <climits>
#include <thread>
#include <ctime>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace gradsync::wait_detail {

void futex_wait(const std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) noexcept {
  if (timeout.count() <= 0) return;
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  // Shared futex (no FUTEX_PRIVATE_FLAG) so it also works on a word in memory shared between
  // processes. A relative timeout; EAGAIN (value changed), EINTR and ETIMEDOUT all just return.
  syscall(SYS_futex, reinterpret_cast<const uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(const std::atomic<uint32_t>* word) noexcept {
  syscall(SYS_futex, reinterpret_cast<const uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

int CpuMask::count() const noexcept {
  int n = 0;
  for (uint64_t b : bits) n += __builtin_popcountll(b);
  return n > 0 ? n : 1;
}

CpuMask usable_cpu_mask() noexcept {
  static_assert(sizeof(cpu_set_t) * 8 >= 1024, "cpu_set_t holds the 1024 CPUs of a CpuMask");
  CpuMask mask;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) {
    for (int c = 0; c < 1024; ++c) {
      if (CPU_ISSET(c, &set)) mask.bits[c / 64] |= uint64_t{1} << (c % 64);
    }
    return mask;
  }
  const unsigned n = std::min(std::max(std::thread::hardware_concurrency(), 1u), 1024u);
  for (unsigned c = 0; c < n; ++c) mask.bits[c / 64] |= uint64_t{1} << (c % 64);
  return mask;
}

int usable_cpus() noexcept { return usable_cpu_mask().count(); }

namespace {

// Kuhn's augmenting path from rank r: a free CPU of its mask, else one whose holder can move to
// another CPU of its own mask. `seen` marks the CPUs this search has tried to free.
bool place(size_t r, std::span<const CpuMask> masks, std::array<int, 1024>& holder, std::array<char, 1024>& seen) {
  for (const bool free_only : {true, false}) {
    for (size_t w = 0; w < 16; ++w) {
      for (uint64_t b = masks[r].bits[w]; b != 0; b &= b - 1) {
        const size_t c = w * 64 + static_cast<size_t>(__builtin_ctzll(b));
        if (free_only ? holder[c] >= 0 : seen[c] != 0) continue;
        seen[c] = 1;
        if (holder[c] < 0 || place(static_cast<size_t>(holder[c]), masks, holder, seen)) {
          holder[c] = static_cast<int>(r);
          return true;
        }
      }
    }
  }
  return false;
}

}  // namespace

int ranks_with_own_cpu(std::span<const CpuMask> masks) noexcept {
  std::array<int, 1024> holder;
  holder.fill(-1);
  std::array<char, 1024> seen;
  int placed = 0;
  for (size_t r = 0; r < masks.size(); ++r) {
    seen.fill(0);
    if (place(r, masks, holder, seen)) ++placed;
  }
  return std::max(placed, 1);
}

}  // namespace gradsync::wait_detail
