#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Debian packages: cpack builds libgradsync0 and libgradsync-dev from the main build, apt installs
# them on this machine (as a user of a fresh Debian 12 would), and a C program through pkg-config,
# a CMake project through find_package and Python through the installed package all use them.
# The packages are removed again at the end.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${BUILD_DIR:-$root/build}"
work="$(mktemp -d)"
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
cleanup() {
  $sudo apt-get purge -y -qq libgradsync-dev libgradsync0 >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

(cd "$build" && cpack -G DEB -B "$work/debs" >/dev/null)
ls "$work"/debs/*.deb
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$work"/debs/*.deb >/dev/null

mkdir -p "$work/consumer"
cat > "$work/consumer/main.c" <<'C'
#include <gradsync/gradsync.h>
#include <stdio.h>
int main(void) {
  printf("gradsync %s abi %d\n", gradsync_version_string(), gradsync_abi_version());
  return gradsync_abi_version() == GRADSYNC_ABI_VERSION ? 0 : 1;
}
C
cat > "$work/consumer/CMakeLists.txt" <<'C'
cmake_minimum_required(VERSION 3.18)
project(consumer C)
find_package(gradsync 0.1 REQUIRED)
add_executable(consumer main.c)
target_link_libraries(consumer PRIVATE gradsync::gradsync)
C
# shellcheck disable=SC2046
cc "$work/consumer/main.c" -o "$work/consumer/pc" $(pkg-config --cflags --libs gradsync)
env -u LD_LIBRARY_PATH "$work/consumer/pc"
cmake -S "$work/consumer" -B "$work/consumer/build" >/dev/null
cmake --build "$work/consumer/build" >/dev/null
env -u LD_LIBRARY_PATH "$work/consumer/build/consumer"
(cd / && env -u GRADSYNC_LIBRARY -u LD_LIBRARY_PATH PYTHONPATH=/usr/share/gradsync/python \
  /usr/bin/python3 -c "import gradsync; print('python: gradsync', gradsync.version(), gradsync.lib._name)")
echo "ok: the .deb packages install, and C, CMake and Python consumers use them"
