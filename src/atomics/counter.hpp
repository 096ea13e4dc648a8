// SPDX-License-Identifier: Apache-2.0
#pragma once
// Caffe2's AtomicFetchAdd / AtomicFetchAdd64, without its mutex: one lock-free atomic word.
// Arithmetic happens on the unsigned type of the same width, so overflow wraps modulo 2^bits
// (defined behaviour), and the result is converted back to the signed type (modular since C++20).
#include <atomic>
#include <cstdint>
#include <type_traits>

namespace gradsync::atomics {

template <class Signed>
class Counter {
  static_assert(std::is_signed_v<Signed> && std::is_integral_v<Signed>);
  using Unsigned = std::make_unsigned_t<Signed>;
  static_assert(std::atomic<Unsigned>::is_always_lock_free);

 public:
  struct FetchAdd {
    Signed old_value;
    Signed new_value;
  };

  explicit Counter(Signed initial) noexcept : value_(static_cast<Unsigned>(initial)) {}

  // acq_rel: a counter is often used as a ticket or a "done" count that publishes other writes.
  FetchAdd fetch_add(Signed delta) noexcept {
    const Unsigned d = static_cast<Unsigned>(delta);
    const Unsigned old = value_.fetch_add(d, std::memory_order_acq_rel);
    return {static_cast<Signed>(old), static_cast<Signed>(static_cast<Unsigned>(old + d))};
  }

  Signed load() const noexcept { return static_cast<Signed>(value_.load(std::memory_order_acquire)); }
  void store(Signed value) noexcept { value_.store(static_cast<Unsigned>(value), std::memory_order_release); }

 private:
  std::atomic<Unsigned> value_;
};

using Counter32 = Counter<int32_t>;
using Counter64 = Counter<int64_t>;

}  // namespace gradsync::atomics
