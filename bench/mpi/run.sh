#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs the MPI transport benchmark with 2 ranks on this host:
#   bench/mpi/run.sh [BUILD_DIR]      allreduce (default BUILD_DIR: build/)
#   bench/mpi/run.sh v [BUILD_DIR]    the v and rooted collectives (allgatherv, reduce_scatterv,
#                                     alltoallv, gatherv, scatterv)
# Medians of interleaved repetitions; every figure is printed beside raw MPI measured in the same run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
target=mpi_bench
if [ "${1:-}" = v ]; then
  target=mpi_v_bench
  shift
fi
build="${1:-$root/build}"
exe="$build/bench/mpi/$target"
[ -x "$exe" ] || cmake --build "$build" --target "$target"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec mpirun --allow-run-as-root -np 2 --bind-to core "$exe"
