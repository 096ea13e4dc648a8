// SPDX-License-Identifier: Apache-2.0
// The MPI transport beside raw MPI_Allreduce (bench/mpi/run.sh [np]):
// - allreduce of M floats, M in {1, 1K, 4K, 64K, 256K, 1M, 16M} (4K: the most the small path carries
//   at up to 4 ranks; 256K: where deterministic mode of two ranks swaps whole copies): raw MPI_Allreduce, the transport
//   with its defaults, and in deterministic (rank-order) mode, in place, or out of place ("out" as the third argument:
//   every variant, raw MPI too); each run interleaves the three, and the table gives min / median / max over the runs
//   of each one's median time, and of its ratio to raw MPI's median in the same run.
// - 256 buffers of 4K floats: one fused allreduce beside 256 separate raw MPI_Allreduce calls.
#define OMPI_SKIP_MPICXX 1  // C bindings only
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/create.hpp"
#include "measure.hpp"

using namespace gradsync;
using namespace gradsync::comm;
using gradsync::bench::measure;
using gradsync::bench::median;
using gradsync::bench::Variant;

namespace {

std::unique_ptr<Communicator> make(bool deterministic) {
  Options o;
  o.transport = Transport::Mpi;
  o.deterministic = deterministic;
  o.timeout = std::chrono::milliseconds(120000);
  return create(o);
}

struct Spread {
  double min, med, max;
};
Spread spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v.front(), v[v.size() / 2], v.back()};
}

}  // namespace

int main(int argc, char** argv) {
  // [runs [largest size in floats [in|out]]]
  const int runs = argc > 1 ? std::max(1, std::atoi(argv[1])) : 5;
  const size_t largest = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : size_t{16} << 20;
  const bool out_of_place = argc > 3 && std::string(argv[3]) == "out";
  auto plain = make(false);  // initialises MPI
  auto deterministic = make(true);
  MPI_Comm raw;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  int rank = 0, size = 0;
  MPI_Comm_rank(raw, &rank);
  MPI_Comm_size(raw, &size);
  if (rank == 0) {
    double load = 0;
    std::ifstream("/proc/loadavg") >> load;
    std::printf(
        "MPI transport vs raw MPI_Allreduce (f32 sum, %s), %d ranks, %d runs; per run the median of the "
        "slowest rank's time per call; min / median / max over the runs (load average %.1f)\n\n",
        out_of_place ? "out of place" : "in place", size, runs, load);
    std::printf("| floats | raw MPI us | default us | default / raw | deterministic us | deterministic / raw |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|\n");
  }
  for (size_t m : {size_t{1}, size_t{1} << 10, size_t{4} << 10, size_t{64} << 10, size_t{256} << 10, size_t{1} << 20,
                   size_t{16} << 20}) {
    if (m > largest) break;
    std::vector<float> a(m, 0.0f), b(m, 0.0f), d(m, 0.0f), to(out_of_place ? m : 0);
    const BufferRef rb{b.data(), out_of_place ? to.data() : b.data(), m},
        rd{d.data(), out_of_place ? to.data() : d.data(), m};
    const void* raw_from = out_of_place ? a.data() : MPI_IN_PLACE;
    float* raw_to = out_of_place ? to.data() : a.data();
    // One call per sample for large sizes (ranks meet in a barrier first), short batches for small
    // ones; variants rotate, so that a shared machine's bursts fall on all of them alike.
    const int batch = m <= 1024 ? 20 : 1;
    const int reps = m >= (16 << 20) ? 5 : m >= (1 << 20) ? 15 : 41;
    std::vector<double> t_raw, t_def, t_det, r_def, r_det;
    for (int run = 0; run < runs; ++run) {
      std::vector<Variant> v{
          {"raw", [&] { MPI_Allreduce(raw_from, raw_to, static_cast<int>(m), MPI_FLOAT, MPI_SUM, raw); }, {}},
          {"default", [&] { plain->allreduce(std::span<const BufferRef>(&rb, 1), DType::F32, ReduceOp::Sum); }, {}},
          {"determ",
           [&] { deterministic->allreduce(std::span<const BufferRef>(&rd, 1), DType::F32, ReduceOp::Sum); },
           {}},
      };
      measure(v, reps, batch, raw);
      const double base = median(v[0].per_call), def = median(v[1].per_call), det = median(v[2].per_call);
      t_raw.push_back(base * 1e6);
      t_def.push_back(def * 1e6);
      t_det.push_back(det * 1e6);
      r_def.push_back(def / base);
      r_det.push_back(det / base);
    }
    if (rank == 0) {
      const Spread a1 = spread(t_raw), b1 = spread(t_def), c1 = spread(r_def), d1 = spread(t_det), e1 = spread(r_det);
      std::printf(
          "| %zu | %.2f / %.2f / %.2f | %.2f / %.2f / %.2f | %.2f / %.2f / %.2f | %.2f / %.2f / %.2f | %.2f / "
          "%.2f / %.2f |\n",
          m, a1.min, a1.med, a1.max, b1.min, b1.med, b1.max, c1.min, c1.med, c1.max, d1.min, d1.med, d1.max, e1.min,
          e1.med, e1.max);
      std::fflush(stdout);
    }
  }

  if (largest < (size_t{16} << 20)) return 0;
  // Fused: 256 buffers of 4K floats.
  constexpr size_t kBuffers = 256, kCount = 4096;
  std::vector<std::vector<float>> raw_bufs(kBuffers, std::vector<float>(kCount, 1.0f)), fused_bufs = raw_bufs;
  std::vector<BufferRef> fused_refs;
  for (size_t i = 0; i < kBuffers; ++i) fused_refs.push_back({fused_bufs[i].data(), fused_bufs[i].data(), kCount});
  std::vector<Variant> f{
      {"256 raw",
       [&] {
         for (auto& buf : raw_bufs) MPI_Allreduce(MPI_IN_PLACE, buf.data(), kCount, MPI_FLOAT, MPI_SUM, raw);
       },
       {}},
      {"fused", [&] { plain->allreduce(fused_refs, DType::F32, ReduceOp::Sum); }, {}},
  };
  measure(f, 21, 1, raw);
  const double base = median(f[0].per_call);
  if (rank == 0) {
    std::printf("\n%zu buffers x %zu floats (f32 sum): median time per round\n", kBuffers, kCount);
    std::printf("  256 separate raw MPI_Allreduce : %9.1f us\n", base * 1e6);
    std::printf("  fused allreduce (default)      : %9.1f us  speed-up %.2fx\n", median(f[1].per_call) * 1e6,
                base / median(f[1].per_call));
  }
  MPI_Comm_free(&raw);
  return 0;
}
