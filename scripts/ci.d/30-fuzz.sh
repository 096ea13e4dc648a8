#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CI stage: libFuzzer (clang-14, ASan + UBSan) opens arbitrary bytes as a table and as an
# accumulator's gradient file, for a bounded number of executions from a seed corpus of valid and
# damaged files. Any crash, hang (> 10 s per input), or unexpected status fails the stage.
# Builds only the fuzz targets in build-fuzz; about two minutes on 2 cores.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${FUZZ_BUILD_DIR:-$root/build-fuzz}"
runs="${FUZZ_RUNS:-200000}"
CC=clang-14 CXX=clang++-14 cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DGRADSYNC_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" -j "$(nproc)" --target table_fuzzer table_fuzz_replay
corpus="$build/fuzz-corpus/table"
rm -rf "$corpus" && mkdir -p "$corpus"
"$build/tests/fuzz/table_fuzz_replay"                   # the damaged files give their clear errors
"$build/tests/fuzz/table_fuzz_replay" --write-corpus "$corpus"
# Each input is written to a memfd and opened through /proc/self/fd: no disk traffic.
"$build/tests/fuzz/table_fuzzer" "$corpus" -runs="$runs" -max_len=20480 -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$build/fuzz-" 2>&1 | tail -n 25
