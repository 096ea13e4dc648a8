/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The shrink of the MPI transport (src/comm/transport/mpi/mpi_shrink.cpp): the survivors of a group
 * agree on ONE failed set over point-to-point messages with deadlines, no shared memory, then enter
 * MPI_Comm_create_group over the others, which is blocking and cannot be abandoned.
 *
 * Per attempt (epoch e), each rank r holds a set F of ranks it takes as failed:
 * - Propose: r sends PROP(e, F) to every rank, again whenever F grows. F starts with the peers r
 *   sees dead (a process gone, seen by its PID on r's host only), and grows by
 *   - the union of every set a rank outside F proposes (a suspicion spreads: a rank that saw a
 *     death by its PID tells one that would only see it by its deadline);
 *   - a peer seen dead;
 *   - the deadline: the ranks outside F whose latest proposal is not F (they did not answer).
 *   A message of an older epoch is stale and dropped; one of a later epoch (its sender gave up an
 *   attempt) moves r to that epoch, with the union. Messages of ranks in F are dropped.
 * - Decide: r decides F once every rank outside F has proposed exactly F in epoch e (its latest
 *   proposal). A rank that finds itself in F is out: it returns E_REMOTE and tells nobody
 *   anything new (the others named it already).
 * - Confirm: r sends CONF(e, F) to the members of the new group G (the ranks outside F), and waits
 *   for CONF(e, F) from every one of them. It gives the attempt up (epoch e + 1, F grown) on a
 *   member seen dead, a member's proposal that differs from F (it grew after proposing F), a
 *   message of a later epoch from a member, or the deadline (the members that did not confirm).
 * - Form: only then r enters MPI_Comm_create_group over G. It completes once every member of G
 *   has entered. Nothing can end it but a watchdog, which calls MPI_Abort and ends the whole job.
 *   (Where F holds a whole host and G is on one host, G forms a shared-memory group instead, which
 *   its timeout bounds: the same decision, and a forming easier than the one modelled here.)
 * Deaths strike at every step (also between the sends of one broadcast), a second death during the
 * shrink, messages arrive late (every send is a FIFO channel, read whenever its reader chooses), a
 * rank on another host (CROSS) sees no death by PID, only by its deadline, and a rank may come
 * late (LATE: after the others' deadline passed).
 *
 * Deadlines fire when nothing else in the system can move (spin's `timeout`): the timeout is far
 * longer than a message takes (hundreds of ms against tens of us). MUTANT_DEADLINE_ANYTIME shows
 * what happens when a deadline passes while a live rank's answer is on its way (the assumption).
 *
 * Checked:
 * - agreement: every rank that completes the shrink completes it with the same epoch and failed
 *   set, and so the same new group; every rank entering create_group in an epoch enters it with the
 *   epoch's one set;
 * - no silent exclusion: every rank that does not die ends in the new group, or out by E_REMOTE
 *   (it saw itself in the set), or by the watchdog's MPI_Abort; a rank that completes is in its
 *   group, and every live member of that group completed with it;
 * - validity: a rank that entered in time and did not die is never left out, unless a member died
 *   inside the window below;
 * - the window, honestly: the watchdog (MPI_Abort) fires only when a rank died after it began to
 *   send its confirmations (it may have reached some members, who then enter create_group, and
 *   not others) or inside create_group; every other wait ends by a message, a death seen or the
 *   deadline (no invalid end state);
 * - the attempts are bounded by the deaths.
 * The MUTANT_* switches each remove one rule; tests/model/check.sh requires a counterexample for
 * each.
 */

#ifndef N
#define N 3
#endif
#ifndef DEATHS
#define DEATHS 1
#endif
#ifndef CROSS
#define CROSS 0 /* rank N-1 on another host: no PID liveness between it and the others */
#endif
#ifndef LATE
#define LATE 0 /* rank 0 enters only once the others' deadline could pass */
#endif

#define E (DEATHS + 3)
#define CAP 4
#define NONE 255
#define PROP 1
#define CONF 2
#define ALL ((1 << N) - 1)
#define BIT(r) (1 << (r))
#define IN(set, r) (((set) >> (r)) & 1)
#define SAMEHOST(a, b) (!CROSS || ((a) == N - 1) == ((b) == N - 1))
#define SEEN_DEAD(q) (q != me && dead[q] && SAMEHOST(me, q))

chan link[N * N] = [CAP] of { byte, byte, byte }; /* kind, epoch, set; link[from * N + to] */

bool dead[N];
byte deaths;
bool reading[N];     /* still in the shrink: messages to a rank that left it go nowhere */
bool in_window[N];   /* began to send its confirmations, and has not completed or given up */
bool window_death;   /* a rank died in its window */
bool aborted;        /* the watchdog called MPI_Abort */
bool finished[N], out[N];
byte fin_epoch[N], fin_set[N];
byte entered[E], enter_set[E];
byte max_epoch;
byte ended;

#define DIE                                                                   \
  if                                                                          \
  :: atomic { deaths < DEATHS -> deaths++; dead[me] = true; reading[me] = false; \
             if :: in_window[me] -> window_death = true :: else -> skip fi };        \
    goto gone                                                                        \
  :: true -> skip                                                             \
  fi

/* Sends (kind, e, F) to every rank still reading, except me (to members of G only for CONF);
 * a death may cut the broadcast between two sends. */
#define BCAST(kind)                                                           \
  i = 0;                                                                      \
  do                                                                          \
  :: i < N ->                                                                 \
    if                                                                        \
    :: i != me && reading[i] && (kind == PROP || !IN(F, i)) ->                \
      assert(nfull(link[me * N + i]));                               \
      link[me * N + i]!kind, e, F;                                            \
      DIE                                                                     \
    :: else -> skip                                                           \
    fi;                                                                       \
    i++                                                                       \
  :: else -> i = 0; break                                                     \
  od

#define RESET_VIEWS \
  d_step { i = 0; do :: i < N -> latest[i] = NONE; confset[i] = NONE; i++ :: else -> break od; i = 0 }

#define ADD_SEEN_DEAD \
  d_step { i = 0; do :: i < N -> if :: SEEN_DEAD(i) -> F = F | BIT(i) :: else -> skip fi; i++ :: else -> break od; i = 0 }

/* Every rank outside F has proposed F in epoch e. */
#define AGREED_AT(q) (q == me || IN(F, q) || latest[q] == F)
#define CONFIRMED_AT(q) (q == me || IN(F, q) || confset[q] == F)
#if N == 2
#define AGREED (AGREED_AT(0) && AGREED_AT(1))
#define CONFIRMED (CONFIRMED_AT(0) && CONFIRMED_AT(1))
#define ANY_SEEN_DEAD(set) ((!IN(set, 0) && SEEN_DEAD(0)) || (!IN(set, 1) && SEEN_DEAD(1)))
#elif N == 3
#define AGREED (AGREED_AT(0) && AGREED_AT(1) && AGREED_AT(2))
#define CONFIRMED (CONFIRMED_AT(0) && CONFIRMED_AT(1) && CONFIRMED_AT(2))
#define ANY_SEEN_DEAD(set) \
  ((!IN(set, 0) && SEEN_DEAD(0)) || (!IN(set, 1) && SEEN_DEAD(1)) || (!IN(set, 2) && SEEN_DEAD(2)))
#else
#error "the model is written for 2 or 3 ranks"
#endif

#ifdef MUTANT_DEADLINE_ANYTIME
#define DEADLINE true
#else
#define DEADLINE timeout
#endif

proctype Rank(byte me) {
  byte e = 1, F = 0, i, q, kind, ep, s, grown, carry = NONE, carry_kind, carry_set;
  byte latest[N], confset[N];
#if LATE
  if :: me == 0 -> timeout :: else -> skip fi;
#endif
  DIE;
  RESET_VIEWS;
  ADD_SEEN_DEAD;
propose:
  skip;
  d_step { q = 0; kind = 0; ep = 0; s = 0 };
  assert(e < E); /* the deaths bound the attempts */
  if :: e > max_epoch -> max_epoch = e :: else -> skip fi;
  BCAST(PROP);
agree:
  do
  :: IN(F, me) ->
#ifdef MUTANT_NO_SELF_CHECK
    F = F & ~BIT(me); goto propose
#else
    out[me] = true; reading[me] = false; goto end
#endif
  :: !IN(F, me) && AGREED -> goto confirm
  :: atomic { nempty(link[0 * N + me]) -> q = 0; link[0 * N + me]?kind, ep, s }; goto take
  :: atomic { nempty(link[1 * N + me]) -> q = 1; link[1 * N + me]?kind, ep, s }; goto take
#if N == 3
  :: atomic { nempty(link[2 * N + me]) -> q = 2; link[2 * N + me]?kind, ep, s }; goto take
#endif
  :: ANY_SEEN_DEAD(F) ->
    ADD_SEEN_DEAD;
    goto propose
  :: DEADLINE ->
    d_step {
      grown = F;
      i = 0;
      do :: i < N -> if :: i != me && !IN(F, i) && latest[i] != F -> grown = grown | BIT(i) :: else -> skip fi; i++
         :: else -> break od;
      i = 0
    };
    if :: grown != F -> F = grown; grown = 0; goto propose :: else -> grown = 0 fi
  od;
take: /* a message from q, in the agreement */
  if
  :: IN(F, q) || ep < e -> skip /* from a rank taken as failed, or stale */
  :: !IN(F, q) && ep > e ->
    e = ep;
    RESET_VIEWS;
    if :: kind == PROP -> latest[q] = s :: else -> confset[q] = s; latest[q] = s fi;
#ifndef MUTANT_NO_UNION
    F = F | s;
#endif
    goto propose
  :: !IN(F, q) && ep == e ->
    latest[q] = s;
    if :: kind == CONF -> confset[q] = s :: else -> skip fi;
#ifndef MUTANT_NO_UNION
    if :: (F | s) != F -> F = F | s; goto propose :: else -> skip fi
#endif
  fi;
  d_step { q = 0; kind = 0; ep = 0; s = 0 };
  goto agree;

confirm:
#ifndef MUTANT_NO_CONFIRM
  in_window[me] = true;
  BCAST(CONF);
  do
  :: CONFIRMED -> break
  :: atomic { nempty(link[0 * N + me]) -> q = 0; link[0 * N + me]?kind, ep, s }; goto check
  :: atomic { nempty(link[1 * N + me]) -> q = 1; link[1 * N + me]?kind, ep, s }; goto check
#if N == 3
  :: atomic { nempty(link[2 * N + me]) -> q = 2; link[2 * N + me]?kind, ep, s }; goto check
#endif
  :: ANY_SEEN_DEAD(F) ->
    ADD_SEEN_DEAD;
    goto give_up
  :: DEADLINE -> goto give_up /* a member that proposed F is alive: it may wait on a third */
  od;
#endif
  goto form;
check: /* a message from q while confirming */
  if
  :: IN(F, q) || ep < e -> skip
  :: !IN(F, q) && ep == e && kind == CONF -> confset[q] = s; assert(s == F) /* one decision per epoch */
  :: !IN(F, q) && ep == e && kind == PROP && s == F -> skip /* its proposal, before its confirmation */
  :: !IN(F, q) && ep == e && kind == PROP && s != F -> F = F | s; goto give_up /* it grew: it will not confirm */
  :: !IN(F, q) && ep > e -> /* it gave the attempt up: follow it, keeping what it said */
    F = F | s; e = ep - 1; carry = q; carry_kind = kind; carry_set = s; goto give_up
  fi;
  d_step { q = 0; kind = 0; ep = 0; s = 0 };
  goto confirm_wait;
confirm_wait:
  /* back into the confirmation's wait (the do above), without sending again */
  do
  :: CONFIRMED -> goto form
  :: atomic { nempty(link[0 * N + me]) -> q = 0; link[0 * N + me]?kind, ep, s }; goto check
  :: atomic { nempty(link[1 * N + me]) -> q = 1; link[1 * N + me]?kind, ep, s }; goto check
#if N == 3
  :: atomic { nempty(link[2 * N + me]) -> q = 2; link[2 * N + me]?kind, ep, s }; goto check
#endif
  :: ANY_SEEN_DEAD(F) ->
    ADD_SEEN_DEAD;
    goto give_up
  :: DEADLINE -> goto give_up /* a member that proposed F is alive: it may wait on a third */
  od;
give_up:
  in_window[me] = false;
  e++;
  RESET_VIEWS;
  if
  :: carry != NONE ->
    latest[carry] = carry_set;
    if :: carry_kind == CONF -> confset[carry] = carry_set :: else -> skip fi;
    carry = NONE
  :: else -> skip
  fi;
  goto propose;

form: /* MPI_Comm_create_group over the ranks outside F: blocking */
  atomic {
    if
    :: entered[e] == 0 -> enter_set[e] = F
    :: else -> assert(enter_set[e] == F || window_death) /* one group per epoch */
    fi;
    entered[e] = entered[e] | BIT(me)
  };
  in_window[me] = true;
  DIE;
  if
  :: entered[e] == (ALL & ~F) -> skip
#ifndef MUTANT_NO_WATCHDOG
  :: timeout -> /* the watchdog: MPI_Abort ends the job */
    assert(window_death);
    aborted = true;
    goto end
#endif
  fi;
  atomic { finished[me] = true; fin_epoch[me] = e; fin_set[me] = F; in_window[me] = false; reading[me] = false };
  goto end;
gone:
  skip;
end:
  ended++
}

init {
  byte i, j, first = NONE;
  atomic {
    i = 0;
    do :: i < N -> reading[i] = true; i++ :: else -> break od;
    i = 0;
    do :: i < N -> run Rank(i); i++ :: else -> break od
  };
  (ended == N);
  i = 0;
  do
  :: i < N ->
    /* No silent exclusion: a rank that did not die is in the group, out by E_REMOTE, or ended by
     * the watchdog's MPI_Abort. */
    assert(dead[i] || finished[i] || out[i] || aborted);
    if
    :: finished[i] && first == NONE -> first = i
    :: finished[i] && first != NONE -> assert(fin_epoch[i] == fin_epoch[first] && fin_set[i] == fin_set[first])
    :: else -> skip
    fi;
    i++
  :: else -> break
  od;
  if
  :: first != NONE ->
    j = 0;
    do
    :: j < N ->
      /* The group's members completed with it (or died, or the job was aborted). */
      assert(IN(fin_set[first], j) || finished[j] || dead[j] || aborted);
      assert(!IN(fin_set[first], j) || !finished[j]);
      j++
    :: else -> break
    od
  :: else -> skip
  fi;
  /* Validity: a live rank that came in time is left out only after a death in the window. */
  j = LATE;
  do
  :: j < N -> assert(!out[j] || window_death); j++
  :: else -> break
  od
}
