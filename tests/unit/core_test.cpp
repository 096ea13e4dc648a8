// SPDX-License-Identifier: Apache-2.0
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "capi/guard.hpp"
#include "common/liveness.hpp"
#include "common/partition.hpp"
#include "common/stamp_clock.hpp"
#include "gradsync/gradsync.h"

using gradsync::partition;

TEST_CASE("partition follows the library rule", "[core]") {
  CHECK(partition(10, 3, 0).start == 0);
  CHECK(partition(10, 3, 0).len == 4);
  CHECK(partition(10, 3, 1).start == 4);
  CHECK(partition(10, 3, 1).len == 3);
  CHECK(partition(10, 3, 2).start == 7);
  CHECK(partition(10, 3, 2).len == 3);
  // n < p: leading parts of one, trailing parts empty, all contiguous.
  for (uint64_t n : {0u, 1u, 2u, 5u, 17u, 1000u}) {
    for (uint64_t p : {1u, 2u, 3u, 7u, 64u}) {
      uint64_t next = 0;
      for (uint64_t i = 0; i < p; ++i) {
        auto part = partition(n, p, i);
        REQUIRE(part.start == next);
        REQUIRE(part.len <= n / p + 1);
        next += part.len;
      }
      REQUIRE(next == n);
    }
  }
}

TEST_CASE("guard turns every exception into a status and message", "[core]") {
  using gradsync::capi::guard;
  CHECK(guard("f", [] { gradsync::fail(GRADSYNC_E_OUT_OF_RANGE, "row {} out of range [0, {})", 1000, 1000); }) ==
        GRADSYNC_E_OUT_OF_RANGE);
  CHECK(std::string(gradsync_last_error_message()) == "f: row 1000 out of range [0, 1000)");
  CHECK(gradsync_last_error_status() == GRADSYNC_E_OUT_OF_RANGE);
  CHECK(guard("g", [] { throw std::bad_alloc(); }) == GRADSYNC_E_NOMEM);
  CHECK(guard("g", [] { throw std::runtime_error("boom"); }) == GRADSYNC_E_INTERNAL);
  CHECK(guard("g", [] { throw 42; }) == GRADSYNC_E_INTERNAL);
  CHECK(guard("g", [] { return GRADSYNC_E_TIMEOUT; }) == GRADSYNC_E_TIMEOUT);
  CHECK(guard("g", [] {}) == GRADSYNC_OK);
}

TEST_CASE("the last error is per thread", "[core]") {
  gradsync_last_error_clear();
  std::thread t([] { gradsync::capi::guard("other", [] { gradsync::fail(GRADSYNC_E_IO, "disk"); }); });
  t.join();
  CHECK(std::string(gradsync_last_error_message()).empty());
  CHECK(gradsync_last_error_status() == GRADSYNC_OK);
}

namespace {
struct Captured {
  std::atomic<int> lines{0};
  std::string last;
};
void capture(void* user, int32_t level, const char* message) {
  auto* c = static_cast<Captured*>(user);
  if (level >= GRADSYNC_LOG_WARN) c->last = message;
  c->lines++;
}
}  // namespace

TEST_CASE("log lines reach the host callback at or above its level", "[core]") {
  Captured captured;
  REQUIRE(gradsync_set_log_callback(capture, &captured, GRADSYNC_LOG_WARN) == GRADSYNC_OK);
  GS_LOG_INFO("not shown");
  GS_LOG_WARN("shown {}", 7);
  CHECK(captured.lines == 1);
  CHECK(captured.last.find("shown 7") != std::string::npos);
  CHECK(gradsync_get_log_level() == GRADSYNC_LOG_WARN);
  CHECK(gradsync_set_log_callback(capture, &captured, 9) == GRADSYNC_E_INVALID_ARG);
  REQUIRE(gradsync_set_log_callback(nullptr, nullptr, GRADSYNC_LOG_WARN) == GRADSYNC_OK);
}

TEST_CASE("StampClock reads steady_clock, from the TSC where the kernel keeps time with it", "[core][clock]") {
  using namespace std::chrono;
  for (const bool use_tsc : {true, false}) {
    CAPTURE(use_tsc, gradsync::tsc_is_kernel_clock());
    gradsync::StampClock clock(use_tsc);
    // Within a few us of steady_clock (its error is tens of ns; a scale off by 0.1% would be off
    // by 20 us before the next anchor), across several anchors and the waits between them.
    const auto tolerance = microseconds(5);
    const auto until = steady_clock::now() + milliseconds(120);
    int checked = 0;
    for (int i = 0; steady_clock::now() < until; ++i) {
      const auto before = steady_clock::now();
      const auto stamp = clock.now();
      const auto after = steady_clock::now();
      REQUIRE(stamp >= before - tolerance);
      REQUIRE(stamp <= after + tolerance);
      ++checked;
      if (i % 1000 == 999) std::this_thread::sleep_for(milliseconds(7));
    }
    CHECK(checked > 1000);
    CHECK(clock.scaled() == (use_tsc && gradsync::tsc_is_kernel_clock()));
  }
}

namespace {

// The state letter of /proc/<pid>/stat, or 0 when it cannot be read.
char proc_state(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(in, line);
  const auto close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() ? 0 : line[close + 2];
}

}  // namespace

TEST_CASE("process_exiting: a leader gone by pthread_exit is not a dying process; a killed one is", "[core]") {
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    auto sleep_forever = [](void*) -> void* {
      for (;;) ::pause();
    };
    pthread_t worker;
    if (pthread_create(&worker, nullptr, sleep_forever, nullptr) != 0) ::_exit(3);
    pthread_exit(nullptr);  // the process lives on in worker, its leader a zombie
  }
  // Bounded, not timed: the leader turns zombie as soon as the child is scheduled.
  for (int i = 0; i < 10000 && proc_state(child) != 'Z'; ++i) ::usleep(1000);
  REQUIRE(proc_state(child) == 'Z');
  CHECK_FALSE(gradsync::process_exiting(child));
  REQUIRE(::kill(child, SIGKILL) == 0);
  int status = 0;
  // Until the reap it is a pending SIGKILL, in exit, or a zombie: dying, as seen at the latest once
  // it is a zombie (a read may fall between a thread's taking SIGKILL and its entering exit).
  bool dying = false;
  for (int i = 0; i < 10000 && !dying; ++i) {
    dying = gradsync::process_exiting(child);
    if (!dying) ::usleep(1000);
  }
  CHECK(dying);
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK_FALSE(gradsync::process_exiting(child));  // gone: "false on doubt"
}
