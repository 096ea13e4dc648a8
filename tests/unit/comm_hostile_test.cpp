// SPDX-License-Identifier: Apache-2.0
// A member gone bad: a process of the group's own user scribbles over the shared-memory control
// area. Whatever it writes, its peers must not read or write outside the group's heaps: they fail
// with an error instead of a signal. The scribbler here is real: it maps the real segment, as a
// buggy or hostile member would, and rewrites the buffer addresses rank 1 publishes. And the words
// a threads-as-ranks group's processes exchange at creation, checked before they are used.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/create.hpp"
#include "comm/engine/control.hpp"
#include "comm/transport/shm/segment.hpp"
#include "comm/transport/threaded/threaded_communicator.hpp"
#include "common/error.hpp"
#include "gradsync/errors.h"

using namespace std::chrono_literals;
namespace comm = gradsync::comm;

TEST_CASE("a member that rewrites published buffer addresses makes its peers fail, never fault", "[comm][shm]") {
  const std::string name = "hostile-" + std::to_string(::getpid());
  constexpr size_t kCount = 1 << 16;  // 256 KiB: the direct (zero-copy) path, not inline
  constexpr int kCalls = 200;
  std::atomic<bool> formed[2] = {false, false}, done{false};
  std::vector<int> status(2, 0);
  std::vector<std::string> message(2);
  std::vector<int> ok_calls(2, 0);
  std::vector<int> wrong(2, 0);

  std::thread scribbler([&] {
    while (!(formed[0] && formed[1])) std::this_thread::sleep_for(1ms);
    std::string path = "/";
    path += comm::shm::segment_name(name);
    const int fd = ::shm_open(path.c_str(), O_RDWR, 0);
    REQUIRE(fd >= 0);
    struct stat st {};
    REQUIRE(::fstat(fd, &st) == 0);
    const comm::ControlLayout layout = comm::control_layout(2, sizeof(comm::shm::Header));
    auto* base = static_cast<char*>(::mmap(nullptr, layout.end, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    REQUIRE(base != MAP_FAILED);
    ::close(fd);
    auto* tables = reinterpret_cast<comm::BufferAddress*>(base + layout.tables);
    const comm::BufferAddress bad[] = {{uint64_t{1} << 60, uint64_t{1} << 60}, {0, 0}, {~uint64_t{0} - 8, 64}};
    for (uint64_t i = 0; !done.load(); ++i) {
      for (uint64_t parity = 0; parity < 2; ++parity) {
        std::atomic_ref<uint64_t>(tables[(1 * 2 + parity) * comm::kMaxTableBuffers].send).store(bad[i % 3].send);
        std::atomic_ref<uint64_t>(tables[(1 * 2 + parity) * comm::kMaxTableBuffers].recv).store(bad[i % 3].recv);
      }
      std::this_thread::yield();
    }
    ::munmap(base, layout.end);
  });

  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      comm::Options o;
      o.transport = comm::Transport::Shm;
      o.name = name;
      o.rank = r;
      o.size = 2;
      o.timeout = 20000ms;
      auto c = comm::create(o);
      auto* buf = static_cast<float*>(c->alloc(kCount * sizeof(float)));
      formed[r] = true;
      try {
        for (int call = 0; call < kCalls; ++call) {
          // Rank 0 comes late, so rank 1's published addresses sit in the segment a while.
          if (r == 0) std::this_thread::sleep_for(1ms);
          for (size_t i = 0; i < kCount; ++i) buf[i] = static_cast<float>(r + 1);
          comm::BufferRef b{buf, buf, kCount};
          c->allreduce(std::span<const comm::BufferRef>(&b, 1), gradsync::DType::F32, gradsync::ReduceOp::Sum);
          for (size_t i = 0; i < kCount; ++i) wrong[r] += buf[i] != 3.0f;
          ++ok_calls[r];
        }
      } catch (const gradsync::Error& e) {
        status[r] = e.status();
        message[r] = e.what();
      }
      c->dealloc(buf);
    });
  }
  for (auto& t : ranks) t.join();
  done = true;
  scribbler.join();

  INFO(message[0] << " / " << message[1]);
  // Every address written is outside the heaps, so no call reads scribbled memory: an OK call
  // is right, and the first call that saw a scribbled address fails on both ranks alike.
  CHECK(wrong[0] == 0);
  CHECK(wrong[1] == 0);
  CHECK(ok_calls[0] == ok_calls[1]);
  REQUIRE(ok_calls[0] < kCalls);  // the scribbler got in at least once
  CHECK(status[0] == GRADSYNC_E_CORRUPT);
  CHECK(status[1] == GRADSYNC_E_CORRUPT);
  CHECK((message[0] + message[1]).find("rank 1 published a buffer") != std::string::npos);
}

