#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs the MPI transport benchmark with 2 ranks on this host:
#   bench/mpi/run.sh [BUILD_DIR]      (default: build/)
# Medians of interleaved repetitions; every figure is printed beside raw MPI measured in the same run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${1:-$root/build}"
exe="$build/bench/mpi/mpi_bench"
[ -x "$exe" ] || cmake --build "$build" --target mpi_bench
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec mpirun --allow-run-as-root -np 2 --bind-to core "$exe"
