// SPDX-License-Identifier: Apache-2.0
// The rank-order reduction kernels and the futex wait, below every shared-address-space transport.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "../half_reference.hpp"
#include "comm/reduce.hpp"
#include "common/error.hpp"
#include "common/wait.hpp"
#include "test_support.hpp"

using gradsync::DType;
using gradsync::ReduceOp;
namespace comm = gradsync::comm;

namespace {

template <class T>
std::vector<T> random_values(size_t count, std::mt19937_64& rng) {
  std::vector<T> v(count);
  if constexpr (std::is_floating_point_v<T>) {
    std::uniform_real_distribution<T> d(-100, 100);
    for (auto& x : v) x = d(rng);
  } else {
    // Full range, so that sums wrap and the wrap rule is exercised.
    std::uniform_int_distribution<T> d(std::numeric_limits<T>::min(), std::numeric_limits<T>::max());
    for (auto& x : v) x = d(rng);
  }
  return v;
}

template <class T>
void check_kernels(DType dtype) {
  std::mt19937_64 rng(42);
  for (size_t n : {1, 2, 3, 4, 5, 7, 8, 9, 13}) {
    for (size_t count : {0, 1, 3, 17, 1000, 5000}) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Min, ReduceOp::Max}) {
        INFO("n " << n << " count " << count << " op " << gradsync::op_name(op));
        std::vector<std::vector<T>> srcs;
        for (size_t k = 0; k < n; ++k) srcs.push_back(random_values<T>(count, rng));
        std::vector<const void*> ptrs;
        for (auto& s : srcs) ptrs.push_back(s.data());
        std::vector<T> expected(count);
        for (size_t i = 0; i < count; ++i) expected[i] = reference_reduce(op, srcs, i);

        // Out of place, over a sub-range: elements outside [begin, end) stay untouched.
        std::vector<T> dst(count, T(7));
        const size_t begin = count / 3, end = count - count / 5;
        comm::reduce(dtype, op, ptrs.data(), n, dst.data(), begin, end);
        for (size_t i = 0; i < count; ++i) {
          const T want = (i >= begin && i < end) ? expected[i] : T(7);
          REQUIRE(same_bytes(&dst[i], &want, sizeof(T)));
        }

        // In place into the last source, and reduce_to_all into every source (all aliased).
        auto copies = srcs;
        std::vector<const void*> cptrs;
        std::vector<void*> dsts;
        for (auto& s : copies) {
          cptrs.push_back(s.data());
          dsts.push_back(s.data());
        }
        comm::reduce_to_all(dtype, op, cptrs.data(), n, dsts.data(), n, 0, count);
        for (auto& s : copies) REQUIRE(same_bytes(s.data(), expected.data(), count * sizeof(T)));
      }
    }
  }
}

}  // namespace

TEST_CASE("reduce kernels combine in rank order for every dtype and op", "[comm][reduce]") {
  SECTION("f32") { check_kernels<float>(DType::F32); }
  SECTION("f64") { check_kernels<double>(DType::F64); }
  SECTION("i32") { check_kernels<int32_t>(DType::I32); }
  SECTION("i64") { check_kernels<int64_t>(DType::I64); }
}

TEST_CASE("reduce keeps rank order, not a tree or pairwise order", "[comm][reduce]") {
  // (1e8 + 1) + (-1e8) + 1 in f32 is 1 left to right; any other order gives 0 or 2.
  const float a = 1e8f, b = 1.0f, c = -1e8f, d = 1.0f;
  std::vector<const void*> ptrs{&a, &b, &c, &d};
  float out = -1;
  comm::reduce(DType::F32, ReduceOp::Sum, ptrs.data(), 4, &out, 0, 1);
  REQUIRE(out == ((a + b) + c) + d);
}

