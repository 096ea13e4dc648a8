#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs, from Debian 12's packages, whatever libgradsync needs to build, test and run its demos.
# Safe to run again: it installs only what is missing.
set -euo pipefail

packages=(
  build-essential cmake pkg-config
  libboost-dev libboost-thread-dev libspdlog-dev catch2
  libopenmpi-dev openmpi-bin
  # tests/multihost makes hosts out of namespaces: ip (netns, veth, bridge), unshare, mount, hostname.
  iproute2 util-linux mount hostname
  python3 python3-numpy python3-pytest python3-sklearn python3-networkx python3-matplotlib
  clang-14 libclang-rt-14-dev
  # scripts/ci.d/05-format.sh: the sources follow .clang-format
  clang-format
  spin
  # pip install . needs no setuptools: the build backend is in the tree (scripts/pep517).
  python3-venv python3-pip
  # scripts/ci.d/60-deb.sh checks the .deb packages with it.
  lintian
  python3-torch
  # numpy's and torch's matrix products: without it they use Debian's reference BLAS, about 12x
  # slower, and every training step is compute-bound. The pthread build, not the serial one:
  # Debian 12's serial OpenBLAS gives wrong products when two threads of one process call it at
  # once (ranks of a thread group do); the demos run it on one thread (OPENBLAS_NUM_THREADS=1).
  libopenblas0-pthread
  cargo
  doxygen
  # CI's builds run through it (.ci/run): its second Release build of the same sources is cached.
  ccache
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# A machine that chose the serial OpenBLAS by hand keeps it: say why that is unsafe here.
warn_serial_blas() {
  local name chosen
  name="libblas.so.3-$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)"
  chosen="$(update-alternatives --query "$name" 2>/dev/null | sed -n 's/^Value: //p' || true)"
  if [[ "$chosen" == *openblas-serial* ]]; then
    echo "setup: warning: libblas.so.3 is the serial OpenBLAS, which gives wrong results when several threads" \
         "of one process call it (thread groups); choose another: update-alternatives --config $name" >&2
  fi
}

if [ ${#missing[@]} -eq 0 ]; then
  warn_serial_blas
  exit 0
fi

echo "setup: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
warn_serial_blas
