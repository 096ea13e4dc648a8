/* SPDX-License-Identifier: Apache-2.0 */
/* Threads as ranks: the call check folded into the lane's call (checked_levels, lane_call,
 * calls_agree in src/comm/transport/threaded/threaded_communicator.cpp). P processes of T threads
 * each make K calls; every thread picks any of three calls for each: A and B, which fold and whose
 * lane calls are alike (two allreduces that fuse their buffers differently: the lane sees the same
 * call, so only the carried word tells them apart), and X, which does not fold (a broadcast).
 *
 * A level is abstracted as round.pml and mpi_round.pml prove it behaves (no failures here: they
 * are threaded.pml's): a round completes once all its members have arrived, and every member then
 * reads the same result. The lane's check (the MPI fingerprint, the hierarchical hash) compares
 * each process's (call, word): when they differ, every process gets E_MISMATCH, and the lane stays
 * usable.
 *
 * Per call, every thread: a team round of its call's hash (the team agrees or not); then, folded
 * (the call folds and the team agrees), thread 0's lane call carrying the hash (after the team's
 * data round, which tells nothing and is left out), a team round in which thread 0 tells the verdict, and the hand-out round;
 * otherwise explicit, thread 0's lane round of the team's words (the hashes' max and min) carrying
 * its hash, and a team round handing the words and the lane's verdict out. Calls found to differ
 * are then named: a team round, thread 0's lane round of the signatures, a team round.
 *
 * Checked: nothing hangs (every thread ends every call), and for every call either every thread
 * of every process returns OK, or every one returns E_MISMATCH; OK exactly when all picked the
 * same call.
 * Mutants: MUTANT_NO_WORD (the folded lane call carries no word), MUTANT_NO_VERDICT (thread 0
 * keeps the lane's verdict to itself), MUTANT_STALE_VERDICT (a verdict is not cleared when a call
 * begins). */

#ifndef P
#define P 2
#endif
#ifndef T
#define T 2
#endif
#ifndef K
#define K 2
#endif

#define N (P * T)
#define OK 1
#define MISMATCH 2
/* Lane calls */
#define DATA 1
#define CHECK 2
#define NAMES 3

byte pick[K * N];     /* the call each thread makes, as its hash: 1 (A), 2 (B), 3 (X) */
byte outcome[K * N];  /* OK or MISMATCH */

/* Team p's rounds: the last round each member arrived at, its value, the rounds completed, and
 * the last round's result (all values alike; their max; their min). */
byte team_at[N];
byte team_val[N];
byte team_done[P];
bool team_same[P];
byte team_max[P];
byte team_min[P];

/* The lane: the processes' threads 0. */
byte lane_at[P];
byte lane_call[P];
byte lane_word[P];
byte lane_max[P];  /* the team words' max and min (an explicit round's data) */
byte lane_min[P];
byte lane_done = 0;
bool lane_pass;
byte lane_all_max, lane_all_min;

byte finished = 0;

/* Arrive at team round r with value v, wait for its end. */
inline team_round(p, t, r, v) {
  atomic {
    team_at[p * T + t] = r;
    team_val[p * T + t] = v;
    j = 0;
    all = true;
    do
    :: j < T -> all = all && team_at[p * T + j] >= r; j++
    :: else -> break
    od;
    if
    :: all ->
      team_same[p] = true;
      team_max[p] = 0;
      team_min[p] = 255;
      j = 0;
      do
      :: j < T ->
        team_same[p] = team_same[p] && team_val[p * T + j] == team_val[p * T];
        if
        :: team_val[p * T + j] > team_max[p] -> team_max[p] = team_val[p * T + j]
        :: else
        fi;
        if
        :: team_val[p * T + j] < team_min[p] -> team_min[p] = team_val[p * T + j]
        :: else
        fi;
        j++
      :: else -> break
      od;
      team_done[p] = r
    :: else
    fi
  }
  team_done[p] >= r
}

