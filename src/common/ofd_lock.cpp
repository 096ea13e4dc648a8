// SPDX-License-Identifier: Apache-2.0
#include "common/ofd_lock.hpp"

#include <fcntl.h>

#include <cerrno>
#include <cstring>

#include "common/error.hpp"

namespace gradsync {

bool ofd_lock(int fd, off_t byte, short type) {
  struct flock fl {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = 1;
  if (fcntl(fd, F_OFD_SETLK, &fl) == 0) return true;
  if (errno == EAGAIN || errno == EACCES) return false;
  fail(GRADSYNC_E_IO, "fcntl(F_OFD_SETLK) failed: {}", std::strerror(errno));
}

bool ofd_held_by_other(int fd, off_t byte) noexcept {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = 1;
  if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return true;
  return fl.l_type != F_UNLCK;
}

}  // namespace gradsync
