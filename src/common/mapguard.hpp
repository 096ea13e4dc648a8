// SPDX-License-Identifier: Apache-2.0
#pragma once
// Shared mappings of files that another process can shrink (a table or gradient file, the shm
// transport's segment). Touching a page past the end of a truncated file raises SIGBUS, which
// would kill the whole process; no lock stops a same-user process from truncating (flock and OFD
// locks are advisory, leases cannot be taken on a file open for writing, seals exist only for
// memfds). So, as the X server does for client shared memory (os/busfault.c), a SIGBUS whose
// address lies in a registered mapping replaces that whole mapping with anonymous zero pages and
// returns: the faulting instruction runs again on memory that exists, and the owner of the
// mapping learns at its next check (faulted()) that it no longer reads or writes the file, and
// fails the call with GRADSYNC_E_IO. Nothing is unwound (no siglongjmp through C++ frames or held
// locks), so every access is covered, atomics and lock words included.
//
// Any other SIGBUS goes to the disposition that was there before (default: the process dies as
// it would have). A handler installed after ours, without chaining, takes SIGBUS away from this.
#include <cstddef>
#include <cstdint>

namespace gradsync::mapguard {

class Registration {
 public:
  Registration() = default;
  // Registers [base, base + bytes); prot is the mapping's protection, kept by the replacement.
  // Throws gradsync::Error (E_NOMEM) when the fixed registry is full.
  Registration(void* base, size_t bytes, int prot);
  ~Registration() { reset(); }
  Registration(Registration&& other) noexcept : slot_(other.slot_) { other.slot_ = -1; }
  Registration& operator=(Registration&& other) noexcept;
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

  // True once a SIGBUS hit the mapping: it is anonymous memory now, no longer the file's.
  bool faulted() const noexcept;
  // Forgets the mapping; call before it is unmapped.
  void reset() noexcept;

 private:
  int slot_ = -1;
};

}  // namespace gradsync::mapguard
