// SPDX-License-Identifier: Apache-2.0
#pragma once
// Open-file-description locks on single bytes of a file: the liveness signal shared by processes
// that map one file. The kernel drops such a lock when the last descriptor of its open file
// description closes, which happens when the holder exits however it exits (SIGKILL included, and
// before it lingers as a zombie), and never while it lives (stopped or not): unlike a pid, it
// cannot be mistaken for another process, whatever the pid namespace or reuse.
#include <sys/types.h>

namespace gradsync {

// Takes (F_WRLCK, F_RDLCK) or drops (F_UNLCK) the lock on byte `byte`; false when another open
// file description holds it. Error(GRADSYNC_E_IO) on any other failure.
bool ofd_lock(int fd, off_t byte, short type);

// Whether another open file description holds a lock on `byte` (true when it cannot tell: a
// holder is never declared gone on doubt).
bool ofd_held_by_other(int fd, off_t byte) noexcept;

}  // namespace gradsync
