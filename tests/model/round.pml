/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The round protocol of src/comm/engine/round_engine.{hpp,cpp}, as a Promela model that spin
 * checks over every interleaving of its events: completion, abort, timeout, reset and death.
 *
 * Ranks run K calls each; every call is one of the round shapes the collectives use (chosen
 * nondeterministically, the same on every rank, as real calls are). After a failed call a rank
 * calls reset until it succeeds, then goes on with its next call, as a training loop does.
 * Checked at every step:
 *   - agreement: for every call, every rank that finished it reports the same outcome, and an OK
 *     call has the same round number on every rank (the ranks stay aligned through resets);
 *   - cause: a rank only fails a call when the stop word says why (no spurious failure);
 *   - no hang: every wait without a deadline (a completion that holds buffers) ends, and resets
 *     do not loop forever (spin reports invalid end states and assertion failures).
 * Deadlines that pass while a peer is merely slow are spent from a budget (TIMEOUTS); a deadline
 * also passes whenever nothing else in the system can move (spin's `timeout`), as a real one
 * would. Shared words change atomically where the engine uses one atomic operation (a CAS, an
 * add, a store) and in separate steps where the engine reads several words one after the other.
 *
 * The MUTANT_* switches put in rules that are wrong (most of them earlier rules of the engine);
 * tests/model/check.sh requires that spin finds a violation for each, so the model is known to
 * catch what it claims.
 */

#ifndef N
#define N 2
#endif
#ifndef K
#define K 2
#endif
#ifndef ABORTS
#define ABORTS 1
#endif
#ifndef TIMEOUTS
#define TIMEOUTS 1
#endif
#ifndef DEATHS
#define DEATHS 0
#endif
#ifndef LOCAL_FAILS
#define LOCAL_FAILS 0  /* errors of a rank's own in the middle of a round (RoundEngine::run_call) */
#endif

/* Round shapes. */
#define INLINE 0   /* the arrival barrier only: inline payloads, barrier() */
#define HOLD 1     /* + a completion barrier that waits for live peers whatever happens (thread, direct buffers) */
#define COMPLETE 2 /* + an abortable completion barrier (shm zero-copy; the broadcast copy path; an
                      inline allreduce whose ranks mix reachable and unreachable buffers) */
#define PIPE 3     /* + the copy pipeline's waits on peers' counters, then an abortable closing barrier */

/* Wait results. */
#define READY 0
#define STOPPED 1
#define TIMEDOUT 2
#define PEERDIED 3

/* Stop reasons. */
#define ABORTED 1
#define TIMEOUT_STOP 2
#define DEAD 3
#define FAILED_STOP 4

#define OK 1
#define FAILED 2

#if N == 2
#define FORALL(c) (c(0) && c(1))
#define EXISTS(c) (c(0) || c(1))
#elif N == 3
#define FORALL(c) (c(0) && c(1) && c(2))
#define EXISTS(c) (c(0) || c(1) || c(2))
#else
#error "the model is written for 2 or 3 ranks"
#endif

/* GroupWords, and the barrier word of the control block (ControlLayout::barrier) */
byte stop_reason;  /* the stop word: first cause wins */
byte stop_gen;     /* ... and its generation: every stop counts one up, a clear keeps it */
/* The barrier word: every rank's arrivals over the group's life (one fetch_add each), or, once
 * barrier f failed, JUMP + f * SPAN (one CAS), which later arrivals (fewer than SPAN) add to. */
byte g;
byte rs_epoch;     /* the reset word */
byte rs_attempt;
bool rs_open;

/* RankSlot */
byte arrivals[N];
byte staged[N];
bool alive[N];
byte req_e[N];
byte req_a[N];
byte post_round[2 * N];
byte post_arr[2 * N];
byte post_chunks[2 * N];
byte post_stop_reason[2 * N];
byte post_stop_gen[2 * N];

byte shape[K];
byte outcome[N * K];
byte okround[N * K];

byte aborts = ABORTS;
byte timeouts = TIMEOUTS;
byte deaths = DEATHS;
byte local_fails = LOCAL_FAILS;

