// SPDX-License-Identifier: Apache-2.0
// Allreduce among threads: the thread transport beside five baselines measured in the same run.
//
//   ref:    the reference design, the baseline to beat: owner-sliced single pass (each thread reads
//           its slice of all N buffers once and writes the mean into all N buffers), and a
//           spin-then-futex barrier twice per round (inputs ready; outputs written), nothing else.
//           It is a complete allreduce: when a call returns, every buffer holds the result.
//   spin:   information only, the reference design with a barrier that only spins: its speed while
//           no rank ever sleeps, which the reference itself does not keep up (one rank descheduled
//           for longer than its 20 us spin, and both can go on waking each other through futexes:
//           its median at 1K and 64K is then 10x its best). Measured only while every thread has a
//           hardware thread of its own (spinning for a descheduled peer is no design at all).
//   stream: information only, the same kernel with one barrier per call, as a STREAM-style figure.
//           It is not a bound (a call's end is not synchronised), and the transport can beat it.
//   mpi:    raw MPI_Allreduce (sum) of N processes on this host, under mpirun, timed in the same
//           batches; launched for each row just before it, as it cannot take turns with the others
//           (the host's speed can change within a run, and did between a run's first and last row).
//   naive:  the seed's design (kizzasi ThreadedGradientSync): one global mutex, each worker adds
//           into a shared accumulator in arrival order, the last arrival computes the mean and
//           wakes the others with a condition variable, everyone copies back.
//
// Figures: microseconds per allreduce (median of several timed batches), algbw = bytes/t and
// busbw = algbw * 2(N-1)/N as nccl-tests define them. Every method's result is checked.
//   allreduce_bench [--quick]      the table (--quick: up to 64K floats)
//   allreduce_bench --mpi-raw M    (internal) one MPI rank of a row's raw baseline, M floats
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/create.hpp"
#include "common/partition.hpp"
#include "common/wait.hpp"
#include "raw_mpi.hpp"

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

// The calibration's rule: a trial of `trial` calls that took `took` seconds sizes the batches of
// about target_ms, once it lasted 5 ms (or ran 200000 calls); 0 asks for a trial twice as long.
int batch_length(double took, int trial, double target_ms) {
  if (took < 0.005 && trial < 200000) return 0;
  return static_cast<int>(std::clamp(target_ms / 1000.0 * trial / took, 2.0, 200000.0));
}

// Runs the method on n threads: warm-up, calibration of the batch length to about target_ms, then
// `reps` timed batches; returns the median seconds per allreduce. The calibration runs ever longer
// trials until one lasts 5 ms: the first calls of a method are slower than its steady state (cold
// caches, wait budgets still adapting), and a batch sized from them came out at a tenth of
// target_ms, so startup weighed on the figure.
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
        Clock::time_point t0;
        for (int trial = 2;; trial *= 2) {
          sync.arrive_and_wait();
          t0 = Clock::now();
          m.step(r, trial);
          sync.arrive_and_wait();
          if (r == 0) {
            iters = batch_length(std::chrono::duration<double>(Clock::now() - t0).count(), trial, target_ms);
          }
          sync.arrive_and_wait();
          if (iters.load() != 0) break;
        }
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

// The baselines' barrier: a generation counter, waited on as the library's waits are by default
// (spin 20 us, yield 5 us, then a futex sleep). A 1 us spin put the reference to sleep at nearly
// every barrier of a small call (18 us at 1 float instead of under 1), which is no baseline to beat.
class SpinBarrier {
 public:
  // sleep: spin, yield, then sleep as the library's waits do; otherwise only spin.
  explicit SpinBarrier(int n, bool sleep = true) : n_(n), sleep_(sleep) {}
  void wait() {
    const uint32_t gen = word_.value.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      count_.store(0, std::memory_order_relaxed);
      word_.value.fetch_add(1, std::memory_order_seq_cst);
      if (word_.sleepers.load(std::memory_order_seq_cst) != 0) gradsync::wait_detail::futex_wake_all(&word_.value);
      return;
    }
    if (!sleep_) {
      while (word_.value.load(std::memory_order_acquire) == gen) gradsync::cpu_relax();
      return;
    }
    gradsync::wait_until(
        word_, [&] { return word_.value.load(std::memory_order_acquire) != gen; },
        gradsync::WaitClock::now() + std::chrono::minutes(2));
  }

 private:
  const int n_;
  const bool sleep_;
  std::atomic<int> count_{0};
  gradsync::WaitWord word_;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Row {
  int n;
  size_t m;
  double ours, ref, spin, stream, naive;  // spin: NaN where not measured
};

