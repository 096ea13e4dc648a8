#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CI stage: the README's test command again, under AddressSanitizer and UndefinedBehaviorSanitizer,
# in build-asan (the model checks, which test the protocols rather than this build, are not
# registered there). The multihost label is left to the README stage: it runs on namespace hosts the
# same programs that this stage runs on labelled hosts (conformance:hier_hosts*, mpi:*), and would
# add a quarter of an hour. Of the conformance suite (the same scenarios at many group sizes, half
# of this stage's time) it keeps one size per code path: 3 ranks (not a power of two) and 4 (one)
# on threads, whose algorithms shm shares; 3 on shm, MPI and their subgroups; MPI's piecewise
# transfers; hier over interleaved and unequal hosts; threads as ranks on MPI and on labelled hier
# hosts, 2 x 2 (the 3-thread, one-host hier and split forms repeat their paths). python:demos trains models whose library calls
# python:* and the C tests already make here; python:torch_elastic (the stage's longest, 3.5 min)
# drives through torch the shrinks, reshards and checkpoints that python:elastic and
# python:embedding make here directly; python:launcher (76 s here) tests how the launcher starts,
# signals and cleans up after its processes, whose library calls python:shm makes here. Every one of
# them runs in the README stage.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
# No spaces or glob characters: test.sh splits CTEST_ARGS on blanks.
skip='^conformance:(thread_1|thread_2|thread_8|shm_2|shm_4|mpi_1|mpi_2|mpi_4|hier_3|hier_hosts2_3|hier_hosts2_4|mpi_threads3_6|hier_threads2_4|mpi_threads2_split_4)$|^python:(demos|torch_elastic|launcher)$'
BUILD_DIR=build-asan BUILD_TYPE=RelWithDebInfo \
  CMAKE_ARGS="-DGRADSYNC_SANITIZE=address,undefined -DGRADSYNC_BUILD_BENCH=OFF" \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 CTEST_ARGS="-LE multihost -E $skip" \
  scripts/test.sh
