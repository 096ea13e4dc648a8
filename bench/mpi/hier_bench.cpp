// SPDX-License-Identifier: Apache-2.0
// The hierarchical transport beside flat MPI_Allreduce on the same processes, in the same run:
// allreduce of M floats, M in {1, 1K, 64K, 1M, 16M}, out of place (raw MPI: MPI_Allreduce; the
// library: the hierarchical transport, and the flat MPI transport). Meant for several hosts
// (tests/multihost/hosts.py --layout 2,2 -- build/bench/mpi/hier_bench starts it on separate
// hosts made of namespaces); on one host it shows the shared-memory level alone.
//
// Each figure is the median, over interleaved repetitions, of the slowest rank's time per call;
// each line gives the library's speed as a ratio of raw MPI's (> 1: faster).
//
//   hier_bench [REPS] [--levels] [--scatter]
//
// --scatter measures reduce_scatter and allgather instead, at 64K to 16M floats in all (each rank's
// part 1/size of them), beside raw MPI_Reduce_scatter_block and MPI_Allgather on the same ranks;
// each line gives min / median / max over the reps of the slowest rank's time per call, and the
// ratio of the medians.
//
// --levels adds, at 64K and 1M floats, where a hierarchical allreduce's time goes: each of its
// levels run alone on levels built as the transport builds them (the call check over the whole
// group; the host's shared-memory reduce-scatter and all-gather; the cross-host allreduce of this
// local rank's slice), each beside its own limit in the same run (the shared-memory levels beside
// a memcpy of the buffer; the cross-host level beside raw MPI_Allreduce of the same slice over the
// same ranks, and beside that level's rank-order allreduce, which it replaced for 2 hosts).
#define OMPI_SKIP_MPICXX 1  // C bindings only
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <cstring>

#include "comm/communicator.hpp"
#include "comm/create.hpp"
#include "comm/transport/hier/hier_communicator.hpp"
#include "common/random.hpp"
#include "measure.hpp"

using namespace gradsync;
using namespace gradsync::comm;
using gradsync::bench::measure;
using gradsync::bench::median;
using gradsync::bench::Variant;

namespace {

std::string human(double seconds) {
  char b[32];
  if (seconds < 1e-3)
    std::snprintf(b, sizeof b, "%.1f us", seconds * 1e6);
  else
    std::snprintf(b, sizeof b, "%.2f ms", seconds * 1e3);
  return b;
}

// The levels of a hierarchical allreduce (hier_communicator.cpp), each timed alone.
void levels(Communicator& world, const Topology& t, int reps) {
  MPI_Comm raw_cross = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, t.local_rank, t.host, &raw_cross);
  uint64_t nonce = world.rank() == 0 ? random_nonce() : 0;
  world.broadcast(&nonce, 1, DType::I64, 0);
  Options o;
  o.transport = Transport::Shm;
  o.timeout = std::chrono::milliseconds(300000);
  o.name = "gs-hb" + std::to_string(nonce) + "." + std::to_string(t.host);
  o.rank = t.local_rank;
  o.size = t.local_size;
  auto local = create(o);
  auto cross = world.split(t.local_rank, t.host);
  bool header = true;
  std::vector<std::byte> scratch;
  for (const size_t n : {size_t{1} << 16, size_t{1} << 20}) {
    std::vector<float> send(n, 1.0f + static_cast<float>(world.rank())), recv(n);
    const Part mine = local->my_part(n);
    float* slice = recv.data() + mine.start;
    const int batch = n <= (1u << 16) ? 50 : 5;
    std::vector<Variant> v;
    v.push_back({"check",
                 [&] {
                   std::array<int64_t, 2> e{7, -7};
                   const BufferRef b{e.data(), e.data(), e.size()};
                   world.allreduce(std::span<const BufferRef>(&b, 1), DType::I64, ReduceOp::Max);
                 },
                 {}});
    v.push_back({"shm rs", [&] { local->reduce_scatter(send.data(), slice, n, DType::F32, ReduceOp::Sum); }, {}});
    v.push_back({"memcpy", [&] { std::memcpy(recv.data(), send.data(), n * sizeof(float)); }, {}});
    v.push_back(
        {"cross", [&] { hier_cross_allreduce(*cross, slice, mine.len, DType::F32, ReduceOp::Sum, scratch); }, {}});
    v.push_back({"cross ar",
                 [&] {
                   const BufferRef b{slice, slice, mine.len};
                   cross->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum);
                 },
                 {}});
    v.push_back({"raw cross",
                 [&] { MPI_Allreduce(MPI_IN_PLACE, slice, static_cast<int>(mine.len), MPI_FLOAT, MPI_SUM, raw_cross); },
                 {}});
    v.push_back({"shm ag", [&] { local->allgather(nullptr, recv.data(), n, DType::F32); }, {}});
    measure(v, reps, batch, MPI_COMM_WORLD);
    if (world.rank() == 0 && header) {
      std::printf("\nlevels (a rank's slice: 1/%d of the buffer, all-reduced over %d hosts)\n%10s", t.local_size,
                  t.num_hosts, "floats");
      for (auto& x : v) std::printf(" %10s", x.name.c_str());
      std::printf("\n");
      header = false;
    }
    if (world.rank() == 0) {
      std::printf("%10zu", n);
      for (auto& x : v) std::printf(" %10s", human(median(x.per_call)).c_str());
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  local.reset();
  cross.reset();
  MPI_Comm_free(&raw_cross);
}

struct Spread {
  double min, median, max;
};
Spread spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v.front(), v[v.size() / 2], v.back()};
}
std::string triple(const std::vector<double>& v) {
  const Spread s = spread(v);
  return human(s.min) + " / " + human(s.median) + " / " + human(s.max);
}

