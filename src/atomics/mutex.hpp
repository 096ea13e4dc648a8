// SPDX-License-Identifier: Apache-2.0
#pragma once
// Caffe2's CreateMutex, with what it lacked: try_lock, a bounded wait, and ownership. The lock
// state (locked, owner thread) lives under a short internal std::mutex and waiters sleep on a
// condition variable, rather than holding a std::mutex across calls, because:
//  - unlock by a thread that does not hold the lock must be an error (std::mutex makes it UB);
//  - relocking from the owner thread must be an error, not a deadlock;
//  - freeing a locked mutex must be defined (destroying a locked std::mutex is UB).
#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace gradsync::atomics {

// The kernel's id of the calling thread (what Python's threading.get_native_id() returns), so
// messages name threads the way a user can recognise them.
pid_t current_thread_id() noexcept;

class Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  // Throws MISUSE when the calling thread already holds it (it would wait for itself forever).
  void lock();
  // true when acquired; false when another thread holds it. MISUSE when the caller holds it.
  bool try_lock();
  // true when acquired within timeout; false on timeout. MISUSE when the caller holds it.
  bool try_lock_for(std::chrono::milliseconds timeout);
  // Throws NOT_OWNER when the mutex is unlocked or held by another thread.
  void unlock();

  // 0 when unlocked.
  pid_t owner() const;

 private:
  void require_not_owner(const char* operation) const;  // needs state_mutex_ held

  mutable std::mutex state_mutex_;
  std::condition_variable released_;
  bool locked_ = false;
  pid_t owner_ = 0;
};

}  // namespace gradsync::atomics
