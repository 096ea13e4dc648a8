#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CI stage, under ThreadSanitizer: the communicator's unit tests (thread transport, reduction
# kernels, futex and adaptive waits), the atomics (counters, flag, mutex, the three atomic-add
# implementations under 4 threads), the atomics' C-API test (Caffe2's 100-thread checksum) and the
# accumulator's owner mode (its owner threads and job sequence; the tests that fork a child which
# starts threads are left out: TSan does not support threads started after a multi-threaded fork),
# and the liveness links (their lock, polled from any thread; members in threads).
# Builds only those tests, in build-tsan; a few minutes on 2 cores.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${TSAN_BUILD_DIR:-$root/build-tsan}"
jobs="$(nproc)"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADSYNC_SANITIZE=thread \
  -DGRADSYNC_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" -j "$jobs" --target comm_test comm_reduce_test atomics_test capi_atomics capi_async \
  accumulator_test liveness_links_test
# Selected by name (catch_discover_tests prefixes each test with its component): exactly the tests
# built above; --no-tests=error makes an empty selection a failure rather than a silent pass.
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}" \
  ctest --test-dir "$build" -R '^(comm(_reduce)?:|atomics:|capi:(atomics|async)$|accumulator:owner mode|liveness_links:)' --no-tests=error --output-on-failure \
  -j "$jobs"
