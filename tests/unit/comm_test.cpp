// SPDX-License-Identifier: Apache-2.0
// What is particular to the thread transport: its data paths' size thresholds, its weighted mean
// beside the generic staged one, the ranks its timeout and abort messages name, its reset race,
// joining a group of threads, its straggler log, and the CPUs its ranks count on. The semantics
// common to every transport (each collective against the rank-order reference, mismatches,
// arrival order, abort, timeout) are the conformance suite's (tests/conformance). Catch2
// assertions run on the main thread only: the rank threads record what they saw and the main
// thread checks it.
#include <catch2/catch.hpp>

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/create.hpp"
#include "comm/transport/shm/segment.hpp"
#include "common/error.hpp"
#include "common/wait.hpp"
#include "group_pair.hpp"
#include "test_support.hpp"

using gradsync::DType;
using gradsync::Outcome;
using gradsync::ReduceOp;
using gradsync::comm::BufferRef;
using gradsync::comm::Communicator;
using namespace std::chrono_literals;

namespace {

std::string unique_name(const std::string& base) {
  static std::atomic<int> counter{0};
  return base + "#" + std::to_string(counter++);
}

gradsync::comm::Options options(const std::string& name, int rank, int size,
                                std::chrono::milliseconds timeout = 20000ms) {
  gradsync::comm::Options o;
  o.transport = gradsync::comm::Transport::Thread;
  o.name = name;
  o.rank = rank;
  o.size = size;
  o.timeout = timeout;
  return o;
}

// Runs body(comm, rank) on `size` threads that form one group; returns each rank's outcome.
std::vector<Outcome> run_group(int size, const std::function<void(Communicator&, int)>& body,
                               std::chrono::milliseconds timeout = 20000ms) {
  const std::string name = unique_name("group");
  std::vector<Outcome> outcomes(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      outcomes[static_cast<size_t>(r)] = gradsync::capture([&] {
        auto comm = gradsync::comm::create(options(name, r, size, timeout));
        body(*comm, r);
      });
    });
  }
  for (auto& t : threads) t.join();
  return outcomes;
}

void require_all_ok(const std::vector<Outcome>& outcomes) {
  for (size_t r = 0; r < outcomes.size(); ++r) {
    INFO("rank " << r << ": " << outcomes[r].message);
    REQUIRE(outcomes[r].status == 0);
  }
}

template <class T>
std::vector<T> values(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<T> v(count);
  if constexpr (std::is_floating_point_v<T>) {
    std::uniform_real_distribution<T> d(-10, 10);
    for (auto& x : v) x = d(rng);
  } else {
    std::uniform_int_distribution<T> d(-1000000, 1000000);
    for (auto& x : v) x = d(rng);
  }
  return v;
}

template <class T>
void check_allreduce(int n, const std::vector<size_t>& sizes, const std::vector<ReduceOp>& ops) {
  struct Case {
    size_t count;
    ReduceOp op;
    bool in_place;
    std::vector<std::vector<T>> in;   // per rank
    std::vector<std::vector<T>> out;  // per rank
  };
  std::vector<Case> cases;
  uint64_t seed = 1;
  for (size_t count : sizes) {
    for (ReduceOp op : ops) {
      for (bool in_place : {true, false}) {
        Case c{count, op, in_place, {}, {}};
        for (int r = 0; r < n; ++r) {
          c.in.push_back(values<T>(count, seed++));
          c.out.emplace_back(count, T(-1));
        }
        cases.push_back(std::move(c));
      }
    }
  }
  auto outcomes = run_group(n, [&](Communicator& comm, int r) {
    for (auto& c : cases) {
      auto& in = c.in[static_cast<size_t>(r)];
      auto& out = c.out[static_cast<size_t>(r)];
      if (c.in_place) {
        out = in;
        BufferRef b{out.data(), out.data(), c.count};
        comm.allreduce(std::span<const BufferRef>(&b, 1), dtype_of<T>(), c.op);
      } else {
        BufferRef b{in.data(), out.data(), c.count};
        comm.allreduce(std::span<const BufferRef>(&b, 1), dtype_of<T>(), c.op);
      }
    }
  });
  require_all_ok(outcomes);
  for (auto& c : cases) {
    INFO("ranks " << n << " count " << c.count << " op " << gradsync::op_name(c.op) << " in place " << c.in_place);
    std::vector<T> expected(c.count);
    for (size_t i = 0; i < c.count; ++i) expected[i] = reference_reduce(c.op, c.in, i);
    for (int r = 0; r < n; ++r) {
      INFO("rank " << r);
      REQUIRE(same_bytes(c.out[static_cast<size_t>(r)].data(), expected.data(), c.count * sizeof(T)));
    }
  }
}

