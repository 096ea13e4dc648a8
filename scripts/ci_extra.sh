#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CI stages beyond the test command and the ASan/UBSan run: each scripts/ci.d/*.sh is one stage
# (ThreadSanitizer, fuzzing, ...), run in name order; any failure fails CI.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
for stage in scripts/ci.d/*.sh; do
  [ -e "$stage" ] || continue
  echo "--- $stage"
  bash "$stage"
done
