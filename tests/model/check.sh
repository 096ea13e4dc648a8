#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Checks the round protocols' models with spin over every interleaving, in the configurations
# below, and checks that each wrong rule (the MUTANT_* switches) is caught: round.pml, the round
# engine's (threads, shared memory), and mpi_round.pml, the MPI transport's.
# Exhaustive searches (no bitstate); COLLAPSE only compresses the stored states, losing none.
# About five and a half minutes of CPU on a quiet machine and 4 GB of memory: round.pml two and a
# half, mpi_round.pml half a minute, membership.pml (shrink and grow) one, mpi_shrink.pml one and a
# half.
# check.sh MODEL (round, mpi_round, membership, mpi_shrink, mpi_grow, threaded, threaded_check or mpi_reset) checks that
# model alone; ctest runs one each.
set -euo pipefail
only="${1:-}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp "$here/round.pml" "$here/mpi_round.pml" "$here/membership.pml" "$here/mpi_shrink.pml" "$here/mpi_grow.pml" \
  "$here/threaded.pml" "$here/threaded_check.pml" "$here/mpi_reset.pml" "$work/"
cd "$work"

failed=0
model=round.pml
# expect (holds|violated), a name, then spin's -D switches; the model is $model.
check() {
  if [ -n "$only" ] && [ "$model" != "$only.pml" ]; then return; fi
  local expect=$1 name=$2
  shift 2
  spin -a "$@" "$model" >/dev/null
  # A mutant's search stops at its first violation, within a few thousand states: compiling pan
  # with -O2 (2.4 s of CPU) and clearing a 2^26-slot hash table would cost more than it.
  local opt=-O2 slots=26
  if [ "$expect" = violated ]; then opt=-O0 slots=20; fi
  gcc "$opt" -DSAFETY -DCOLLAPSE -DVECTORSZ=2048 -w -o pan pan.c
  local out errors states
  out="$(./pan -m1000000 -w"$slots" 2>&1 || true)"
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
    [ -e "$model.trail" ] && spin -t -p "$@" "$model" | tail -60
    failed=1
  fi
  rm -f "$model.trail"
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

model=mpi_round.pml
check holds "MPI: 2 ranks, 2 calls, an abort" -DN=2 -DK=2 -DABORTS=1 -DTIMEOUTS=0
check holds "MPI: 2 ranks, 3 calls, two aborts" -DN=2 -DK=3 -DABORTS=2 -DTIMEOUTS=0
check holds "MPI: 2 ranks, 2 calls, an abort and a deadline" -DN=2 -DK=2 -DABORTS=1 -DTIMEOUTS=1
check holds "MPI: 2 ranks, 2 calls, an abort and a death" -DN=2 -DK=2 -DABORTS=1 -DTIMEOUTS=0 -DDEATHS=1
check holds "MPI: 3 ranks, 2 calls, an abort" -DN=3 -DK=2 -DABORTS=1 -DTIMEOUTS=0
check holds "MPI: 3 ranks, 1 call, an abort, a deadline and a death" -DN=3 -DK=1 -DABORTS=1 -DTIMEOUTS=1 -DDEATHS=1
check violated "MPI mutant: an abort abandons the exchange this rank posted" -DN=2 -DK=2 -DMUTANT_ABANDON
check violated "MPI mutant: any notice ends a wait, whatever call it stops at" -DN=2 -DK=2 -DMUTANT_STOPAT
check violated "MPI mutant: the table reaches the rank outside the doubling before it is whole" -DN=3 -DK=1 -DABORTS=1 -DTIMEOUTS=0 -DMUTANT_EARLY
check violated "MPI mutant: abort() reads how far the rank posted apart from its flag" -DN=2 -DK=2 -DMUTANT_NOCAS
check violated "MPI mutant: a rank that failed a call goes on in its epoch" -DN=2 -DK=2 -DABORTS=0 -DTIMEOUTS=1 -DMUTANT_STAY
check violated "MPI mutant: a large call enters MPI's collective without a commit" -DN=2 -DK=1 -DABORTS=0 -DTIMEOUTS=1 -DMUTANT_NOCOMMIT
check violated "MPI mutant (the assumption): a deadline in a commit every rank posted" -DN=2 -DK=1 -DABORTS=0 -DTIMEOUTS=1 -DMUTANT_COMMIT_DEADLINE
# The stop check of hier's cross-host level (STOPS_EXT): the exchange's waits take it, the commit's not.
check holds "MPI: 2 ranks, 2 calls, an abort and a stop from outside" -DN=2 -DK=2 -DABORTS=1 -DTIMEOUTS=0 -DSTOPS_EXT=1
check holds "MPI: 3 ranks, 1 call, a stop from outside and a death" -DN=3 -DK=1 -DABORTS=0 -DTIMEOUTS=0 -DSTOPS_EXT=1 -DDEATHS=1
check violated "MPI mutant: the stop check ends a commit wait" -DN=2 -DK=1 -DABORTS=0 -DTIMEOUTS=0 -DSTOPS_EXT=1 -DMUTANT_STOP_IN_COMMIT

# The membership protocol of a shrink (membership.pml): deaths at every step, a second death, a
# deadline passing, an abort racing the new group's commit. About 40 s of CPU.
model=membership.pml
check holds "shrink: 3 ranks, a death" -DN=3 -DDEATHS=1
check holds "shrink: 3 ranks, two deaths" -DN=3 -DDEATHS=2
check holds "shrink: 2 ranks, a death and the deadline" -DN=2 -DDEATHS=1 -DDEADLINE=1
check holds "shrink: 3 ranks, the deadline" -DN=3 -DDEATHS=0 -DDEADLINE=1
check holds "shrink: 2 ranks, a death and an abort of the commit" -DN=2 -DDEATHS=1 -DABORTS=1
check violated "mutant: the decision stored after a separate check, not by CAS" -DN=3 -DDEATHS=1 -DMUTANT_STORE
check violated "mutant: the decision published before its proposal, read without the tag" -DN=3 -DDEATHS=1 -DMUTANT_UNTAGGED
check violated "mutant: propose without waiting for the live ranks" -DN=3 -DDEATHS=0 -DMUTANT_NO_WAIT
check violated "mutant: forming waits for a member that died" -DN=3 -DDEATHS=1 -DMUTANT_NO_ABANDON
check violated "mutant: no commit barrier on the new group" -DN=3 -DDEATHS=1 -DMUTANT_NO_COMMIT
# The grow (-DGROW): a death of a member or of the joiner at each step, two deaths, an abort
# racing each step, the deadline. About 10 s of CPU.
check holds "grow: 2 members and a joiner, a death" -DGROW -DN=2 -DDEATHS=1
check holds "grow: 3 members and a joiner, a death" -DGROW -DN=3 -DDEATHS=1
check holds "grow: 2 members and a joiner, two deaths and an abort" -DGROW -DN=2 -DDEATHS=2 -DABORTS=1
check holds "grow: 2 members and a joiner, a death, an abort and the deadline" -DGROW -DN=2 -DDEATHS=1 -DABORTS=1 -DDEADLINE=1
check violated "grow mutant: no commit barrier on the grown group" -DGROW -DN=2 -DDEATHS=0 -DABORTS=1 -DMUTANT_GROW_NO_COMMIT
check violated "grow mutant: a member that fails does not stop the old group" -DGROW -DN=2 -DDEATHS=1 -DMUTANT_GROW_NO_STOP
check violated "grow mutant: a member that fails leaves the forming group before it stops the old group" -DGROW -DN=2 -DDEATHS=1 -DMUTANT_GROW_LEAVE_FIRST
check violated "grow mutant: the lobby freed after the offer (member 0 and the joiner stop watching each other)" -DGROW -DN=2 -DDEATHS=1 -DMUTANT_LOBBY_FREED

# The MPI transport's shrink (mpi_shrink.pml): agreement over point-to-point messages with
# deadlines, a confirmation round, then the blocking MPI_Comm_create_group under a watchdog.
# About a minute and a half of CPU.
model=mpi_shrink.pml
check holds "MPI shrink: 2 ranks, a death" -DN=2 -DDEATHS=1
check holds "MPI shrink: 3 ranks, a death" -DN=3 -DDEATHS=1
check holds "MPI shrink: 3 ranks, two deaths (a second during the shrink)" -DN=3 -DDEATHS=2
check holds "MPI shrink: 3 ranks, a death, rank 2 on another host (no PID liveness)" -DN=3 -DDEATHS=1 -DCROSS=1
check holds "MPI shrink: 3 ranks, a death, rank 0 comes after the deadline" -DN=3 -DDEATHS=1 -DLATE=1
check violated "MPI shrink mutant: create_group right after the agreement, no confirmation round" -DN=3 -DDEATHS=1 -DMUTANT_NO_CONFIRM
check violated "MPI shrink mutant: a rank keeps its own suspicions, no union of the proposals" -DN=3 -DDEATHS=1 -DCROSS=1 -DMUTANT_NO_UNION
check violated "MPI shrink mutant: a rank named failed by a peer drops itself from the set and goes on" -DN=3 -DDEATHS=0 -DLATE=1 -DMUTANT_NO_SELF_CHECK
check violated "MPI shrink mutant (the assumption): a deadline passes while a live rank's answer is on its way" -DN=2 -DDEATHS=0 -DMUTANT_DEADLINE_ANYTIME
check violated "MPI shrink mutant: create_group without the watchdog" -DN=3 -DDEATHS=1 -DMUTANT_NO_WATCHDOG
# The MPI transport's grow (mpi_grow.pml): an agreement round, then the blocking spawn and merge
# under watchdogs, then the grown group's rounds; deaths at every step, a member's abort, a member
# that saw a host lost, a joiner with another name. A few seconds of CPU.
model=mpi_grow.pml
check holds "MPI grow: 2 members and a joiner, nobody lost" -DN=2 -DDEATHS=0
check holds "MPI grow: 2 members and a joiner, a death and an abort" -DN=2 -DDEATHS=1 -DABORTS=1
check holds "MPI grow: 3 members and a joiner, two deaths and an abort" -DN=3 -DDEATHS=2 -DABORTS=1
check holds "MPI grow: 2 members and 2 joiners, a death" -DN=2 -DJ=2 -DDEATHS=1
check holds "MPI grow: 2 members and a joiner, both members dead" -DN=2 -DDEATHS=2
check holds "MPI grow: a member saw a host lost, a death" -DN=2 -DDEATHS=1 -DHOST_LOST=1
check holds "MPI grow: a joiner with another name, a death" -DN=2 -DDEATHS=1 -DBAD_JOINER=1
check violated "MPI grow mutant: spawn without the watchdog" -DN=2 -DDEATHS=1 -DMUTANT_NO_WATCHDOG
check violated "MPI grow mutant: a joiner's MPI_Init without its watchdog" -DN=2 -DDEATHS=2 -DMUTANT_NO_INIT_WATCHDOG
check violated "MPI grow mutant: a member refuses on its own host loss, not the agreed one" -DN=2 -DDEATHS=0 -DHOST_LOST=1 -DMUTANT_REFUSE_LOCAL
check violated "MPI grow mutant: a joiner with another name fails alone" -DN=2 -DDEATHS=0 -DBAD_JOINER=1 -DMUTANT_VERDICT_LOCAL
# Threads as ranks (threaded.pml): how a level's failure reaches the threads in the other levels.
# About a minute and a half of CPU, most of it the abort's configuration.
model=threaded.pml
check holds "threads: 2 processes x 2 threads, 1 call, deadlines" -DP=2 -DT=2 -DK=1
check holds "threads: 3 processes x 1 thread, 2 calls, deadlines" -DP=3 -DT=1 -DK=2
check holds "threads: 2 x 2, 1 call, a failure of a thread's own" -DP=2 -DT=2 -DK=1 -DFAILS=1
check holds "threads: 2 x 1, 2 calls, an abort" -DP=2 -DT=1 -DK=2 -DABORTS=1
check holds "threads: 2 x 2, 1 call, an abort" -DP=2 -DT=2 -DK=1 -DABORTS=1
check violated "threads mutant: a sibling's timeout reported as the abort that brought it" -DP=2 -DT=2 -DK=1 -DMUTANT_NO_TRANSLATE
check violated "threads mutant: every abort passed on to the lane" -DP=2 -DT=2 -DK=1 -DMUTANT_PASS_ALWAYS
check violated "threads mutant: a timeout stops the lane too" -DP=2 -DT=2 -DK=1 -DMUTANT_LANE_ON_TIMEOUT
check violated "threads mutant: a lane's deadline met late not recorded as a timeout" -DP=2 -DT=2 -DK=1 -DMUTANT_NO_LANE_REASON
# Threads as ranks (threaded_check.pml): the call check folded into the lane's call; every rank
# reaches the same verdict whatever each called. About 15 s of CPU (2 x 2 threads, 2 calls holds
# too, over 2.1e8 states in 12 minutes: too long for every run).
model=threaded_check.pml
check holds "threads' check: 2 processes x 2 threads, 1 call" -DP=2 -DT=2 -DK=1
check holds "threads' check: 3 processes x 1 thread, 2 calls" -DP=3 -DT=1 -DK=2
check violated "threads' check mutant: the folded lane call carries no word" -DP=2 -DT=2 -DK=2 -DMUTANT_NO_WORD
check violated "threads' check mutant: thread 0 keeps the lane's verdict" -DP=2 -DT=2 -DK=2 -DMUTANT_NO_VERDICT
check violated "threads' check mutant: a verdict not cleared when a call begins" -DP=2 -DT=2 -DK=2 -DMUTANT_STALE_VERDICT
# The MPI transport's reset and join (mpi_reset.pml): their duplications of a parent, resumed by
# the next call after one that failed on some ranks. Under a second of CPU.
model=mpi_reset.pml
check holds "MPI reset: 2 ranks, 2 duplications, 2 waits given up" -DN=2 -DD=2 -DGIVEUPS=2
check holds "MPI reset: 3 ranks, 2 duplications, 3 waits given up" -DN=3 -DD=2 -DGIVEUPS=3
check holds "MPI reset: 3 ranks, 3 duplications (a join's), 3 waits given up" -DN=3 -DD=3 -DGIVEUPS=3
check violated "MPI reset mutant: a failed reset's duplications posted again" -DN=2 -DD=2 -DGIVEUPS=2 -DMUTANT_REPOST
exit $failed
