// SPDX-License-Identifier: Apache-2.0
#include "common/fork.hpp"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <unordered_set>

#include "common/error.hpp"

namespace gradsync {
namespace {

std::atomic<uint64_t> g_generation{0};

// The descriptors to close in a child. Held across fork() (prepare to parent/child), so that the
// child's copy of the set is whole and its lock free. Never destroyed: a fork may run after
// static destructors.
std::mutex& fds_mutex() {
  static auto* m = new std::mutex();
  return *m;
}
std::unordered_set<int>& fds_to_close() {
  static auto* fds = new std::unordered_set<int>();
  return *fds;
}

void before_fork() noexcept { fds_mutex().lock(); }
void after_fork_in_parent() noexcept { fds_mutex().unlock(); }
// Runs in the child only, which has one thread: nothing races it.
void after_fork_in_child() noexcept {
  g_generation.fetch_add(1, std::memory_order_relaxed);
  for (int fd : fds_to_close()) ::close(fd);
  fds_to_close().clear();
  fds_mutex().unlock();
}
[[maybe_unused]] const int g_atfork_registered = [] {
  fds_mutex();  // made before any fork can take it
  fds_to_close();
  return pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
}();

}  // namespace

uint64_t fork_generation() noexcept { return g_generation.load(std::memory_order_relaxed); }

bool close_in_forked_children(int fd) noexcept {
  try {
    std::lock_guard lock(fds_mutex());
    fds_to_close().insert(fd);
    return true;
  } catch (...) {
    return false;
  }
}

void keep_in_forked_children(int fd) noexcept {
  std::lock_guard lock(fds_mutex());
  fds_to_close().erase(fd);
}

OwnerProcess::OwnerProcess() noexcept : pid_(::getpid()), generation_(fork_generation()) {}

void OwnerProcess::refuse(std::string_view what, std::string_view remedy) const {
  fail(GRADSYNC_E_MISUSE,
       "{} belongs to the parent process (pid {}) that created it; this process (pid {}) is a child "
       "forked from it: {}",
       what, pid_, ::getpid(), remedy);
}

}  // namespace gradsync