TEST_CASE("integer mean truncates toward zero", "[comm][reduce]") {
  const int32_t a = -7, b = 0;
  std::vector<const void*> ptrs{&a, &b};
  int32_t out = 0;
  comm::reduce(DType::I32, ReduceOp::Mean, ptrs.data(), 2, &out, 0, 1);
  REQUIRE(out == -3);
  const int32_t big = INT32_MAX;
  std::vector<const void*> two{&big, &big};
  comm::reduce(DType::I32, ReduceOp::Mean, two.data(), 2, &out, 0, 1);
  REQUIRE(out == INT32_MAX);
}

using half_reference::from_bf16;
using half_reference::from_f16;
using half_reference::to_bf16;
using half_reference::to_f16;

TEST_CASE("bf16 and f16 reduce in f32, in rank order, rounded once", "[comm][reduce]") {
  struct Half {
    DType dtype;
    uint16_t (*to)(float);
    float (*from)(uint16_t);
  };
  for (const Half h : {Half{DType::BF16, to_bf16, from_bf16}, Half{DType::F16, to_f16, from_f16}}) {
    for (const size_t nsrcs : {size_t{1}, size_t{3}, size_t{9}}) {  // the fixed and the generic folds
      const size_t count = 1000;
      std::vector<std::vector<uint16_t>> in(nsrcs, std::vector<uint16_t>(count));
      std::vector<const void*> ptrs;
      for (size_t r = 0; r < nsrcs; ++r) {
        for (size_t i = 0; i < count; ++i) in[r][i] = h.to(static_cast<float>((i % 37) * 0.173 - 2.9 + r * 0.71));
        ptrs.push_back(in[r].data());
      }
      for (const ReduceOp op : {ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Min, ReduceOp::Max}) {
        INFO("dtype " << static_cast<int>(h.dtype) << " sources " << nsrcs << " op " << gradsync::op_name(op));
        std::vector<uint16_t> out(count);
        comm::reduce(h.dtype, op, ptrs.data(), nsrcs, out.data(), 0, count);
        for (size_t i = 0; i < count; ++i) {
          float acc = h.from(in[0][i]);
          for (size_t r = 1; r < nsrcs; ++r) {
            const float v = h.from(in[r][i]);
            acc = op == ReduceOp::Min ? (v < acc ? v : acc) : op == ReduceOp::Max ? (acc < v ? v : acc) : acc + v;
          }
          if (op == ReduceOp::Mean) acc /= static_cast<float>(nsrcs);
          REQUIRE(out[i] == h.to(acc));
        }
      }
    }
  }
}

TEST_CASE("copy_to_all writes every destination", "[comm][reduce]") {
  std::vector<double> src(10000);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<double>(i) * 0.5;
  std::vector<std::vector<double>> outs(3, std::vector<double>(src.size(), -1));
  std::vector<void*> dsts{outs[0].data(), outs[1].data(), outs[2].data(), src.data()};
  comm::copy_to_all(DType::F64, src.data(), dsts.data(), dsts.size(), 100, 9000);
  for (auto& o : outs) {
    for (size_t i = 0; i < o.size(); ++i) REQUIRE(o[i] == ((i >= 100 && i < 9000) ? src[i] : -1.0));
  }
}

TEST_CASE("wait_until: ready, timeout, abort, and a wake from another thread", "[comm][wait]") {
  using namespace std::chrono_literals;
  gradsync::WaitWord word;
  std::atomic<uint32_t> flag{0}, abort_flag{0};
  auto ready = [&] { return flag.load(std::memory_order_acquire) != 0; };

  REQUIRE(gradsync::wait_until(word, ready, gradsync::WaitClock::now() + 50ms) == gradsync::WaitResult::Timeout);

  // A waiter that has gone to sleep in the futex is woken by notify().
  std::thread waker([&] {
    std::this_thread::sleep_for(30ms);
    flag.store(1, std::memory_order_seq_cst);
    gradsync::notify(word);
  });
  REQUIRE(gradsync::wait_until(word, ready, gradsync::WaitClock::now() + 10s) == gradsync::WaitResult::Ready);
  waker.join();

  flag.store(0);
  std::thread aborter([&] {
    std::this_thread::sleep_for(30ms);
    abort_flag.store(1, std::memory_order_seq_cst);
    gradsync::notify(word);
  });
  REQUIRE(gradsync::wait_until(word, ready, gradsync::WaitClock::now() + 10s, &abort_flag) ==
          gradsync::WaitResult::Aborted);
  aborter.join();
  REQUIRE(word.sleepers.load() == 0);
}

