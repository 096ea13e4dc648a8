// SPDX-License-Identifier: Apache-2.0
// Shared-memory transport benchmark: 2 processes, allreduce (sum, f32, in place) of M floats for
// M in {1, 1K, 64K, 1M, 16M}, through both data paths (copy: ordinary caller buffers; zero copy:
// buffers from Communicator::alloc in the segment), beside two baselines measured in the same run:
//   - raw MPI_Allreduce with 2 ranks on this host (this program re-launched under
//     `mpirun -np 2 --allow-run-as-root --oversubscribe`), and
//   - the thread transport (2 threads of one process).
//   - the copy path's memcpy floor: the zero-copy time plus the two copies that any copy path must
//     add on each rank (its input for the peers into shared memory, the peers' results out of it:
//     (N-1)/N of the buffer each), timed as plain memcpys on 2 threads at once.
// Figures are medians of per-call times. Targets: copy path >= 4x raw MPI at 16M floats, and at
// least 0.9x its memcpy floor's speed; zero copy within 1.1x the thread transport's time from 64K
// floats; 1 float <= 2x raw MPI's time.
//   shm_bench            the full table
//   shm_bench --matrix   every path beside raw MPI at N = 2 and 4, in place and out of place,
//                        unpinned and pinned, 1K..16M floats (rows keyed for bench/spread.py):
//                        the copy path as it runs (ranks reach each other's processes, so owner
//                        slices are read and written where they are) and staged through the
//                        segment (GRADSYNC_SHM_CROSS_PROCESS=0), zero copy, threads, their speed
//                        relative to raw MPI (its time over theirs), and a cache-line round trip
//                        between CPUs 0 and 1 just before (the host's slow mode shows there)
//   shm_bench --mpi-raw  (internal) one MPI rank of the raw baseline
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/create.hpp"
#include "raw_mpi.hpp"

namespace {

using Clock = std::chrono::steady_clock;
namespace gc = gradsync::comm;

const std::vector<size_t> kSizes = {1, 1024, 65536, 1u << 20, 16u << 20};

// Calls per size: at least ~20 ms of them at the fastest rate measured, as in allreduce_bench's
// batches. A count, not a time, because the ranks of a collective must make the same calls. With
// 3000 calls (under a millisecond at 1 float) one run in ten caught the ranks' first
// milliseconds, before the scheduler had spread two processes forked together over both CPUs,
// and took 3 us a call instead of 0.2 for every small size.
int iterations(size_t m) {
  if (m <= 1) return 100000;
  if (m <= 1024) return 40000;
  if (m <= 65536) return 3000;
  if (m <= (1u << 20)) return 150;
  return 25;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? NAN : v[v.size() / 2];
}

// --matrix times fewer calls (it measures 5 paths x 8 configurations x 5 sizes): its medians
// are as stable at these counts, and a run takes minutes rather than most of an hour on a loaded
// machine, where raw MPI's 16M round at N = 4 takes most of a second.
bool g_matrix = false;
int matrix_iterations(size_t m) {
  if (m <= 1024) return 10000;
  if (m <= 8192) return 3000;
  if (m <= 65536) return 500;
  if (m <= (1u << 20)) return 30;
  return 5;
}

// Times `call` (per call, in microseconds) after a warm-up of half as many calls; returns the median.
template <class F>
double time_calls(size_t m, F&& call) {
  const int n = g_matrix ? matrix_iterations(m) : iterations(m);
  for (int i = 0; i < std::max(2, n / 2); ++i) call();
  std::vector<double> t;
  t.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const auto a = Clock::now();
    call();
    t.push_back(std::chrono::duration<double, std::micro>(Clock::now() - a).count());
  }
  return median(t);
}

