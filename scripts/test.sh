#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds libgradsync and runs every test: C++ unit tests, C ABI tests, Python tests, and the
# multi-process (shared memory, MPI) suites. Does all set-up on a fresh Debian 12 machine.
#   scripts/test.sh                 Release build in build/
#   BUILD_DIR=... CMAKE_ARGS=... scripts/test.sh   another build (CI's sanitizer runs use this)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"

build="${BUILD_DIR:-$root/build}"
jobs="$(nproc)"
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" ${CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$jobs"
cd "$build"
# shellcheck disable=SC2086
ctest --output-on-failure -j "$jobs" ${CTEST_ARGS:-}
