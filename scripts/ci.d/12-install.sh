#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CI stage: install, find_package and pkg-config from another project, on the README stage's build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
scripts/check_install.sh build
