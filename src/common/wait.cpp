// SPDX-License-Identifier: Apache-2.0
#include "common/wait.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <climits>
#include <ctime>
#include <fstream>
#include <iterator>
#include <string_view>
#include <thread>
#include <vector>

#include "common/log.hpp"

namespace gradsync::wait_detail {

void futex_wait(const std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) noexcept {
  if (timeout.count() <= 0) return;
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  // Shared futex (no FUTEX_PRIVATE_FLAG) so it also works on a word in memory shared between
  // processes. A relative timeout; EAGAIN (value changed), EINTR and ETIMEDOUT all just return.
  syscall(SYS_futex, reinterpret_cast<const uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(const std::atomic<uint32_t>* word) noexcept {
  syscall(SYS_futex, reinterpret_cast<const uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

int CpuMask::count() const noexcept {
  int n = 0;
  for (uint64_t b : bits) n += __builtin_popcountll(b);
  return n > 0 ? n : 1;
}

namespace {

// The affinity of the calling thread, CPU c as bit c mod 1024; false when it cannot be read.
bool affinity_mask(CpuMask& mask) noexcept {
  // A kernel built for more CPUs than a set holds refuses the call (EINVAL): retry with larger sets.
  for (size_t cpus = 1024; cpus <= (size_t{1} << 20); cpus *= 4) {
    cpu_set_t* set = CPU_ALLOC(cpus);
    if (set == nullptr) return false;
    const size_t bytes = CPU_ALLOC_SIZE(cpus);
    CPU_ZERO_S(bytes, set);
    const bool read = sched_getaffinity(0, bytes, set) == 0;
    const int error = errno;
    if (read) {
      for (size_t c = 0; c < cpus; ++c) {
        if (CPU_ISSET_S(c, bytes, set)) mask.bits[(c % 1024) / 64] |= uint64_t{1} << (c % 64);
      }
    }
    CPU_FREE(set);
    if (read) return std::any_of(std::begin(mask.bits), std::end(mask.bits), [](uint64_t b) { return b != 0; });
    if (error != EINVAL) return false;
  }
  return false;
}

// The first line of a small file (at most 255 bytes of it), without its newline; "" when unreadable.
std::string first_line(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return {};
  char buf[256];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return {};
  const std::string_view text(buf, static_cast<size_t>(n));
  return std::string(text.substr(0, text.find('\n')));
}

// A decimal count that is the whole of s, or -1.
int64_t parse_count(std::string_view s) noexcept {
  int64_t v = -1;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  return ec == std::errc() && end == s.data() + s.size() && v >= 0 ? v : -1;
}

// Whether `word` is one of the comma-separated items of `list`.
bool has_item(std::string_view list, std::string_view word) noexcept {
  for (size_t at = 0; at <= list.size();) {
    const size_t comma = std::min(list.find(',', at), list.size());
    if (list.substr(at, comma - at) == word) return true;
    at = comma + 1;
  }
  return false;
}

// A path field of mountinfo, whose spaces, tabs, newlines and backslashes are octal escapes.
std::string unescape(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && s[i + 1] >= '0' && s[i + 1] <= '3' && s[i + 2] >= '0' && s[i + 2] <= '7' &&
        s[i + 3] >= '0' && s[i + 3] <= '7') {
      out += static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0'));
      i += 3;
    } else {
      out += s[i];
    }
  }
  return out;
}

// The limit one cgroup directory sets, in whole CPUs (at least 1), or 0 when it sets none.
int limit_of(const std::string& dir, bool v2) {
  int64_t quota = -1, period = -1;
  if (v2) {
    // "max 100000", or "<quota> <period>".
    const std::string line = first_line(dir + "/cpu.max");
    const size_t space = line.find(' ');
    if (space == std::string::npos) return 0;
    quota = parse_count(std::string_view(line).substr(0, space));
    period = parse_count(std::string_view(line).substr(space + 1));
  } else {
    // -1 when unlimited, which parse_count reads as no count.
    quota = parse_count(first_line(dir + "/cpu.cfs_quota_us"));
    period = parse_count(first_line(dir + "/cpu.cfs_period_us"));
  }
  if (quota <= 0 || period <= 0) return 0;
  return static_cast<int>(std::clamp<int64_t>(quota / period, 1, 1 << 20));
}

// The least limit of directory `mount_point + path` and its ancestors up to the mount point; *at
// names the directory that sets it.
int least_limit(const std::string& root, const std::string& mount_point, std::string path, bool v2, std::string* at) {
  int least = 0;
  for (;;) {
    const int here = limit_of(root + mount_point + path, v2);
    if (here > 0 && (least == 0 || here < least)) {
      least = here;
      *at = mount_point + path;
    }
    if (path.empty()) return least;
    const size_t slash = path.rfind('/');
    path.resize(slash == std::string::npos ? 0 : slash);
  }
}

}  // namespace

int cgroup_cpu_limit(const std::string& root) noexcept {
  try {
    // Where this thread sits (a thread of a v2 threaded subtree may have a cgroup of its own; a
    // kernel before 3.17 has no thread-self): "0::<path>" in the v2 hierarchy,
    // "<id>:<controllers>:<path>" in v1.
    std::string v1_path, v2_path;
    bool in_v1 = false, in_v2 = false;
    {
      std::ifstream cgroup(root + "/proc/thread-self/cgroup");
      if (!cgroup.is_open()) cgroup.open(root + "/proc/self/cgroup");
      for (std::string line; std::getline(cgroup, line);) {
        const size_t a = line.find(':');
        const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
        if (b == std::string::npos) continue;
        const std::string_view controllers = std::string_view(line).substr(a + 1, b - a - 1);
        if (line.compare(0, a, "0") == 0 && controllers.empty()) {
          v2_path = line.substr(b + 1);
          in_v2 = true;
        } else if (has_item(controllers, "cpu")) {
          v1_path = line.substr(b + 1);
          in_v1 = true;
        }
      }
    }
    // Where each hierarchy is mounted: "<id> <parent> <dev> <root> <mount point> <options>
    // [<optional fields>] - <type> <source> <super options>". A container sees its own cgroup as
    // the mount's root, and the thread's path above starts with it (or is "/" in a cgroup
    // namespace); a path outside the mount's root is not visible here.
    int least = 0;
    std::string at;
    std::ifstream mounts(root + "/proc/self/mountinfo");
    for (std::string line; std::getline(mounts, line);) {
      std::vector<std::string_view> f;
      for (size_t from = 0; from < line.size();) {
        const size_t space = std::min(line.find(' ', from), line.size());
        f.push_back(std::string_view(line).substr(from, space - from));
        from = space + 1;
      }
      // The separator comes after the six fixed fields and any optional ones.
      const auto dash = f.size() > 6 ? std::find(f.begin() + 6, f.end(), "-") : f.end();
      if (dash == f.end() || f.end() - dash < 4) continue;
      const std::string_view type = dash[1], options = dash[3];
      const bool v2 = type == "cgroup2";
      if (!(v2 ? in_v2 : in_v1 && type == "cgroup" && has_item(options, "cpu"))) continue;
      const std::string mount_root = unescape(f[3]), mount_point = unescape(f[4]);
      std::string path = v2 ? v2_path : v1_path;
      if (mount_root != "/") {
        if (path.compare(0, mount_root.size(), mount_root) != 0 ||
            (path.size() > mount_root.size() && path[mount_root.size()] != '/')) {
          continue;
        }
        path.erase(0, mount_root.size());
      }
      while (!path.empty() && path.back() == '/') path.pop_back();
      // A path that climbs (a component ".."): the cgroup lies outside this cgroup namespace's
      // root, where this mount cannot reach it; not followed.
      if ((path + "/").find("/../") != std::string::npos) continue;
      std::string here_at;
      const int here = least_limit(root, mount_point, path, v2, &here_at);
      if (here > 0 && (least == 0 || here < least)) {
        least = here;
        at = here_at;
      }
    }
    // Says why a group counts fewer CPUs than its ranks' affinities hold.
    if (least > 0) GS_LOG_DEBUG("the CPU quota of cgroup {} allows {} CPU(s)' time", at, least);
    return least;
  } catch (...) {
    return 0;  // out of memory: no limit is known
  }
}

CpuMask usable_cpu_mask() noexcept {
  CpuMask mask;
  if (!affinity_mask(mask)) {
    mask = CpuMask{};
    const unsigned n = std::min(std::max(std::thread::hardware_concurrency(), 1u), 1024u);
    for (unsigned c = 0; c < n; ++c) mask.bits[c / 64] |= uint64_t{1} << (c % 64);
  }
  return mask;
}

int usable_cpus() noexcept {
  const int cpus = usable_cpu_mask().count(), limit = cgroup_cpu_limit();
  return limit > 0 ? std::min(cpus, limit) : cpus;
}

namespace {

// Kuhn's augmenting path from rank r: a free CPU of its mask, else one whose holder can move to
// another CPU of its own mask. `seen` marks the CPUs this search has tried to free.
bool place(size_t r, std::span<const CpuMask> masks, std::array<int, 1024>& holder, std::array<char, 1024>& seen) {
  for (const bool free_only : {true, false}) {
    for (size_t w = 0; w < 16; ++w) {
      for (uint64_t b = masks[r].bits[w]; b != 0; b &= b - 1) {
        const size_t c = w * 64 + static_cast<size_t>(__builtin_ctzll(b));
        if (free_only ? holder[c] >= 0 : seen[c] != 0) continue;
        seen[c] = 1;
        if (holder[c] < 0 || place(static_cast<size_t>(holder[c]), masks, holder, seen)) {
          holder[c] = static_cast<int>(r);
          return true;
        }
      }
    }
  }
  return false;
}

}  // namespace

int ranks_with_own_cpu(std::span<const CpuMask> masks, std::span<const int> limits) noexcept {
  std::array<int, 1024> holder;
  holder.fill(-1);
  std::array<char, 1024> seen;
  int placed = 0;
  for (size_t r = 0; r < masks.size(); ++r) {
    seen.fill(0);
    if (place(r, masks, holder, seen)) ++placed;
  }
  for (const int limit : limits) {
    if (limit > 0) placed = std::min(placed, limit);
  }
  return std::max(placed, 1);
}

}  // namespace gradsync::wait_detail
