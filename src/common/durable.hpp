// SPDX-License-Identifier: Apache-2.0
#pragma once
// What the components that write files (tables, checkpoints) share to make a change durable.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "common/error.hpp"

namespace gradsync {

inline std::string errno_text(int err) { return std::strerror(err); }

// Makes the names created, renamed or removed in `dir` durable. A file system that cannot sync a
// directory (EINVAL) has nothing to sync there.
inline void fsync_directory(const std::string& dir) {
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) fail(GRADSYNC_E_IO, "cannot open the directory '{}' to sync it: {}", dir, errno_text(errno));
  const int rc = ::fsync(dfd);
  const int err = errno;
  ::close(dfd);
  if (rc != 0 && err != EINVAL) fail(GRADSYNC_E_IO, "cannot sync the directory '{}': {}", dir, errno_text(err));
}

}  // namespace gradsync
