#!/usr/bin/env bash
# CI stage: the communicator's unit tests (thread transport, reduction kernels, futex waits) under
# ThreadSanitizer. Builds only those tests in build-tsan; a few minutes on 2 cores.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${TSAN_BUILD_DIR:-$root/build-tsan}"
jobs="$(nproc)"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADSYNC_SANITIZE=thread \
  -DGRADSYNC_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" -j "$jobs" --target comm_test comm_reduce_test
# Selected by name (catch_discover_tests prefixes each test with its component): exactly the tests
# built above.
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}" \
  ctest --test-dir "$build" -R '^comm(_reduce)?:' --output-on-failure -j "$jobs"