const std::vector<ReduceOp> kAllOps{ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Min, ReduceOp::Max};

}  // namespace

TEST_CASE("allreduce around the sizes where the data path changes, every op, in place and not", "[comm][allreduce]") {
  // 512 bytes: threads go in place above it when they have a CPU each, through the inline areas
  // below (and always when they outnumber the CPUs: 3 and 4 ranks here may); 16 KiB: the inline
  // areas' end. Slices of a rank may be empty (fewer elements than ranks).
  for (int n : {2, 3, 4}) {
    check_allreduce<float>(n, {1, 3, 127, 128, 129, 1000, 4095, 4096, 4097}, kAllOps);
    check_allreduce<double>(n, {63, 64, 65, 2047, 2048, 2049}, kAllOps);
  }
}

TEST_CASE("weighted mean equals the generic staged implementation bitwise, small and large", "[comm][weighted]") {
  for (int n : {2, 3, 4}) {
    for (size_t count : {size_t{1}, size_t{700}, size_t{100003}}) {
      std::vector<std::vector<float>> in_f, fast_f(n), generic_f(n);
      std::vector<std::vector<double>> in_d, fast_d(n), generic_d(n);
      for (int r = 0; r < n; ++r) {
        in_f.push_back(values<float>(count, 900 + r));
        in_d.push_back(values<double>(count, 950 + r));
      }
      std::vector<uint64_t> totals(n);
      auto outcomes = run_group(n, [&](Communicator& comm, int r) {
        const uint64_t w = static_cast<uint64_t>(3 * r + 1);  // uneven shards
        fast_f[r] = in_f[r];
        comm.weighted_mean(fast_f[r].data(), fast_f[r].data(), count, DType::F32, w, &totals[r]);
        generic_f[r].assign(count, 0);
        comm.Communicator::weighted_mean(in_f[r].data(), generic_f[r].data(), count, DType::F32, w, nullptr);
        fast_d[r].assign(count, 0);
        comm.weighted_mean(in_d[r].data(), fast_d[r].data(), count, DType::F64, w, nullptr);
        generic_d[r] = in_d[r];
        comm.Communicator::weighted_mean(generic_d[r].data(), generic_d[r].data(), count, DType::F64, w, nullptr);
      });
      require_all_ok(outcomes);
      for (int r = 0; r < n; ++r) {
        INFO("ranks " << n << " count " << count << " rank " << r);
        REQUIRE(totals[r] == static_cast<uint64_t>(3 * n * (n - 1) / 2 + n));
        REQUIRE(same_bytes(fast_f[r].data(), generic_f[r].data(), count * sizeof(float)));
        REQUIRE(same_bytes(fast_f[r].data(), fast_f[0].data(), count * sizeof(float)));
        REQUIRE(same_bytes(fast_d[r].data(), generic_d[r].data(), count * sizeof(double)));
      }
    }
  }
}