// The owner-sliced kernel of the baselines: this thread's slice of every buffer, reduced in rank
// order, the mean written back into every buffer.
void owner_slice(const std::vector<std::unique_ptr<Buffer>>& bufs, int n, int r, size_t m) {
  const auto part = gradsync::partition(m, static_cast<uint64_t>(n), static_cast<uint64_t>(r));
  const float fn = static_cast<float>(n);
  if (n == 2) {
    float* __restrict a = bufs[0]->data + part.start;
    float* __restrict b = bufs[1]->data + part.start;
    for (size_t j = 0; j < part.len; ++j) {
      const float v = (a[j] + b[j]) / fn;
      a[j] = v;
      b[j] = v;
    }
    return;
  }
  if (n == 4) {
    float* __restrict a = bufs[0]->data + part.start;
    float* __restrict b = bufs[1]->data + part.start;
    float* __restrict c = bufs[2]->data + part.start;
    float* __restrict d = bufs[3]->data + part.start;
    for (size_t j = 0; j < part.len; ++j) {
      const float v = (((a[j] + b[j]) + c[j]) + d[j]) / fn;
      a[j] = v;
      b[j] = v;
      c[j] = v;
      d[j] = v;
    }
    return;
  }
  throw std::runtime_error("the baselines' kernel is written for N = 2 and 4");
}

std::string size_name(size_t m) {
  if (m >= (1u << 20)) return std::to_string(m >> 20) + "M";
  if (m >= 1024) return std::to_string(m >> 10) + "K";
  return std::to_string(m);
}

double target_ms(size_t m) { return m >= (1u << 22) ? 150 : 60; }

constexpr int kReps = 5;

#if GRADSYNC_HAVE_MPI
// measure()'s batches for an MPI rank, rank 0's trials sizing them for all; rank 0's median, in
// microseconds per call.
double mpi_batches(size_t m, const std::function<void()>& call) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  call();
  auto batch = [&](int k) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = Clock::now();
    for (int i = 0; i < k; ++i) call();
    MPI_Barrier(MPI_COMM_WORLD);
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  int iters = 0;
  for (int trial = 2; iters == 0; trial *= 2) {
    const double took = batch(trial);
    if (rank == 0) iters = batch_length(took, trial, target_ms(m));
    MPI_Bcast(&iters, 1, MPI_INT, 0, MPI_COMM_WORLD);
  }
  std::vector<double> samples;
  for (int rep = 0; rep < kReps; ++rep) samples.push_back(batch(iters) / iters);
  return median(samples) * 1e6;
}
#endif