TEST_CASE("wait_until reports the phase a wait ended in", "[comm][wait]") {
  using namespace std::chrono_literals;
  gradsync::WaitWord word;
  std::atomic<uint32_t> flag{0};
  auto ready = [&] { return flag.load(std::memory_order_seq_cst) != 0; };
  auto set_later = [&](std::chrono::milliseconds after) {
    return std::thread([&, after] {
      std::this_thread::sleep_for(after);
      flag.store(1, std::memory_order_seq_cst);
      gradsync::notify(word);
    });
  };
  gradsync::WaitTrace trace;

  SECTION("a long spin budget ends in the spin") {
    std::thread t = set_later(5ms);
    REQUIRE(gradsync::wait_until(word, ready, gradsync::WaitClock::now() + 30s, nullptr, ~0u,
                                 gradsync::WaitPolicy{20s, 0s}, &trace) == gradsync::WaitResult::Ready);
    t.join();
    REQUIRE(trace.ended_in == gradsync::WaitPhase::Spin);
  }
  SECTION("a long yield budget ends in the yields") {
    std::thread t = set_later(5ms);
    REQUIRE(gradsync::wait_until(word, ready, gradsync::WaitClock::now() + 30s, nullptr, ~0u,
                                 gradsync::WaitPolicy{0s, 20s}, &trace) == gradsync::WaitResult::Ready);
    t.join();
    REQUIRE(trace.ended_in == gradsync::WaitPhase::Yield);
    REQUIRE_FALSE(trace.slow_yield);
  }
  SECTION("a slow yield ends the yields, and the wait sleeps") {
    std::thread t = set_later(20ms);
    // Every yield takes longer than 0 ns, so the first one counts as slow.
    REQUIRE(gradsync::wait_until(word, ready, gradsync::WaitClock::now() + 30s, nullptr, ~0u,
                                 gradsync::WaitPolicy{0s, 20s, 0ns}, &trace) == gradsync::WaitResult::Ready);
    t.join();
    REQUIRE(trace.slow_yield);
    REQUIRE(trace.ended_in == gradsync::WaitPhase::Sleep);
  }
  SECTION("no budgets: straight to sleep, and a timeout there") {
    REQUIRE(gradsync::wait_until(word, ready, gradsync::WaitClock::now() + 20ms, nullptr, ~0u,
                                 gradsync::WaitPolicy{0s, 0s}, &trace) == gradsync::WaitResult::Timeout);
    REQUIRE(trace.ended_in == gradsync::WaitPhase::Sleep);
  }
  REQUIRE(word.sleepers.load() == 0);
}

TEST_CASE("AdaptiveWait loses no wake-up in a ping-pong, whatever its budgets become", "[comm][wait]") {
  using namespace std::chrono_literals;
  // More players than cores exercises the yield phase; the slow phases shrink and restore the
  // budgets many times over 3000 hand-offs.
  const int players = static_cast<int>(std::thread::hardware_concurrency()) + 2;
  constexpr uint64_t kRounds = 3000;
  gradsync::WaitWord word;
  std::atomic<uint64_t> turn{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int p = 0; p < players; ++p) {
    threads.emplace_back([&, p] {
      gradsync::AdaptiveWait wait(players);
      for (uint64_t t = static_cast<uint64_t>(p); t < kRounds; t += static_cast<uint64_t>(players)) {
        if (wait(
                word, [&] { return turn.load(std::memory_order_seq_cst) == t; }, gradsync::WaitClock::now() + 60s) !=
            gradsync::WaitResult::Ready) {
          failures.fetch_add(1);
          return;
        }
        turn.store(t + 1, std::memory_order_seq_cst);
        gradsync::notify(word);
      }
    });
  }
  for (auto& t : threads) t.join();
  REQUIRE(failures.load() == 0);
  REQUIRE(turn.load() == kRounds);

  gradsync::AdaptiveWait wait(2);
  std::atomic<uint32_t> abort_flag{0};
  auto never = [] { return false; };
  REQUIRE(wait(word, never, gradsync::WaitClock::now() + 20ms) == gradsync::WaitResult::Timeout);
  std::thread aborter([&] {
    std::this_thread::sleep_for(10ms);
    abort_flag.store(1, std::memory_order_seq_cst);
    gradsync::notify(word);
  });
  REQUIRE(wait(word, never, gradsync::WaitClock::now() + 30s, &abort_flag) == gradsync::WaitResult::Aborted);
  aborter.join();
}

