#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds and runs the three kinds of consumer of an installed libgradsync: a C program through
# pkg-config, a CMake project through find_package(gradsync), and Python through the installed
# package, from outside any checkout and with nothing set in the environment.
#   scripts/check_consumers.sh PREFIX     (PREFIX: where it is installed, e.g. /usr)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
pc_dir=$(find "$prefix"/lib* -type d -name pkgconfig -exec test -e '{}/gradsync.pc' ';' -print 2>/dev/null | head -n1)
[ -n "$pc_dir" ] || { echo "no gradsync.pc under $prefix/lib*"; exit 1; }
lib_dir="$(dirname "$pc_dir")"

cat > "$work/main.c" <<'C'
#include <gradsync/gradsync.h>
#include <stdio.h>
int main(void) {
  printf("gradsync %s abi %d\n", gradsync_version_string(), gradsync_abi_version());
  return gradsync_abi_version() == GRADSYNC_ABI_VERSION ? 0 : 1;
}
C
cat > "$work/CMakeLists.txt" <<'C'
cmake_minimum_required(VERSION 3.18)
project(consumer C)
find_package(gradsync 0.1 REQUIRED)
add_executable(consumer main.c)
target_link_libraries(consumer PRIVATE gradsync::gradsync)
C
# A prefix outside the loader's paths needs LD_LIBRARY_PATH to run; /usr does not.
run_env=(env -u LD_LIBRARY_PATH)
case "$lib_dir" in /usr/lib | /usr/lib/*) ;; *) run_env=(env LD_LIBRARY_PATH="$lib_dir") ;; esac

# shellcheck disable=SC2046
cc "$work/main.c" -o "$work/pc" $(PKG_CONFIG_PATH="$pc_dir" pkg-config --cflags --libs gradsync)
"${run_env[@]}" "$work/pc"
cmake -S "$work" -B "$work/build" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$work/build" >/dev/null
"${run_env[@]}" "$work/build/consumer"
(cd / && env -u GRADSYNC_LIBRARY -u LD_LIBRARY_PATH PYTHONPATH="$prefix/lib/python3/dist-packages" \
  /usr/bin/python3 -c "import gradsync; print('python: gradsync', gradsync.version(), gradsync.lib._name)")

# MPI is a plugin: the core library never links it; where the plugin is installed, the MPI
# transport works through it under a real mpirun.
core="$(readlink -f "$lib_dir/libgradsync.so.0")"
if readelf -d "$core" | grep NEEDED | grep -qi mpi; then echo "$core links MPI"; exit 1; fi
if [ -e "$lib_dir/libgradsync-mpi.so.0" ]; then
  "$here/check_mpi_python.sh" /usr/bin/python3 "$prefix/lib/python3/dist-packages"
else
  echo "no MPI plugin installed under $lib_dir: the MPI transport's check is not run"
fi
echo "ok: C (pkg-config), CMake (find_package) and Python consumers of $prefix built and ran; $core links no MPI"
