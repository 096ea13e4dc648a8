/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The MPI transport's round protocol (src/comm/transport/mpi/mpi_communicator.cpp, "The round
 * protocol" above MpiCommunicator::arrive), as a Promela model that spin checks over every
 * interleaving of its events: completion, abort, timeout, a dead peer, a stop from outside and reset.
 *
 * Each call starts with its exchange: a rank posts its first message (it can never take it back: MPI
 * cannot cancel). With 2 ranks the exchange completes on a rank once the other has posted. With 3 it
 * is the transport's recursive doubling with one rank outside: rank 0 sends its entry to rank 1;
 * rank 1, once it has that, sends what it holds to rank 2; rank 2's exchange completes once rank 1
 * has sent; rank 1, once it has rank 2's, sends the whole table to rank 0, whose exchange then
 * completes. A rank moves from one step to the next only through the same committed wait. A
 * small call (an allreduce that fits, a barrier) ends there. A large one posts a commit barrier once
 * its exchange has completed, then enters MPI's blocking collective, which no deadline, abort or
 * notice can end: it completes only when every rank has entered it (or a death ends the job). The
 * commit (empty messages in the exchange's steps) is one wait here, which completes once every rank
 * has posted it: a rank abandons it only on what ends a committed wait, and once every rank has
 * posted it nothing but a death (or a deadline, the assumption below) does.
 * A death ends any wait once it has happened (LIVENESS), at whatever moment the rank sees it: the
 * transport sees it by PID on its host, by a liveness link, or in a peer's notice that reports it
 * (whatever call that notice stops at: a dead rank posts nothing more).
 * Ranks run K calls, each small or large (chosen once, the same for every rank's k-th call); after
 * a failed call a rank resets (a fresh epoch: messages of the old one never match) and goes on
 * with its next call, at most RESETS times. Checked:
 *   - no hang: no rank waits forever in MPI's blocking collective (spin reports the invalid end
 *     state), and every other wait ends (deadlines);
 *   - the ranks never drift: no rank completes a call of an epoch after a call that some rank
 *     failed in that epoch (a rank that fails a call posts nothing more in its epoch);
 *   - one outcome for aborts: with no deadline and no death, every rank ends every call of an
 *     epoch alike (all complete it, all fail it, or all find the calls differ).
 * Deadlines pass at any moment in an exchange while their budget lasts (TIMEOUTS), and in any wait
 * whenever nothing else in the system can move (spin's `timeout`), as a real one would. In the
 * commit wait only the latter: the guarantee assumes that a deadline does not pass in the
 * microseconds between every rank posting the commit and this rank seeing it complete (the mutant
 * MUTANT_COMMIT_DEADLINE shows what happens when it does: docs/mpi.md).
 * A stop from outside (STOPS_EXT): the hierarchical transport's cross-host level is an MPI group
 * whose exchange waits also end when the group built over it was stopped by a peer (the stop
 * check: a notice on its MPI level), which says nothing of this group's own ranks; like a
 * deadline, it may end an exchange at any moment. Its commit waits do not take it: there it would
 * leave a rank whose commit completed inside MPI's collective forever (MUTANT_STOP_IN_COMMIT).
 *
 * The MUTANT_* switches put in rules that are wrong; tests/model/check.sh requires that spin finds
 * a violation for each, so the model is known to catch what it claims.
 */

#ifndef N
#define N 2
#endif
#ifndef K
#define K 2
#endif
#ifndef RESETS
#define RESETS 1
#endif
#ifndef ABORTS
#define ABORTS 1
#endif
#ifndef TIMEOUTS
#define TIMEOUTS 0
#endif
#ifndef DEATHS
#define DEATHS 0
#endif
#ifndef STOPS_EXT
#define STOPS_EXT 0
#endif

#define E (RESETS + 1)
#define INF 255

#define SMALL 0
#define LARGE 1

/* Outcomes. */
#define OK 1
#define FAILED 2
#define MISMATCH 3

/* Wait results. */
#define READY 0
#define STOPPED 1
#define TIMEDOUT 2
#define PEERDIED 3

#if N == 2
#define FORALL(c) (c(0) && c(1))
#define EXISTS(c) (c(0) || c(1))
#elif N == 3
#define FORALL(c) (c(0) && c(1) && c(2))
#define EXISTS(c) (c(0) || c(1) || c(2))
#else
#error "the model is written for 2 or 3 ranks"
#endif

byte shape[K + 1];        /* of the k-th call (k from 1) */
byte ep[N];               /* each rank's epoch */
byte xp[E * N];           /* the last call whose exchange rank r posted in epoch e */
byte xst[E * N];           /* 4 * call + the step of its exchange that rank r has posted */
byte xshape[E * N * (K + 1)]; /* the shape of that call, by (e, r, call) */
byte cp[E * N];           /* the last commit posted */
byte dp[E * N];           /* the last blocking collective entered */
byte net[E * N];          /* the earliest stop_at of the notices sent to rank r in epoch e */
byte heard[N];            /* ... of those it has taken in */
bool sent[N];             /* notices sent in the current epoch (once) */
bool abit[N];             /* gradsync_comm_abort was called (the state word's low bit) */
bool dead[N];
byte failat[E * N];       /* the call rank r failed in epoch e, or 0 */
byte outc[E * N * (K + 1)];
byte finished;

byte aborts = ABORTS;
byte timeouts = TIMEOUTS;
byte deaths = DEATHS;
byte stops_ext = STOPS_EXT;

#define XP(i) (xp[e * N + i] >= j)
#define CP(i) (cp[e * N + i] >= j)
/* Rank i has posted step s of call j's exchange; what step st of rank me waits for; its last step. */
#define XS(i, s) (xst[e * N + (i)] >= 4 * j + (s))
#if N == 2
#define XREADY XS(1 - me, 0)
#define XSTEPS 1
#else
#ifdef MUTANT_EARLY
/* a wrong rule: rank 1 sends rank 0 the table before it has rank 2's entry */
#define XS_TABLE XS(1, 1)
#else
#define XS_TABLE XS(1, 2)
#endif
#define XREADY \
  ((me == 0 && XS_TABLE) || (me == 1 && st == 0 && XS(0, 0)) || (me == 1 && st == 1 && XS(2, 0)) || \
   (me == 2 && XS(1, 1)))
#define XSTEPS (me == 1 -> 2 : 1)
#endif
#define DP(i) (dp[e * N + i] >= j)
#define SAME(i) (xshape[(e * N + i) * (K + 1) + j] == xshape[(e * N + me) * (K + 1) + j])
#define IS_DEAD(i) (dead[i])
#define NOT_FAILED_BEFORE(i) (failat[e * N + i] == 0 || failat[e * N + i] >= j)
#define MIN(a, b) ((a) < (b) -> (a) : (b))

/* Tells every peer (once per epoch) that rank r will not post call `stop` of epoch `in`. */
inline notify(r, in, stop) {
  if
  :: !sent[r] ->
    sent[r] = 1;
    i = 0;
    do
    :: i < N ->
      if
      :: i != r -> net[in * N + i] = MIN(net[in * N + i], stop)
      :: else -> skip
      fi;
      i++
    :: else -> break
    od
  :: else -> skip
  fi
}

inline die_here() {
#if DEATHS > 0
  if
  :: atomic { deaths > 0 -> deaths--; dead[me] = 1 }; goto end
  :: skip
  fi
#else
  skip
#endif
}

/* A committed wait (exchange or commit) for every rank's `posted` of call j. */
#define ANNOUNCE \
  :: atomic { abit[me] && !sent[me] -> notify(me, e, j + 1) }
#define HEAR \
  :: atomic { net[e * N + me] < heard[me] -> heard[me] = net[e * N + me] }
#ifdef MUTANT_STOPAT
/* a wrong rule: any notice ends the wait, whichever call its sender stops at */
#define STOPS :: heard[me] != INF -> res = STOPPED; break
#else
#define STOPS :: heard[me] <= j -> res = STOPPED; break
#endif
#if DEATHS > 0
#define LIVENESS :: EXISTS(IS_DEAD) -> res = PEERDIED; break
#else
#define LIVENESS :: false -> skip
#endif
/* The stop check: the group over this one was stopped, at any moment of the wait. */
#define STOP_CHECK :: atomic { stops_ext > 0 -> stops_ext-- }; res = STOPPED; break

proctype rank(byte me) {
  byte e = 0, j = 0, k = 1, resets = 0, res, i, st;
  do
  :: k > K -> break
  :: else ->
    j++;
    /* Entry: a rank that comes back after a while looks for notices first (or not). */
    if
    :: atomic { net[e * N + me] < heard[me] -> heard[me] = net[e * N + me] }
    :: skip
    fi;
    /* Posting, atomically with abort()'s read of the state word (a CAS). */
    atomic {
      if
      :: abit[me] || heard[me] != INF -> res = STOPPED
      :: else -> res = READY; xp[e * N + me] = j; xst[e * N + me] = 4 * j; xshape[(e * N + me) * (K + 1) + j] = shape[k]
      fi
    }
    die_here();
    if
    :: res == READY ->
      /* The exchange, step by step. */
      st = 0;
      do
      :: st == XSTEPS -> res = READY; break
      :: st < XSTEPS && XREADY -> atomic { st++; xst[e * N + me] = 4 * j + st }
      ANNOUNCE
      HEAR
      STOPS
      LIVENESS
      STOP_CHECK
#ifdef MUTANT_ABANDON
      /* a wrong rule: this rank's own abort abandons the exchange it has posted */
      :: abit[me] -> res = STOPPED; break
#endif
      :: atomic { timeouts > 0 -> timeouts-- }; res = TIMEDOUT; break
      :: timeout -> res = TIMEDOUT; break
      od
    :: else -> skip
    fi;
    if
    :: res == READY && !FORALL(SAME) ->
      /* Every rank holds the same table: all find the calls differ, and post nothing more for it. */
      outc[(e * N + me) * (K + 1) + j] = MISMATCH
    :: res == READY && FORALL(SAME) && shape[k] == SMALL ->
      assert(FORALL(NOT_FAILED_BEFORE));
      outc[(e * N + me) * (K + 1) + j] = OK
    :: res == READY && FORALL(SAME) && shape[k] == LARGE ->
#ifndef MUTANT_NOCOMMIT
      cp[e * N + me] = j;
      die_here();
      do
      :: FORALL(CP) -> res = READY; break
      ANNOUNCE
      HEAR
      STOPS
      LIVENESS
#ifdef MUTANT_STOP_IN_COMMIT
      /* a wrong rule: the stop check ends a commit wait too */
      STOP_CHECK
#endif
#ifdef MUTANT_COMMIT_DEADLINE
      /* a deadline passing in the commit even though every rank has posted it */
      :: atomic { timeouts > 0 -> timeouts-- }; res = TIMEDOUT; break
#endif
      :: timeout -> res = TIMEDOUT; break
      od;
#endif
      if
      :: res == READY ->
        /* MPI's blocking collective: nothing ends it but every rank (or a death, ending the job). */
        dp[e * N + me] = j;
        die_here();
        if
        :: FORALL(DP) -> skip
#if DEATHS > 0
        :: EXISTS(IS_DEAD) -> goto end  /* mpirun ends the job */
#endif
        fi;
        assert(FORALL(NOT_FAILED_BEFORE));
        outc[(e * N + me) * (K + 1) + j] = OK
      :: else -> skip
      fi
    :: else -> skip
    fi;
    if
    :: res != READY ->
      /* Failed: tell the peers that call j of this epoch completes nowhere, then reset. */
      atomic {
        outc[(e * N + me) * (K + 1) + j] = FAILED;
        failat[e * N + me] = j;
        notify(me, e, j)
      }
      if
#ifdef MUTANT_STAY
      /* a wrong rule: a rank that failed a call goes on in the same epoch */
      :: true -> skip
#endif
      :: resets < RESETS ->
        resets++;
        atomic { e++; ep[me] = e; j = 0; heard[me] = INF; sent[me] = 0; abit[me] = 0 }
      :: else -> k = K  /* no more resets: stop */
      fi
    :: else -> skip
    fi;
    k++
  od;
end:
  atomic { finished++ }
}

/* gradsync_comm_abort from another thread: one atomic read-modify-write of the state word, then
 * the notices (MPI_THREAD_MULTIPLE), saying the first call the rank will not post. */
proctype aborter() {
  byte r, i, e;
  do
  :: aborts > 0 ->
    if
    :: r = 0
    :: r = 1
#if N == 3
    :: r = 2
#endif
    fi;
#ifdef MUTANT_NOCAS
    /* a wrong rule: abort() reads how far the rank has posted apart from setting its flag */
    atomic { aborts--; e = ep[r]; i = xp[e * N + r] }
    atomic { abit[r] = 1; notify(r, e, i + 1) }
#else
    atomic {
      aborts--;
      e = ep[r];
      abit[r] = 1;
      notify(r, e, xp[e * N + r] + 1)
    }
#endif
  :: else -> break
  od
}

/* One outcome per call: with no deadline, no death and no stop from outside, every rank ends every
 * call alike. */
proctype judge() {
  byte e, j, r;
  finished == N;
#if TIMEOUTS == 0 && DEATHS == 0 && STOPS_EXT == 0
  for (e : 0 .. E - 1) {
    for (j : 1 .. K) {
      for (r : 1 .. N - 1) {
        assert(outc[(e * N + r) * (K + 1) + j] == outc[e * N * (K + 1) + j])
      }
    }
  }
#endif
}

init {
  byte k, i;
  atomic {
    for (i : 0 .. N - 1) { heard[i] = INF }
    for (i : 0 .. E * N - 1) { net[i] = INF }
  }
  for (k : 1 .. K) {
    if
    :: shape[k] = SMALL
    :: shape[k] = LARGE
    fi
  }
  atomic {
    for (i : 0 .. N - 1) { run rank(i) }
    run aborter();
    run judge()
  }
}
