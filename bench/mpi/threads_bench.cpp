// SPDX-License-Identifier: Apache-2.0
// Threads as ranks (comm.h) beside what a program without them writes with MPI, on the same
// processes, in the same run: each of T threads per process holds M floats to all-reduce over
// every thread of every process. The library: a threaded group (options.threads), one allreduce
// per thread. The baseline, by hand: the threads meet at a barrier, thread 0 adds the T buffers
// into its own, calls MPI_Allreduce over the processes, and the threads copy the result out after
// a second barrier (the plain form of MPI_THREAD_FUNNELED hybrid code).
//
//   mpirun -np P threads_bench mpi|hier [THREADS] [REPS]
// (tests/multihost/hosts.py --layout 1,1 -- build/bench/mpi/threads_bench hier 2 runs it on 2
// separate hosts made of namespaces.)
//
// Each figure: min / median / max over REPS interleaved repetitions of the slowest process's time
// per call (a batch of calls timed by thread 0 between MPI barriers); the ratio is the baseline's
// median over the library's (> 1: the library is faster).
#define OMPI_SKIP_MPICXX 1  // C bindings only
#include <mpi.h>

#include <algorithm>
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/gradsync.h"

namespace {

struct Spread {
  double min, med, max;
};
Spread spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v.front(), v[v.size() / 2], v.back()};
}

std::string human(double s) {
  char b[32];
  std::snprintf(b, sizeof b, s < 1e-3 ? "%.1f us" : "%.2f ms", s < 1e-3 ? s * 1e6 : s * 1e3);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  const bool hier = argc > 1 && std::strcmp(argv[1], "hier") == 0;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 2;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 7;
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, procs = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &procs);

  std::vector<gradsync_comm*> comms(static_cast<size_t>(threads), nullptr);
  {
    std::vector<std::thread> make;
    for (int t = 0; t < threads; ++t) {
      make.emplace_back([&, t] {
        gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
        o.transport = hier ? GRADSYNC_TRANSPORT_HIER : GRADSYNC_TRANSPORT_MPI;
        o.threads = threads;
        o.thread = t;
        o.deterministic = 1;
        std::snprintf(o.name, sizeof o.name, "threads-bench");
        if (gradsync_comm_create(&comms[static_cast<size_t>(t)], &o) != GRADSYNC_OK) {
          std::fprintf(stderr, "create: %s\n", gradsync_last_error_message());
          std::exit(1);
        }
      });
    }
    for (auto& m : make) m.join();
  }
  if (rank == 0) {
    std::printf("threads as ranks (%s transport): %d processes x %d threads, allreduce of M floats per rank\n",
                hier ? "hierarchical" : "MPI", procs, threads);
    std::printf("%-9s %-30s %-30s %s\n", "M", "library (min/med/max)", "by hand, MPI (min/med/max)", "ratio");
  }

  for (const size_t m : {size_t{1024}, size_t{65536}, size_t{1} << 20, size_t{1} << 22}) {
    const int batch = m <= 65536 ? 20 : 3;
    std::vector<std::vector<float>> data(static_cast<size_t>(threads), std::vector<float>(m));
    std::vector<double> lib, hand;
    std::barrier sync(threads);
    // variant 0: the library; 1: by hand. Thread 0 times a batch between MPI barriers.
    auto run = [&](int variant, int t, double* per_call) {
      std::vector<float>& mine = data[static_cast<size_t>(t)];
      sync.arrive_and_wait();
      double t0 = 0;
      if (t == 0) {
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
      }
      sync.arrive_and_wait();
      for (int i = 0; i < batch; ++i) {
        std::fill(mine.begin(), mine.end(), 1.0f);
        if (variant == 0) {
          if (gradsync_comm_allreduce(comms[static_cast<size_t>(t)], mine.data(), mine.data(), m, GRADSYNC_F32,
                                      GRADSYNC_SUM) != GRADSYNC_OK) {
            std::fprintf(stderr, "allreduce: %s\n", gradsync_last_error_message());
            std::exit(1);
          }
        } else {
          sync.arrive_and_wait();
          if (t == 0) {
            for (int u = 1; u < threads; ++u) {
              const float* other = data[static_cast<size_t>(u)].data();
              for (size_t k = 0; k < m; ++k) mine[k] += other[k];
            }
            MPI_Allreduce(MPI_IN_PLACE, mine.data(), static_cast<int>(m), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
          }
          sync.arrive_and_wait();
          if (t != 0) std::memcpy(mine.data(), data[0].data(), m * sizeof(float));
        }
      }
      sync.arrive_and_wait();
      if (t == 0) {
        double per = (MPI_Wtime() - t0) / batch;
        MPI_Allreduce(MPI_IN_PLACE, &per, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        *per_call = per;
      }
    };
    for (int rep = -1; rep < reps; ++rep) {  // rep -1: warm-up
      for (int k = 0; k < 2; ++k) {
        const int variant = (k + rep + 2) % 2;  // alternate which goes first
        double per_call = 0;
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t) ts.emplace_back(run, variant, t, &per_call);
        for (auto& x : ts) x.join();
        if (rep >= 0) (variant == 0 ? lib : hand).push_back(per_call);
      }
    }
    const float want = static_cast<float>(threads * procs);
    for (const auto& d : data)
      if (d[0] != want || d[m - 1] != want) {
        std::fprintf(stderr, "wrong result: %g, expected %g\n", static_cast<double>(d[0]), static_cast<double>(want));
        return 1;
      }
    if (rank == 0) {
      const Spread a = spread(lib), b = spread(hand);
      const std::string la = human(a.min) + " / " + human(a.med) + " / " + human(a.max);
      const std::string lb = human(b.min) + " / " + human(b.med) + " / " + human(b.max);
      std::printf("%-9zu %-30s %-30s %.2fx\n", m, la.c_str(), lb.c_str(), b.med / a.med);
      std::fflush(stdout);
    }
  }
  for (gradsync_comm* c : comms) gradsync_comm_free(c);
  MPI_Finalize();
  return 0;
}
