#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Debian packages: cpack builds libgradsync0, libgradsync0-mpi and libgradsync-dev from the main build, apt installs
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
  $sudo apt-get purge -y -qq libgradsync-dev libgradsync0-mpi libgradsync0 >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

(cd "$build" && cpack -G DEB -B "$work/debs" >/dev/null)
ls "$work"/debs/*.deb
for pkg in libgradsync0 libgradsync0-mpi libgradsync-dev; do
  ls "$work"/debs/"${pkg}"_*.deb >/dev/null || { echo "cpack made no $pkg package"; exit 1; }
done
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$work"/debs/*.deb >/dev/null

"$root/scripts/check_consumers.sh" /usr
echo "ok: the .deb packages install, and C, CMake and Python consumers use them"
