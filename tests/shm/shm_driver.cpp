// SPDX-License-Identifier: Apache-2.0
// Starts the ranks of one shared-memory test case as real processes (fork/exec of shm_worker),
// waits for them with a bound (no test can hang), and checks how each one ended:
//   shm_driver <path to shm_worker> <case> <ranks>
// Most cases expect every rank to exit 0 and the group's segment to be gone afterwards (the last
// member removes it). Special cases: "kill*" (rank 1 must die by SIGKILL, the rest exit 0),
// "stale" (a whole group is SIGKILLed, leaving its segment; a new group of that name reclaims it,
// and a half-written segment is rebuilt), "names" (two groups of different names run at once).
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kBound = std::chrono::seconds(100);

std::string g_worker;
int g_failures = 0;

void failure(const std::string& what) {
  std::fprintf(stderr, "shm_driver: FAIL: %s\n", what.c_str());
  ++g_failures;
}

struct Proc {
  pid_t pid;
  std::string label;
  int expect_signal;  // 0: must exit 0; otherwise must die by this signal
};

Proc spawn(const std::string& kase, int rank, int size, const std::string& group, int expect_signal = 0) {
  const std::string r = std::to_string(rank), s = std::to_string(size);
  const pid_t pid = fork();
  if (pid < 0) {
    std::perror("fork");
    std::exit(2);
  }
  if (pid == 0) {
    execl(g_worker.c_str(), g_worker.c_str(), kase.c_str(), r.c_str(), s.c_str(), group.c_str(), (char*)nullptr);
    std::perror("execl");
    _exit(127);
  }
  return Proc{pid, kase + " rank " + r + "/" + s + " of " + group, expect_signal};
}

// Reaps every process within the bound; kills the rest when it passes.
void wait_all(std::vector<Proc> procs) {
  const auto deadline = Clock::now() + kBound;
  while (!procs.empty()) {
    bool progressed = false;
    for (size_t i = 0; i < procs.size();) {
      int status = 0;
      const pid_t got = waitpid(procs[i].pid, &status, WNOHANG);
      if (got == 0) {
        ++i;
        continue;
      }
      progressed = true;
      const Proc p = procs[i];
      procs.erase(procs.begin() + static_cast<long>(i));
      if (got < 0) {
        failure(p.label + ": waitpid failed");
      } else if (p.expect_signal == 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        failure(p.label + (WIFEXITED(status) ? ": exited with " + std::to_string(WEXITSTATUS(status))
                                             : ": killed by signal " + std::to_string(WTERMSIG(status))));
      } else if (p.expect_signal != 0 && !(WIFSIGNALED(status) && WTERMSIG(status) == p.expect_signal)) {
        failure(p.label + ": expected death by signal " + std::to_string(p.expect_signal));
      }
    }
    if (procs.empty()) break;
    if (Clock::now() >= deadline) {
      for (const auto& p : procs) {
        failure(p.label + ": still running after " + std::to_string(kBound.count()) + " s (hang); killed");
        kill(p.pid, SIGKILL);
        waitpid(p.pid, nullptr, 0);
      }
      break;
    }
    if (!progressed) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

std::vector<Proc> spawn_group(const std::string& kase, int n, const std::string& group) {
  std::vector<Proc> procs;
  for (int r = 0; r < n; ++r) procs.push_back(spawn(kase, r, n, group));
  return procs;
}

bool segment_exists(const std::string& group) {
  struct stat st {};
  return stat(("/dev/shm/gradsync." + group).c_str(), &st) == 0;
}

void expect_no_segment(const std::string& group) {
  if (segment_exists(group)) failure("segment /dev/shm/gradsync." + group + " was left behind");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s <shm_worker> <case> <ranks>\n", argv[0]);
    return 2;
  }
  g_worker = argv[1];
  const std::string kase = argv[2];
  const int n = std::atoi(argv[3]);
  // Unique per run, so concurrent test runs (other build trees) never share a group.
  const std::string group = kase + "-" + std::to_string(getpid());
  std::vector<std::string> groups = {group};

  if (kase == "kill" || kase == "kill_zero_copy") {
    std::vector<Proc> procs = spawn_group(kase, n, group);
    procs[1].expect_signal = SIGKILL;
    wait_all(procs);
    expect_no_segment(group);
  } else if (kase == "stale") {
    std::vector<Proc> procs = spawn_group("stale_die", n, group);
    for (auto& p : procs) p.expect_signal = SIGKILL;
    wait_all(procs);
    if (!segment_exists(group)) failure("the killed group left no segment, so the test proves nothing");
    wait_all(spawn_group("stale_reuse", n, group));
    expect_no_segment(group);
    // A segment that was never finished (a creator killed mid-initialisation): garbage bytes.
    const std::string half = group + "-half";
    groups.push_back(half);
    const int fd = open(("/dev/shm/gradsync." + half).c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
    const char junk[100] = "not a gradsync segment";
    if (fd < 0 || write(fd, junk, sizeof junk) != static_cast<ssize_t>(sizeof junk))
      failure("cannot write junk segment");
    if (fd >= 0) close(fd);
    wait_all(spawn_group("stale_reuse", n, half));
    expect_no_segment(half);
  } else if (kase == "replace") {
    std::vector<Proc> procs = spawn_group("replace", 2, group);
    const auto deadline = Clock::now() + kBound;
    int status = 0;
    while (waitpid(procs[1].pid, &status, WNOHANG) == 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)) failure("rank 1 did not die by SIGKILL");
    wait_all({procs[0], spawn("replacement", 1, 2, group)});
    expect_no_segment(group);
  } else if (kase == "names") {
    // n/2 ranks in each of two groups, concurrently.
    const std::string other = group + "-other";
    groups.push_back(other);
    std::vector<Proc> procs = spawn_group("names", n / 2, group);
    for (auto& p : spawn_group("names", n - n / 2, other)) procs.push_back(p);
    wait_all(procs);
    expect_no_segment(group);
    expect_no_segment(other);
  } else {
    wait_all(spawn_group(kase, n, group));
    expect_no_segment(group);
  }

  // Best-effort cleanup so that a failed run leaves nothing behind either.
  for (const auto& g : groups) {
    unlink(("/dev/shm/gradsync." + g).c_str());
    for (const char* m : {"timed-out", "late-in-reset", "aborted"}) unlink(("/tmp/" + g + "." + m).c_str());
  }
  if (g_failures == 0) std::printf("shm_driver: %s with %d ranks: ok\n", kase.c_str(), n);
  return g_failures == 0 ? 0 : 1;
}
