#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CI stage: the library exports only gradsync_ names, carries its SONAME, and does not load MPI
# (the MPI transport lives in its plugin). Reads the README stage's build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
lib=$(readlink -f build/libgradsync.so)
bad=$(nm -D --defined-only "$lib" | awk '{print $3}' | grep -v '^gradsync_' | grep -v '^GRADSYNC_' || true)
if [ -n "$bad" ]; then echo "symbols outside the gradsync_ prefix:"; echo "$bad"; exit 1; fi
readelf -d "$lib" | grep -q 'SONAME.*libgradsync.so.0' || { echo "SONAME missing"; exit 1; }
if ldd "$lib" | grep -i mpi; then echo "libgradsync loads MPI: the MPI transport belongs in its plugin"; exit 1; fi
echo "ok: ldd $lib shows no MPI; the plugin: $(ldd build/libgradsync-mpi.so.0 | grep -o 'libmpi\.so[^ ]*' | head -n1)"
echo "ok: $(nm -D --defined-only "$lib" | grep -c ' gradsync_') gradsync_ symbols, SONAME $(readelf -d "$lib" | grep SONAME | sed 's/.*\[\(.*\)\]/\1/')"
