// SPDX-License-Identifier: Apache-2.0
#include "atomics/atomic_add.hpp"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>

#include "common/cpu_relax.hpp"

namespace gradsync::atomics {
namespace {

// 4096 locks of 4 bytes (16 KiB, stays in L1/L2). Blocks are spread over the table by a
// multiplicative hash so that two threads sweeping neighbouring blocks rarely share a lock's
// cache line; a collision only costs waiting, never correctness.
constexpr unsigned kLockBits = 12;
std::atomic<uint32_t> g_stripe_locks[size_t{1} << kLockBits];

inline std::atomic<uint32_t>& stripe_lock(uintptr_t block) noexcept {
  return g_stripe_locks[(static_cast<uint64_t>(block) * 0x9E3779B97F4A7C15ull) >> (64 - kLockBits)];
}

inline void acquire(std::atomic<uint32_t>& lock) noexcept {
  if (lock.exchange(1, std::memory_order_acquire) == 0) return;
  // A holder keeps a lock for one block's worth of adds (tens of ns), but may be preempted
  // (more Python worker threads than cores): yield after a short spin instead of burning its slice.
  for (unsigned spins = 0;; ++spins) {
    while (lock.load(std::memory_order_relaxed) != 0) {
      if (++spins < 128) {
        gradsync::cpu_relax();
      } else {
        std::this_thread::yield();
      }
    }
    if (lock.exchange(1, std::memory_order_acquire) == 0) return;
  }
}

inline void release(std::atomic<uint32_t>& lock) noexcept { lock.store(0, std::memory_order_release); }

// A fork() while another thread holds a stripe lock would leave that lock held forever in the
// child (its holder does not exist there), and the child's next add on a block hashing to it
// would spin for ever. The forking thread itself is never inside an add, so in the child every
// lock is free by construction: release them all.
void release_all_in_child() noexcept {
  for (auto& lock : g_stripe_locks) lock.store(0, std::memory_order_relaxed);
}
[[maybe_unused]] const int g_atfork_registered = pthread_atfork(nullptr, nullptr, release_all_in_child);

template <class T>
inline void plain_add(T* __restrict dst, const T* __restrict src, size_t n) noexcept {
  for (size_t i = 0; i < n; ++i) dst[i] += src[i];
}

}  // namespace

template <class T>
void add_cas(T* dst, const T* src, size_t n) noexcept {
  for (size_t i = 0; i < n; ++i) {
    T expected;
    __atomic_load(dst + i, &expected, __ATOMIC_RELAXED);
    T desired = expected + src[i];
    while (!__atomic_compare_exchange(dst + i, &expected, &desired, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
      desired = expected + src[i];
  }
}

template <class T>
void add_atomic_ref(T* dst, const T* src, size_t n) noexcept {
  for (size_t i = 0; i < n; ++i) std::atomic_ref<T>(dst[i]).fetch_add(src[i]);
}

// The body is inlined into clones compiled for AVX2 and for baseline x86-64, one picked at load
// time (an ifunc): cache-resident arrays get 256-bit adds without -march flags on the library.
namespace {

template <class T>
[[gnu::always_inline]] inline void striped_body(T* dst, const T* src, size_t n) noexcept {
  uintptr_t address = reinterpret_cast<uintptr_t>(dst);
  const uintptr_t end = address + n * sizeof(T);
  while (address < end) {
    const uintptr_t block = address / kStripeBytes;
    const uintptr_t block_end = std::min<uintptr_t>((block + 1) * kStripeBytes, end);
    const size_t count = (block_end - address) / sizeof(T);
    auto& lock = stripe_lock(block);
    acquire(lock);
    plain_add(dst, src, count);
    release(lock);
    dst += count;
    src += count;
    address = block_end;
  }
}

#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
#define GRADSYNC_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define GRADSYNC_CLONES
#endif
GRADSYNC_CLONES void striped_f32(float* dst, const float* src, size_t n) noexcept { striped_body(dst, src, n); }
GRADSYNC_CLONES void striped_f64(double* dst, const double* src, size_t n) noexcept { striped_body(dst, src, n); }

}  // namespace

template <>
void add_striped<float>(float* dst, const float* src, size_t n) noexcept {
  striped_f32(dst, src, n);
}
template <>
void add_striped<double>(double* dst, const double* src, size_t n) noexcept {
  striped_f64(dst, src, n);
}

template void add_cas<float>(float*, const float*, size_t) noexcept;
template void add_cas<double>(double*, const double*, size_t) noexcept;
template void add_atomic_ref<float>(float*, const float*, size_t) noexcept;
template void add_atomic_ref<double>(double*, const double*, size_t) noexcept;

}  // namespace gradsync::atomics