TEST_CASE("a rank that does not arrive: every waiter times out, later calls fail fast, reset recovers",
          "[comm][timeout]") {
  const std::string name = unique_name("timeout");
  const int n = 3;
  std::vector<std::unique_ptr<Communicator>> comms(n);
  {
    std::vector<std::thread> joins;
    std::vector<Outcome> joined(n);
    for (int r = 0; r < n; ++r) {
      joins.emplace_back([&, r] {
        joined[r] = gradsync::capture([&] { comms[r] = gradsync::comm::create(options(name, r, n, 200ms)); });
      });
    }
    for (auto& t : joins) t.join();
    require_all_ok(joined);
  }
  std::vector<Outcome> waited(2), after(n), reset(n), again(n);
  std::vector<float> result(n, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {  // rank 2 never comes
    threads.emplace_back([&, r] {
      float v = 1;
      BufferRef b{&v, &v, 1};
      waited[r] =
          gradsync::capture([&] { comms[r]->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum); });
    });
  }
  for (auto& t : threads) t.join();
  threads.clear();
  for (int r = 0; r < n; ++r) {
    float v = 1;
    after[r] = gradsync::capture([&] { comms[r]->barrier(); });
    (void)v;
  }
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      reset[r] = gradsync::capture([&] { comms[r]->reset(); });
      again[r] = gradsync::capture([&] {
        float v = static_cast<float>(r);
        BufferRef b{&v, &v, 1};
        comms[r]->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum);
        result[r] = v;
      });
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    INFO(waited[r].message);
    REQUIRE(waited[r].status == GRADSYNC_E_TIMEOUT);
    REQUIRE(waited[r].message.find("[2] did not arrive") != std::string::npos);
  }
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r << ": " << after[r].message << " / " << reset[r].message << " / " << again[r].message);
    REQUIRE(after[r].status == GRADSYNC_E_ABORTED);
    REQUIRE(reset[r].status == 0);
    REQUIRE(again[r].status == 0);
    REQUIRE(result[r] == 3.0f);
  }
}

TEST_CASE("abort from another thread wakes every waiter, and reuse fails fast until reset", "[comm][abort]") {
  const std::string name = unique_name("abort");
  const int n = 3;
  std::vector<std::unique_ptr<Communicator>> comms(n);
  {
    std::vector<std::thread> joins;
    for (int r = 0; r < n; ++r)
      joins.emplace_back([&, r] { comms[r] = gradsync::comm::create(options(name, r, n, 20000ms)); });
    for (auto& t : joins) t.join();
  }
  std::vector<Outcome> waited(2), reuse(n), reset(n), again(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::vector<float> v(100000, 1.0f);  // the two-barrier path
      BufferRef b{v.data(), v.data(), v.size()};
      waited[r] =
          gradsync::capture([&] { comms[r]->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum); });
    });
  }
  std::this_thread::sleep_for(50ms);
  comms[2]->abort();  // rank 2's handle, from the main thread, while ranks 0 and 1 wait
  for (auto& t : threads) t.join();
  threads.clear();
  for (int r = 0; r < n; ++r) {
    reuse[r] = gradsync::capture([&] {
      double v = 1;
      BufferRef b{&v, &v, 1};
      comms[r]->allreduce(std::span<const BufferRef>(&b, 1), DType::F64, ReduceOp::Sum);
    });
  }
  std::vector<double> result(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      reset[r] = gradsync::capture([&] { comms[r]->reset(); });
      again[r] = gradsync::capture([&] {
        double v = r + 1;
        BufferRef b{&v, &v, 1};
        comms[r]->allreduce(std::span<const BufferRef>(&b, 1), DType::F64, ReduceOp::Max);
        result[r] = v;
      });
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    INFO(waited[r].message);
    REQUIRE(waited[r].status == GRADSYNC_E_ABORTED);
    REQUIRE(waited[r].message.find("abort() called on rank 2") != std::string::npos);
  }
  for (int r = 0; r < n; ++r) {
    INFO(reuse[r].message << " / " << reset[r].message << " / " << again[r].message);
    REQUIRE(reuse[r].status == GRADSYNC_E_ABORTED);
    REQUIRE(reset[r].status == 0);
    REQUIRE(again[r].status == 0);
    REQUIRE(result[r] == 3.0);
  }
}

