// SPDX-License-Identifier: Apache-2.0
// The MPI transport beside raw MPI_Allreduce, 2 ranks (bench/mpi/run.sh):
// - allreduce of M floats, M in {1, 1K, 64K, 1M, 16M}: raw MPI_Allreduce; the transport with its
//   default fingerprint check; with the check off (a plain Ibarrier rendezvous keeps the
//   deadline); and in deterministic (rank-order) mode.
// - 256 buffers of 4K floats: one fused allreduce beside 256 separate raw MPI_Allreduce calls.
// Each figure is the median over interleaved samples of the slowest rank's time per call.
#define OMPI_SKIP_MPICXX 1  // C bindings only
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "measure.hpp"

using namespace gradsync;
using namespace gradsync::comm;
using gradsync::bench::measure;
using gradsync::bench::median;
using gradsync::bench::Variant;

namespace {

std::unique_ptr<Communicator> make(bool deterministic, bool check) {
  Options o;
  o.transport = Transport::Mpi;
  o.deterministic = deterministic;
  o.check_mismatch = check;
  o.timeout = std::chrono::milliseconds(120000);
  return create(o);
}

}  // namespace

int main() {
  auto fingerprint = make(false, true);  // initialises MPI
  auto unchecked = make(false, false);
  auto deterministic = make(true, true);
  MPI_Comm raw;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  int rank = 0, size = 0;
  MPI_Comm_rank(raw, &rank);
  MPI_Comm_size(raw, &size);
  if (rank == 0) {
    double load = 0;
    std::ifstream("/proc/loadavg") >> load;
    std::printf("MPI transport vs raw MPI_Allreduce (f32 sum), %d ranks; median of the slowest rank's time per call "
                "(load average %.1f)\n\n",
                size, load);
    std::printf("%10s | %12s | %12s %8s | %12s %8s | %12s %8s\n", "floats", "raw MPI us", "default us", "vs raw",
                "no-check us", "vs raw", "determ. us", "vs raw");
  }
  for (size_t m : {size_t{1}, size_t{1} << 10, size_t{64} << 10, size_t{1} << 20, size_t{16} << 20}) {
    std::vector<float> a(m, 0.0f), b(m, 0.0f), c(m, 0.0f), d(m, 0.0f);
    const BufferRef rb{b.data(), b.data(), m}, rc{c.data(), c.data(), m}, rd{d.data(), d.data(), m};
    std::vector<Variant> v{
        {"raw", [&] { MPI_Allreduce(MPI_IN_PLACE, a.data(), static_cast<int>(m), MPI_FLOAT, MPI_SUM, raw); }, {}},
        {"default", [&] { fingerprint->allreduce(std::span<const BufferRef>(&rb, 1), DType::F32, ReduceOp::Sum); }, {}},
        {"no-check", [&] { unchecked->allreduce(std::span<const BufferRef>(&rc, 1), DType::F32, ReduceOp::Sum); }, {}},
        {"determ", [&] { deterministic->allreduce(std::span<const BufferRef>(&rd, 1), DType::F32, ReduceOp::Sum); }, {}},
    };
    // One call per sample (ranks meet in a barrier first), many samples, variants rotating: the
    // median then shrugs off a shared machine's bursts better than long back-to-back batches.
    const int batch = m <= 1024 ? 10 : 1;
    const int reps = m >= (16 << 20) ? 21 : m >= (1 << 20) ? 101 : 201;
    measure(v, reps, batch, raw);
    const double base = median(v[0].per_call);
    if (rank == 0) {
      std::printf("%10zu | %12.1f |", m, base * 1e6);
      for (size_t k = 1; k < v.size(); ++k) {
        const double t = median(v[k].per_call);
        std::printf(" %12.1f %+7.1f%% |", t * 1e6, (t / base - 1.0) * 100.0);
      }
      std::printf("\n");
    }
  }

  // Fused: 256 buffers of 4K floats.
  constexpr size_t kBuffers = 256, kCount = 4096;
  std::vector<std::vector<float>> raw_bufs(kBuffers, std::vector<float>(kCount, 1.0f)), fused_bufs = raw_bufs,
                                  det_bufs = raw_bufs;
  std::vector<BufferRef> fused_refs, det_refs;
  for (size_t i = 0; i < kBuffers; ++i) {
    fused_refs.push_back({fused_bufs[i].data(), fused_bufs[i].data(), kCount});
    det_refs.push_back({det_bufs[i].data(), det_bufs[i].data(), kCount});
  }
  std::vector<Variant> f{
      {"256 raw", [&] {
         for (auto& buf : raw_bufs) MPI_Allreduce(MPI_IN_PLACE, buf.data(), kCount, MPI_FLOAT, MPI_SUM, raw);
       }, {}},
      {"fused", [&] { fingerprint->allreduce(fused_refs, DType::F32, ReduceOp::Sum); }, {}},
      {"fused determ", [&] { deterministic->allreduce(det_refs, DType::F32, ReduceOp::Sum); }, {}},
  };
  measure(f, 41, 1, raw);
  const double base = median(f[0].per_call);
  if (rank == 0) {
    std::printf("\n%zu buffers x %zu floats (f32 sum): median time per round\n", kBuffers, kCount);
    std::printf("  256 separate raw MPI_Allreduce : %9.1f us\n", base * 1e6);
    std::printf("  fused allreduce (default)      : %9.1f us  speed-up %.2fx (target >= 1.5x)\n",
                median(f[1].per_call) * 1e6, base / median(f[1].per_call));
    std::printf("  fused allreduce (deterministic): %9.1f us  speed-up %.2fx\n", median(f[2].per_call) * 1e6,
                base / median(f[2].per_call));
    std::printf("\nTarget: the default's overhead <= 5%% at >= 64K floats.\n");
  }
  MPI_Comm_free(&raw);
  return 0;
}
