// SPDX-License-Identifier: Apache-2.0
#pragma once
// Whether a peer process is gone: the one test behind every dead-peer check (the shared-memory
// group's members, the MPI group's ranks on this host, the holders of an accumulator's row locks).
// A peer is known by what this process can observe of it:
// - its pid, where it runs on this host in this pid namespace (0: not known so). A pid that no
//   longer exists (ESRCH) is a peer gone; one that exists may be a zombie, or reused.
// - the OFD lock it holds on a byte of a file both map (common/ofd_lock.hpp), where it holds one
//   (fd < 0: none). The kernel drops that lock when the peer exits, however it exits, and never
//   while it lives: a lock nobody holds is a peer gone.
// A peer is never declared gone on doubt.
#include <signal.h>
#include <sys/types.h>

#include <cerrno>

#include "common/ofd_lock.hpp"

namespace gradsync {

struct PeerMark {
  pid_t pid = 0;
  int fd = -1;
  off_t byte = 0;
};

inline bool peer_gone(const PeerMark& peer) noexcept {
  if (peer.pid > 0 && ::kill(peer.pid, 0) != 0 && errno == ESRCH) return true;
  return peer.fd >= 0 && !ofd_held_by_other(peer.fd, peer.byte);
}

// Whether the kernel is tearing process pid down: it was SIGKILLed, is exiting, or is a zombie.
// Such a process may hold its OFD locks a while yet (the kernel unmaps its memory before it
// closes its files, which on a loaded host takes milliseconds), but it runs no code of its own
// again: a lock it holds is about to go. Read from /proc, so false on doubt (no such process
// here, or its entry unreadable): never a reason to take a peer's lock for gone, only to wait for it.
bool process_exiting(pid_t pid) noexcept;

}  // namespace gradsync