// One call, one outcome: a reset that one rank reports done is done on every rank, even when that
// rank frees its communicator at once; the departure fails the next call instead.
TEST_CASE("a reset done on one rank is done on every rank, even if that rank frees at once", "[comm][abort]") {
  for (int round = 0; round < 200; ++round) {
    const std::string name = unique_name("reset-free");
    std::vector<std::unique_ptr<Communicator>> comms(2);
    {
      std::vector<std::thread> joins;
      for (int r = 0; r < 2; ++r)
        joins.emplace_back([&, r] { comms[r] = gradsync::comm::create(options(name, r, 2)); });
      for (auto& t : joins) t.join();
    }
    comms[1]->abort();
    std::vector<Outcome> reset(2), next(2);
    std::thread freer([&] {
      reset[0] = gradsync::capture([&] { comms[0]->reset(); });
      comms[0].reset();
    });
    reset[1] = gradsync::capture([&] { comms[1]->reset(); });
    freer.join();
    next[1] = gradsync::capture([&] {
      double v = 1;
      BufferRef b{&v, &v, 1};
      comms[1]->allreduce(std::span<const BufferRef>(&b, 1), DType::F64, ReduceOp::Sum);
    });
    INFO("round " << round << ": " << reset[0].message << " / " << reset[1].message);
    REQUIRE(reset[0].status == 0);
    REQUIRE(reset[1].status == 0);
    INFO(next[1].message);
    REQUIRE(next[1].status == GRADSYNC_E_ABORTED);
  }
}

TEST_CASE("joining: duplicate rank, size disagreement, join timeout, and a free while peers wait", "[comm][join]") {
  // A size disagreement, or a rank claimed twice, breaks the forming group whoever arrived first:
  // both sides fail at once (well before the 5 s deadline), naming the cause.
  struct Breaker {
    const char* what;
    int rank, size, status;
    const char* message;
  };
  for (const Breaker& b : {Breaker{"size", 1, 3, GRADSYNC_E_MISMATCH, "size 3"},
                           Breaker{"dup", 0, 2, GRADSYNC_E_MISUSE, "two threads claim one rank"}}) {
    const std::string name = unique_name(b.what);
    Outcome waiting, breaker;
    const auto start = std::chrono::steady_clock::now();
    std::thread first(
        [&] { waiting = gradsync::capture([&] { gradsync::comm::create(options(name, 0, 2, 5000ms)); }); });
    std::this_thread::sleep_for(20ms);
    breaker = gradsync::capture([&] { gradsync::comm::create(options(name, b.rank, b.size, 5000ms)); });
    first.join();
    INFO(b.what << ": " << waiting.message << " / " << breaker.message);
    REQUIRE(waiting.status == b.status);
    REQUIRE(breaker.status == b.status);
    REQUIRE(waiting.message.find(b.message) != std::string::npos);
    REQUIRE(std::chrono::steady_clock::now() - start < 4000ms);
  }

  const std::string name = unique_name("join");
  std::unique_ptr<Communicator> first, second;
  std::vector<Outcome> formed(2);
  std::thread joiner(
      [&] { formed[0] = gradsync::capture([&] { first = gradsync::comm::create(options(name, 0, 2, 5000ms)); }); });
  formed[1] = gradsync::capture([&] { second = gradsync::comm::create(options(name, 1, 2, 5000ms)); });
  joiner.join();
  require_all_ok(formed);
  // A formed group refuses a cloned rank (the seed counted it twice) and another size, unharmed.
  Outcome clone = gradsync::capture([&] { gradsync::comm::create(options(name, 1, 2, 200ms)); });
  INFO(clone.message);
  REQUIRE(clone.status == GRADSYNC_E_MISUSE);
  Outcome late_size = gradsync::capture([&] { gradsync::comm::create(options(name, 1, 3, 200ms)); });
  REQUIRE(late_size.status == GRADSYNC_E_MISMATCH);
  std::vector<Outcome> still(2);
  std::thread other([&] { still[0] = gradsync::capture([&] { first->barrier(); }); });
  still[1] = gradsync::capture([&] { second->barrier(); });
  other.join();
  require_all_ok(still);

  // Rank 1 leaves while rank 0 waits: rank 0 gets an error, not a hang.
  Outcome left;
  std::thread waiter([&] {
    left = gradsync::capture([&] {
      float v = 1;
      BufferRef b{&v, &v, 1};
      first->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum);
    });
  });
  std::this_thread::sleep_for(50ms);
  second.reset();
  waiter.join();
  INFO(left.message);
  REQUIRE(left.status == GRADSYNC_E_ABORTED);
  REQUIRE(left.message.find("rank 1 left") != std::string::npos);
  first.reset();

  // A join that times out leaves nothing behind: the name can form a group right after.
  const std::string lonely = unique_name("lonely");
  Outcome timed_out = gradsync::capture([&] { gradsync::comm::create(options(lonely, 0, 2, 200ms)); });
  INFO(timed_out.message);
  REQUIRE(timed_out.status == GRADSYNC_E_TIMEOUT);
  REQUIRE(timed_out.message.find("[1] did not join") != std::string::npos);
  std::vector<Outcome> pair(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      pair[r] = gradsync::capture([&] {
        auto c = gradsync::comm::create(options(lonely, r, 2, 5000ms));
        c->barrier();
      });
    });
  }
  for (auto& t : ts) t.join();
  require_all_ok(pair);
}

