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
//   shm_bench --mpi-raw  (internal) one MPI rank of the raw baseline
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"
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

// Times `call` (per call, in microseconds) after a warm-up of half as many calls; returns the median.
template <class F>
double time_calls(size_t m, F&& call) {
  const int n = iterations(m);
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
double run_size(gc::Communicator& comm, size_t m, bool zero_copy) {
  {
    float* data = nullptr;
    std::vector<float> own;
    if (zero_copy) {
      data = static_cast<float*>(comm.alloc(m * sizeof(float)));
    } else {
      own.resize(m);
      data = own.data();
    }
    std::fill(data, data + m, 1.0f);
    const gc::BufferRef buf{data, data, m};
    comm.allreduce(std::span<const gc::BufferRef>(&buf, 1), gradsync::DType::F32, gradsync::ReduceOp::Sum);
    if (data[0] != 2.0f || data[m - 1] != 2.0f) {
      std::fprintf(stderr, "shm_bench: wrong result %g at M=%zu\n", double(data[0]), m);
      std::exit(1);
    }
    // Mean keeps the values finite over thousands of calls; it costs the same as sum.
    comm.barrier();
    const double us = time_calls(m, [&] {
      comm.allreduce(std::span<const gc::BufferRef>(&buf, 1), gradsync::DType::F32, gradsync::ReduceOp::Mean);
    });
    comm.barrier();
    if (zero_copy) comm.dealloc(data);
    return us;
  }
}

// Both data paths size by size (interleaved, so that both see the same machine load).
void run_rank(gc::Communicator& comm, bool with_zero_copy, std::map<size_t, double>& copy_us,
              std::map<size_t, double>& zero_us) {
  for (size_t m : kSizes) {
    copy_us[m] = run_size(comm, m, false);
    if (with_zero_copy) zero_us[m] = run_size(comm, m, true);
  }
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
      gc::Options o;
      o.transport = gc::Transport::Shm;
      o.rank = r;
      o.size = 2;
      o.name = name;
      o.timeout = std::chrono::milliseconds(60000);
      auto comm = gc::create(o);
      std::map<size_t, double> a, b;
      run_rank(*comm, true, a, b);
      if (r == 0) {
        for (size_t m : kSizes) dprintf(fds[1], "%zu %.6f %.6f\n", m, a[m], b[m]);
      }
      comm = nullptr;  // leave the group before exiting
      _exit(0);
    }
  }
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
  return ok && copy_us.size() == kSizes.size();
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

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--mpi-raw") == 0) {
#if GRADSYNC_HAVE_MPI
    return bench::raw_mpi_rank(argc, argv, kSizes, [](size_t m, const std::function<void()>& call) {
      return time_calls(m, call);
    });
#else
    return 1;
#endif
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
