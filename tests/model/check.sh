#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Checks the round protocol's model (round.pml) with spin over every interleaving, in the
# configurations below, and checks that each earlier, wrong rule (the MUTANT_* switches) is caught.
# Exhaustive searches (no bitstate); COLLAPSE only compresses the stored states, losing none.
# About three minutes and 4 GB of memory.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp "$here/round.pml" "$work/"
cd "$work"

failed=0
# expect (holds|violated), a name, then spin's -D switches.
check() {
  local expect=$1 name=$2
  shift 2
  spin -a "$@" round.pml >/dev/null
  gcc -O2 -DSAFETY -DCOLLAPSE -DVECTORSZ=2048 -w -o pan pan.c
  local out errors states
  out="$(./pan -m1000000 -w26 2>&1 || true)"
  errors="$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' <<<"$out")"
  states="$(sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' <<<"$out")"
  if grep -q "max search depth too small\|out of memory" <<<"$out"; then
    echo "FAIL $name: the search did not complete"; echo "$out"; failed=1; return
  fi
  if [ "$expect" = holds ] && [ "$errors" = 0 ]; then
    echo "ok   $name: holds over $states states"
  elif [ "$expect" = violated ] && [ "${errors:-0}" != 0 ]; then
    echo "ok   $name: violation found, as it must be ($(grep -m1 'violated\|invalid end' <<<"$out" | cut -c1-90))"
  else
    echo "FAIL $name: expected the properties to be $expect"; echo "$out"
    [ -e round.pml.trail ] && spin -t -p round.pml | tail -60
    failed=1
  fi
  rm -f round.pml.trail
}

check holds "2 ranks, 2 calls, an abort and a deadline" -DN=2 -DK=2 -DABORTS=1 -DTIMEOUTS=1
check holds "2 ranks, 3 calls, an abort" -DN=2 -DK=3 -DABORTS=1 -DTIMEOUTS=0
check holds "2 ranks, 2 calls, an abort and a death" -DN=2 -DK=2 -DABORTS=1 -DTIMEOUTS=0 -DDEATHS=1
check holds "3 ranks, 1 call, an abort" -DN=3 -DK=1 -DABORTS=1 -DTIMEOUTS=0
check holds "3 ranks, 1 call, a death" -DN=3 -DK=1 -DABORTS=0 -DTIMEOUTS=0 -DDEATHS=1
check holds "2 ranks, 2 calls, an abort and an error of a rank's own" -DN=2 -DK=2 -DABORTS=1 -DTIMEOUTS=0 -DLOCAL_FAILS=1
check holds "3 ranks, 1 call, an error of a rank's own" -DN=3 -DK=1 -DABORTS=0 -DTIMEOUTS=0 -DLOCAL_FAILS=1
check violated "mutant: a failure of a later barrier taken as this barrier's" -DN=2 -DK=2 -DMUTANT_DECIDE
check violated "mutant: a failure that arrivals after it can complete" -DN=2 -DK=2 -DMUTANT_COUNT
check violated "mutant: a rank that left its round is not counted past it" -DN=2 -DK=1 -DABORTS=0 -DTIMEOUTS=0 -DLOCAL_FAILS=1 -DMUTANT_STAY
check violated "mutant: reset ignores a barrier decided failed before anyone arrived" -DN=2 -DK=2 -DMUTANT_SKIP
check violated "mutant: reset retracts a request a peer may have seen" -DN=2 -DK=3 -DMUTANT_RETRACT
check violated "mutant: a stop tagged with a reset epoch read apart from its CAS" -DN=2 -DK=2 -DMUTANT_TAG
exit $failed
