// SPDX-License-Identifier: Apache-2.0
// The communicator over the thread transport, through the internal C++ API: what only this
// transport or its internals have (the staged weighted mean as a second implementation, joining
// and leaving a group of threads, the messages that name the missing or aborting rank, the
// straggler log). The semantics every transport shares (collectives against the rank-order
// reference, mismatches, bad arguments, abort, timeout and reset) are in the conformance suite
// (tests/conformance), which runs them over threads too. Catch2 assertions run on the main thread
// only: the rank threads record what they saw and the main thread checks it.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"
#include "common/error.hpp"
#include "test_support.hpp"

using gradsync::DType;
using gradsync::ReduceOp;
using gradsync::comm::BufferRef;
using gradsync::comm::Communicator;
using namespace std::chrono_literals;

namespace {

// memcmp of n bytes that accepts the NULL data() of empty vectors (memcmp itself must not get NULL).
bool same_bytes(const void* a, const void* b, size_t n) { return n == 0 || std::memcmp(a, b, n) == 0; }

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

// What one call on one rank ended with: 0 or the status of the gradsync::Error, and its message.
struct Outcome {
  int status = 0;
  std::string message;
};

template <class F>
Outcome attempt(F&& f) {
  try {
    f();
    return {};
  } catch (const gradsync::Error& e) {
    return {e.status(), e.what()};
  } catch (const std::exception& e) {
    return {-1000, e.what()};
  }
}

// Runs body(comm, rank) on `size` threads that form one group; returns each rank's outcome.
std::vector<Outcome> run_group(int size, const std::function<void(Communicator&, int)>& body,
                               std::chrono::milliseconds timeout = 20000ms) {
  const std::string name = unique_name("group");
  std::vector<Outcome> outcomes(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      outcomes[static_cast<size_t>(r)] = attempt([&] {
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

}  // namespace

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
      joins.emplace_back([&, r] { joined[r] = attempt([&] { comms[r] = gradsync::comm::create(options(name, r, n, 200ms)); }); });
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
      waited[r] = attempt([&] { comms[r]->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum); });
    });
  }
  for (auto& t : threads) t.join();
  threads.clear();
  for (int r = 0; r < n; ++r) {
    float v = 1;
    after[r] = attempt([&] { comms[r]->barrier(); });
    (void)v;
  }
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      reset[r] = attempt([&] { comms[r]->reset(); });
      again[r] = attempt([&] {
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
    for (int r = 0; r < n; ++r) joins.emplace_back([&, r] { comms[r] = gradsync::comm::create(options(name, r, n, 20000ms)); });
    for (auto& t : joins) t.join();
  }
  std::vector<Outcome> waited(2), reuse(n), reset(n), again(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::vector<float> v(100000, 1.0f);  // the two-barrier path
      BufferRef b{v.data(), v.data(), v.size()};
      waited[r] = attempt([&] { comms[r]->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum); });
    });
  }
  std::this_thread::sleep_for(50ms);
  comms[2]->abort();  // rank 2's handle, from the main thread, while ranks 0 and 1 wait
  for (auto& t : threads) t.join();
  threads.clear();
  for (int r = 0; r < n; ++r) {
    reuse[r] = attempt([&] {
      double v = 1;
      BufferRef b{&v, &v, 1};
      comms[r]->allreduce(std::span<const BufferRef>(&b, 1), DType::F64, ReduceOp::Sum);
    });
  }
  std::vector<double> result(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      reset[r] = attempt([&] { comms[r]->reset(); });
      again[r] = attempt([&] {
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
    std::thread first([&] { waiting = attempt([&] { gradsync::comm::create(options(name, 0, 2, 5000ms)); }); });
    std::this_thread::sleep_for(20ms);
    breaker = attempt([&] { gradsync::comm::create(options(name, b.rank, b.size, 5000ms)); });
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
  std::thread joiner([&] { formed[0] = attempt([&] { first = gradsync::comm::create(options(name, 0, 2, 5000ms)); }); });
  formed[1] = attempt([&] { second = gradsync::comm::create(options(name, 1, 2, 5000ms)); });
  joiner.join();
  require_all_ok(formed);
  // A formed group refuses a cloned rank (the seed counted it twice) and another size, unharmed.
  Outcome clone = attempt([&] { gradsync::comm::create(options(name, 1, 2, 200ms)); });
  INFO(clone.message);
  REQUIRE(clone.status == GRADSYNC_E_MISUSE);
  Outcome late_size = attempt([&] { gradsync::comm::create(options(name, 1, 3, 200ms)); });
  REQUIRE(late_size.status == GRADSYNC_E_MISMATCH);
  std::vector<Outcome> still(2);
  std::thread other([&] { still[0] = attempt([&] { first->barrier(); }); });
  still[1] = attempt([&] { second->barrier(); });
  other.join();
  require_all_ok(still);

  // Rank 1 leaves while rank 0 waits: rank 0 gets an error, not a hang.
  Outcome left;
  std::thread waiter([&] {
    left = attempt([&] {
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
  Outcome timed_out = attempt([&] { gradsync::comm::create(options(lonely, 0, 2, 200ms)); });
  INFO(timed_out.message);
  REQUIRE(timed_out.status == GRADSYNC_E_TIMEOUT);
  REQUIRE(timed_out.message.find("[1] did not join") != std::string::npos);
  std::vector<Outcome> pair(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] { pair[r] = attempt([&] { auto c = gradsync::comm::create(options(lonely, r, 2, 5000ms)); c->barrier(); }); });
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
  CHECK(lines.contains("call 1 allreduce: rank 0 waiting 5 s for rank(s) 1"));
}
