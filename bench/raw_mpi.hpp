// SPDX-License-Identifier: Apache-2.0
#pragma once
// Raw MPI_Allreduce (f32, in place or out of place) as a baseline measured in the same run as a
// benchmark's own figures: the benchmark launches itself as `mpirun -np N ... <self> --mpi-raw
// [args]` and reads back "<floats> <us>" lines, which its rank 0 prints one per size.
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#if GRADSYNC_HAVE_MPI
#define OMPI_SKIP_MPICXX 1  // the C API only; the C++ bindings need their own library
#include <mpi.h>
#endif

namespace bench {

// The figures of `ranks` MPI processes for `sizes` sizes, by size; false when MPI is missing or
// the run failed (then mpirun's exit status goes to stderr). The flags are Open MPI's, Debian's
// MPI; mpirun's own messages are dropped, as they would interleave with the table. mpirun_flags
// go before the program (e.g. the binding: Open MPI binds 2 ranks to cores unless told
// `--bind-to none`).
inline bool raw_mpi(const char* self, int ranks, const std::string& args, size_t sizes, std::map<size_t, double>& us,
                    const std::string& mpirun_flags = "") {
#if GRADSYNC_HAVE_MPI
  const std::string cmd = "mpirun -np " + std::to_string(ranks) + " --allow-run-as-root --oversubscribe " +
                          mpirun_flags + " '" + self + "' --mpi-raw " + args + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return false;
  size_t m;
  double t;
  while (std::fscanf(p, "%zu %lf", &m, &t) == 2) us[m] = t;
  const int status = pclose(p);
  if (status != 0) std::fprintf(stderr, "raw MPI baseline: mpirun exited with status %d\n", status);
  return status == 0 && us.size() == sizes;
#else
  (void)self, (void)ranks, (void)args, (void)sizes, (void)us, (void)mpirun_flags;
  return false;
#endif
}

#if GRADSYNC_HAVE_MPI
// One rank of that run: for each size, time(m, call) in microseconds per call, where call() is
// one allreduce of m floats (time must make every rank run call() as often).
inline int raw_mpi_rank(int argc, char** argv, const std::vector<size_t>& sizes,
                        const std::function<double(size_t, const std::function<void()>&)>& time, bool in_place = true) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  for (size_t m : sizes) {
    std::vector<float> data(m, 1.0f), out(in_place ? 0 : m);
    MPI_Barrier(MPI_COMM_WORLD);
    const double t = time(m, [&] {
      MPI_Allreduce(in_place ? MPI_IN_PLACE : data.data(), in_place ? data.data() : out.data(), static_cast<int>(m),
                    MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    });
    if (rank == 0) std::printf("%zu %.6f\n", m, t);
  }
  MPI_Finalize();
  return 0;
}
#endif

}  // namespace bench
