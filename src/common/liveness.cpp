// SPDX-License-Identifier: Apache-2.0
#include "common/liveness.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace gradsync {
namespace {

constexpr unsigned long kPfExiting = 0x4;  // PF_EXITING (linux/sched.h): the task is in do_exit

// /proc/<pid>/<file> into buf, NUL-terminated (cut at its size); false when it cannot be read.
bool read_proc(pid_t pid, const char* file, char* buf, size_t size) noexcept {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/%s", static_cast<int>(pid), file);
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  size_t have = 0;
  while (have + 1 < size) {
    const ssize_t n = ::read(fd, buf + have, size - 1 - have);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    have += static_cast<size_t>(n);
  }
  ::close(fd);
  buf[have] = '\0';
  return have > 0;
}

// Whether the signal mask on the line `key` of a /proc status file holds SIGKILL.
bool kill_in(const char* status, const char* key) noexcept {
  const char* at = std::strstr(status, key);
  if (at == nullptr) return false;
  const unsigned long long mask = std::strtoull(at + std::strlen(key), nullptr, 16);
  return ((mask >> (SIGKILL - 1)) & 1) != 0;
}

}  // namespace

bool process_exiting(pid_t pid) noexcept {
  if (pid <= 0) return false;
  char buf[4096];
  if (read_proc(pid, "stat", buf, sizeof buf)) {
    // "pid (comm) state ppid pgrp session tty_nr tpgid flags ...": comm may hold spaces and ')'.
    const char* p = std::strrchr(buf, ')');
    char state = 0;
    unsigned long flags = 0;
    if (p != nullptr && std::sscanf(p + 1, " %c %*d %*d %*d %*d %*d %lu", &state, &flags) == 2 &&
        (state == 'Z' || state == 'X' || (flags & kPfExiting) != 0)) {
      return true;
    }
  }
  // Killed, not yet exiting: SIGKILL is pending, for the process (kill) or its thread (tgkill).
  return read_proc(pid, "status", buf, sizeof buf) && (kill_in(buf, "\nShdPnd:") || kill_in(buf, "\nSigPnd:"));
}

}  // namespace gradsync
