#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Python package the normal way, offline, with Debian's Python and with another CPython (the
# first python3 on PATH that is not Debian's, e.g. pyenv's, or $GRADSYNC_OTHER_PYTHON): `pip install .`
# through the in-tree build backend (scripts/pep517, no build requirement to download), then the
# wheel (`pip wheel .`) in a fresh virtual environment. The backend packs the library CI built in
# build/ (config setting build-dir) rather than compiling it again. `import gradsync` works from
# any directory with nothing else set, and the MPI transport works through the plugin. The wheel's
# library needs nothing beyond glibc and the C++ runtime (ldd), and runs with spdlog and fmt
# hidden from it (a mount namespace that covers their files).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="$(cd "${BUILD_DIR:-$root/build}" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
pip_build=(--no-index --config-settings "build-dir=$build")
clean_env=(env -u GRADSYNC_LIBRARY -u PYTHONPATH -u LD_LIBRARY_PATH)
# shellcheck disable=SC2016
allreduce='
import os, sys, threading
import numpy as np
import gradsync as gs
where = os.path.dirname(gs.__file__)
assert "site-packages" in where and os.path.exists(os.path.join(where, "libgradsync.so.0")), where
assert gs.lib._name == os.path.join(where, "libgradsync.so.0"), gs.lib._name
out = [None, None]
def worker(rank):
    with gs.Communicator("wheel", rank, 2) as comm:
        out[rank] = comm.allreduce(np.full(4, rank + 1, np.float32), op="sum")
threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
for t in threads: t.start()
for t in threads: t.join()
assert all((o == 3).all() for o in out), out
print(f"{sys.argv[1]}: Python {sys.version.split()[0]} ({sys.executable}), gradsync {gs.version()} from {where}:",
      f"a 2-thread allreduce gives {out[0]}")
'

# Debian's Python: pip install . into a virtual environment, as the README says.
/usr/bin/python3 -m venv --system-site-packages "$work/debian"
"$work/debian/bin/pip" install -q "${pip_build[@]}" "$root"
(cd / && "${clean_env[@]}" "$work/debian/bin/python" -c "$allreduce" "pip install . (Debian's Python)")

# Another CPython. Its environment gets Debian's numpy (and nothing else of Debian's) when both
# are built for the same Python ABI; pip sees it installed and downloads nothing.
other="${GRADSYNC_OTHER_PYTHON:-}"
if [ -z "$other" ]; then
  while read -r candidate; do
    if [ "$("$candidate" -c 'import sys; print(sys.prefix)' 2>/dev/null)" != /usr ]; then
      other="$("$candidate" -c 'import sys; print(sys.executable)')"
      break
    fi
  done < <(type -ap python3)
fi
[ -n "$other" ] || { echo "40-wheel: no CPython other than Debian's on PATH (set GRADSYNC_OTHER_PYTHON)"; exit 1; }
soabi() { "$1" -c 'import sysconfig; print(sysconfig.get_config_var("SOABI"))'; }
if [ "$(soabi "$other")" != "$(soabi /usr/bin/python3)" ]; then
  echo "40-wheel: $other ($(soabi "$other")) cannot load Debian's numpy ($(soabi /usr/bin/python3))"; exit 1
fi
"$other" -m venv "$work/other"
mkdir "$work/debian-numpy"
ln -s /usr/lib/python3/dist-packages/numpy /usr/lib/python3/dist-packages/numpy-*info "$work/debian-numpy/"
site="$("$work/other/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
echo "$work/debian-numpy" > "$site/debian_numpy.pth"
"$work/other/bin/pip" install -q "${pip_build[@]}" "$root"
(cd / && "${clean_env[@]}" "$work/other/bin/python" -c "$allreduce" "pip install . (another CPython)")

# The wheel, in a fresh environment.
"$work/debian/bin/pip" wheel -q --no-deps "${pip_build[@]}" -w "$work/dist" "$root"
/usr/bin/python3 -m venv --system-site-packages "$work/venv"
"$work/venv/bin/pip" install -q --no-index --no-deps "$work"/dist/gradsync-*.whl
(cd / && "${clean_env[@]}" "$work/venv/bin/python" -c "$allreduce" "the wheel")
pkg="$("$work/venv/bin/python" -c 'import os, gradsync; print(os.path.dirname(gradsync.__file__))')"
[ -e "$pkg/libgradsync-mpi.so.0" ] || { echo "40-wheel: the wheel lacks the MPI plugin"; exit 1; }
(cd / && "${clean_env[@]}" "$work/venv/bin/python" -c \
  'import gradsync as gs; assert gs.has_feature(gs.FEATURE_MPI_TRANSPORT), "the wheel'"'"'s MPI plugin does not load"')
"$root/scripts/check_mpi_python.sh" "$work/venv/bin/python"

# What the wheel's library loads: glibc, the C++ runtime and nothing else. (Its MPI plugin links
# Open MPI by design: it is loaded only for the MPI transport.)
echo "ldd $pkg/libgradsync.so.0:"
ldd "$pkg/libgradsync.so.0" | sed 's/^/  /'
allowed='^(linux-vdso\.so\.1|ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1|libstdc\+\+\.so\.6|libgcc_s\.so\.1)$'
extra="$(ldd "$pkg/libgradsync.so.0" | awk '{print $1}' | sed 's|.*/||' | grep -Ev "$allowed" || true)"
[ -z "$extra" ] || { echo "40-wheel: the wheel's library loads more than glibc and the C++ runtime: $extra"; exit 1; }

# The wheel where spdlog and fmt are absent: their files covered by empty ones in a private mount
# namespace, checked to be unloadable there, and the wheel's library still loads and works.
hide=()
for lib in $(ldconfig -p | awk '/lib(spdlog|fmt)\.so/ {print $NF}' | xargs -r readlink -f | sort -u); do hide+=("$lib"); done
[ ${#hide[@]} -gt 0 ] || { echo "40-wheel: no libspdlog or libfmt on this machine to hide"; exit 1; }
unshare_cmd=(unshare --mount --propagation private)
[ "$(id -u)" -eq 0 ] || unshare_cmd=(unshare --user --map-root-user --mount --propagation private)
# shellcheck disable=SC2016
(cd / && "${clean_env[@]}" "${unshare_cmd[@]}" bash -c '
  set -euo pipefail
  for f in "${@:3}"; do mount --bind /dev/null "$f"; done
  for f in "${@:3}"; do
    if "$1" -c "import ctypes, sys; ctypes.CDLL(sys.argv[1])" "$f" 2>/dev/null; then echo "$f still loads"; exit 1; fi
  done
  "$1" -c "$2" "the wheel, with $(printf "%s " "${@:3}")hidden"
' hide "$work/venv/bin/python" "$allreduce" "${hide[@]}")
