// SPDX-License-Identifier: Apache-2.0
// The per-rank-count (v) collectives and the rooted ones on the MPI transport beside raw MPI's
// same calls, measured in the same run (bench/mpi/run.sh v): allgatherv, reduce_scatterv (f32
// sum), alltoallv, gatherv and scatterv of M f32 elements in all, M in {64K, 16M}, split unevenly
// (rank r's share grows with r). Each sample is the slowest rank's time for one call after a
// barrier; variants rotate, and the table shows min / median / max over the samples.
#define OMPI_SKIP_MPICXX 1  // C bindings only
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/create.hpp"

using namespace gradsync;
using namespace gradsync::comm;

namespace {

struct Variant {
  std::function<void()> run;
  std::vector<double> samples;
};

struct Spread {
  double min, median, max;
};

Spread spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v.front(), v[v.size() / 2], v.back()};
}

void measure(std::vector<Variant>& variants, int reps, MPI_Comm world) {
  for (auto& v : variants) v.run();  // warm-up
  for (int rep = 0; rep < reps; ++rep) {
    for (size_t k = 0; k < variants.size(); ++k) {
      Variant& v = variants[(k + static_cast<size_t>(rep)) % variants.size()];
      MPI_Barrier(world);
      const double t0 = MPI_Wtime();
      v.run();
      double t = MPI_Wtime() - t0;
      MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, world);
      v.samples.push_back(t);
    }
  }
}

// M elements over n ranks, rank r's share proportional to r + 1.
std::vector<size_t> uneven(size_t m, size_t n) {
  std::vector<size_t> c(n);
  const size_t weights = n * (n + 1) / 2;
  size_t given = 0;
  for (size_t r = 0; r < n; ++r) given += c[r] = m * (r + 1) / weights;
  c[n - 1] += m - given;
  return c;
}

std::vector<int> ints(const std::vector<size_t>& v) { return std::vector<int>(v.begin(), v.end()); }

std::vector<size_t> packed(const std::vector<size_t>& counts) {
  std::vector<size_t> d(counts.size());
  std::exclusive_scan(counts.begin(), counts.end(), d.begin(), size_t{0});
  return d;
}

}  // namespace

int main() {
  Options o;
  o.transport = Transport::Mpi;
  o.timeout = std::chrono::milliseconds(120000);
  auto comm = create(o);  // initialises MPI
  MPI_Comm raw;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  int rank = 0, size = 0;
  MPI_Comm_rank(raw, &rank);
  MPI_Comm_size(raw, &size);
  const auto n = static_cast<size_t>(size), me = static_cast<size_t>(rank);
  if (rank == 0) {
    double load = 0;
    std::ifstream("/proc/loadavg") >> load;
    std::printf(
        "v and rooted collectives: MPI transport vs raw MPI, %d ranks, f32, uneven parts; slowest rank's "
        "time per call, min / median / max (load average %.1f)\n\n",
        size, load);
    std::printf("%-16s %9s | %-26s | %-26s | %s\n", "collective", "elements", "raw MPI us", "gradsync us",
                "median vs raw");
  }
  for (size_t m : {size_t{64} << 10, size_t{16} << 20}) {
    const std::vector<size_t> counts = uneven(m, n), displs = packed(counts);
    const std::vector<int> icounts = ints(counts), idispls = ints(displs);
    const size_t mine = counts[me];
    std::vector<float> whole(m, 1.0f), whole2(m, 1.0f), part(mine, 1.0f), part2(mine, 1.0f);
    // alltoallv: this rank sends counts[d] * (me + 1) / n-ish parts: rank s sends rank d
    // counts[d] / n elements + s, so the parts differ in both directions.
    std::vector<size_t> sc(n), rc(n);
    for (size_t d = 0; d < n; ++d) sc[d] = counts[d] / n + me;
    for (size_t s = 0; s < n; ++s) rc[s] = counts[me] / n + s;
    const std::vector<size_t> sd = packed(sc), rd = packed(rc);
    const size_t send_total = sd.back() + sc.back(), recv_total = rd.back() + rc.back();
    std::vector<float> a2a_send(send_total, 1.0f), a2a_recv(recv_total), a2a_recv2(recv_total);
    const std::vector<int> isc = ints(sc), isd = ints(sd), irc = ints(rc), ird = ints(rd);
    const std::vector<size_t> none;

    struct Row {
      const char* name;
      std::vector<Variant> v;
    };
    std::vector<Row> rows;
    rows.push_back({"allgatherv",
                    {{[&] {
                        MPI_Allgatherv(part.data(), icounts[me], MPI_FLOAT, whole.data(), icounts.data(),
                                       idispls.data(), MPI_FLOAT, raw);
                      },
                      {}},
                     {[&] { comm->allgatherv(part2.data(), whole2.data(), counts, DType::F32); }, {}}}});
    rows.push_back(
        {"reduce_scatterv",
         {{[&] { MPI_Reduce_scatter(whole.data(), part.data(), icounts.data(), MPI_FLOAT, MPI_SUM, raw); }, {}},
          {[&] { comm->reduce_scatterv(whole2.data(), part2.data(), counts, DType::F32, ReduceOp::Sum, std::nullopt); },
           {}}}});
    rows.push_back({"alltoallv",
                    {{[&] {
                        MPI_Alltoallv(a2a_send.data(), isc.data(), isd.data(), MPI_FLOAT, a2a_recv.data(), irc.data(),
                                      ird.data(), MPI_FLOAT, raw);
                      },
                      {}},
                     {[&] { comm->alltoallv(a2a_send.data(), sc, sd, a2a_recv2.data(), rc, rd, DType::F32); }, {}}}});
    rows.push_back(
        {"gatherv (root 0)",
         {{[&] {
             MPI_Gatherv(part.data(), icounts[me], MPI_FLOAT, whole.data(), icounts.data(), idispls.data(), MPI_FLOAT,
                         0, raw);
           },
           {}},
          {[&] { comm->gatherv(part2.data(), mine, whole2.data(), me == 0 ? counts : none, DType::F32, 0); }, {}}}});
    rows.push_back(
        {"scatterv (root 0)",
         {{[&] {
             MPI_Scatterv(whole.data(), icounts.data(), idispls.data(), MPI_FLOAT, part.data(), icounts[me], MPI_FLOAT,
                          0, raw);
           },
           {}},
          {[&] { comm->scatterv(whole2.data(), me == 0 ? counts : none, part2.data(), mine, DType::F32, 0); }, {}}}});
    const int reps = m >= (size_t{16} << 20) ? 15 : 201;
    for (Row& row : rows) {
      measure(row.v, reps, raw);
      if (rank != 0) continue;
      const Spread b = spread(row.v[0].samples), g = spread(row.v[1].samples);
      std::printf("%-16s %9zu | %7.1f %8.1f %9.1f | %7.1f %8.1f %9.1f | %.2fx\n", row.name, m, b.min * 1e6,
                  b.median * 1e6, b.max * 1e6, g.min * 1e6, g.median * 1e6, g.max * 1e6, g.median / b.median);
    }
  }
  MPI_Comm_free(&raw);
  return 0;
}
