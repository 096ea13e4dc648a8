/* SPDX-License-Identifier: Apache-2.0 */
/* Threads as ranks (src/comm/transport/threaded/threaded_communicator.cpp): how a failure in one
 * level reaches the threads in the others. P processes of T threads each; the threads of a
 * process meet in their team, the processes' threads 0 in the lane. Each thread makes K calls of
 * three steps: team, lane (thread 0 only), team.
 *
 * A level is abstracted as the levels' own models (round.pml, mpi_round.pml) prove it behaves: a
 * round completes for all its members once all have arrived, unless the level was stopped first;
 * a member waiting in a round that cannot complete may meet its deadline, which stops the level
 * with a timeout (its waiting members get the timeout, later arrivals an abort); an abort stops
 * it (waiting members and later arrivals get an abort). Deadlines may pass at any moment a member
 * is missing, which covers every lateness.
 *
 * The rules under test (run_levels, begin_call, abort), each failure also stopping the team:
 * - a failed call stops the thread's later calls at once (until a reset, not modelled);
 * - a timeout: the process records it; the lane is left to its own deadline;
 * - a failure of the thread's own (FAILS of them: a lost peer, a bad buffer): recorded as an
 *   abort, the thread's lane stopped;
 * - an abort met during the call after the process recorded a timeout: reported as that timeout;
 *   after it recorded an abort: passed on to the thread's lane;
 * - any other abort (a stop passed on already, or a deadline this thread arrived after): goes no
 *   further; where the thread's lane says a peer's deadline stopped it (the MPI transport's notice
 *   carries it; the team's thread transport says nothing), recorded as a timeout;
 * - abort() (ABORTS of them, by any process at any time): recorded, team and every lane stopped.
 *
 * Checked: every thread ends every call (no invalid end state: nothing hangs), and without aborts
 * and failures every call that began before any stop, failed while it waited in a level (not on
 * arriving at a stopped one: then it is the late rank), reports the timeout (comm.h: a rank that
 * does not arrive gives every waiting rank the timeout), never an abort.
 * Mutants: MUTANT_NO_TRANSLATE (a sibling's timeout reported as the abort that brought it),
 * MUTANT_PASS_ALWAYS (every abort passed on to the lane), MUTANT_LANE_ON_TIMEOUT (a timeout
 * stops the lane too), MUTANT_NO_LANE_REASON (a late arrival's lane stopped by a deadline not
 * recorded as a timeout). */

#ifndef P
#define P 2
#endif
#ifndef T
#define T 2
#endif
#ifndef K
#define K 2
#endif
#ifndef ABORTS
#define ABORTS 0
#endif
#ifndef FAILS
#define FAILS 0
#endif
#define LANES 1

#define OK 0
#define TIMEOUT 1
#define ABORTED 2

#define TEAMS P
#define LEVELS (TEAMS + LANES)
#define MEMBERS 4  /* at least P and T */

/* Level l: teams 0 .. P-1, then lanes. Member m of team p is thread m of p; of lane k, thread k
 * of process m. */
byte at[LEVELS * MEMBERS];  /* the last round each member arrived at */
byte done[LEVELS];          /* rounds completed */
byte stopped[LEVELS];       /* OK, or why it stopped: TIMEOUT or ABORTED */
byte size[LEVELS];

/* Per process: its stops, counted, and whether the last was a timeout. */
byte stops[P];
bool stop_timed_out[P];
bool any_stop = false;     /* some level stopped somewhere */
byte aborts_left = ABORTS;
byte fails_left = FAILS;
byte finished = 0;

inline stop(l, why) {
  if
  :: stopped[l] == OK -> stopped[l] = why; any_stop = true
  :: else
  fi
}

/* Arrive at round r of level l as member m, then wait: result OK, or why it failed (late: it
 * arrived at a stopped level). Or, FAILS times, fail on its own (result: the failure, 3). */
