#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The source tarball, from a git checkout: every tracked file of a commit (HEAD unless one is
# given) under gradsync-<version>/, written to dist/gradsync-<version>.tar.gz (or $OUT_DIR). What is
# not tracked (build trees, caches, local files) is not in it. Building and testing from it need
# no git: unpack it and run scripts/test.sh there (CI does: scripts/ci.d/80-tarball.sh).
#   scripts/dist.sh [COMMIT]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rev="${1:-HEAD}"
command -v git >/dev/null || { echo "dist: making the tarball needs git, from a checkout" >&2; exit 1; }
if ! err="$(git -C "$root" rev-parse --verify "$rev^{commit}" 2>&1 >/dev/null)"; then
  echo "dist: no commit $rev in $root: $err" >&2; exit 1
fi
version="$(git -C "$root" show "$rev:CMakeLists.txt" | sed -n 's/^project(gradsync VERSION \([0-9.]*\).*/\1/p')"
[ -n "$version" ] || { echo "dist: no project(gradsync VERSION ...) in $rev:CMakeLists.txt" >&2; exit 1; }
if [ "$rev" = HEAD ] && ! git -C "$root" diff --quiet HEAD; then
  echo "dist: note: uncommitted changes are not in the tarball (it is HEAD's files)" >&2
fi
out="${OUT_DIR:-$root/dist}"
mkdir -p "$out"
tarball="$out/gradsync-$version.tar.gz"
git -C "$root" archive --format=tar.gz --prefix="gradsync-$version/" -o "$tarball" "$rev"
echo "$tarball"