TEST_CASE("a wait that lasts names the ranks it waits for, at warning level", "[comm][log]") {
  LogLines lines(GRADSYNC_LOG_WARN);
  // Rank 1 is late past the first report (5 s), well within the deadline.
  auto outcomes = run_group(2, [&](Communicator& comm, int r) {
    if (r == 1) std::this_thread::sleep_for(5500ms);
    float v = 1;
    BufferRef b{&v, &v, 1};
    comm.allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum);
  });
  require_all_ok(outcomes);
  INFO(lines.first());
  // Call 1 is the group's own, at creation: its topology exchange.
  CHECK(lines.contains("call 2 allreduce: rank 0 waiting 5 s for rank(s) 1"));
}

// Whether ranks outnumber CPUs decides how a group waits and which data paths it takes, and a
// rank pinned to one CPU sees one: the group counts how many ranks can each have a CPU of its own.
TEST_CASE("the ranks that can each have a CPU of their own: a largest matching", "[comm]") {
  namespace wd = gradsync::wait_detail;
  auto mask = [](std::initializer_list<int> cpus) {
    wd::CpuMask m;
    for (int c : cpus) m.bits[c / 64] |= uint64_t{1} << (c % 64);
    return m;
  };
  auto own = [](std::vector<wd::CpuMask> masks) { return wd::ranks_with_own_cpu(masks); };
  CHECK(own({mask({0, 1}), mask({0, 1})}) == 2);
  CHECK(own({mask({0}), mask({0})}) == 1);
  // Rank 0 first takes CPU 0, then moves to CPU 1 so that rank 1 can have CPU 0.
  CHECK(own({mask({0, 1}), mask({0})}) == 2);
  // Two ranks on one CPU share it however many CPUs a third may use: not the union's 4.
  CHECK(own({mask({0}), mask({0}), mask({0, 1, 2, 3})}) == 2);
  CHECK(own({mask({3, 700}), mask({700, 1023}), mask({3})}) == 3);
  CHECK(own({mask({5})}) == 1);
  CHECK(own({}) == 1);
  std::vector<wd::CpuMask> all(64, mask({0, 1, 2, 3, 4, 5, 6, 7}));
  CHECK(own(all) == 8);

  // A cgroup's CPU quota caps the count, also for ranks pinned one per CPU (8 ranks on 8 CPUs in a
  // container allowed 2 CPUs' time count 2): each mask alone says nothing of the quota.
  auto capped = [](std::vector<wd::CpuMask> masks, std::vector<int> limits) {
    return wd::ranks_with_own_cpu(masks, limits);
  };
  std::vector<wd::CpuMask> pinned;
  for (int c = 0; c < 8; ++c) pinned.push_back(mask({c}));
  CHECK(capped(pinned, std::vector<int>(8, 2)) == 2);
  CHECK(capped(pinned, std::vector<int>(8, 0)) == 8);
  CHECK(capped(pinned, {0, 0, 0, 3, 0, 0, 5, 0}) == 3);  // the least limit, 0 counting as none
  CHECK(capped(pinned, std::vector<int>(8, 16)) == 8);   // a quota above the CPUs changes nothing
  CHECK(capped({mask({0}), mask({0})}, {4, 4}) == 1);
  // Limits no kernel gives (a member gone bad wrote them): negative ones count as none.
  CHECK(capped(pinned, {-7, INT_MAX, 0, -1, INT_MIN, 0, 0, 0}) == 8);
  CHECK(capped(pinned, {-7, INT_MAX, 0, 3, INT_MIN, 0, 0, 0}) == 3);
}

