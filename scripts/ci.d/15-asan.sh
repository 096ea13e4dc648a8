#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CI stage: the README's test command again, under AddressSanitizer and UndefinedBehaviorSanitizer,
# in build-asan (the model checks, which test the protocols rather than this build, are not
# registered there). The multihost label is left to the README stage: it runs on namespace hosts the
# same programs that this stage runs on labelled hosts (conformance:hier_hosts*, mpi:*), and would
# add a quarter of an hour.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
BUILD_DIR=build-asan BUILD_TYPE=RelWithDebInfo \
  CMAKE_ARGS="-DGRADSYNC_SANITIZE=address,undefined -DGRADSYNC_BUILD_BENCH=OFF" \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 CTEST_ARGS="-LE multihost" \
  scripts/test.sh
