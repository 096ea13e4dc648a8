#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs a build into a scratch prefix and builds a consumer against it twice: through
# find_package(gradsync) and through pkg-config. Proves the packaging works for another project.
set -euo pipefail
build="${1:-build}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null

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
cmake -S "$work/consumer" -B "$work/consumer/build" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/consumer/build" >/dev/null
LD_LIBRARY_PATH="$work/prefix/lib" "$work/consumer/build/consumer"

# The installed .pc file as it is, from a prefix moved after the install: it must be relocatable.
mv "$work/prefix" "$work/moved"
libdir=$(find "$work/moved" -type d -name pkgconfig | head -n1)
# shellcheck disable=SC2046
cc "$work/consumer/main.c" -o "$work/consumer/pc" $(PKG_CONFIG_PATH="$libdir" pkg-config --cflags --libs gradsync)
LD_LIBRARY_PATH="$(dirname "$libdir")" "$work/consumer/pc"
# The Python package installed beside the library finds it, from any directory, with no set-up.
(cd "$work" && env -u GRADSYNC_LIBRARY -u LD_LIBRARY_PATH PYTHONPATH="$work/moved/share/gradsync/python" \
  /usr/bin/python3 -c "import gradsync; print('python: gradsync', gradsync.version())")
echo "ok: find_package, pkg-config and Python consumers built and ran"
