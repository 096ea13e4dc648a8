#!/usr/bin/env bash
# The main job: builds libgradsync (all set-up included) and trains the digits classifier
# through it. Extra arguments go to scripts/train_digits.py.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$root/build" -j "$(nproc)" --target gradsync >/dev/null
export GRADSYNC_LIBRARY="$root/build/libgradsync.so.0"
exec /usr/bin/python3 "$root/scripts/train_digits.py" "$@"
