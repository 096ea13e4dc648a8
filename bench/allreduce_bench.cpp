// SPDX-License-Identifier: Apache-2.0
// Allreduce among threads: the thread transport beside two baselines measured in the same run.
//
//   bound: the memory-bandwidth bound, a STREAM-like kernel on the same N threads doing exactly the
//          reads and writes of an ideal in-place N-buffer allreduce (each thread reads its slice of
//          all N buffers, writes the mean to all N buffers) and one barrier per call.
//   naive: the seed's design (kizzasi ThreadedGradientSync): one global mutex, each worker adds into
//          a shared accumulator in arrival order, the last arrival computes the mean and wakes the
//          others with a condition variable, everyone copies back.
//
// Figures: microseconds per allreduce (median of several timed batches), algbw = bytes/t and
// busbw = algbw * 2(N-1)/N as nccl-tests define them. Every method's result is checked.
//   allreduce_bench [--quick]
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"
#include "common/partition.hpp"
#include "common/wait.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using gradsync::DType;
using gradsync::ReduceOp;

// Page-aligned float buffer, first touched by the thread that uses it (NUMA-friendly, and the
// pages are faulted in before timing).
struct Buffer {
  float* data = nullptr;
  size_t count = 0;
  explicit Buffer(size_t n) : count(n) {
    data = static_cast<float*>(std::aligned_alloc(4096, std::max<size_t>(4096, (n * 4 + 4095) / 4096 * 4096)));
    if (!data) throw std::bad_alloc();
  }
  ~Buffer() { std::free(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

// Rank r holds r + 1 + (i % 7): the mean over ranks is (N + 1) / 2 + i % 7, exact in f32; a mean of
// equal values is that value again, so the buffers stay checkable after any number of rounds.
void fill(float* p, size_t n, int rank) {
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<float>(rank + 1 + static_cast<int>(i % 7));
}
bool check(const float* p, size_t n, int size) {
  const float base = static_cast<float>(size + 1) / 2.0f;
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != base + static_cast<float>(i % 7)) return false;
  }
  return true;
}

// A method is: prepare(rank) once per thread, then step(rank, iters) runs iters allreduces in place.
struct Method {
  std::function<void(int)> prepare;
  std::function<void(int, int)> step;
  std::function<void(int)> finish;
};

// Runs the method on n threads: warm-up, calibration of the batch length to about target_ms, then
// `reps` timed batches; returns the median seconds per allreduce.
double measure(int n, Method& m, double target_ms, int reps) {
  std::barrier sync(n);
  std::vector<double> samples;
  std::atomic<int> iters{1};
  std::vector<std::thread> threads;
  std::exception_ptr error;
  std::mutex error_mutex;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        m.prepare(r);
        m.step(r, 1);  // warm-up (and page faults of the output)
        sync.arrive_and_wait();
        auto t0 = Clock::now();
        m.step(r, 2);
        sync.arrive_and_wait();
        if (r == 0) {
          const double per = std::chrono::duration<double>(Clock::now() - t0).count() / 2;
          iters = static_cast<int>(std::clamp(target_ms / 1000.0 / per, 2.0, 200000.0));
        }
        sync.arrive_and_wait();
        const int k = iters.load();
        for (int rep = 0; rep < reps; ++rep) {
          sync.arrive_and_wait();
          t0 = Clock::now();
          m.step(r, k);
          sync.arrive_and_wait();
          if (r == 0) samples.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / k);
        }
        m.finish(r);
      } catch (...) {
        std::lock_guard lock(error_mutex);
        error = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

// The bound's barrier: a generation counter, waited on with a short spin (1 us) then a futex sleep,
// cheap both on free cores and on a loaded machine.
class SpinBarrier {
 public:
  explicit SpinBarrier(int n) : n_(n) {}
  void wait() {
    const uint32_t gen = word_.value.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      count_.store(0, std::memory_order_relaxed);
      word_.value.fetch_add(1, std::memory_order_seq_cst);
      if (word_.sleepers.load(std::memory_order_seq_cst) != 0) gradsync::wait_detail::futex_wake_all(&word_.value);
      return;
    }
    gradsync::wait_until(
        word_, [&] { return word_.value.load(std::memory_order_acquire) != gen; },
        gradsync::WaitClock::now() + std::chrono::minutes(2), nullptr, ~0u,
        gradsync::WaitPolicy{std::chrono::microseconds(1), std::chrono::nanoseconds(0)});
  }

 private:
  const int n_;
  std::atomic<int> count_{0};
  gradsync::WaitWord word_;
};