// A tree of files laid out as /proc and /sys/fs/cgroup are (real files, a made-up system): the
// limit read from it, as the kernel's cgroup v1 and v2 write their files, and from hostile ones.
TEST_CASE("the CPU limit of the thread's cgroups, v1 and v2, nested, in a container, and garbage", "[comm]") {
  namespace wd = gradsync::wait_detail;
  const TempDir tmp("gradsync-cgroup");
  const std::string root = tmp.dir.string() + "/system";
  auto put = [&](const std::string& path, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(root + path).parent_path());
    std::ofstream(root + path) << text;
  };
  auto fresh = [&] {
    std::filesystem::remove_all(root);
    std::filesystem::create_directories(root);
  };
  const std::string v1_mount = "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct\n";
  const std::string v2_mount = "30 23 0:27 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";

  SECTION("v1, no quota: no limit") {
    fresh();
    put("/proc/self/cgroup", "4:cpu,cpuacct:/\n0::/\n");
    put("/proc/self/mountinfo", v1_mount);
    put("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "-1\n");
    put("/sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n");
    CHECK(wd::cgroup_cpu_limit(root) == 0);
  }
  SECTION("v1 in a container: the mount's root is the container's cgroup") {
    fresh();
    put("/proc/self/cgroup", "12:memory:/x\n4:cpu,cpuacct:/docker/abc\n");
    put("/proc/self/mountinfo",
        "1 0 0:1 / / rw - ext4 /dev/vda rw\n"
        "32 31 0:29 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpuacct,cpu\n");
    put("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "250000\n");
    put("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
    CHECK(wd::cgroup_cpu_limit(root) == 2);
  }
  SECTION("v2: the least limit over the cgroup and its ancestors, at least one CPU") {
    fresh();
    put("/proc/self/cgroup", "0::/a/b/c\n");
    put("/proc/self/mountinfo", v2_mount);
    put("/sys/fs/cgroup/a/cpu.max", "350000 100000\n");
    put("/sys/fs/cgroup/a/b/cpu.max", "150000 100000\n");
    put("/sys/fs/cgroup/a/b/c/cpu.max", "max 100000\n");
    CHECK(wd::cgroup_cpu_limit(root) == 1);
    put("/sys/fs/cgroup/a/b/cpu.max", "max 100000\n");
    CHECK(wd::cgroup_cpu_limit(root) == 3);
    put("/sys/fs/cgroup/a/b/c/cpu.max", "20000 100000\n");  // a fifth of a CPU
    CHECK(wd::cgroup_cpu_limit(root) == 1);
  }
  SECTION("v1 and v2 together (hybrid): the cpu controller's v1 hierarchy holds the limit") {
    fresh();
    put("/proc/self/cgroup", "4:cpu,cpuacct:/user.slice/job\n1:name=systemd:/x\n0::/user.slice/job\n");
    put("/proc/self/mountinfo", "31 23 0:26 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n" + v1_mount);
    // v1: the parent limits, the cgroup itself does not; the unified hierarchy has no cpu files.
    put("/sys/fs/cgroup/cpu/user.slice/cpu.cfs_quota_us", "300000\n");
    put("/sys/fs/cgroup/cpu/user.slice/cpu.cfs_period_us", "100000\n");
    put("/sys/fs/cgroup/cpu/user.slice/job/cpu.cfs_quota_us", "-1\n");
    put("/sys/fs/cgroup/cpu/user.slice/job/cpu.cfs_period_us", "100000\n");
    put("/sys/fs/cgroup/unified/user.slice/job/cgroup.procs", "1\n");
    CHECK(wd::cgroup_cpu_limit(root) == 3);
  }
  SECTION("this thread's cgroup (a v2 threaded subtree) before the process's") {
    fresh();
    put("/proc/self/cgroup", "0::/app\n");
    put("/proc/thread-self/cgroup", "0::/app/worker\n");
    put("/proc/self/mountinfo", v2_mount);
    put("/sys/fs/cgroup/app/cpu.max", "max 100000\n");
    put("/sys/fs/cgroup/app/worker/cpu.max", "100000 100000\n");
    CHECK(wd::cgroup_cpu_limit(root) == 1);
  }
  SECTION("a mount point with a space, escaped as the kernel writes it") {
    fresh();
    put("/proc/self/cgroup", "0::/job\n");
    put("/proc/self/mountinfo", "30 23 0:27 / /sys/fs/my\\040cgroup rw - cgroup2 cgroup2 rw\n");
    put("/sys/fs/my cgroup/job/cpu.max", "800000 100000\n");
    CHECK(wd::cgroup_cpu_limit(root) == 8);
  }
  SECTION("garbage, missing files and paths outside the mount: no limit, no crash") {
    fresh();
    CHECK(wd::cgroup_cpu_limit(root) == 0);  // nothing to read at all
    put("/proc/self/cgroup", "garbage\n::\n0::/a\n4:cpu:/other/x\n");
    put("/proc/self/mountinfo", "-\n1 2 - \n\n30 23 0:27 / /sys/fs/cgroup rw - cgroup2\n" + v2_mount +
                                    "32 31 0:29 /docker/abc /sys/fs/cgroup/cpu ro - cgroup cgroup rw,cpu\n");
    for (const std::string bad :
         {"banana", "100000", "-5 100000", "100000 0", "99999999999999999999999 1", "100000 100000 extra", ""}) {
      put("/sys/fs/cgroup/a/cpu.max", bad);
      CHECK(wd::cgroup_cpu_limit(root) == 0);
    }
    // /other/x is outside the v1 mount's root /docker/abc: its files are not this process's.
    put("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "100000");
    put("/sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000");
    CHECK(wd::cgroup_cpu_limit(root) == 0);
    // A directory in place of the file.
    put("/proc/self/cgroup", "0::/b\n");
    std::filesystem::create_directories(root + "/sys/fs/cgroup/b/cpu.max");
    CHECK(wd::cgroup_cpu_limit(root) == 0);
    // A path that climbs out of the mount is not followed; a name that merely starts with ".." is.
    put("/sys/fs/cgroup/cpu.max", "200000 100000\n");
    put("/proc/self/cgroup", "0::/b/../..\n");
    CHECK(wd::cgroup_cpu_limit(root) == 0);
    put("/proc/self/cgroup", "0::/..b\n");
    put("/sys/fs/cgroup/..b/cpu.max", "max 100000\n");
    CHECK(wd::cgroup_cpu_limit(root) == 2);
  }
}

// The shm segment's count is read directly; a thread group's, from the line its ranks log.
TEST_CASE("a group counts the ranks that can each have a CPU of their own", "[comm][shm][thread]") {
  namespace wd = gradsync::wait_detail;
  const wd::CpuMask mask = wd::usable_cpu_mask();
  std::vector<int> cpus;
  for (int c = 0; c < 1024; ++c) {
    if ((mask.bits[c / 64] >> (c % 64)) & 1) cpus.push_back(c);
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
  CHECK(static_cast<int>(cpus.size()) == CPU_COUNT(&set));
  const int limit = wd::cgroup_cpu_limit();
  CHECK(wd::usable_cpus() == (limit > 0 ? std::min(limit, CPU_COUNT(&set)) : CPU_COUNT(&set)));
  REQUIRE(!cpus.empty());

  // Two ranks, each a thread pinned to one CPU (new threads: the test's own keeps its affinity).
  // On distinct CPUs they count two (unless this process's cgroups allow only one CPU's time), on
  // one CPU one.
  std::vector<bool> cases{false};
  if (cpus.size() >= 2) cases.push_back(true);
  for (const bool distinct : cases) {
    const std::string name = "cpus-" + std::to_string(::getpid()) + (distinct ? "-distinct" : "-shared");
    LogLines lines(GRADSYNC_LOG_DEBUG);
    const PairCount got = form_pair(name, cpus[0], cpus[distinct ? 1 : 0]);
    const int expected = distinct && limit != 1 ? 2 : 1;
    INFO(got.error);
    CHECK(got.segment[0] == expected);
    CHECK(got.segment[1] == expected);
    CHECK(got.error.empty());
    const std::string said = expected == 2 ? "2 of the ranks can each have a CPU of its own, so waits spin"
                                           : "1 of the ranks can each have a CPU of its own, so waits yield";
    CHECK(lines.contains("thread group '" + name + "': rank 0 of 2 joined; " + said));
    CHECK(lines.contains("thread group '" + name + "': rank 1 of 2 joined; " + said));
  }
}
