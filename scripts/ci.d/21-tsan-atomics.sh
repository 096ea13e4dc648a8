#!/usr/bin/env bash
# CI stage: the atomics (counters, flag, mutex, the three atomic-add implementations under 4
# threads) and their C-API test (Caffe2's 100-thread checksum, pthreads) under ThreadSanitizer.
# Shares the build-tsan tree of 20-tsan.sh (same configuration), so only these targets compile.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${TSAN_BUILD_DIR:-$root/build-tsan}"
jobs="$(nproc)"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADSYNC_SANITIZE=thread \
  -DGRADSYNC_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" -j "$jobs" --target atomics_test capi_atomics
# Selected by name (the Catch2 tests are named "atomics:<case>"); --no-tests=error makes an empty
# selection a failure rather than a silent pass.
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}" \
  ctest --test-dir "$build" -R '^(atomics:|capi:atomics$)' --no-tests=error --output-on-failure -j "$jobs"