#define JUMP 128
#define SPAN (2 * N)
#ifdef MUTANT_COUNT
/* a wrong rule: a failure only flags the count, and arrivals after it go on counting */
#define FAILED_AT ((g - JUMP) / N + 1)
#define WENT(b) ((g % JUMP) >= (b) * N)
#define FELL(b) (g >= JUMP && !WENT(b))
#define FAILURE(b) (g + JUMP)
#else
#define FAILED_AT ((g - JUMP) / SPAN)
/* Barrier b went ahead (every rank counted in before any failure of it), or fell (failed). */
#define WENT(b) ((g < JUMP && g >= (b) * N) || (g >= JUMP && FAILED_AT > (b)))
#define FELL(b) (g >= JUMP && FAILED_AT <= (b))
#define FAILURE(b) (JUMP + (b) * SPAN)
#endif
/* The last barrier any arrival so far concerns: the failed one, or the latest begun. */
#define SPENT (g >= JUMP -> FAILED_AT : (g + N - 1) / N)

#define ARRIVED(r) (arrivals[r] >= target)
#define ARRIVED_OR_DEAD(r) (arrivals[r] >= target || !alive[r])
#define IS_DEAD(r) (!alive[r])
#define STAGED(r) (staged[r] >= chunks + 1)
#define ASKED(r) (req_e[r] == my_e && req_a[r] == my_a)
#define ASKED_OLD(r) (req_e[r] >= my_e)

#define MAX(a, b) ((a) > (b) -> (a) : (b))

/* stop(): one CAS loop on the stop word. */
inline stop(why) {
#ifdef MUTANT_TAG
  /* the earlier rule: tagged with the reset epoch, read apart from the CAS */
  e = rs_epoch;
  atomic {
    if
    :: stop_reason == 0 -> stop_reason = why; stop_gen = e
    :: else -> skip
    fi
  }
#else
  atomic {
    if
    :: stop_reason == 0 -> stop_reason = why; stop_gen++
    :: else -> skip
    fi
  }
#endif
}

/* decide(): a read of the barrier word, and, for a rank giving up on a barrier still open, one
 * CAS that fails it. A wait that ended ready finds the barrier complete or failed already. */
inline decide(index, failing) {
  atomic {
    if
#ifdef MUTANT_DECIDE
    /* a wrong rule: any failure is this barrier's, whichever barrier it names */
    :: g >= JUMP -> went = 0
    :: g < JUMP && WENT(index) -> went = 1
#else
    :: WENT(index) -> went = 1  /* a failure of a later barrier leaves this one complete */
    :: FELL(index) -> went = 0
#endif
    :: !WENT(index) && !FELL(index) -> assert(failing); g = FAILURE(index); went = 0
    fi
  }
}

/* Arrival: this rank's own count in its slot, then one fetch_add on the barrier word (with its
 * local counts); a death may come between the two. */
inline arrive() {
  arrivals[me] = barriers + 1;
  die_here();
  atomic { barriers++; target = barriers; g++ }
}

/* A deadline may pass at any moment while the budget lasts, and whenever nothing else can move.
 * Nothing may be stuck then: a barrier every rank arrived at is decided (without deaths, which
 * leave barriers open for good). */
#define DEADLINE_PASSES \
  :: atomic { timeouts > 0 -> timeouts-- }; res = TIMEDOUT; break \
  :: timeout -> assert(DEATHS > 0 || !FORALL(ARRIVED) || WENT(target) || FELL(target)); res = TIMEDOUT; break

inline die_here() {
#if DEATHS > 0
  if
  :: atomic { deaths > 0 -> deaths--; alive[me] = 0 }; goto dead
  :: skip
  fi
#else
  skip
#endif
}

/* Arrival at the next barrier, the abortable wait, the verdict. */
inline barrier_abortable() {
  arrive();
  do
  :: WENT(target) || FELL(target) -> res = READY; break
  :: stop_reason != 0 -> res = STOPPED; break
  :: EXISTS(IS_DEAD) -> stop(DEAD); res = PEERDIED; break
  DEADLINE_PASSES
  od;
  if
  :: res == TIMEDOUT -> stop(TIMEOUT_STOP)
  :: else -> skip
  fi;
  decide(target, res != READY);
  if
  :: !went -> goto failed
  :: else -> skip
  fi
}

/* A rank leaves its round by an error of its own before the round's next barrier (fail_round):
 * it stops the group, fails that barrier, and counts itself past it. */
inline fail_locally() {
  if
  :: atomic { local_fails > 0 -> local_fails-- };
     stop(FAILED_STOP);
     decide(barriers + 1, 1);
#ifndef MUTANT_STAY
     arrivals[me] = barriers + 1;
#endif
     goto failed
  :: skip
  fi
}