// One rank of a communicator benchmark at one size and data path; checks the first result.
// Out of place, the result goes to a second buffer (from the segment too for zero copy).
double run_size(gc::Communicator& comm, size_t m, bool zero_copy, bool in_place = true) {
  std::vector<float> own_send, own_recv;
  float* send = nullptr;
  float* recv = nullptr;
  if (zero_copy) {
    send = static_cast<float*>(comm.alloc(m * sizeof(float)));
    recv = in_place ? send : static_cast<float*>(comm.alloc(m * sizeof(float)));
  } else {
    own_send.resize(m);
    send = own_send.data();
    if (!in_place) own_recv.resize(m);
    recv = in_place ? send : own_recv.data();
  }
  std::fill(send, send + m, 1.0f);
  const gc::BufferRef buf{send, recv, m};
  comm.allreduce(std::span<const gc::BufferRef>(&buf, 1), gradsync::DType::F32, gradsync::ReduceOp::Sum);
  const float want = float(comm.size());
  if (recv[0] != want || recv[m - 1] != want) {
    std::fprintf(stderr, "shm_bench: wrong result %g at M=%zu\n", double(recv[0]), m);
    std::exit(1);
  }
  // Mean keeps the values finite over thousands of calls; it costs the same as sum.
  comm.barrier();
  const double us = time_calls(m, [&] {
    comm.allreduce(std::span<const gc::BufferRef>(&buf, 1), gradsync::DType::F32, gradsync::ReduceOp::Mean);
  });
  comm.barrier();
  if (zero_copy) {
    comm.dealloc(send);
    if (!in_place) comm.dealloc(recv);
  }
  return us;
}

// Both data paths size by size (interleaved, so that both see the same machine load).
void run_rank(gc::Communicator& comm, bool with_zero_copy, std::map<size_t, double>& copy_us,
              std::map<size_t, double>& zero_us) {
  for (size_t m : kSizes) {
    copy_us[m] = run_size(comm, m, false);
    if (with_zero_copy) zero_us[m] = run_size(comm, m, true);
  }
}

void pin_to_cpu(int r) {
  const unsigned cpus = std::max(1u, std::thread::hardware_concurrency());
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(static_cast<unsigned>(r) % cpus, &set);
  sched_setaffinity(0, sizeof set, &set);
}

// Rank r of the shm group `name` of n ranks.
gc::Options shm_options(const std::string& name, int r, int n, std::chrono::milliseconds timeout) {
  gc::Options o;
  o.transport = gc::Transport::Shm;
  o.rank = r;
  o.size = n;
  o.name = name;
  o.timeout = timeout;
  return o;
}

// The parent's side of a forked group: rank 0's "size copy_us zero_us" lines from the pipe, then
// every child reaped; true when each exited 0 and `sizes` lines came.
bool collect(const int fds[2], std::span<const pid_t> pids, size_t sizes, std::map<size_t, double>& copy_us,
             std::map<size_t, double>& zero_us) {
  close(fds[1]);
  FILE* in = fdopen(fds[0], "r");
  size_t m;
  double a, b;
  while (std::fscanf(in, "%zu %lf %lf", &m, &a, &b) == 3) {
    copy_us[m] = a;
    zero_us[m] = b;
  }
  std::fclose(in);
  bool ok = true;
  for (pid_t p : pids) {
    int status = 0;
    waitpid(p, &status, 0);
    ok &= WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return ok && copy_us.size() == sizes;
}

// Both shm paths with 2 forked processes; rank 0 sends its figures back through a pipe.
bool bench_shm(std::map<size_t, double>& copy_us, std::map<size_t, double>& zero_us) {
  int fds[2];
  if (pipe(fds) != 0) return false;
  const std::string name = "bench-" + std::to_string(getpid());
  pid_t pids[2];
  for (int r = 0; r < 2; ++r) {
    pids[r] = fork();
    if (pids[r] == 0) {
      close(fds[0]);
      auto comm = gc::create(shm_options(name, r, 2, std::chrono::milliseconds(60000)));
      std::map<size_t, double> a, b;
      run_rank(*comm, true, a, b);
      if (r == 0) {
        for (size_t m : kSizes) dprintf(fds[1], "%zu %.6f %.6f\n", m, a[m], b[m]);
      }
      comm = nullptr;  // leave the group before exiting
      _exit(0);
    }
  }
  return collect(fds, pids, kSizes.size(), copy_us, zero_us);
}

bool bench_threads(std::map<size_t, double>& us) {
  std::map<size_t, double> other;
  std::vector<std::thread> threads;
  bool ok = true;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        gc::Options o;
        o.transport = gc::Transport::Thread;
        o.rank = r;
        o.size = 2;
        o.name = "bench-threads";
        o.timeout = std::chrono::milliseconds(60000);
        auto comm = gc::create(o);
        std::map<size_t, double> unused;
        run_rank(*comm, false, r == 0 ? us : other, unused);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "thread transport: %s\n", e.what());
        ok = false;
      }
    });
  }
  for (auto& t : threads) t.join();
  return ok;
}