// A member of another build: its segment has another format. A joiner of this build must neither
// join it nor rebuild it (truncating it under the live member): it fails, naming both formats.
TEST_CASE("a joiner refuses the segment of a live member of another build, and leaves it whole", "[comm][shm]") {
  const std::string name = "otherbuild-" + std::to_string(::getpid());
  std::string path = "/";
  path += comm::shm::segment_name(name);
  constexpr off_t kBytes = 1 << 16;
  constexpr uint64_t kSentinel = 0x5eed5eed5eed5eedull;
  int fd = ::shm_open(path.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, kBytes) == 0);
  auto* base = static_cast<char*>(::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  REQUIRE(base != MAP_FAILED);
  auto* h = new (base) comm::shm::Header();
  h->format_version = comm::shm::kFormatVersion + 1;
  h->size = 2;
  h->total_bytes = kBytes;
  std::memcpy(base + kBytes - sizeof kSentinel, &kSentinel, sizeof kSentinel);
  h->magic.store(comm::shm::kSegmentMagic, std::memory_order_release);

  // The other build's rank 0: a live process holding its rank lock, as members do.
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t member = ::fork();
  REQUIRE(member >= 0);
  if (member == 0) {
    const int mfd = ::shm_open(path.c_str(), O_RDWR, 0);
    struct flock lock {};
    lock.l_type = F_WRLCK;
    lock.l_whence = SEEK_SET;
    lock.l_start = comm::shm::kRankLockByte;
    lock.l_len = 1;
    const char ok = mfd >= 0 && ::fcntl(mfd, F_OFD_SETLK, &lock) == 0 ? 'y' : 'n';
    if (::write(ready[1], &ok, 1) != 1) ::_exit(1);
    ::pause();
    ::_exit(0);
  }
  char ok = 0;
  REQUIRE(::read(ready[0], &ok, 1) == 1);
  REQUIRE(ok == 'y');

  comm::Options o;
  o.transport = comm::Transport::Shm;
  o.name = name;
  o.rank = 1;
  o.size = 2;
  o.timeout = 5000ms;
  int status = 0;
  std::string message;
  try {
    comm::create(o);
  } catch (const gradsync::Error& e) {
    status = e.status();
    message = e.what();
  }
  ::kill(member, SIGKILL);
  ::waitpid(member, nullptr, 0);
  CHECK(status == GRADSYNC_E_MISMATCH);
  CHECK(message.find("another libgradsync build") != std::string::npos);
  struct stat st {};
  REQUIRE(::fstat(fd, &st) == 0);
  CHECK(st.st_size == kBytes);
  uint64_t tail = 0;
  std::memcpy(&tail, base + kBytes - sizeof tail, sizeof tail);
  CHECK(tail == kSentinel);
  CHECK(h->format_version == comm::shm::kFormatVersion + 1);
  ::munmap(base, kBytes);
  ::close(fd);
  ::close(ready[0]);
  ::close(ready[1]);
  ::shm_unlink(path.c_str());
}

// Threads as ranks: each process reports how many threads it holds, and every process lays out the
// group's ranks from those counts. A peer gone bad could report any number; nothing is laid out
// (allocated, indexed) from one that is not checked.
TEST_CASE("threads as ranks: thread counts reported by peers are checked before the layout", "[comm][threads]") {
  const std::vector<int64_t> good{2, 1, 3};
  CHECK(comm::lay_out_ranks(good, 1, 1) == std::vector<int>{0, 0, 1, 2, 2, 2});
  CHECK(comm::lay_out_ranks(std::vector<int64_t>{256}, 0, 256).size() == 256);
  const auto refused = [](std::vector<int64_t> reported, int process, int threads, const char* says) {
    try {
      (void)comm::lay_out_ranks(reported, process, threads);
      FAIL("accepted");
    } catch (const gradsync::Error& e) {
      CHECK(e.status() == GRADSYNC_E_CORRUPT);
      CHECK_THAT(e.what(), Catch::Contains(says));
    }
  };
  refused({2, 0, 3}, 0, 2, "process 1 of 3 reported 0 threads");
  refused({2, -1, 3}, 0, 2, "reported -1 threads");
  refused({2, 257}, 0, 2, "reported 257 threads");
  refused({2, int64_t{1} << 40}, 0, 2, "reported 1099511627776 threads");
  refused({2, INT64_MIN}, 0, 2, "outside [1, 256]");
  refused({2, 3}, 1, 2, "this process (process 1 of 2) has 2 threads, but 3 arrived");
}

// A grow's joiner lays the group out from the members' layout, which comes from a peer: each entry
// names a member process, and each member process holds as many ranks as it reported threads.
TEST_CASE("threads as ranks: a grown group's layout from the members is checked", "[comm][threads]") {
  // Members: processes 0 and 1 (a shrink's layout, alternating); joiners: processes 2 and 3.
  const std::vector<int64_t> counts{2, 1, 2, 1};
  CHECK(comm::lay_out_grown(counts, std::vector<int64_t>{0, 1, 0}, 2, 2, 2) == std::vector<int>{0, 1, 0, 2, 2, 3});
  const auto refused = [&](std::vector<int64_t> reported, std::vector<int64_t> layout, int member_procs,
                           const char* says) {
    try {
      (void)comm::lay_out_grown(reported, layout, 2, 2, member_procs);
      FAIL("accepted");
    } catch (const gradsync::Error& e) {
      CHECK(e.status() == GRADSYNC_E_CORRUPT);
      CHECK_THAT(e.what(), Catch::Contains(says));
    }
  };
  refused(counts, {0, 2, 0}, 2, "names process 2 of 2");
  refused(counts, {0, -1, 0}, 2, "names process -1 of 2");
  refused(counts, {0, 1, 1}, 2, "gives process 0 1 ranks, but it reported 2 threads");
  refused(counts, {0, 0}, 2, "gives process 1 0 ranks");
  refused(counts, {0, 1, 0}, 4, "4 member processes in a grown group of 4");
  refused(counts, {0, 1, 0}, 0, "0 member processes");
  refused({2, 0, 2, 1}, {0, 0}, 2, "reported 0 threads");
}