inline level_call(l, m, r, result) {
  atomic {
    if
    :: fails_left > 0 -> fails_left--; result = 3
    :: stopped[l] != OK -> result = ABORTED; late = true; lane_timed_out = l >= TEAMS && stopped[l] == TIMEOUT
    :: else ->
      at[l * MEMBERS + m] = r;
      j = 0;
      all = true;
      do
      :: j < size[l] -> all = all && at[l * MEMBERS + j] >= r; j++
      :: else -> break
      od;
      if
      :: all -> done[l] = r
      :: else
      fi;
      result = 255
    fi
  }
  do
  :: result != 255 -> break
  :: atomic { done[l] >= r -> result = OK }
  :: atomic { stopped[l] != OK && done[l] < r -> result = stopped[l] }
  :: atomic {  /* the deadline, while a member is missing */
      stopped[l] == OK && done[l] < r ->
      stop(l, TIMEOUT);
      result = TIMEOUT
    }
  od
}

inline note_stop(p, timed_out) {
  stops[p]++;
  stop_timed_out[p] = timed_out
}

proctype thread(byte p; byte t) {
  byte c = 0, step, result, status, l, m, j;
  byte team_round = 0, lane_round = 0;
  byte stops_at_call;
  byte my_lane = TEAMS;
  bool all, failed = false, began_clean, pass_on, during, late, lane_timed_out;
  do
  :: c == K -> break
  :: c < K ->
    c++;
#ifndef MUTANT_NO_FAST_FAIL
    if
    :: failed -> goto next  /* begin_call: fails at once, touching no level */
    :: else
    fi;
#endif
    atomic { stops_at_call = stops[p]; began_clean = !any_stop; late = false; lane_timed_out = false };
    step = 0;
    status = OK;
    do
    :: step == 3 || status != OK -> break
    :: else ->
      if
      :: step == 1 && t != 0 -> step++; goto stepped  /* the path through thread 0 */
      :: step == 1 -> l = my_lane; m = p; lane_round++; level_call(l, m, lane_round, result)
      :: else -> l = p; m = t; team_round++; level_call(l, m, team_round, result)
      fi;
      status = result;
      step++;
stepped: skip
    od;
    if
    :: status != OK ->
      /* run_levels' catch */
      atomic {
        pass_on = false;
        during = stops[p] > stops_at_call;
        if
        :: status == TIMEOUT -> note_stop(p, true)
#ifdef MUTANT_LANE_ON_TIMEOUT
          ; pass_on = true
#endif
        :: status != TIMEOUT && status != ABORTED -> note_stop(p, false); pass_on = true
        :: status == ABORTED && during && stop_timed_out[p] ->
#ifndef MUTANT_NO_TRANSLATE
          status = TIMEOUT
#else
          skip
#endif
        :: status == ABORTED && during && !stop_timed_out[p] -> pass_on = true
        :: status == ABORTED && !during ->
#ifdef MUTANT_PASS_ALWAYS
          pass_on = true
#else
          skip
#endif
#ifndef MUTANT_NO_LANE_REASON
          ;
          if
          :: lane_timed_out -> note_stop(p, true)
          :: else
          fi
#endif
        fi;
        stop(p, ABORTED);
        if
        :: pass_on && t == 0 -> stop(my_lane, ABORTED)
        :: else
        fi
      };
      failed = true;
      /* Without aborts, a call that began before any stop reports the timeout. */
      assert(ABORTS > 0 || FAILS > 0 || !began_clean || late || status == TIMEOUT)
    :: else
    fi;
next: skip
  od;
  finished++
}

/* abort() on a thread of process p, at any moment. */
proctype aborter() {
  byte p, k;
  do
  :: aborts_left == 0 || finished == P * T -> break
  :: aborts_left > 0 ->
    /* abort() on process 0 (the processes are alike but for the order of their ranks) */
    p = 0;
    atomic {
      aborts_left--;
      note_stop(p, false);
      stop(p, ABORTED);
      k = 0;
      do
      :: k < LANES -> stop(TEAMS + k, ABORTED); k++
      :: else -> break
      od
    }
  od
}

init {
  byte p, t, l;
  atomic {
    l = 0;
    do
    :: l < TEAMS -> size[l] = T; l++
    :: l < LEVELS -> size[l] = P; l++
    :: else -> break
    od;
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
    od;
    run aborter()
  }
}
