// SPDX-License-Identifier: Apache-2.0
// Real cgroups: this process makes two (an outer one with a CPU quota, and an inner one without)
// under its own cgroup of the cpu controller, and forks children into them. Each child checks the
// limit it reads, the CPUs its ranks may count on, and what a thread group and a shared-memory
// segment of two ranks formed there count. cgroup v1 (cpu.cfs_quota_us) or v2 (cpu.max).
#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gradsync/gradsync.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "../unit/group_pair.hpp"
#include "common/wait.hpp"

namespace {

namespace wd = gradsync::wait_detail;

bool write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  f.flush();
  return static_cast<bool>(f);
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

bool has_word(const std::string& list, const std::string& word) {
  std::istringstream in(list);
  for (std::string w; in >> w;) {
    if (w == word) return true;
  }
  return false;
}

// The directory under which this test makes its cgroups, in the cpu controller, and whether it is
// cgroup v2; "" when there is none this test can write. Under v2 a cgroup's children get cpu.max
// only when it hands them the controller (cgroup.subtree_control), which a cgroup holding
// processes (this one, at least) may not do unless it is the root or does so already.
std::string cpu_cgroup_base(bool& v2) {
  std::string v1_path, v2_path;
  std::ifstream cgroup("/proc/self/cgroup");
  for (std::string line; std::getline(cgroup, line);) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (b == std::string::npos) continue;
    std::string controllers = line.substr(a + 1, b - a - 1);
    std::replace(controllers.begin(), controllers.end(), ',', ' ');
    if (line.compare(0, a, "0") == 0 && b == a + 1) v2_path = line.substr(b + 1);
    if (has_word(controllers, "cpu")) v1_path = line.substr(b + 1);
  }
  std::ifstream mounts("/proc/self/mountinfo");
  for (std::string line; std::getline(mounts, line);) {
    std::istringstream in(line);
    std::vector<std::string> f;
    for (std::string w; in >> w;) f.push_back(w);
    size_t dash = 0;
    while (dash < f.size() && f[dash] != "-") ++dash;
    if (dash + 3 >= f.size() || f[3] != "/") continue;
    std::string options = f[dash + 3];
    std::replace(options.begin(), options.end(), ',', ' ');
    if (f[dash + 1] == "cgroup" && has_word(options, "cpu") && !v1_path.empty()) {
      v2 = false;
      return f[4] + (v1_path == "/" ? "" : v1_path);
    }
    if (f[dash + 1] == "cgroup2" && !v2_path.empty() && v1_path.empty()) {
      v2 = true;
      const std::string own = f[4] + (v2_path == "/" ? "" : v2_path);
      if (!has_word(read_file(own + "/cgroup.controllers"), "cpu")) return "";
      if (!has_word(read_file(own + "/cgroup.subtree_control"), "cpu") &&
          !write_file(own + "/cgroup.subtree_control", "+cpu")) {
        return "";
      }
      return own;
    }
  }
  return "";
}

bool set_quota(const std::string& dir, bool v2, int64_t quota_us) {
  if (v2) return write_file(dir + "/cpu.max", (quota_us < 0 ? "max" : std::to_string(quota_us)) + " 100000");
  return write_file(dir + "/cpu.cfs_period_us", "100000") &&
         write_file(dir + "/cpu.cfs_quota_us", std::to_string(quota_us));
}

// The CPUs of this thread's affinity, in order.
std::vector<int> affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

// The lines the library logs while a pair forms (the thread group's count is in one of them).
std::mutex g_lines_mutex;
std::vector<std::string>* g_lines = nullptr;
void capture(void*, int32_t, const char* message) {
  std::lock_guard lock(g_lines_mutex);
  if (g_lines != nullptr) g_lines->emplace_back(message);
}

