#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CI stage: the C and C++ sources follow .clang-format (Debian 12's clang-format 14, which
# scripts/setup.sh installs). To format a change: clang-format -i <files>. Seconds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
mapfile -t files < <(find src capi include tests bench -type f \( -name '*.c' -o -name '*.h' -o -name '*.cpp' \
                       -o -name '*.hpp' \) | sort)
[ ${#files[@]} -gt 100 ] || { echo "05-format: found only ${#files[@]} sources"; exit 1; }
clang-format --dry-run -Werror "${files[@]}"
echo "05-format: ${#files[@]} C and C++ files follow .clang-format"