// The two copies a copy path adds to the zero-copy work, as plain memcpys on 2 threads at once:
// each thread's input for its peer into shared memory, then the peer's results out of it. The
// second copy reads what the other core has just written, as every copy path must (a copy of
// local data would miss the cross-core transfer, which costs 2x on some placements of the cores).
bool bench_memcpy(std::map<size_t, double>& us) {
  std::barrier sync(2);
  std::vector<std::thread> threads;
  std::map<size_t, double> other;
  std::vector<float> shared[2];
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      for (size_t m : kSizes) {
        const size_t half = m - m / 2;  // what the peer reduces: (N-1)/N of the buffer, rounded up
        std::vector<float> caller(m, 1.0f);
        shared[r].assign(half, 0.0f);
        sync.arrive_and_wait();
        const double t = time_calls(m, [&] {
          std::memcpy(shared[r].data(), caller.data(), half * sizeof(float));
          sync.arrive_and_wait();
          std::memcpy(caller.data(), shared[1 - r].data(), half * sizeof(float));
          sync.arrive_and_wait();
        });
        (r == 0 ? us : other)[m] = t;
        sync.arrive_and_wait();
      }
    });
  }
  for (auto& t : threads) t.join();
  return us.size() == kSizes.size();
}

std::string label(size_t m) {
  if (m >= (1u << 20)) return std::to_string(m >> 20) + "M";
  if (m >= 1024) return std::to_string(m >> 10) + "K";
  return std::to_string(m);
}

// ---- --matrix ----
const std::vector<size_t> kMatrixSizes = {1024, 8192, 65536, 1u << 20, 16u << 20};

struct Config {
  int n;
  bool in_place, pin;
};

// One forked shm group of cfg.n ranks over kMatrixSizes: the copy path (staged through the
// segment when `staged`), and zero copy unless staged; rank 0's medians come back through a pipe.
bool matrix_shm(const Config& cfg, bool staged, std::map<size_t, double>& copy_us, std::map<size_t, double>& zero_us) {
  int fds[2];
  if (pipe(fds) != 0) return false;
  const std::string name = "bench-" + std::to_string(getpid()) + (staged ? "-staged" : "");
  std::vector<pid_t> pids;
  for (int r = 0; r < cfg.n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      if (cfg.pin) pin_to_cpu(r);
      if (staged) setenv("GRADSYNC_SHM_CROSS_PROCESS", "0", 1);
      auto comm = gc::create(shm_options(name, r, cfg.n, std::chrono::milliseconds(120000)));
      for (size_t m : kMatrixSizes) {
        const double copy = run_size(*comm, m, false, cfg.in_place);
        const double zero = staged ? NAN : run_size(*comm, m, true, cfg.in_place);
        if (r == 0) dprintf(fds[1], "%zu %.6f %.6f\n", m, copy, zero);
      }
      comm = nullptr;
      _exit(0);
    }
    pids.push_back(pid);
  }
  return collect(fds, pids, kMatrixSizes.size(), copy_us, zero_us);
}