/* A completion barrier while peers use this rank's private buffers: it ends when the barrier
 * went ahead, or, once it fell or a peer is dead, when every live rank is past it. */
inline barrier_hold() {
  arrive();
  WENT(target) || ((EXISTS(IS_DEAD) || FELL(target)) && FORALL(ARRIVED_OR_DEAD));
  if
  :: EXISTS(IS_DEAD) -> stop(DEAD); res = PEERDIED
  :: else -> res = READY
  fi;
  decide(target, res != READY);
  if
  :: !went -> goto failed
  :: else -> skip
  fi
}

/* The copy pipeline: publish this rank's chunk, wait for the peers' (wait_for). */
inline pipeline() {
  staged[me] = chunks + 1;
  do
  :: FORALL(STAGED) -> res = READY; break
  :: stop_reason != 0 -> res = STOPPED; break
  :: EXISTS(IS_DEAD) -> stop(DEAD); res = PEERDIED; break
  DEADLINE_PASSES
  od;
  if
  :: res != READY ->
     if
     :: res == TIMEDOUT -> stop(TIMEOUT_STOP)
     :: else -> skip
     fi;
     /* the peers meet again at this rank's next barrier: it fails for all of them */
     decide(barriers + 1, 1);
     goto failed
  :: else -> skip
  fi;
  die_here();
  chunks++
}

/* Agreement, checked as each outcome is recorded. */
inline record(v) {
  atomic {
    outcome[me * K + k] = v;
    okround[me * K + k] = (v == OK -> round : 0);
    r = 0;
    do
    :: r < N ->
       assert(outcome[r * K + k] == 0 || (outcome[r * K + k] == v && okround[r * K + k] == okround[me * K + k]));
       r++
    :: else -> break
    od
  }
}

/* Before a reset's verdict, by a rank that saw every request: every rank resumes from the largest
 * count posted, on a barrier word raised to it with its failure cleared, unless an arrival past it
 * was counted already. Read and raised in one step: once every rank asked, a post can only be
 * rewritten (for a later attempt) with counts no smaller. */
inline resume_barriers() {
  atomic {
    vb = 0; r = 0;
    do
    :: r < N -> vb = MAX(vb, post_arr[(my_e % 2) * N + r]); r++
    :: else -> break
    od;
    if
    :: (g >= JUMP && FAILED_AT <= vb) || (g < JUMP && g < vb * N) -> g = vb * N
    :: else -> skip
    fi
  }
}

#ifndef MUTANT_RETRACT
/* reset(): join the open attempt (opening the next epoch if none is open), post this rank's
 * counts, wait for every rank's request, decide the attempt by CAS. */
inline reset() {
  atomic {
    if
    :: !rs_open -> rs_epoch++; rs_attempt = 0; rs_open = 1
    :: else -> skip
    fi;
    my_e = rs_epoch;
    my_a = rs_attempt
  }
  p = (my_e % 2) * N + me;
  post_round[p] = round;
#ifdef MUTANT_SKIP
  /* the earlier rule: only the barriers this rank arrived at are spent */
  post_arr[p] = barriers;
#else
  post_arr[p] = MAX(barriers, SPENT);
#endif
  post_chunks[p] = MAX(chunks, staged[me]);
  atomic { post_stop_reason[p] = stop_reason; post_stop_gen[p] = stop_gen }
  atomic { req_e[me] = my_e; req_a[me] = my_a }
  die_here();
  do
  :: FORALL(ASKED) || rs_epoch != my_e || rs_attempt != my_a || !rs_open -> res = READY; break
  :: EXISTS(IS_DEAD) -> stop(DEAD); res = PEERDIED; break
  DEADLINE_PASSES
  od;
  if
  :: res == PEERDIED -> goto dead_group
  :: else -> skip
  fi;
  all_asked = FORALL(ASKED);
  if
  :: all_asked ->
     resume_barriers()
  :: else -> skip
  fi;
  atomic {
    if
    :: rs_epoch == my_e && rs_attempt == my_a && rs_open ->
       if
       :: all_asked -> rs_open = 0
       :: else -> rs_attempt++
       fi
    :: else -> skip
    fi;
    closed = (rs_epoch > my_e || !rs_open)
  }
  /* a reset that keeps failing is a hang */
  assert(rs_attempt < 8);
}
#else
/* The earlier reset: wait for every rank's request for the next epoch; one that gives up
 * retracts its request, although a peer may have seen it already and gone ahead. */
