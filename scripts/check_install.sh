#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs a build into a scratch prefix, moves the installed tree elsewhere (it must be
# relocatable: gradsync.pc and the Python package find their files relative to themselves), and
# builds and runs every kind of consumer against it.
set -euo pipefail
build="${1:-build}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
mv "$work/prefix" "$work/moved"
"$root/scripts/check_consumers.sh" "$work/moved"