struct Row {
  int n;
  size_t m;
  double ours, bound, naive;
};

std::string size_name(size_t m) {
  if (m >= (1u << 20)) return std::to_string(m >> 20) + "M";
  if (m >= 1024) return std::to_string(m >> 10) + "K";
  return std::to_string(m);
}

Row run(int n, size_t m, int reps) {
  const double target_ms = m >= (1u << 22) ? 150 : 60;
  std::vector<std::unique_ptr<Buffer>> bufs(static_cast<size_t>(n));
  std::vector<char> ok(static_cast<size_t>(n), 0);
  auto alloc = [&](int r) {
    bufs[static_cast<size_t>(r)] = std::make_unique<Buffer>(m);
    fill(bufs[static_cast<size_t>(r)]->data, m, r);
  };
  auto verify = [&](int r) { ok[static_cast<size_t>(r)] = check(bufs[static_cast<size_t>(r)]->data, m, n); };
  auto all_ok = [&](const char* what) {
    for (int r = 0; r < n; ++r) {
      if (!ok[static_cast<size_t>(r)]) {
        std::fprintf(stderr, "%s: wrong result on rank %d (N=%d M=%zu)\n", what, r, n, m);
        std::exit(1);
      }
    }
  };

  // ---- ours: the thread transport
  const std::string name = "bench-" + std::to_string(n) + "-" + std::to_string(m);
  std::vector<std::unique_ptr<gradsync::comm::Communicator>> comms(static_cast<size_t>(n));
  Method ours{
      [&](int r) {
        alloc(r);
        gradsync::comm::Options o;
        o.name = name;
        o.rank = r;
        o.size = n;
        o.timeout = std::chrono::milliseconds(120000);
        comms[static_cast<size_t>(r)] = gradsync::comm::create(o);
      },
      [&](int r, int iters) {
        float* p = bufs[static_cast<size_t>(r)]->data;
        const gradsync::comm::BufferRef b{p, p, m};
        for (int i = 0; i < iters; ++i) {
          comms[static_cast<size_t>(r)]->allreduce(std::span<const gradsync::comm::BufferRef>(&b, 1), DType::F32,
                                                   ReduceOp::Mean);
        }
      },
      [&](int r) {
        verify(r);
        comms[static_cast<size_t>(r)].reset();
        bufs[static_cast<size_t>(r)].reset();
      }};
  const double t_ours = measure(n, ours, target_ms, reps);
  all_ok("thread transport");

  // ---- bound: each thread reads its slice of every buffer and writes the mean to every buffer
  SpinBarrier spin(n);
  Method bound{
      [&](int r) { alloc(r); },
      [&](int r, int iters) {
        const auto part = gradsync::partition(m, static_cast<uint64_t>(n), static_cast<uint64_t>(r));
        std::vector<float*> p(static_cast<size_t>(n));
        for (int i = 0; i < iters; ++i) {
          spin.wait();  // every buffer is ready (the one barrier a collective cannot avoid)
          for (int k = 0; k < n; ++k) p[static_cast<size_t>(k)] = bufs[static_cast<size_t>(k)]->data + part.start;
          const float inv_n = static_cast<float>(n);
          if (n == 2) {
            float* __restrict a = p[0];
            float* __restrict b = p[1];
            for (size_t j = 0; j < part.len; ++j) {
              const float v = (a[j] + b[j]) / inv_n;
              a[j] = v;
              b[j] = v;
            }
          } else {
            float* __restrict a = p[0];
            float* __restrict b = p[1];
            float* __restrict c = p[2];
            float* __restrict d = p[3];
            for (size_t j = 0; j < part.len; ++j) {
              const float v = (((a[j] + b[j]) + c[j]) + d[j]) / inv_n;
              a[j] = v;
              b[j] = v;
              c[j] = v;
              d[j] = v;
            }
          }
        }
        spin.wait();
      },
      [&](int r) {
        verify(r);
        bufs[static_cast<size_t>(r)].reset();
      }};
  const double t_bound = measure(n, bound, target_ms, reps);
  all_ok("bandwidth bound");

  // ---- naive: the seed's design
  struct Naive {
    std::mutex mutex;
    std::condition_variable cv;
    std::vector<float> acc;
    int arrived = 0, copied = 0;
    uint64_t generation = 0;
  } naive_state;
  naive_state.acc.assign(m, 0.0f);
  Method naive{
      [&](int r) { alloc(r); },
      [&](int r, int iters) {
        float* p = bufs[static_cast<size_t>(r)]->data;
        Naive& s = naive_state;
        for (int i = 0; i < iters; ++i) {
          std::unique_lock lock(s.mutex);
          // A previous round's stragglers must have copied out before the accumulator is reused.
          s.cv.wait(lock, [&] { return s.copied == 0; });
          for (size_t j = 0; j < m; ++j) s.acc[j] += p[j];
          const uint64_t gen = s.generation;
          if (++s.arrived == n) {
            for (size_t j = 0; j < m; ++j) s.acc[j] /= static_cast<float>(n);
            s.arrived = 0;
            ++s.generation;
            s.cv.notify_all();
          } else {
            s.cv.wait(lock, [&] { return s.generation != gen; });
          }
          std::memcpy(p, s.acc.data(), m * sizeof(float));
          if (++s.copied == n) {
            std::fill(s.acc.begin(), s.acc.end(), 0.0f);
            s.copied = 0;
            s.cv.notify_all();
          }
        }
      },
      [&](int r) {
        verify(r);
        bufs[static_cast<size_t>(r)].reset();
      }};
  const double t_naive = measure(n, naive, target_ms, reps);
  all_ok("naive");
  return {n, m, t_ours, t_bound, t_naive};
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const std::vector<size_t> sizes = quick ? std::vector<size_t>{1, 1 << 10, 1 << 16}
                                          : std::vector<size_t>{1, 1 << 10, 1 << 16, 1 << 20, 1 << 24};
  const int reps = 5;
  std::printf("allreduce among threads, f32 mean in place; us = median of %d batches; %u hardware threads\n", reps,
              std::thread::hardware_concurrency());
  std::printf("%2s %5s | %10s %8s %8s | %10s %8s | %10s | %8s %8s\n", "N", "M", "ours us", "algbw", "busbw", "bound us",
              "busbw", "naive us", "of bound", "x naive");
  std::vector<Row> rows;
  for (int n : {2, 4}) {
    for (size_t m : sizes) {
      const Row row = run(n, m, reps);
      rows.push_back(row);
      const double bytes = 4.0 * static_cast<double>(m);
      const double algbw = bytes / row.ours / 1e9, busbw = algbw * 2.0 * (n - 1) / n;
      const double bound_busbw = bytes / row.bound / 1e9 * 2.0 * (n - 1) / n;
      std::printf("%2d %5s | %10.2f %8.2f %8.2f | %10.2f %8.2f | %10.2f | %7.0f%% %7.1fx\n", n, size_name(m).c_str(),
                  row.ours * 1e6, algbw, busbw, row.bound * 1e6, bound_busbw, row.naive * 1e6,
                  100.0 * row.bound / row.ours, row.naive / row.ours);
      std::fflush(stdout);
    }
  }
  auto find = [&](int n, size_t m) -> const Row* {
    for (const auto& r : rows) {
      if (r.n == n && r.m == m) return &r;
    }
    return nullptr;
  };
  std::printf("\ntargets:\n");
  if (const Row* r = find(2, 1 << 24)) {
    std::printf("  N=2 16M: %.0f%% of the bandwidth bound (target >= 80%%): %s\n", 100.0 * r->bound / r->ours,
                r->bound / r->ours >= 0.8 ? "met" : "NOT met");
    std::printf("  N=2 16M: %.1fx naive (target >= 3x): %s\n", r->naive / r->ours,
                r->naive / r->ours >= 3 ? "met" : "NOT met");
  }
  if (const Row* r = find(2, 1)) {
    std::printf("  N=2 1 float: %.1fx naive (target >= 50x): %s\n", r->naive / r->ours,
                r->naive / r->ours >= 50 ? "met" : "NOT met");
  }
  if (const Row* r = find(4, 1)) {
    std::printf("  N=4 1 float: %.1fx naive (target >= 5x, no collapse on 2 cores): %s\n", r->naive / r->ours,
                r->naive / r->ours >= 5 ? "met" : "NOT met");
  }
  return 0;
}
