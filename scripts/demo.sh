#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The main job: builds libgradsync (all set-up included) and trains on the digits through it.
# First a small CNN through gradsync.torch, on 1 worker and then on 2 worker processes (the
# speed-up of data parallelism on this host's cores, at the same accuracy); then the MLP
# data-parallel through the sharded parameter with Adam, comparing 1 worker with 4 workers
# (uncompressed, bf16 and IEEE-half gradients: a correctness check, and its table says so when it
# shows no speed, as with more workers than cores), and writing the loss curves to loss_curves.png in
# BUILD/demo-output (never into the source tree; --out DIR elsewhere). Extra arguments go to
# scripts/train_digits.py (the second part), e.g.
#   scripts/demo.sh --transport shm              worker processes on this host
#   scripts/demo.sh --transport mpi --workers 2  under mpirun (started here)
#   scripts/demo.sh --mode hogwild               lock-free atomic adds instead
#   scripts/demo.sh --out /tmp/digits            the loss curves there
#   BUILD_DIR=/tmp/gs-build scripts/demo.sh      build (and outputs) outside the checkout, which
#                                                may then be read-only
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
"$root/scripts/setup.sh"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)" --target gradsync >/dev/null
export GRADSYNC_LIBRARY="$build/libgradsync.so.0"
# The default output directory; an --out among the arguments comes later and wins.
out=(--out "$build/demo-output")

transport=threads
workers=2
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --transport) transport="${args[i + 1]:-}" ;;
    --transport=*) transport="${args[i]#*=}" ;;
    --workers) workers="${args[i + 1]:-}" ;;
    --workers=*) workers="${args[i]#*=}" ;;
  esac
done
if [[ "$transport" == mpi ]]; then
  # One MPI process per worker; as root OpenMPI needs --allow-run-as-root, and --oversubscribe
  # lets more workers than cores share the machine.
  exec mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$workers" -x GRADSYNC_LIBRARY \
    /usr/bin/python3 "$root/scripts/train_digits.py" "${out[@]}" "$@"
fi
mkdir -p "$build/demo-output"
/usr/bin/python3 "$root/scripts/train_torch.py" --timeline "$build/demo-output/torch-timeline.json"
echo
exec /usr/bin/python3 "$root/scripts/train_digits.py" "${out[@]}" "$@"