TEST_CASE("AdaptiveWait::poll_briefly ends only on the condition or the abort word, and only when spinning pays",
          "[comm][wait]") {
  using namespace std::chrono_literals;
  std::atomic<uint32_t> abort_flag{0};
  int polls = 0;
  auto never = [&] {
    ++polls;
    return false;
  };
  // A rank per CPU (this process may use at least one): the budget starts above zero.
  gradsync::AdaptiveWait wait(1);
  const auto budget = wait.spin_budget();
  REQUIRE(budget > 0ns);
  REQUIRE_FALSE(wait.poll_briefly(never, &abort_flag).has_value());
  REQUIRE(polls > 1);
  REQUIRE(wait.spin_budget() == budget);  // gave up without learning anything
  // A condition that comes true while polling is a success of the spin phase: the budget grows.
  int until = 3;
  REQUIRE(wait.poll_briefly([&] { return --until == 0; }, &abort_flag) == gradsync::WaitResult::Ready);
  REQUIRE(wait.spin_budget() > budget);
  abort_flag.store(1);
  REQUIRE(wait.poll_briefly(never, &abort_flag, 1u) == gradsync::WaitResult::Aborted);
  REQUIRE_FALSE(wait.poll_briefly(never, &abort_flag, 2u).has_value());  // outside the mask
  // A peer on this CPU needs the CPU, and an oversubscribed group yields: no polls at all.
  polls = 0;
  REQUIRE_FALSE(wait.poll_briefly(never, nullptr, ~0u, true).has_value());
  REQUIRE_FALSE(gradsync::AdaptiveWait(1 << 20).poll_briefly(never).has_value());
  REQUIRE(polls == 0);
}

