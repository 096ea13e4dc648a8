// SPDX-License-Identifier: Apache-2.0
#pragma once
// Caffe2's CreateAtomicBool / ConditionalSetAtomicBool / CheckAtomicBool. The flag is sticky:
// conditional_set(false) never clears it (as in Caffe2, where workers raise a shared "stop" flag
// and a later worker with nothing to report must not lower it); only reset() does.
#include <atomic>

namespace gradsync::atomics {

class Flag {
 public:
  // Returns whether the flag is set after the call.
  bool conditional_set(bool condition) noexcept {
    if (condition) {
      value_.store(true, std::memory_order_release);
      return true;
    }
    return value_.load(std::memory_order_acquire);
  }
  bool check() const noexcept { return value_.load(std::memory_order_acquire); }
  void reset() noexcept { value_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> value_{false};
};

}  // namespace gradsync::atomics
