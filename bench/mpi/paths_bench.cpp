// SPDX-License-Identifier: Apache-2.0
// Every allreduce path of one host beside raw MPI_Allreduce on the same processes, in the same run
// (bench/mpi/run.sh paths [np]): out of place, f32 sum, of M floats, the variants interleaved
// (measure.hpp) and each sample the slowest rank's time per call:
//   raw      MPI_Allreduce(send, recv) on a duplicate of MPI_COMM_WORLD
//   mpi      the MPI transport with its defaults
//   copy     the shm transport on ordinary buffers, as it runs (owner slices through the kernel
//            where ranks reach each other's processes and each has a CPU, else staged)
//   staged   the same through the segment's stages (its group formed with
//            GRADSYNC_SHM_CROSS_PROCESS=0)
//   0-copy   the shm transport on buffers from comm.alloc
// With --trigger CMD each run measures three phases in the same processes: before CMD, while it
// runs (rank 0 starts it with sh -c in a process group of its own), and after it was killed; a mode
// that outlives its cause shows in the third. Prints min / median / max over the runs of each
// path's median and of its time over raw MPI's in the same phase of the same run.
//   mpi_paths_bench [--runs R] [--sizes 1024,65536,...] [--trigger CMD] [--settle-ms T]
#define OMPI_SKIP_MPICXX 1  // C bindings only
#include <mpi.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/create.hpp"
#include "measure.hpp"

using namespace gradsync;
using namespace gradsync::comm;
using gradsync::bench::measure;
using gradsync::bench::median;
using gradsync::bench::Spread;
using gradsync::bench::spread;
using gradsync::bench::Variant;

namespace {

double load_average() {
  double load = 0;
  std::ifstream("/proc/loadavg") >> load;
  return load;
}

std::unique_ptr<Communicator> shm_group(const std::string& name, int rank, int size, bool staged) {
  if (staged) setenv("GRADSYNC_SHM_CROSS_PROCESS", "0", 1);
  Options o;
  o.transport = Transport::Shm;
  o.name = name;
  o.rank = rank;
  o.size = size;
  o.timeout = std::chrono::milliseconds(120000);
  auto comm = create(o);
  if (staged) unsetenv("GRADSYNC_SHM_CROSS_PROCESS");
  return comm;
}

// The trigger: `sh -c cmd` in a process group of its own, so that killing the group ends whatever
// it started.
pid_t start_trigger(const std::string& cmd) {
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  setpgid(pid, pid);
  return pid;
}

void stop_trigger(pid_t pid) {
  kill(-pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

const char* const kPaths[] = {"raw", "mpi", "copy", "staged", "0-copy"};
constexpr size_t kNumPaths = sizeof(kPaths) / sizeof(kPaths[0]);

}  // namespace

int main(int argc, char** argv) {
  int runs = 5;
  std::vector<size_t> sizes = {1024, 65536, size_t{1} << 20, size_t{16} << 20};
  std::string trigger;
  int settle_ms = 1000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--runs") {
      runs = std::max(1, std::atoi(argv[i + 1]));
    } else if (flag == "--sizes") {
      sizes.clear();
      for (const char* p = argv[i + 1]; *p != '\0';) {
        char* end = nullptr;
        sizes.push_back(std::strtoull(p, &end, 10));
        p = *end == ',' ? end + 1 : end;
      }
    } else if (flag == "--trigger") {
      trigger = argv[i + 1];
    } else if (flag == "--settle-ms") {
      settle_ms = std::atoi(argv[i + 1]);
    }
  }
  Options mo;
  mo.transport = Transport::Mpi;
  mo.timeout = std::chrono::milliseconds(120000);
  auto mpi = create(mo);  // initialises MPI
  MPI_Comm raw;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  int rank = 0, size = 0;
  MPI_Comm_rank(raw, &rank);
  MPI_Comm_size(raw, &size);
  int job = rank == 0 ? static_cast<int>(getpid()) : 0;
  MPI_Bcast(&job, 1, MPI_INT, 0, raw);
  const std::string name = "paths-bench-" + std::to_string(job);
  auto copy = shm_group(name, rank, size, false);
  auto staged = shm_group(name + "-staged", rank, size, true);

