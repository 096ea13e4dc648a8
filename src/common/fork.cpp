// SPDX-License-Identifier: Apache-2.0
#include "common/fork.hpp"

#include <pthread.h>
#include <unistd.h>

#include <atomic>

#include "common/error.hpp"

namespace gradsync {
namespace {

std::atomic<uint64_t> g_generation{0};

// Runs in the child only, which has one thread: nothing races the increment.
void count_fork_in_child() noexcept { g_generation.fetch_add(1, std::memory_order_relaxed); }
[[maybe_unused]] const int g_atfork_registered = pthread_atfork(nullptr, nullptr, count_fork_in_child);

}  // namespace

uint64_t fork_generation() noexcept { return g_generation.load(std::memory_order_relaxed); }

OwnerProcess::OwnerProcess() noexcept : pid_(::getpid()), generation_(fork_generation()) {}

void OwnerProcess::refuse(std::string_view what, std::string_view remedy) const {
  fail(GRADSYNC_E_MISUSE,
       "{} belongs to the parent process (pid {}) that created it; this process (pid {}) is a child "
       "forked from it: {}",
       what, pid_, ::getpid(), remedy);
}

}  // namespace gradsync
