#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs the MPI transport benchmark on this host:
#   bench/mpi/run.sh [NP] [BUILD_DIR]     allreduce beside raw MPI (default NP 2, BUILD_DIR build/)
#   bench/mpi/run.sh v [BUILD_DIR]        the v and rooted collectives (allgatherv, reduce_scatterv,
#                                         alltoallv, gatherv, scatterv), 2 ranks
#   bench/mpi/run.sh paths [NP] [BUILD_DIR]  every allreduce path of one host (MPI transport, shm
#                                         copy, staged, zero copy) beside raw MPI on the same
#                                         processes (paths_bench.cpp, whose --trigger CMD
#                                         measures before, during and after CMD)
# Every figure is printed beside raw MPI measured in the same run. Ranks float (--bind-to none):
# with more ranks than cores, pinning would stack them.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
target=mpi_bench
np=2
if [ "${1:-}" = v ]; then
  target=mpi_v_bench
  shift
elif [ "${1:-}" = paths ]; then
  target=mpi_paths_bench
  shift
  if [[ "${1:-}" =~ ^[0-9]+$ ]]; then
    np=$1
    shift
  fi
elif [[ "${1:-}" =~ ^[0-9]+$ ]]; then
  np=$1
  shift
fi
build="${1:-$root/build}"
exe="$build/bench/mpi/$target"
[ -x "$exe" ] || cmake --build "$build" --target "$target"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$np" "$exe" ${RUNS:-}