namespace {

// Random values with the awkward ones mixed in: signed zeros, infinities, NaN, subnormals, extremes.
template <class T>
std::vector<T> awkward_values(size_t n, std::mt19937_64& rng) {
  std::vector<T> v(n);
  std::uniform_int_distribution<int> pick(0, 15);
  for (auto& x : v) {
    if constexpr (std::is_floating_point_v<T>) {
      using L = std::numeric_limits<T>;
      const T special[] = {T(0),           -T(0),           L::infinity(), -L::infinity(),
                           L::quiet_NaN(), L::denorm_min(), L::max(),      L::lowest()};
      const int k = pick(rng);
      x = k < 8 ? special[k] : std::uniform_real_distribution<T>(-1e3, 1e3)(rng);
    } else {
      x = static_cast<T>(rng());
    }
  }
  return v;
}

// Restores the best kernels whatever happens in the test.
struct BestKernelsAfter {
  ~BestKernelsAfter() { comm::use_kernel_isa(comm::best_kernel_isa()); }
};

// Every ISA this CPU runs, the baseline first.
std::vector<comm::KernelIsa> cpu_isas() {
  std::vector<comm::KernelIsa> isas;
  for (comm::KernelIsa isa : {comm::KernelIsa::Baseline, comm::KernelIsa::Avx2, comm::KernelIsa::Avx512}) {
    if (comm::cpu_has(isa)) isas.push_back(isa);
  }
  return isas;
}

template <class T>
void compare_isas(DType dtype) {
  BestKernelsAfter restore;
  std::mt19937_64 rng(7);
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Min, ReduceOp::Max}) {
    for (size_t n : {1u, 2u, 3u, 4u, 8u, 9u}) {
      const size_t count = 1037;  // not a multiple of any vector width
      std::vector<std::vector<T>> srcs;
      std::vector<const void*> ptrs;
      for (size_t k = 0; k < n; ++k) srcs.push_back(awkward_values<T>(count, rng));
      for (auto& s : srcs) ptrs.push_back(s.data());
      const std::vector<comm::KernelIsa> isas = cpu_isas();
      std::vector<std::vector<T>> out(isas.size(), std::vector<T>(count));
      for (size_t i = 0; i < isas.size(); ++i) {
        comm::use_kernel_isa(isas[i]);
        comm::reduce(dtype, op, ptrs.data(), n, out[i].data(), 3, count);  // an unaligned start
      }
      INFO("op " << static_cast<int>(op) << ", " << n << " sources");
      for (size_t i = 1; i < isas.size(); ++i) {
        INFO("isa " << static_cast<int>(isas[i]));
        REQUIRE(same_bytes(out[0].data() + 3, out[i].data() + 3, (count - 3) * sizeof(T)));
      }
      // One result per destination (the fused form when there are as many as sources), into
      // separate buffers and in place: the bits of reduce, on every ISA.
      for (size_t i = 0; i < isas.size(); ++i) {
        comm::use_kernel_isa(isas[i]);
        std::vector<std::vector<T>> dst(n, std::vector<T>(count)), inplace = srcs;
        std::vector<void*> dptrs, iptrs;
        for (auto& d : dst) dptrs.push_back(d.data());
        for (auto& d : inplace) iptrs.push_back(d.data());
        comm::reduce_to_all(dtype, op, ptrs.data(), n, dptrs.data(), n, 3, count);
        std::vector<const void*> isrcs(iptrs.begin(), iptrs.end());
        comm::reduce_to_all(dtype, op, isrcs.data(), n, iptrs.data(), n, 3, count);
        for (size_t k = 0; k < n; ++k) {
          INFO("isa " << static_cast<int>(isas[i]) << ", destination " << k);
          REQUIRE(same_bytes(dst[k].data() + 3, out[0].data() + 3, (count - 3) * sizeof(T)));
          REQUIRE(same_bytes(inplace[k].data() + 3, out[0].data() + 3, (count - 3) * sizeof(T)));
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("the vector kernels give the bits of the baseline kernels", "[comm][reduce]") {
  if (comm::best_kernel_isa() == comm::KernelIsa::Baseline) WARN("no AVX2 on this CPU: baseline against itself");
  if (!comm::cpu_has(comm::KernelIsa::Avx512)) WARN("no AVX-512 on this CPU: its kernels are not compared");
  SECTION("f32") { compare_isas<float>(DType::F32); }
  SECTION("f64") { compare_isas<double>(DType::F64); }
  SECTION("i32") { compare_isas<int32_t>(DType::I32); }
  SECTION("i64") { compare_isas<int64_t>(DType::I64); }
}

TEST_CASE("AdaptiveWait: a wait that yields in vain shrinks the yield budget, a slow yield zeroes it", "[comm][wait]") {
  using namespace std::chrono_literals;
  gradsync::WaitWord word;
  std::atomic<uint32_t> flag{0};
  auto ready = [&] { return flag.load(std::memory_order_seq_cst) != 0; };
  // More ranks than any machine has cores: no spin, the full yield budget.
  gradsync::AdaptiveWait wait(1 << 20);
  REQUIRE(wait.spin_budget() == 0ns);
  REQUIRE(wait.yield_budget() == wait.max_yield_budget());
  std::thread setter([&] {
    std::this_thread::sleep_for(30ms);  // far beyond the yield budget: the wait ends asleep
    flag.store(1, std::memory_order_seq_cst);
    gradsync::notify(word);
  });
  REQUIRE(wait(word, ready, gradsync::WaitClock::now() + 30s) == gradsync::WaitResult::Ready);
  setter.join();
  // Halved (yielded in vain) or zeroed (a yield lost the core to another process): smaller either way.
  REQUIRE(wait.yield_budget() < wait.max_yield_budget());
}

TEST_CASE("AdaptiveWait: a short sleep grows the spin budget, a long one does not", "[comm][wait]") {
  using namespace std::chrono_literals;
  gradsync::WaitWord word;
  std::atomic<uint32_t> flag{0};
  auto ready = [&] { return flag.load(std::memory_order_seq_cst) != 0; };
  gradsync::AdaptiveWait wait(1);  // one rank: never oversubscribed, so it may spin
  // Wake the waiter only once it sleeps on the futex: the wait then ends in the sleep phase, after
  // about one futex wake-up, well within the spin budget's ceiling (50 us) on an idle machine, and
  // anyway far below a millisecond. The waking thread is started once and already polling when a
  // wait begins: starting a thread per wait can take longer than the ceiling (a millisecond under
  // AddressSanitizer), which no wake-up could then beat.
  std::atomic<uint64_t> round{0};
  std::atomic<int64_t> extra_us{0};
  std::atomic<bool> done{false};
  std::thread setter([&] {
    uint64_t seen = 0;
    for (;;) {
      while (round.load(std::memory_order_seq_cst) == seen && !done.load()) std::this_thread::yield();
      if (done.load()) return;
      seen = round.load(std::memory_order_seq_cst);
      while (word.sleepers.load(std::memory_order_seq_cst) == 0 && !done.load()) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::microseconds(extra_us.load()));
      flag.store(1, std::memory_order_seq_cst);
      gradsync::notify(word);
    }
  });
  struct Join {
    std::atomic<bool>& done;
    std::thread& t;
    ~Join() {
      done.store(true);
      t.join();
    }
  } join{done, setter};
  auto wake_when_asleep = [&](std::chrono::microseconds extra) {
    flag.store(0);
    extra_us.store(extra.count());
    round.fetch_add(1, std::memory_order_seq_cst);
    REQUIRE(wait(word, ready, gradsync::WaitClock::now() + 30s) == gradsync::WaitResult::Ready);
  };
  // Drive the spin budget to nothing with long sleeps first (each halves it).
  for (int i = 0; i < 20 && wait.spin_budget() > 0ns; ++i) wake_when_asleep(std::chrono::microseconds(2000));
  REQUIRE(wait.spin_budget() == 0ns);
  // A sleep that a spin would have caught grows the budget back: two ranks that both fell asleep
  // would otherwise keep waking each other through the kernel for good. Retried, since a loaded
  // machine can make a wake-up slower than the ceiling many times in a row (seen: 50 at load 7).
  bool grew = false;
  for (int i = 0; i < 2000 && !grew; ++i) {
    wake_when_asleep(std::chrono::microseconds(0));
    grew = wait.spin_budget() > 0ns;
  }
  REQUIRE(grew);
}

TEST_CASE("AdaptiveWait: a peer on this CPU is yielded to, and the budgets learn nothing from it", "[comm][wait]") {
  using namespace std::chrono_literals;
  gradsync::WaitWord word;
  std::atomic<uint32_t> flag{0};
  auto ready = [&] { return flag.load(std::memory_order_seq_cst) != 0; };
  gradsync::AdaptiveWait wait(1);
  const auto spin = wait.spin_budget(), yield = wait.yield_budget();
  std::thread setter([&] {
    std::this_thread::sleep_for(20ms);
    flag.store(1, std::memory_order_seq_cst);
    gradsync::notify(word);
  });
  REQUIRE(wait(word, ready, gradsync::WaitClock::now() + 30s, nullptr, ~0u, true) == gradsync::WaitResult::Ready);
  setter.join();
  REQUIRE(wait.spin_budget() == spin);
  REQUIRE(wait.yield_budget() == yield);
}