Row run(int n, size_t m, int reps) {
  std::vector<std::unique_ptr<Buffer>> bufs(static_cast<size_t>(n));
  std::vector<char> ok(static_cast<size_t>(n), 0);
  // The buffers are allocated once per size and refilled for each method: fresh 64 MB mappings
  // for every timed batch made the 16M figures bimodal (2.6 or 7.7 ms, for every method alike),
  // while the same calls on buffers kept across batches take 4.4-4.7 ms steadily.
  auto alloc = [&](int r) {
    auto& b = bufs[static_cast<size_t>(r)];
    if (!b) b = std::make_unique<Buffer>(m);
    fill(b->data, m, r);
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
  Method ours{[&](int r) {
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
                  comms[static_cast<size_t>(r)]->allreduce(std::span<const gradsync::comm::BufferRef>(&b, 1),
                                                           DType::F32, ReduceOp::Mean);
                }
              },
              [&](int r) {
                verify(r);
                comms[static_cast<size_t>(r)].reset();
              }};

  // ---- ref: the reference design, two barriers per round; spin: the same with barriers that never
  // sleep (information)
  auto reference = [&](SpinBarrier& barrier) {
    return Method{[&](int r) { alloc(r); },
                  [&, b = &barrier](int r, int iters) {
                    for (int i = 0; i < iters; ++i) {
                      b->wait();  // every rank's input is ready
                      owner_slice(bufs, n, r, m);
                      b->wait();  // every rank's output is written: the call may return
                    }
                  },
                  [&](int r) { verify(r); }};
  };
  SpinBarrier spin(n);
  Method ref = reference(spin);
  SpinBarrier spinning(n, false);
  Method spin_ref = reference(spinning);
  const bool may_spin = static_cast<unsigned>(n) <= std::thread::hardware_concurrency();

  // ---- stream: the same kernel with one barrier per call (information, not a bound)
  Method stream{[&](int r) { alloc(r); },
                [&](int r, int iters) {
                  for (int i = 0; i < iters; ++i) {
                    spin.wait();
                    owner_slice(bufs, n, r, m);
                  }
                  spin.wait();
                },
                [&](int r) { verify(r); }};

  // ---- naive: the seed's design
  struct Naive {
    std::mutex mutex;
    std::condition_variable cv;
    std::vector<float> acc;
    int arrived = 0, copied = 0;
    uint64_t generation = 0;
  } naive_state;
  naive_state.acc.assign(m, 0.0f);
  Method naive{[&](int r) { alloc(r); },
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
               [&](int r) { verify(r); }};
  // The methods take turns, one timed batch each per turn, so that a change in the machine's
  // speed during the run (other tenants, memory bandwidth that moves by 2x at 16M) falls on all
  // of them alike rather than on whichever ran at that moment.
  std::vector<double> t_ours, t_ref, t_spin, t_stream, t_naive;
  for (int rep = 0; rep < reps; ++rep) {
    t_ours.push_back(measure(n, ours, target_ms(m), 1));
    all_ok("thread transport");
    t_ref.push_back(measure(n, ref, target_ms(m), 1));
    all_ok("reference design");
    if (may_spin) {
      t_spin.push_back(measure(n, spin_ref, target_ms(m), 1));
      all_ok("spinning reference");
    }
    t_stream.push_back(measure(n, stream, target_ms(m), 1));
    all_ok("stream");
    t_naive.push_back(measure(n, naive, target_ms(m), 1));
    all_ok("naive");
  }
  return {n, m, median(t_ours), median(t_ref), may_spin ? median(t_spin) : NAN, median(t_stream), median(t_naive)};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--mpi-raw") == 0) {
    const size_t m = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 0;
    if (m == 0) return 2;
#if GRADSYNC_HAVE_MPI
    return bench::raw_mpi_rank(argc, argv, {m}, mpi_batches);
#else
    return 1;
#endif
  }
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const std::vector<size_t> sizes =
      quick ? std::vector<size_t>{1, 1 << 10, 1 << 16} : std::vector<size_t>{1, 1 << 10, 1 << 16, 1 << 20, 1 << 24};
  std::printf(
      "allreduce among threads, f32 mean in place; us = median of %d batches, the methods taking turns; %u hardware "
      "threads\n",
      kReps, std::thread::hardware_concurrency());
  std::printf("%2s %5s | %10s %8s | %10s %8s | %10s %10s %10s | %8s %9s %8s | %10s %8s\n", "N", "M", "ours us", "busbw",
              "ref us", "busbw", "spin us", "stream us", "naive us", "ref/ours", "spin/ours", "x naive", "mpi us",
              "mpi/ours");
  std::vector<Row> rows;
  std::map<int, double> one_float_vs_mpi;  // by N: our time at 1 float over raw MPI's
  for (int n : {2, 4}) {
    for (size_t m : sizes) {
      std::map<size_t, double> mpi;
      if (!bench::raw_mpi(argv[0], n, std::to_string(m), 1, mpi)) mpi.clear();
      const Row row = run(n, m, kReps);
      rows.push_back(row);
      const double bytes = 4.0 * static_cast<double>(m);
      auto busbw = [&](double t) { return bytes / t / 1e9 * 2.0 * (n - 1) / n; };
      const double mpi_us = mpi.count(m) ? mpi[m] : NAN;
      std::printf("%2d %5s | %10.2f %8.2f | %10.2f %8.2f | %10.2f %10.2f %10.2f | %8.2f %9.2f %7.1fx | %10.2f %8.2f\n",
                  n, size_name(m).c_str(), row.ours * 1e6, busbw(row.ours), row.ref * 1e6, busbw(row.ref),
                  row.spin * 1e6, row.stream * 1e6, row.naive * 1e6, row.ref / row.ours, row.spin / row.ours,
                  row.naive / row.ours, mpi_us, mpi_us / (row.ours * 1e6));
      std::fflush(stdout);
      if (m == 1) one_float_vs_mpi[n] = row.ours * 1e6 / mpi_us;
    }
  }
  // The target is ref/ours >= 1.0 at every size (the reference design's speed or better); one run
  // says little on a shared machine: bench/spread.py runs it several times and prints the spread.
  int behind = 0;
  for (const Row& r : rows) behind += r.ref / r.ours < 1.0 ? 1 : 0;
  std::printf("\nrows where the transport is slower than the reference design in this run: %d of %zu\n", behind,
              rows.size());
  // And at 1 float, at most 1.5x raw MPI's time.
  for (const auto& [n, ratio] : one_float_vs_mpi) {
    if (std::isnan(ratio)) {
      std::printf("N = %d, 1 float: raw MPI unavailable (no MPI in this build, or mpirun failed)\n", n);
    } else {
      std::printf("N = %d, 1 float: %.2fx raw MPI's time (target <= 1.5x)\n", n, ratio);
    }
  }
  return 0;
}
