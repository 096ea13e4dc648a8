// SPDX-License-Identifier: Apache-2.0
#pragma once
// The timing loop of the MPI benchmarks: variants interleaved, so that a shared machine's slow
// spells fall on all of them alike, and each sample the slowest rank's time per call.
#define OMPI_SKIP_MPICXX 1  // C bindings only
#include <mpi.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

namespace gradsync::bench {

struct Variant {
  std::string name;
  std::function<void()> run;
  std::vector<double> per_call;
};

// min / median / max of a set of figures (a benchmark's runs).
struct Spread {
  double min, med, max;
};
inline Spread spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v.front(), v[v.size() / 2], v.back()};
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Runs each variant `batch` times back to back, `reps` times, rotating the order, and records
// the slowest rank's time per call.
inline void measure(std::vector<Variant>& variants, int reps, int batch, MPI_Comm world) {
  for (auto& v : variants) v.run();  // warm-up (allocations, first-touch, connections)
  for (int rep = 0; rep < reps; ++rep) {
    for (size_t k = 0; k < variants.size(); ++k) {
      Variant& v = variants[(k + static_cast<size_t>(rep)) % variants.size()];
      MPI_Barrier(world);
      const double t0 = MPI_Wtime();
      for (int i = 0; i < batch; ++i) v.run();
      double t = (MPI_Wtime() - t0) / batch;
      MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, world);
      v.per_call.push_back(t);
    }
  }
}

}  // namespace gradsync::bench
