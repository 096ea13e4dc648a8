#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CI stage: libFuzzer (clang-14, ASan + UBSan), bounded runs of each target:
#  - table_fuzzer: arbitrary bytes opened as a table and as an accumulator's gradient file, alone
#    (seeds: the hand-made damaged files of table_fuzz_replay);
#  - table_shared_fuzzer: the same files while a peer holds them, so their shared state (touched
#    count, list, flags, state header) is used as it is by adds, touched, zero and apply;
#  - segment_fuzzer: arbitrary bytes as the shm segment a rank joins, with the harness playing
#    the live peers;
#  - checkpoint_fuzzer: arbitrary bytes as a checkpoint directory of the sharded embedding (a
#    manifest and its parts), read as a load reads it (seeds: real checkpoints, checkpoint_seeds).
# The last three start from their kept corpora (tests/fuzz/corpus/<target>/, copied: the runs never
# write into the source tree). Any crash, hang (> 10 s per input), or unexpected status fails the
# stage. Builds only the fuzz targets in build-fuzz (each source they reach compiled once); the
# damaged files come from the README stage's build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${FUZZ_BUILD_DIR:-$root/build-fuzz}"
runs="${FUZZ_RUNS:-200000}"
# Each segment input builds a segment of a few MiB in /dev/shm (about 1000 runs a second).
segment_runs="${FUZZ_SEGMENT_RUNS:-20000}"
# Each checkpoint input is a directory of files in /dev/shm (about 3000 runs a second unloaded).
checkpoint_runs="${FUZZ_CHECKPOINT_RUNS:-30000}"
# -O1 with line tables: what a crash report needs, in a third of -O2 -g's build time.
CC=clang-14 CXX=clang++-14 cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DGRADSYNC_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" -j "$(nproc)" --target table_fuzzer table_shared_fuzzer segment_fuzzer checkpoint_fuzzer
replay="$root/build/tests/fuzz/table_fuzz_replay"
corpus="$build/fuzz-corpus/table"
rm -rf "$corpus" && mkdir -p "$corpus"
"$replay"                              # the damaged files give their clear errors
"$replay" --write-corpus "$corpus"
# Each input is written to a memfd and opened through /proc/self/fd: no disk traffic.
"$build/tests/fuzz/table_fuzzer" "$corpus" -runs="$runs" -max_len=20480 -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$build/fuzz-" 2>&1 | tail -n 25
fuzz_kept() {  # target, runs, max_len
  local work="$build/fuzz-corpus/$1"
  rm -rf "$work" && mkdir -p "$work" && cp "$root/tests/fuzz/corpus/$1/"* "$work/"
  "$build/tests/fuzz/$1_fuzzer" "$work" -runs="$2" -max_len="$3" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$build/fuzz-$1-" 2>&1 | tail -n 8
}
fuzz_kept table_shared "$runs" 20480
fuzz_kept segment "$segment_runs" 8192
fuzz_kept checkpoint "$checkpoint_runs" 20480