  const std::vector<std::string> phases =
      trigger.empty() ? std::vector<std::string>{"normal"} : std::vector<std::string>{"before", "during", "after"};
  // [phase][size][path] -> per-run medians (us) and ratios to raw.
  std::map<std::string, std::map<size_t, std::vector<std::vector<double>>>> us, ratio;
  const double load_before = load_average();
  for (int run = 0; run < runs; ++run) {
    for (const std::string& phase : phases) {
      pid_t hog = 0;
      if (phase == "during" && rank == 0) hog = start_trigger(trigger);
      if (phase != "before" && phase != "normal") {
        std::this_thread::sleep_for(std::chrono::milliseconds(settle_ms));
      }
      MPI_Barrier(raw);
      for (size_t m : sizes) {
        std::vector<float> send(m, 1.0f), recv(m, 0.0f), send2(m, 1.0f), recv2(m, 0.0f), send3(m, 1.0f), recv3(m, 0.0f),
            send4(m, 1.0f), recv4(m, 0.0f);
        auto* zs = static_cast<float*>(copy->alloc(m * sizeof(float)));
        auto* zr = static_cast<float*>(copy->alloc(m * sizeof(float)));
        std::fill(zs, zs + m, 1.0f);
        const BufferRef b_mpi{send2.data(), recv2.data(), m}, b_copy{send3.data(), recv3.data(), m},
            b_staged{send4.data(), recv4.data(), m}, b_zero{zs, zr, m};
        auto one = [](Communicator& c, const BufferRef& b) {
          c.allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum);
        };
        std::vector<Variant> v{
            {kPaths[0],
             [&] { MPI_Allreduce(send.data(), recv.data(), static_cast<int>(m), MPI_FLOAT, MPI_SUM, raw); },
             {}},
            {kPaths[1], [&] { one(*mpi, b_mpi); }, {}},
            {kPaths[2], [&] { one(*copy, b_copy); }, {}},
            {kPaths[3], [&] { one(*staged, b_staged); }, {}},
            {kPaths[4], [&] { one(*copy, b_zero); }, {}},
        };
        const int batch = m <= 1024 ? 50 : m <= 65536 ? 10 : 1;
        const int reps = m >= (16u << 20) ? 5 : m >= (1u << 20) ? 15 : 31;
        measure(v, reps, batch, raw);
        // Every path's result, checked once per size and phase: a fast wrong path is no figure.
        const float want = static_cast<float>(size);
        for (const float* r :
             std::initializer_list<const float*>{recv.data(), recv2.data(), recv3.data(), recv4.data(), zr}) {
          if (r[0] != want || r[m - 1] != want) {
            std::fprintf(stderr, "paths_bench: wrong result %g at M=%zu\n", static_cast<double>(r[0]), m);
            MPI_Abort(MPI_COMM_WORLD, 1);
          }
        }
        auto& u = us[phase][m];
        auto& q = ratio[phase][m];
        u.resize(kNumPaths);
        q.resize(kNumPaths);
        const double base = median(v[0].per_call);
        for (size_t p = 0; p < kNumPaths; ++p) {
          u[p].push_back(median(v[p].per_call) * 1e6);
          q[p].push_back(median(v[p].per_call) / base);
        }
        copy->dealloc(zs);
        copy->dealloc(zr);
      }
      if (hog != 0) stop_trigger(hog);
      MPI_Barrier(raw);
    }
  }
  if (rank == 0) {
    std::printf(
        "allreduce f32 sum, out of place, np %d, %d runs; per run the median of the slowest rank's time per "
        "call; min / median / max over the runs (load average %.1f before, %.1f after)\n",
        size, runs, load_before, load_average());
    if (!trigger.empty()) std::printf("trigger: %s (settle %d ms)\n", trigger.c_str(), settle_ms);
    std::printf("\n| phase | floats | path | us | time / raw MPI's |\n|---|---:|---|---:|---:|\n");
    for (const std::string& phase : phases) {
      for (size_t m : sizes) {
        for (size_t p = 0; p < kNumPaths; ++p) {
          const Spread t = spread(us[phase][m][p]), r = spread(ratio[phase][m][p]);
          std::printf("| %s | %zu | %s | %.1f / %.1f / %.1f | %.2f / %.2f / %.2f |\n", phase.c_str(), m, kPaths[p],
                      t.min, t.med, t.max, r.min, r.med, r.max);
        }
      }
    }
  }
  MPI_Comm_free(&raw);
  staged = nullptr;
  copy = nullptr;
  return 0;
}