bool matrix_threads(const Config& cfg, std::map<size_t, double>& us) {
  std::vector<std::thread> threads;
  std::vector<std::map<size_t, double>> per(static_cast<size_t>(cfg.n));
  std::atomic<bool> ok{true};
  for (int r = 0; r < cfg.n; ++r) {
    threads.emplace_back([&, r] {
      try {
        if (cfg.pin) pin_to_cpu(r);
        gc::Options o;
        o.transport = gc::Transport::Thread;
        o.rank = r;
        o.size = cfg.n;
        o.name = "bench-matrix-threads";
        o.timeout = std::chrono::milliseconds(120000);
        auto comm = gc::create(o);
        for (size_t m : kMatrixSizes) per[static_cast<size_t>(r)][m] = run_size(*comm, m, false, cfg.in_place);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "thread transport: %s\n", e.what());
        ok = false;
      }
    });
  }
  for (auto& t : threads) t.join();
  us = per[0];
  return ok;
}

// Median nanoseconds of a cache-line round trip between two threads pinned to CPUs 0 and 1.
double cross_core_round_trip_ns() {
  if (std::thread::hardware_concurrency() < 2) return NAN;
  alignas(64) std::atomic<long> flag{0};
  constexpr int kTrips = 20000;
  std::thread peer([&] {
    pin_to_cpu(1);
    for (int i = 0; i < kTrips; ++i) {
      while (flag.load(std::memory_order_acquire) != 2 * i + 1) {
      }
      flag.store(2 * i + 2, std::memory_order_release);
    }
  });
  cpu_set_t old;
  sched_getaffinity(0, sizeof old, &old);
  pin_to_cpu(0);
  std::vector<double> ns;
  for (int i = 0; i < kTrips; ++i) {
    const auto a = Clock::now();
    flag.store(2 * i + 1, std::memory_order_release);
    while (flag.load(std::memory_order_acquire) != 2 * i + 2) {
    }
    ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - a).count());
  }
  peer.join();
  sched_setaffinity(0, sizeof old, &old);
  return median(ns);
}