inline reset() {
  my_e = rs_epoch + 1;
  p = (my_e % 2) * N + me;
  post_round[p] = round;
  post_arr[p] = MAX(barriers, SPENT);
  post_chunks[p] = MAX(chunks, staged[me]);
  atomic { post_stop_reason[p] = stop_reason; post_stop_gen[p] = stop_gen }
  req_e[me] = my_e;
  do
  :: FORALL(ASKED_OLD) -> res = READY; break
  :: EXISTS(IS_DEAD) -> stop(DEAD); res = PEERDIED; break
  DEADLINE_PASSES
  od;
  if
  :: res == PEERDIED -> goto dead_group
  :: else -> skip
  fi;
  closed = 1;
  if
  :: res != READY && !FORALL(ASKED_OLD) -> req_e[me] = my_e - 1; closed = 0
  :: else ->
     resume_barriers();
     atomic { if :: rs_epoch < my_e -> rs_epoch = my_e :: else -> skip fi }
  fi;
  assert(rs_epoch < 8);
}
#endif

proctype Rank(byte me) {
  byte k, r, p, e, target, res, my_e, my_a, sr, sg, vb;
  byte round, barriers, chunks;
  bool went, closed, all_asked;

  do
  :: k == K -> break
  :: k < K ->
     /* fail_fast */
     if
     :: stop_reason != 0 -> goto failed
     :: else -> skip
     fi;
     round++;
     barrier_abortable();
     if
     :: shape[k] == INLINE -> skip
     :: shape[k] == HOLD -> fail_locally(); barrier_hold()
     :: shape[k] == COMPLETE -> barrier_abortable()
     :: shape[k] == PIPE -> pipeline(); barrier_abortable()
     fi;
     record(OK);
     k++;
     goto next;
failed:
     /* every failure names its cause: the stop word is set before any verdict "failed" */
     assert(stop_reason != 0);
     record(FAILED);
     if
     :: stop_reason == DEAD -> goto dead_group
     :: else -> skip
     fi;
again:
     reset();
     if
     :: !closed -> goto again
     :: else -> skip
     fi;
     /* adopt the largest counts posted for this epoch */
     round = 0; barriers = 0; chunks = 0; r = 0; sr = 0; sg = 0;
     do
     :: r < N ->
        p = (my_e % 2) * N + r;
        round = MAX(round, post_round[p]);
        barriers = MAX(barriers, post_arr[p]);
        chunks = MAX(chunks, post_chunks[p]);
        /* the latest stop posted: a later generation, or the same one cleared */
        if
        :: post_stop_gen[p] > sg || (post_stop_gen[p] == sg && post_stop_reason[p] == 0) ->
           sg = post_stop_gen[p]; sr = post_stop_reason[p]
        :: else -> skip
        fi;
        r++
     :: else -> break
     od;
     arrivals[me] = barriers;
     staged[me] = chunks;
     if
     :: stop_reason == DEAD -> goto dead_group
     :: else -> skip
     fi;
#ifdef MUTANT_TAG
     /* the earlier rule: clear every stop tagged before this reset */
     atomic {
       if
       :: stop_reason != 0 && stop_gen < my_e -> stop_reason = 0
       :: else -> skip
       fi
     }
#else
     /* clear the stop the ranks reset from, and nothing newer; each rank does before it leaves */
     atomic {
       if
       :: sr != 0 && stop_reason == sr && stop_gen == sg -> stop_reason = 0
       :: else -> skip
       fi
     }
#endif
     k++;
next:
     skip
  od;
  goto end;
dead:
  /* this rank died: it records nothing more */
  goto end;
dead_group:
  /* a peer died: the survivor frees the group */
  skip;
end:
  skip
}

active proctype Aborter() {
  byte e;
  do
  :: aborts > 0 -> aborts--; stop(ABORTED)
  :: aborts == 0 -> break
  od
}

init {
  byte i;
  atomic {
    i = 0;
    do
    :: i < K ->
       if
       :: shape[i] = INLINE
       :: shape[i] = HOLD
       :: shape[i] = COMPLETE
       :: shape[i] = PIPE
       fi;
       i++
    :: else -> break
    od;
    i = 0;
    do
    :: i < N -> alive[i] = 1; i++
    :: else -> break
    od;
    i = 0;
    do
    :: i < N -> run Rank(i); i++
    :: else -> break
    od
  }
}
