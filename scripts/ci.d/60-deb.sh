#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Debian packages: cpack builds libgradsync0, libgradsync0-mpi, libgradsync-dev and python3-gradsync
# from the main build (cmake/debian.cmake), lintian finds no error or warning but those the packages
# override (each with its reason), apt installs them on this machine (as a user of a fresh
# Debian 12 would), and Debian's python3 imports gradsync from /usr/lib/python3/dist-packages with
# nothing set, while a C program through pkg-config, a CMake project through find_package and
# Python use them. The packages are removed again at the end.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${BUILD_DIR:-$root/build}"
work="$(mktemp -d)"
packages=(libgradsync0 libgradsync0-mpi libgradsync-dev python3-gradsync)
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
cleanup() {
  $sudo apt-get purge -y -qq "${packages[@]}" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

(cd "$build" && cpack -G DEB -B "$work/debs" >/dev/null)
ls "$work"/debs/*.deb
for pkg in "${packages[@]}"; do
  ls "$work"/debs/"${pkg}"_*.deb >/dev/null || { echo "cpack made no $pkg package"; exit 1; }
done

# Errors and warnings fail. The packages' own overrides (/usr/share/lintian/overrides, written
# by cmake/debian.cmake) say why each one is right as it is.
command -v lintian >/dev/null || { echo "60-deb: lintian is missing (scripts/setup.sh installs it)"; exit 1; }
lintian --fail-on error,warning "$work"/debs/*.deb
echo "ok: lintian finds no error or warning; the packages' overrides, with their reasons:"
for deb in "$work"/debs/*.deb; do
  dpkg-deb --fsys-tarfile "$deb" | tar -xO --wildcards './usr/share/lintian/overrides/*' | sed "s|^|  $(basename "$deb"): |"
done

$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$work"/debs/*.deb >/dev/null
(cd / && env -u GRADSYNC_LIBRARY -u PYTHONPATH -u LD_LIBRARY_PATH /usr/bin/python3 -c '
import gradsync, os
assert gradsync.__file__ == "/usr/lib/python3/dist-packages/gradsync/__init__.py", gradsync.__file__
assert os.path.isfile("/usr/lib/python3/dist-packages/gradsync/torch/elastic.py"), "the subpackage gradsync.torch is missing"
print("python3-gradsync: import gradsync from", gradsync.__file__, "with", gradsync.lib._name)')
"$root/scripts/check_consumers.sh" /usr
echo "ok: the .deb packages pass lintian and install, and C, CMake and Python consumers use them"