int matrix(const char* self) {
  std::printf("allreduce f32 sum; median us per call; speed = raw MPI's time over the path's (>1: faster than MPI)\n");
  std::printf("copy: ordinary buffers as the library runs them; staged: the same through the segment's stages\n");
  std::printf("(GRADSYNC_SHM_CROSS_PROCESS=0); 0-copy: buffers from comm.alloc; xcore: cache-line round trip, ns\n");
  std::printf("%-16s | %9s %9s %9s %9s %9s | %6s %6s %6s %6s | %6s\n", "N place pin M", "raw MPI", "copy", "staged",
              "0-copy", "threads", "copy", "staged", "0-copy", "thr", "xcore");
  for (int n : {2, 4}) {
    for (bool in_place : {false, true}) {
      for (bool pin : {false, true}) {
        const Config cfg{n, in_place, pin};
        const double xcore = cross_core_round_trip_ns();
        std::map<size_t, double> mpi, copy, zero, staged, unused, threads;
        // Open MPI binds 2 ranks to cores by default; unpinned means unbound here, as for the library.
        const std::string flags = pin ? "--map-by core --bind-to core:overload-allowed" : "--bind-to none";
        const bool have_mpi = bench::raw_mpi(self, n, std::string("matrix ") + (in_place ? "in" : "out"),
                                             kMatrixSizes.size(), mpi, flags);
        if (!matrix_shm(cfg, false, copy, zero) || !matrix_shm(cfg, true, staged, unused)) {
          std::fprintf(stderr, "shm_bench: the shared-memory run failed\n");
          return 1;
        }
        const bool have_threads = matrix_threads(cfg, threads);
        for (size_t m : kMatrixSizes) {
          const double raw = have_mpi ? mpi[m] : NAN;
          const double thr = have_threads ? threads[m] : NAN;
          char key[64];
          std::snprintf(key, sizeof key, "%d %s %s %s", n, in_place ? "in" : "out", pin ? "pin" : "free",
                        label(m).c_str());
          std::printf("%-16s | %9.2f %9.2f %9.2f %9.2f %9.2f | %6.2f %6.2f %6.2f %6.2f | %6.0f\n", key, raw, copy[m],
                      staged[m], zero[m], thr, raw / copy[m], raw / staged[m], raw / zero[m], raw / thr, xcore);
        }
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--mpi-raw") == 0) {
#if GRADSYNC_HAVE_MPI
    const bool of_matrix = argc > 2 && std::strcmp(argv[2], "matrix") == 0;
    g_matrix = of_matrix;
    const bool in_place = !(argc > 3 && std::strcmp(argv[3], "out") == 0);
    return bench::raw_mpi_rank(
        argc, argv, of_matrix ? kMatrixSizes : kSizes,
        [](size_t m, const std::function<void()>& call) { return time_calls(m, call); }, in_place);
#else
    return 1;
#endif
  }
  if (argc > 1 && std::strcmp(argv[1], "--matrix") == 0) {
    g_matrix = true;
    return matrix(argv[0]);
  }
  std::map<size_t, double> mpi, copy, zero, threads;
  const bool have_mpi = bench::raw_mpi(argv[0], 2, "", kSizes.size(), mpi);
  if (!bench_shm(copy, zero)) {
    std::fprintf(stderr, "shm_bench: the shared-memory run failed\n");
    return 1;
  }
  const bool have_threads = bench_threads(threads);
  std::map<size_t, double> copies;
  if (!bench_memcpy(copies)) {
    std::fprintf(stderr, "shm_bench: the memcpy floor's run failed\n");
    return 1;
  }

  std::printf("allreduce, 2 ranks, f32, in place; median us per call (algbw GB/s = 4M/t)\n");
  std::printf("%6s | %10s | %10s %7s %8s | %10s %10s | %10s %8s | %10s %12s\n", "M", "raw MPI", "shm copy", "GB/s",
              "vs MPI", "copy floor", "floor/copy", "shm 0-copy", "GB/s", "threads", "0-copy/thr");
  for (size_t m : kSizes) {
    const double gb = 4.0 * double(m) / 1e3;  // bytes / us -> GB/s
    // Below 64K floats the floor's own barrier dominates: it says nothing there.
    const double floor = m >= 65536 ? zero[m] + copies[m] : NAN;
    std::printf("%6s | %10.2f | %10.2f %7.2f %7.2fx | %10.2f %9.0f%% | %10.2f %8.2f | %10.2f %11.2fx\n",
                label(m).c_str(), have_mpi ? mpi[m] : NAN, copy[m], gb / copy[m], have_mpi ? mpi[m] / copy[m] : NAN,
                floor, 100.0 * floor / copy[m], zero[m], gb / zero[m], have_threads ? threads[m] : NAN,
                have_threads ? threads[m] / zero[m] : NAN);
  }
  const size_t big = 16u << 20;
  std::printf("\ntargets:\n");
  if (have_mpi) {
    std::printf("  copy path at 16M >= 4x raw MPI:      %.2fx  %s (its memcpy floor here is %.2fx raw MPI)\n",
                mpi[big] / copy[big], mpi[big] / copy[big] >= 4.0 ? "MET" : "MISSED",
                mpi[big] / (zero[big] + copies[big]));
    std::printf("  1 float <= 2x raw MPI's time:        %.2fx  %s\n", copy[1] / mpi[1],
                copy[1] / mpi[1] <= 2.0 ? "MET" : "MISSED");
  } else {
    std::printf("  raw MPI baseline unavailable (no MPI in this build, or mpirun failed)\n");
  }
  const double floor_ratio = (zero[big] + copies[big]) / copy[big];
  std::printf("  copy path at 16M >= 0.9x its floor:  %.2fx  %s\n", floor_ratio, floor_ratio >= 0.9 ? "MET" : "MISSED");
  if (have_threads) {
    double worst = INFINITY;  // threads' time over zero copy's, from 64K floats
    for (size_t m : kSizes) {
      if (m >= 65536) worst = std::min(worst, threads[m] / zero[m]);
    }
    std::printf("  zero copy from 64K <= 1.1x threads:  %.2fx  %s (the slowest size's time over threads')\n",
                1.0 / worst, 1.0 / worst <= 1.1 ? "MET" : "MISSED");
  }
  std::printf("(medians of %d..%d calls per size; machine: %u hardware threads, shared and possibly loaded)\n",
              iterations(big), iterations(1), std::thread::hardware_concurrency());
  return 0;
}
