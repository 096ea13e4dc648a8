// SPDX-License-Identifier: Apache-2.0
#pragma once
// Objects that a fork() copies into a child where they cannot work: their threads are not there,
// and their place in a group (a shared-memory rank, an MPI rank) is still the parent's. Such an
// object records the process that made it and checks it on every use; in any other process it
// refuses (GRADSYNC_E_MISUSE) and its teardown releases only what is the child's own.
//
// The check is a relaxed load and a compare, cheap enough for every collective: a counter that the
// child of every fork() increments (pthread_atfork), rather than getpid(), which is a system call.
// A process made by a raw clone() system call, which runs no fork handlers, is not told apart.
#include <sys/types.h>

#include <cstdint>
#include <string_view>

namespace gradsync {

// Changes in the child of every fork(), never in the process that forked.
uint64_t fork_generation() noexcept;

// fd is closed in the child of every later fork(), before the child runs code of its own, until
// keep_in_forked_children(fd) (before this process closes it): for a descriptor whose holding
// means something to a peer (a liveness link, whose end tells the peer this process is gone; a
// child that kept it open would hide that). False when out of memory (then fd is not registered).
bool close_in_forked_children(int fd) noexcept;
void keep_in_forked_children(int fd) noexcept;

class OwnerProcess {
 public:
  OwnerProcess() noexcept;
  // Whether this is the process that made the object.
  bool here() const noexcept { return generation_ == fork_generation(); }
  pid_t pid() const noexcept { return pid_; }
  // Throws GRADSYNC_E_MISUSE outside the owner: "<what> belongs to the parent process (pid P) ...
  // this process (pid C) is a child forked from it: <remedy>".
  void require_here(std::string_view what, std::string_view remedy) const {
    if (!here()) refuse(what, remedy);
  }
  // require_here's throw, for callers that build `what` only when they must.
  [[noreturn]] void refuse(std::string_view what, std::string_view remedy) const;

 private:
  pid_t pid_;
  uint64_t generation_;
};

}  // namespace gradsync
