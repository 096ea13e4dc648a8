// SPDX-License-Identifier: Apache-2.0
// Fuzz target: the shared-memory segment a rank joins. The fuzzer's bytes are the segment that
// already exists under the group's name in /dev/shm (header, rank slots, control block); the
// harness plays its peers by holding their liveness locks, then a rank joins it as the shm
// transport does, and reads what its peers published in the control area. Every size, offset and
// count in those bytes must be checked: the join gives a clear error or a consistent group,
// never a read outside the mapping, a crash or a hang.
//
// Input: byte 0 the joining rank, byte 1 the size it claims (1..4), byte 2 which ranks the
// harness keeps alive (bit r: rank r's lock), byte 3 the file length in 64 KiB units (0: the
// input's length), then the segment image.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "comm/transport/shm/segment.hpp"
#include "common/error.hpp"
#include "common/log.hpp"

namespace shm = gradsync::comm::shm;

namespace {

// A rank joining a segment that is damaged, foreign, held by others or incomplete.
bool expected_failure(int status) {
  return status == GRADSYNC_E_CORRUPT || status == GRADSYNC_E_VERSION_MISMATCH || status == GRADSYNC_E_MISMATCH ||
         status == GRADSYNC_E_TIMEOUT || status == GRADSYNC_E_REMOTE || status == GRADSYNC_E_MISUSE ||
         status == GRADSYNC_E_NO_SPACE;
}

void hold(int fd, off_t byte) {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = 1;
  if (fcntl(fd, F_OFD_SETLK, &fl) != 0) std::abort();
}

// What the round engine reads of a peer: its slot and the addresses it published. A published
// address must resolve inside the mapping or not at all.
void read_peers(const shm::Segment& seg, uint64_t mapped) {
  const auto lo = reinterpret_cast<uintptr_t>(seg.base());
  const auto& control = seg.control();
  for (int r = 0; r < seg.size(); ++r) {
    const gradsync::comm::RankSlot& s = seg.slot(r);
    volatile uint64_t sink = s.arrivals.load() + s.staged.load() + s.reset_request.load();
    (void)sink;
    for (uint64_t parity = 0; parity < 2; ++parity) {
      const gradsync::comm::Descriptor d = s.desc[parity];
      const uint64_t n = std::min<uint64_t>(d.call.count, gradsync::comm::kMaxTableBuffers);
      const gradsync::comm::BufferAddress* table = control.table(r, parity);
      for (uint64_t i = 0; i < n; ++i) {
        const uint64_t bytes = d.call.count * 4;
        for (uint64_t address : {table[i].send, table[i].recv}) {
          const char* p = control.reach(address, bytes);
          if (p == nullptr) continue;
          const auto a = reinterpret_cast<uintptr_t>(p);
          if (a < lo || a + bytes > lo + mapped || a + bytes < a) {
            std::fprintf(stderr, "a published address resolves outside the segment\n");
            std::abort();
          }
        }
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static bool quiet = [] {
    gradsync::log::set_level(6);  // reclaiming a stale segment is logged as a warning
    return true;
  }();
  (void)quiet;
  if (size < 4) return 0;
  const int size_claimed = 1 + (data[1] & 3);
  const int rank = data[0] % size_claimed;
  const unsigned alive = data[2];
  const uint64_t file_bytes = data[3] == 0 ? size - 4 : uint64_t{data[3]} << 16;
  static std::atomic<unsigned> counter{0};
  const std::string group = "fuzz." + std::to_string(getpid()) + "." + std::to_string(counter++);
  const std::string path = "/dev/shm/" + shm::segment_name(group);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) std::abort();
  for (size_t off = 4; off < size;) {
    const ssize_t w = ::pwrite(fd, data + off, size - off, static_cast<off_t>(off - 4));
    if (w <= 0) std::abort();
    off += static_cast<size_t>(w);
  }
  if (::ftruncate(fd, static_cast<off_t>(file_bytes)) != 0) std::abort();
  // The peers: whichever ranks the input says are alive hold their liveness lock, as a live
  // member does (an OFD lock of another open file description conflicts, even in this process).
  for (int r = 0; r < 8; ++r) {
    if ((alive >> r) & 1) hold(fd, shm::kRankLockByte + r);
  }
  try {
    // A deadline just ahead: every wait of the join ends at once, so a waiting state costs one poll.
    auto seg = shm::Segment::join(group, rank, size_claimed, shm::Clock::now() + std::chrono::microseconds(20));
    struct stat st {};
    if (::fstat(fd, &st) != 0) std::abort();
    // Whatever masks and CPU limits the peers' slots held, the group counts 1 to size CPUs.
    if (seg->cpus() < 1 || seg->cpus() > seg->size()) {
      std::fprintf(stderr, "a group of %d counts %d CPUs\n", seg->size(), seg->cpus());
      std::abort();
    }
    read_peers(*seg, static_cast<uint64_t>(st.st_size));
  } catch (const gradsync::Error& e) {
    if (!expected_failure(e.status())) {
      std::fprintf(stderr, "unexpected status %d joining: %s\n", e.status(), e.what());
      std::abort();
    }
  }
  ::unlink(path.c_str());
  ::close(fd);
  return 0;
}