/* Thread 0 of process p arrives at lane round r with its call, word and team words. */
inline lane_round(p, r, call, word, wmax, wmin) {
  atomic {
    lane_at[p] = r;
    lane_call[p] = call;
    lane_word[p] = word;
    lane_max[p] = wmax;
    lane_min[p] = wmin;
    j = 0;
    all = true;
    do
    :: j < P -> all = all && lane_at[j] >= r; j++
    :: else -> break
    od;
    if
    :: all ->
      lane_pass = true;
      lane_all_max = 0;
      lane_all_min = 255;
      j = 0;
      do
      :: j < P ->
        lane_pass = lane_pass && lane_call[j] == lane_call[0] && lane_word[j] == lane_word[0];
        if
        :: lane_max[j] > lane_all_max -> lane_all_max = lane_max[j]
        :: else
        fi;
        if
        :: lane_min[j] < lane_all_min -> lane_all_min = lane_min[j]
        :: else
        fi;
        j++
      :: else -> break
      od;
      lane_done = r
    :: else
    fi
  }
  lane_done >= r
}

proctype thread(byte p; byte t) {
  byte c = 0, h, j, tr = 0, lr = 0, carried, wmax, wmin;
  bool all, agree, differ = false;
  do
  :: c == K -> break
  :: c < K ->
    h = pick[c * N + p * T + t];
#ifndef MUTANT_STALE_VERDICT
    differ = false;  /* begin_call */
#endif
    tr++;
    team_round(p, t, tr, h);
    agree = team_same[p];
    wmax = team_max[p];
    wmin = team_min[p];
    if
    :: agree && h != 3 ->  /* folded (the team's data round, which tells nothing, left out) */
      if
      :: t == 0 ->
#ifdef MUTANT_NO_WORD
        carried = 0;
#else
        carried = h;
#endif
        lr++;
        lane_round(p, lr, DATA, carried, 0, 0);
        differ = differ || !lane_pass
      :: else
      fi;
      tr++;  /* calls_agree: thread 0 tells its verdict */
      team_round(p, t, tr, differ);
#ifndef MUTANT_NO_VERDICT
      differ = team_max[p] != 0
#endif
      ;
      if
      :: !differ -> tr++; team_round(p, t, tr, 0)  /* the hand-out */
      :: else
      fi
    :: else ->  /* explicit */
      if
      :: t == 0 ->
        lr++;
        lane_round(p, lr, CHECK, h, wmax, wmin);
        differ = !lane_pass || lane_all_max != lane_all_min
      :: else
      fi;
      tr++;
      team_round(p, t, tr, differ);
      differ = team_max[p] != 0
    fi;
    if
    :: differ ->  /* name_different_calls */
      tr++;
      team_round(p, t, tr, 0);
      if
      :: t == 0 -> lr++; lane_round(p, lr, NAMES, 0, 0, 0)
      :: else
      fi;
      tr++;
      team_round(p, t, tr, 0);
      outcome[c * N + p * T + t] = MISMATCH
    :: else -> outcome[c * N + p * T + t] = OK
    fi;
    c++
  od;
  atomic { finished++ }
}

init {
  byte i, k, p, t;
  bool same;
  /* Every thread's call for every call number, picked before any thread starts. */
  i = 0;
  do
  :: i < K * N ->
    if
    :: pick[i] = 1
    :: pick[i] = 2
    :: pick[i] = 3
    fi;
    i++
  :: else -> break
  od;
  atomic {
    p = 0;
    do
    :: p < P ->
      t = 0;
      do
      :: t < T -> run thread(p, t); t++
      :: else -> break
      od;
      p++
    :: else -> break
    od
  }
  finished == N;
  k = 0;
  do
  :: k < K ->
    same = true;
    i = 0;
    do
    :: i < N -> same = same && pick[k * N + i] == pick[k * N]; i++
    :: else -> break
    od;
    i = 0;
    do
    :: i < N ->
      assert(outcome[k * N + i] == outcome[k * N]);
      assert((outcome[k * N + i] == OK) == same);
      i++
    :: else -> break
    od;
    k++
  :: else -> break
  od
}
