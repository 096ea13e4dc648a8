// SPDX-License-Identifier: Apache-2.0
#include "atomics/mutex.hpp"

#include <sys/syscall.h>
#include <unistd.h>

#include "common/error.hpp"

namespace gradsync::atomics {

pid_t current_thread_id() noexcept {
  thread_local const pid_t id = static_cast<pid_t>(::syscall(SYS_gettid));
  return id;
}

void Mutex::require_not_owner(const char* operation) const {
  if (locked_ && owner_ == current_thread_id())
    fail(GRADSYNC_E_MISUSE, "{}: the mutex is already held by this thread ({}); it is not recursive", operation,
         owner_);
}

void Mutex::lock() {
  std::unique_lock<std::mutex> state(state_mutex_);
  require_not_owner("lock");
  released_.wait(state, [&] { return !locked_; });
  locked_ = true;
  owner_ = current_thread_id();
}

bool Mutex::try_lock() {
  std::lock_guard<std::mutex> state(state_mutex_);
  require_not_owner("try_lock");
  if (locked_) return false;
  locked_ = true;
  owner_ = current_thread_id();
  return true;
}

bool Mutex::try_lock_for(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> state(state_mutex_);
  require_not_owner("lock with timeout");
  if (!released_.wait_for(state, timeout, [&] { return !locked_; })) return false;
  locked_ = true;
  owner_ = current_thread_id();
  return true;
}

void Mutex::unlock() {
  {
    std::lock_guard<std::mutex> state(state_mutex_);
    const pid_t me = current_thread_id();
    if (!locked_) fail(GRADSYNC_E_NOT_OWNER, "thread {} unlocks a mutex that is not locked", me);
    if (owner_ != me) fail(GRADSYNC_E_NOT_OWNER, "thread {} unlocks a mutex held by thread {}", me, owner_);
    locked_ = false;
    owner_ = 0;
  }
  released_.notify_one();
}

pid_t Mutex::owner() const {
  std::lock_guard<std::mutex> state(state_mutex_);
  return locked_ ? owner_ : 0;
}

}  // namespace gradsync::atomics
