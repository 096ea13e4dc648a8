// SPDX-License-Identifier: Apache-2.0
#include "common/liveness.hpp"

#include <dirent.h>
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

// Whether thread tid of process pid is being torn down: 1 when it is a zombie, in do_exit, or has
// SIGKILL pending (for itself or its process), 0 when it runs on, -1 when it cannot be read.
int task_dying(pid_t pid, pid_t tid) noexcept {
  char file[64];
  char buf[4096];
  std::snprintf(file, sizeof file, "task/%d/stat", static_cast<int>(tid));
  if (!read_proc(pid, file, buf, sizeof buf)) return -1;
  // "tid (comm) state ppid pgrp session tty_nr tpgid flags ...": comm may hold spaces and ')'.
  const char* p = std::strrchr(buf, ')');
  char state = 0;
  unsigned long flags = 0;
  if (p == nullptr || std::sscanf(p + 1, " %c %*d %*d %*d %*d %*d %lu", &state, &flags) != 2) return -1;
  if (state == 'Z' || state == 'X' || (flags & kPfExiting) != 0) return 1;
  std::snprintf(file, sizeof file, "task/%d/status", static_cast<int>(tid));
  if (!read_proc(pid, file, buf, sizeof buf)) return -1;
  return kill_in(buf, "\nShdPnd:") || kill_in(buf, "\nSigPnd:") ? 1 : 0;
}

}  // namespace

bool process_exiting(pid_t pid) noexcept {
  if (pid <= 0) return false;
  // Judged thread by thread: a leader that called pthread_exit is a zombie while its other
  // threads run on, and those still hold the process's locks as any live process does.
  char dir_path[48];
  std::snprintf(dir_path, sizeof dir_path, "/proc/%d/task", static_cast<int>(pid));
  DIR* dir = ::opendir(dir_path);
  if (dir == nullptr) return false;
  int dying = 0;
  bool live = false;
  while (const dirent* e = ::readdir(dir)) {
    char* end = nullptr;
    const long tid = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0') continue;
    const int verdict = task_dying(pid, static_cast<pid_t>(tid));
    if (verdict == 0) {
      live = true;
      break;
    }
    if (verdict > 0) ++dying;  // a thread gone between readdir and read counts for nothing
  }
  ::closedir(dir);
  return !live && dying > 0;
}

}  // namespace gradsync
