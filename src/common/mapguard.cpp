// SPDX-License-Identifier: Apache-2.0
#include "common/mapguard.hpp"

#include <signal.h>
#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "common/error.hpp"

namespace gradsync::mapguard {
namespace {

// A fixed table, read by the signal handler without locks: a slot is published by storing its
// length, then its base (release); the handler reads base (acquire), then length.
constexpr int kSlots = 4096;
struct Slot {
  std::atomic<uintptr_t> base{0};
  std::atomic<size_t> bytes{0};
  std::atomic<int> prot{0};
  std::atomic<uint32_t> faulted{0};
  std::atomic<bool> used{false};
};
Slot g_slots[kSlots];
struct sigaction g_previous {};
std::once_flag g_installed;

void chain(int sig, siginfo_t* info, void* context) {
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler == SIG_DFL || g_previous.sa_handler == SIG_IGN) {
    // A fault cannot be ignored: restore the default, and the instruction faults again on return
    // and ends the process with SIGBUS, as it would have without this library.
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(SIGBUS, &dfl, nullptr);
    return;
  }
  g_previous.sa_handler(sig);
}

void on_sigbus(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Slot& s : g_slots) {
    const uintptr_t base = s.base.load(std::memory_order_acquire);
    if (base == 0 || address < base) continue;
    const size_t bytes = s.bytes.load(std::memory_order_relaxed);
    if (address - base >= bytes) continue;
    // The whole mapping, not just the page: the file is gone from under this handle, and every
    // later access must meet memory, not another fault. mmap is a plain system call on Linux.
    // MAP_NORESERVE: a segment reserves far more address space than it uses (sparse heaps), and
    // a private mapping of that size would fail the overcommit check; only touched pages count.
    void* r = ::mmap(reinterpret_cast<void*>(base), bytes, s.prot.load(std::memory_order_relaxed),
                     MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED) break;
    s.faulted.store(1, std::memory_order_release);
    errno = saved_errno;
    return;
  }
  errno = saved_errno;
  chain(sig, info, context);
}

void install() {
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;  // SA_ONSTACK: a thread with an alternate stack keeps it
  sigemptyset(&sa.sa_mask);
  if (sigaction(SIGBUS, &sa, &g_previous) != 0)
    fail(GRADSYNC_E_IO, "cannot install the SIGBUS handler that guards mapped files: {}", std::strerror(errno));
}

}  // namespace

Registration::Registration(void* base, size_t bytes, int prot) {
  std::call_once(g_installed, install);
  for (int i = 0; i < kSlots; ++i) {
    bool expected = false;
    if (!g_slots[i].used.compare_exchange_strong(expected, true, std::memory_order_acq_rel)) continue;
    g_slots[i].faulted.store(0, std::memory_order_relaxed);
    g_slots[i].prot.store(prot, std::memory_order_relaxed);
    g_slots[i].bytes.store(bytes, std::memory_order_relaxed);
    g_slots[i].base.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
    slot_ = i;
    return;
  }
  fail(GRADSYNC_E_NOMEM, "more than {} files and segments are mapped at once in this process", kSlots);
}

Registration& Registration::operator=(Registration&& other) noexcept {
  if (this != &other) {
    reset();
    slot_ = other.slot_;
    other.slot_ = -1;
  }
  return *this;
}

bool Registration::faulted() const noexcept {
  return slot_ >= 0 && g_slots[slot_].faulted.load(std::memory_order_acquire) != 0;
}

void Registration::reset() noexcept {
  if (slot_ < 0) return;
  g_slots[slot_].base.store(0, std::memory_order_release);
  g_slots[slot_].bytes.store(0, std::memory_order_relaxed);
  g_slots[slot_].used.store(false, std::memory_order_release);
  slot_ = -1;
}

}  // namespace gradsync::mapguard
