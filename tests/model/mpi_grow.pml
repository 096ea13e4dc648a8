/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The grow of the MPI transport (src/comm/transport/mpi/mpi_grow.cpp): N members take in J joiners
 * that they start themselves.
 * 1. Agree: one verified round over the members (an allgather) that carries each member's joiner
 *    count, join name and whether it saw a whole host lost. A member completes a round once every
 *    member's entry has reached it (a member that dies after sending its entry does not stop the
 *    others); it fails on a member seen dead before its entry came, on a peer's abort notice, or at
 *    its deadline. (That a round ends so, and alike on every rank when nobody dies, is
 *    mpi_round.pml's to check; here a round is that abstraction.) A member that completes it
 *    refuses (E_UNSUPPORTED) if ANY member saw a host lost: every member holds every entry, so all
 *    refuse alike.
 * 2. Spawn: MPI_Comm_spawn, blocking over the members; the runtime starts the joiners once the
 *    root (member 0) has entered it, and it completes once every member has entered it and every
 *    joiner has started MPI. A participant that dies first leaves it incomplete forever.
 * 3. Merge and offer: MPI_Intercomm_merge and MPI_Bcast, blocking over members and joiners alike.
 *    Steps 2 and 3 run under a watchdog: at the group's timeout it calls MPI_Abort, which ends the
 *    whole job (the joiners, connected to it, too).
 * 4. Form: the new communicator's setup and the joiners' verdicts (an allgather: a joiner started
 *    for another name makes every rank fail alike), then the commit barrier: rounds of the grown
 *    group, as in 1.
 * Deaths strike any process at any step, every member's too (a joiner's MPI_Init, which answers
 * the spawn, then waits for nobody: its own watchdog ends that process); a member may abort the
 * old group (gradsync_comm_abort)
 * before its entry of step 1; a member may have seen a host lost; a joiner may come with another
 * name. Deadlines fire when nothing else can move (spin's `timeout`), as in mpi_shrink.pml.
 *
 * Checked:
 * - never a hang: every process ends (no invalid end state): returned, dead, or the job ended;
 * - the watchdog ends the job only after a death (a participant of a blocking call that never
 *   comes); without a death, every member and joiner returns;
 * - one verdict: every process that returns OK holds the grown group, which every process entered
 *   up to its last round; none returns OK where a member refused or a joiner came with another
 *   name; where a member saw a host lost, no joiner is ever started, and every member that
 *   completes the agreement refuses;
 * - a joiner's other name fails every rank, the joiners too, with E_MISMATCH where nobody died.
 * Rank 0 prepares the spawn (its program, the info) before the agreement, whose entry says whether
 * it could: so no member fails alone between the agreement and the spawn, and the model has no
 * such step. A live joiner slower to start MPI than the timeout loses to the watchdog like a dead
 * one (the deadline here fires only when nothing else can move: comm.h says so instead).
 * The MUTANT_* switches each remove one rule; tests/model/check.sh requires a counterexample for
 * each.
 */

#ifndef N
#define N 2
#endif
#ifndef J
#define J 1
#endif
#ifndef DEATHS
#define DEATHS 1
#endif
#ifndef ABORTS
#define ABORTS 0
#endif
#ifndef HOST_LOST
#define HOST_LOST 0 /* member N-1 saw a whole host lost */
#endif
#ifndef BAD_JOINER
#define BAD_JOINER 0 /* joiner 0 comes with another join name */
#endif

#define P (N + J) /* at most 4: members 0 .. N-1, then the joiners */
#define MAXP 4
#define MEMBER_ALIVE(p) ((p) >= N || !dead[p])
#define ALIVE(p) ((p) >= P || !dead[p])
#define SPAWNED (in_spawn == N && mpi_started == J && MEMBER_ALIVE(0) && MEMBER_ALIVE(1) && MEMBER_ALIVE(2))
#define MERGED (in_merge == P && ALIVE(0) && ALIVE(1) && ALIVE(2) && ALIVE(3))

/* outcomes */
#define RUNNING 0
#define OK 1
#define FAILED 2   /* a member's or joiner's error (E_REMOTE, E_TIMEOUT, E_ABORTED) */
#define REFUSED 3  /* E_UNSUPPORTED: a host was lost */
#define MISMATCH 4 /* a joiner's other name */
#define DEAD 5

byte outcome[MAXP];
bool dead[MAXP];
byte deaths = 0;
byte aborts = 0;
bool job_ended = false; /* a watchdog's MPI_Abort */
bool host_lost[N];
bool bad[MAXP];

/* round r's entries: arrived[r] bit per participant; notice[r]: a participant will not come */
#define ROUNDS 4 /* 0: agree; 1: setup; 2: verdict; 3: commit */
int arrived[ROUNDS];
bool notice[ROUNDS];
bool any_lost; /* the agreement's OR of host_lost, as the members that complete it read it */
bool any_bad;  /* the verdict's OR */

byte in_spawn = 0;
bool joiners_started = false;
byte mpi_started = 0; /* joiners that started MPI (their MPI_Init answers the spawn) */
byte in_merge = 0;

#define BIT(p) (1 << (p))
#define MEMBERS ((1 << N) - 1)
#define EVERYONE ((1 << P) - 1)

/* A death at this point, if the budget allows: the process is gone. */
inline maybe_die(me) {
  if
  :: atomic { deaths < DEATHS && !job_ended -> deaths++; dead[me] = true; outcome[me] = DEAD }; goto gone
  :: true -> skip
  fi
}

/* Round r over the participants `who` (a bit set): completes once every entry has come; fails on a
 * participant seen dead before its entry came, on a notice, or at the deadline. */
inline round(me, r, who, result) {
  arrived[r] = arrived[r] | BIT(me);
  do
  :: (arrived[r] & who) == who -> result = OK; break
  :: notice[r] -> result = FAILED; break
  :: job_ended -> goto ended
  :: (who & 1) && dead[0] && !(arrived[r] & 1) -> result = FAILED; break
  :: (who & 2) && dead[1] && !(arrived[r] & 2) -> result = FAILED; break
  :: (who & 4) && dead[2] && !(arrived[r] & 4) -> result = FAILED; break
  :: (who & 8) && dead[3] && !(arrived[r] & 8) -> result = FAILED; break
  :: timeout -> result = FAILED; break /* the deadline */
  od;
  if
  :: result == FAILED -> notice[r] = true /* its peers hear it will not complete */
  :: else -> skip
  fi
}

/* A blocking MPI collective under the watchdog: completes when `done` holds; at the deadline (when
 * nothing else can move) the watchdog ends the job. */
inline blocking(done) {
  do
  :: done -> break
  :: job_ended -> goto ended
  :: timeout ->
#ifdef MUTANT_NO_WATCHDOG
     (false) /* nothing ends the call */
#else
     assert(deaths > 0); /* only a participant that never comes leaves it incomplete */
     job_ended = true; goto ended
#endif
  od
}

proctype member(byte me) {
  byte result = RUNNING;
  maybe_die(me);
  /* A member's own abort, before its entry: it will not come, and says so. */
  if
  :: aborts < ABORTS -> aborts++; notice[0] = true; outcome[me] = FAILED; goto gone
  :: true -> skip
  fi;
  round(me, 0, MEMBERS, result);
  if
  :: result == FAILED -> outcome[me] = FAILED; goto gone
  :: else -> skip
  fi;
#ifdef MUTANT_REFUSE_LOCAL
  if
  :: host_lost[me] -> outcome[me] = REFUSED; goto gone
  :: else -> skip
  fi;
#else
  if
  :: any_lost -> outcome[me] = REFUSED; goto gone
  :: else -> skip
  fi;
#endif
  maybe_die(me);
  d_step { in_spawn++; if :: me == 0 -> joiners_started = true :: else -> skip fi }
  blocking(SPAWNED);
  maybe_die(me);
  in_merge++;
  blocking(MERGED);
  maybe_die(me);
  round(me, 1, EVERYONE, result);
  if :: result == FAILED -> outcome[me] = FAILED; goto gone :: else -> skip fi;
  round(me, 2, EVERYONE, result);
  if :: result == FAILED -> outcome[me] = FAILED; goto gone :: else -> skip fi;
  if :: any_bad -> outcome[me] = MISMATCH; goto gone :: else -> skip fi;
  maybe_die(me);
  round(me, 3, EVERYONE, result);
  if :: result == FAILED -> outcome[me] = FAILED; goto gone :: else -> skip fi;
  assert(!any_lost && !any_bad);
  assert(arrived[3] == EVERYONE); /* every process of the grown group reached its commit */
  outcome[me] = OK;
  goto gone;
ended:
  skip;
gone:
  skip
}

proctype joiner(byte me) {
  byte result = RUNNING;
end_unstarted:
  joiners_started; /* never, where the members refused or failed first: no process then */
  maybe_die(me);
  mpi_started++;
  /* MPI_Init completes with the spawn: a member gone from it leaves it waiting until a member's
   * watchdog ends the job, the joiner with it, or, with every member gone, its own watchdog ends
   * this process. */
  do
  :: SPAWNED -> break
  :: job_ended -> goto ended
  :: timeout ->
#ifdef MUTANT_NO_INIT_WATCHDOG
     (false)
#else
     assert(deaths > 0); outcome[me] = FAILED; goto gone
#endif
  od;
  maybe_die(me);
  in_merge++;
  blocking(MERGED);
  maybe_die(me);
  round(me, 1, EVERYONE, result);
  if :: result == FAILED -> outcome[me] = FAILED; goto gone :: else -> skip fi;
#ifdef MUTANT_VERDICT_LOCAL
  if :: bad[me] -> notice[2] = true; outcome[me] = MISMATCH; goto gone :: else -> skip fi;
#endif
  round(me, 2, EVERYONE, result);
  if :: result == FAILED -> outcome[me] = FAILED; goto gone :: else -> skip fi;
  if :: any_bad -> outcome[me] = MISMATCH; goto gone :: else -> skip fi;
  maybe_die(me);
  round(me, 3, EVERYONE, result);
  if :: result == FAILED -> outcome[me] = FAILED; goto gone :: else -> skip fi;
  assert(!any_bad && arrived[3] == EVERYONE);
  outcome[me] = OK;
  goto gone;
ended:
  skip;
gone:
  skip
}

/* Once every process is done: what the outcomes must be. */
proctype judge() {
  byte p;
  (job_ended || (outcome[0] != RUNNING && outcome[1] != RUNNING && (P < 3 || outcome[2] != RUNNING) &&
                 (P < 4 || outcome[3] != RUNNING)) ||
   (!joiners_started && outcome[0] != RUNNING && outcome[1] != RUNNING && (N < 3 || outcome[2] != RUNNING)));
  if
  :: job_ended -> assert(deaths > 0)
  :: else ->
     if
     :: HOST_LOST -> assert(!joiners_started)
     :: else -> skip
     fi;
     for (p : 0 .. P - 1) {
       if
       :: deaths == 0 && aborts == 0 && !HOST_LOST && !BAD_JOINER && !dead[p] -> assert(outcome[p] == OK)
       :: else -> skip
       fi;
       if
       :: p < N && outcome[p] == REFUSED -> assert(HOST_LOST)
       :: else -> skip
       fi;
       if
       :: BAD_JOINER && deaths == 0 && aborts == 0 -> assert(outcome[p] == MISMATCH)
       :: else -> skip
       fi
     }
  fi
}

init {
  byte p;
  atomic {
    host_lost[N - 1] = HOST_LOST;
    any_lost = HOST_LOST; /* what every member that completes the agreement reads */
    bad[N] = BAD_JOINER;
    any_bad = BAD_JOINER;
    for (p : 0 .. N - 1) { run member(p) }
    for (p : N .. P - 1) { run joiner(p) }
    run judge()
  }
}
