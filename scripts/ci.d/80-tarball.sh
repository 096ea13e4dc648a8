#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CI stage: the source tarball (scripts/dist.sh) passes the README's test command, scripts/test.sh,
# unpacked in a directory without .git and with git hidden from PATH: building and testing need
# neither a checkout nor git. The tarball is made of the working tree's tracked files (git stash
# create: uncommitted changes included), so this stage tests the sources the others test. A second
# full build (under CI, its compilations come from the README stage's through ccache) and a test run. The suites that run groups of processes (labels model, multihost,
# conformance, stress, mpi) are left out here: they test the protocols and transports, which neither
# a checkout nor git touches, and the README stage ran them on these same sources; so are the Python
# tests that train models or launch jobs through the package (demos, torch, torch_elastic, launcher),
# whose package import the other Python tests make too. What can depend on the tree (the build, the
# Python package and its backend, the file checks) runs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
start=$SECONDS
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

rev="$(git -C "$root" stash create)"  # empty when nothing tracked has changed
tarball="$(OUT_DIR="$work" "$root/scripts/dist.sh" "${rev:-HEAD}")"
mkdir "$work/unpacked"
tar -xzf "$tarball" -C "$work/unpacked"
tree="$(echo "$work"/unpacked/gradsync-*)"
[ -f "$tree/scripts/test.sh" ] || { echo "80-tarball: $tarball does not hold gradsync-<version>/scripts/test.sh"; exit 1; }
[ ! -e "$tree/.git" ] || { echo "80-tarball: the unpacked tree has a .git"; exit 1; }

# A PATH without git: links to every other command of every PATH directory, the first of each name.
bin="$work/bin"
mkdir "$bin"
declare -A seen=()
IFS=: read -ra dirs <<< "$PATH"
for dir in "${dirs[@]}"; do
  batch=()
  for cmd in "$dir"/*; do
    name="${cmd##*/}"
    if [ -x "$cmd" ] && [ ! -d "$cmd" ] && [ -z "${seen[$name]:-}" ]; then
      seen[$name]=1
      [[ "$name" == git || "$name" == git-* ]] || batch+=("$cmd")
    fi
  done
  [ ${#batch[@]} -eq 0 ] || ln -s -t "$bin" -- "${batch[@]}"
done
if PATH="$bin" command -v git >/dev/null; then echo "80-tarball: git is still on PATH"; exit 1; fi

echo "80-tarball: $(basename "$tarball") ($(tar -tzf "$tarball" | grep -vc '/$') files) unpacked in $tree:" \
     "no .git, no git on PATH; running scripts/test.sh there"
# CCACHE_BASEDIR: paths under the tree are hashed relative to the build, as the README stage's
# are, so its compilations of the same sources are reused (when .ci/run set ccache up).
(cd "$tree" && CCACHE_BASEDIR="$tree" env -u BUILD_DIR -u BUILD_TYPE -u CMAKE_ARGS CTEST_ARGS="-LE model|multihost|conformance|stress|mpi -E ^python:(demos|torch|torch_elastic|launcher)$" PATH="$bin" scripts/test.sh)
echo "80-tarball: ok: the tarball builds and passes scripts/test.sh without .git or git ($((SECONDS - start)) s)"