// In a child moved into `dir`: the limit read must be `limit`, and ranks count min(limit, CPUs),
// whether they share the affinity or are pinned one per CPU. `setter`: the cgroup whose quota
// the debug log must name, or "" when it need not be checked.
int child_checks(const std::string& dir, int limit, const std::string& setter, const std::string& name) {
  if (!write_file(dir + "/cgroup.procs", std::to_string(getpid()))) {
    std::printf("FAIL could not move into %s\n", dir.c_str());
    return 1;
  }
  int failures = 0;
  auto expect = [&](bool ok, const std::string& what) {
    if (!ok) ++failures;
    std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  };
  const std::vector<int> affinity = affinity_cpus();
  const int cpus = std::max(static_cast<int>(affinity.size()), 1);
  const int usable = limit > 0 && limit < cpus ? limit : cpus;
  expect(wd::cgroup_cpu_limit() == limit, "limit read in " + dir + ": " + std::to_string(wd::cgroup_cpu_limit()) +
                                              ", expected " + std::to_string(limit));
  expect(wd::usable_cpus() == usable,
         "usable CPUs " + std::to_string(wd::usable_cpus()) + ", expected " + std::to_string(usable));
  // Pinned: each rank's thread on a CPU of its own (the first two of the affinity), as launchers
  // that bind ranks to cores do: each mask then holds one CPU, and only the quota says that the
  // two share one CPU's time.
  for (const bool pinned : {false, true}) {
    if (pinned && affinity.size() < 2) continue;
    const std::string group = name + (pinned ? "-pinned" : "");
    std::vector<std::string> lines;
    {
      std::lock_guard lock(g_lines_mutex);
      g_lines = &lines;
    }
    gradsync_set_log_callback(&capture, nullptr, GRADSYNC_LOG_DEBUG);
    const PairCount c = form_pair(group, pinned ? affinity[0] : -1, pinned ? affinity[1] : -1);
    gradsync_set_log_callback(nullptr, nullptr, GRADSYNC_LOG_WARN);
    {
      std::lock_guard lock(g_lines_mutex);
      g_lines = nullptr;
    }
    const int own = usable >= 2 ? 2 : 1;
    const std::string how = pinned ? " (ranks pinned to CPUs of their own)" : "";
    expect(c.error.empty(), "groups formed" + how + (c.error.empty() ? "" : ": " + c.error));
    for (int r = 0; r < 2; ++r) {
      expect(c.segment[r] == own, "segment of 2 counts " + std::to_string(c.segment[r]) + " on rank " +
                                      std::to_string(r) + ", expected " + std::to_string(own) + how);
    }
    const std::string said = "thread group '" + group + "': rank 0 of 2 joined; " + std::to_string(own) +
                             " of the ranks can each have a CPU of its own, so waits " + (own == 2 ? "spin" : "yield");
    bool logged = false;
    for (const auto& l : lines) logged |= l.find(said) != std::string::npos;
    expect(logged, "the thread group logs: " + said);
    if (!setter.empty()) {
      const std::string why =
          "the CPU quota of cgroup " + setter + " allows " + std::to_string(limit) + " CPU(s)' time";
      bool named = false;
      for (const auto& l : lines) named |= l.find(why) != std::string::npos;
      expect(named, "the log names the quota: " + why);
    }
  }
  return failures == 0 ? 0 : 1;
}

int run_child(const std::string& dir, int limit, const std::string& setter, const std::string& name) {
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    const int rc = child_checks(dir, limit, setter, name);
    std::fflush(stdout);
    _exit(rc);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return 1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

}  // namespace

int main() {
  if (geteuid() != 0) {
    std::printf("cgroup tests need root to make cgroups; run as root (CI does)\n");
    return 77;
  }
  // A quota above this process's own cgroups' (a CI container's, say) is capped by theirs.
  const int above = wd::cgroup_cpu_limit();
  bool v2 = false;
  const std::string base = cpu_cgroup_base(v2);
  const std::string outer = base + "/gradsync-quota-" + std::to_string(getpid());
  const std::string inner = outer + "/inner";
  if (base.empty() || mkdir(outer.c_str(), 0755) != 0) {
    std::printf("no cpu controller this test can write (cgroup %s)\n", base.empty() ? "not found" : base.c_str());
    return 77;
  }
  std::printf("cgroup v%d at %s\n", v2 ? 2 : 1, outer.c_str());
  int failures = 0;
  const std::string tag = std::to_string(getpid());
  // inner has no quota of its own (under v2, outer does not even hand it the controller, so that
  // outer may hold processes too).
  if (mkdir(inner.c_str(), 0755) != 0) ++failures;
  // 1.5 CPUs' time: one CPU for ranks to count on, in the cgroup and in one inside it without a
  // limit of its own. 4 CPUs' time: no fewer CPUs than the affinity gives (2 here, or more).
  // The log names outer as the quota's cgroup, unless one above it allows as little or less.
  auto capped = [&](int limit) { return above > 0 ? std::min(limit, above) : limit; };
  auto setter = [&](int limit) { return above > 0 && above <= limit ? std::string() : outer; };
  failures += !set_quota(outer, v2, 150000);
  failures += run_child(outer, capped(1), setter(1), "quota-a-" + tag);
  failures += run_child(inner, capped(1), setter(1), "quota-b-" + tag);
  failures += !set_quota(outer, v2, 400000);
  failures += run_child(outer, capped(4), setter(4), "quota-c-" + tag);
  failures += !set_quota(outer, v2, 50000);
  failures += run_child(inner, capped(1), setter(1), "quota-d-" + tag);
  rmdir(inner.c_str());
  rmdir(outer.c_str());
  std::printf("cpu_quota: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