// Fails the run unless every element of got is want(i).
template <class Want>
void verify(const char* what, size_t n, const std::vector<float>& got, const Want& want, int rank) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want(i)) continue;
    std::fprintf(stderr, "hier_bench: rank %d: %s of %zu floats: element %zu is %g, not %g\n", rank, what, n, i,
                 static_cast<double>(got[i]), static_cast<double>(want(i)));
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

// Reduce-scatter and allgather of n floats in all (a multiple of the ranks, so that raw MPI's
// block forms apply): raw MPI, the hierarchical transport and the flat MPI transport.
void scatter_gather(Communicator& hier, Communicator& flat, int reps) {
  const int rank = hier.rank(), size = hier.size();
  if (rank == 0) {
    std::printf("\nreduce_scatter and allgather: min / median / max of %d reps, slowest rank\n", reps);
    std::printf("%-6s %9s %32s %32s %7s %32s %7s\n", "", "floats", "raw MPI", "hier", "x raw", "mpi transport",
                "x raw");
  }
  for (const size_t total : {size_t{1} << 16, size_t{1} << 18, size_t{1} << 20, size_t{1} << 22, size_t{1} << 24}) {
    const size_t part = total / static_cast<size_t>(size), n = part * static_cast<size_t>(size);
    std::vector<float> send(n, 1.0f + static_cast<float>(rank)), recv(n), mine(part, 1.0f + static_cast<float>(rank));
    const int batch = total <= (1u << 18) ? 20 : total <= (1u << 20) ? 5 : 1;
    const int ipart = static_cast<int>(part);
    std::vector<Variant> rs{
        {"raw",
         [&] { MPI_Reduce_scatter_block(send.data(), recv.data(), ipart, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); },
         {}},
        {"hier", [&] { hier.reduce_scatter(send.data(), recv.data(), n, DType::F32, ReduceOp::Sum); }, {}},
        {"mpi", [&] { flat.reduce_scatter(send.data(), recv.data(), n, DType::F32, ReduceOp::Sum); }, {}}};
    std::vector<Variant> ag{
        {"raw",
         [&] { MPI_Allgather(mine.data(), ipart, MPI_FLOAT, recv.data(), ipart, MPI_FLOAT, MPI_COMM_WORLD); },
         {}},
        {"hier", [&] { hier.allgather(mine.data(), recv.data(), n, DType::F32); }, {}},
        {"mpi", [&] { flat.allgather(mine.data(), recv.data(), n, DType::F32); }, {}}};
    measure(rs, reps, batch, MPI_COMM_WORLD);
    measure(ag, reps, batch, MPI_COMM_WORLD);
    // The figures stand for correct results: the sum of 1 + r over the ranks (exact in f32), and
    // rank r's part holding 1 + r.
    std::vector<float> got(part);
    hier.reduce_scatter(send.data(), got.data(), n, DType::F32, ReduceOp::Sum);
    verify(
        "reduce_scatter", n, got, [&](size_t) { return static_cast<float>(size * (size + 1) / 2); }, rank);
    std::vector<float> all(n);
    hier.allgather(mine.data(), all.data(), n, DType::F32);
    verify(
        "allgather", n, all, [&](size_t i) { return 1.0f + static_cast<float>(i / part); }, rank);
    if (rank != 0) continue;
    for (auto* v : {&rs, &ag}) {
      const double raw = spread((*v)[0].per_call).median, h = spread((*v)[1].per_call).median,
                   m = spread((*v)[2].per_call).median;
      std::printf("%-6s %9zu %32s %32s %6.2fx %32s %6.2fx\n", v == &rs ? "rs" : "ag", n,
                  triple((*v)[0].per_call).c_str(), triple((*v)[1].per_call).c_str(), raw / h,
                  triple((*v)[2].per_call).c_str(), raw / m);
    }
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int reps = 5;
  bool want_levels = false, want_scatter = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--levels") == 0)
      want_levels = true;
    else if (std::strcmp(argv[i], "--scatter") == 0)
      want_scatter = true;
    else
      reps = std::atoi(argv[i]);
  }

  Options o;
  o.transport = Transport::Hier;
  o.timeout = std::chrono::milliseconds(300000);
  auto hier = create(o);
  o.transport = Transport::Mpi;
  o.deterministic = true;  // the rank-order reduction, as the hierarchical transport's levels
  auto flat = create(o);
  const Topology& t = hier->topology();
  if (want_scatter) {
    if (rank == 0) {
      std::printf("hier_bench: %d ranks on %d hosts (this host: %d ranks)\n", size, t.num_hosts, t.local_size);
    }
    scatter_gather(*hier, *flat, reps);
    hier.reset();
    flat.reset();
    MPI_Finalize();
    return 0;
  }
  if (rank == 0) {
    std::printf("hier_bench: %d ranks on %d hosts (this host: %d ranks); median of %d reps, slowest rank\n", size,
                t.num_hosts, t.local_size, reps);
    std::printf("%10s %12s %12s %8s %12s %8s\n", "floats", "raw MPI", "hier", "x raw", "mpi transport", "x raw");
  }
  for (const size_t n : {size_t{1}, size_t{1} << 10, size_t{1} << 16, size_t{1} << 20, size_t{1} << 24}) {
    std::vector<float> send(n, 1.0f + static_cast<float>(rank)), recv(n);
    const int batch = n <= (1u << 10) ? 200 : n <= (1u << 16) ? 50 : n <= (1u << 20) ? 5 : 1;
    std::vector<Variant> variants;
    variants.push_back(
        {"raw",
         [&] { MPI_Allreduce(send.data(), recv.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); },
         {}});
    variants.push_back({"hier",
                        [&] {
                          const BufferRef b{send.data(), recv.data(), n};
                          hier->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum);
                        },
                        {}});
    variants.push_back({"mpi",
                        [&] {
                          const BufferRef b{send.data(), recv.data(), n};
                          flat->allreduce(std::span<const BufferRef>(&b, 1), DType::F32, ReduceOp::Sum);
                        },
                        {}});
    measure(variants, reps, batch, MPI_COMM_WORLD);
    // The figures stand for a correct result: every element the sum of 1 + r over the ranks
    // (exact in f32 at these sizes), wherever a level's pieces or windows begin.
    std::fill(recv.begin(), recv.end(), 0.0f);
    variants[1].run();
    const auto expect = static_cast<float>(size * (size + 1) / 2);
    const auto wrong = std::count_if(recv.begin(), recv.end(), [&](float x) { return x != expect; });
    if (wrong != 0) {
      std::fprintf(stderr, "hier_bench: rank %d: %zu floats: %td elements differ from %g\n", rank, n, wrong,
                   static_cast<double>(expect));
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    const double raw = median(variants[0].per_call), h = median(variants[1].per_call), m = median(variants[2].per_call);
    if (rank == 0) {
      std::printf("%10zu %12s %12s %7.2fx %12s %7.2fx\n", n, human(raw).c_str(), human(h).c_str(), raw / h,
                  human(m).c_str(), raw / m);
      std::fflush(stdout);
    }
  }
  if (want_levels) levels(*flat, t, reps);
  hier.reset();
  flat.reset();
  MPI_Finalize();
  return 0;
}
