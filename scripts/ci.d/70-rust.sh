#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CI stage: the Rust crates in rust/ (gradsync-sys, the hand-written C API, and gradsync, the safe
# wrapper), built and tested offline with Debian's cargo and rustc only (zero dependencies), against
# the library that CI has built in build/. A rustup toolchain that happens to be on PATH is never
# used: cargo, rustc and rustdoc are called by their /usr/bin paths.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
lib="${GRADSYNC_LIB_DIR:-$root/build}"
for tool in /usr/bin/cargo /usr/bin/rustc /usr/bin/rustdoc; do
  [ -x "$tool" ] || { echo "70-rust: $tool is missing (scripts/setup.sh installs Debian's cargo)"; exit 1; }
done
[ -e "$lib/libgradsync.so" ] || { echo "70-rust: no libgradsync.so in $lib (build the library first: scripts/test.sh)"; exit 1; }

cd "$root/rust"
export GRADSYNC_LIB_DIR="$lib" RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc
export CARGO_TARGET_DIR="$root/rust/target" RUSTFLAGS="-D warnings" RUSTDOCFLAGS="-D warnings"
unset LD_LIBRARY_PATH  # the tests find the library through their rpath
/usr/bin/cargo --version
/usr/bin/cargo test --offline --locked
/usr/bin/cargo doc --offline --locked --no-deps -q
# The README's example (rust/gradsync/examples/readme.rs, kept equal to it by tests/python/test_readme.py).
/usr/bin/cargo run --offline --locked -q --example readme
