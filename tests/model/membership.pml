/* SPDX-License-Identifier: Apache-2.0 */
/* The membership protocol of a shrink (src/comm/membership.hpp), over every interleaving of the
 * survivors' steps with deaths at every step (a death in the old group is also a member leaving
 * it after its shrink, as the thread transport sees it), deadlines passing, and an abort racing
 * the new group's commit.
 *
 * Per attempt (epoch e): post e; wait until every rank posted e or is dead, or e is decided, or the
 * deadline passes; propose the ranks that have not posted e or are dead and decide e by one CAS on
 * the decision word (epoch, winner); read the winner's proposal, checked by its tag; form the group
 * of the others (every member joins; a member that sees a member dead while the group is short
 * gives up) and commit with one barrier of the new group, decided once (its count reaching the
 * members first, or a failure CAS first); a failed commit is a new attempt.
 *
 * Checked: one failed set per epoch (agreement); without a deadline passing, no live rank is
 * left out (validity); every rank that finishes finishes in the same group, whose members are
 * exactly the finished ones and the dead (one outcome, no split groups); no rank waits forever
 * (valid end states); the epochs needed are bounded by the losses.
 *
 * With -DGROW, the grow instead (src/comm/membership.hpp): N members and one joiner. Agree (a
 * round of the old group, decided once); admit (member 0 and the joiner form a lobby, then a
 * broadcast round of the lobby, decided once); form the grown group (every participant joins and
 * waits for all; one that sees the group stopped, a member dead, a participant dead or gone from
 * the forming group, its lobby partner dead or gone, or the deadline, gives up and leaves); commit
 * (a barrier of the grown group, decided once). A member that fails stops the old group, and only
 * then leaves the lobby and the forming group. Deaths at every step, of a member or of the
 * joiner; an abort of the old group racing every step.
 * Checked: one outcome (no participant succeeds while another that lives fails), every member
 * that fails leaves the old group stopped (for its reset) and stops it before it leaves the
 * forming group (so the others never take its leaving for a death), without a death, an abort or a
 * deadline every participant succeeds, and nobody waits forever (valid end states; the joiner may
 * wait in the lobby for members that never come: that wait ends at its own deadline). */

#ifndef N
#define N 3
#endif
#ifndef DEATHS
#define DEATHS 1
#endif
#ifndef DEADLINE
#define DEADLINE 0
#endif
#ifndef ABORTS
#define ABORTS 0
#endif
#ifndef GROW
#define E (DEATHS + DEADLINE + ABORTS + 2)
#define NONE 255

byte request[N];
bool dead[N];
byte deaths, aborts;
bool late; /* the deadline has passed: every wait may end, and a rank that then fails gives up */
bool timedout[N];
byte ended;

byte tag[N];
byte bits[N];
byte dec_epoch, dec_winner;

byte joined[E];
byte commit_count[E];
bool commit_failed[E];

byte agreed[E];
bool finished[N], out[N];
byte done_epoch[N], done_set[N];

#define IN(set, r) (((set) >> (r)) & 1)
#define DIE if :: deaths < DEATHS -> deaths++; dead[me] = true; goto gone :: true -> skip fi

#if N == 2
#define ALL_POSTED(e) ((request[0] >= e || dead[0]) && (request[1] >= e || dead[1]))
#define PROPOSAL(e) ((request[0] < e || dead[0] -> 1 : 0) | (request[1] < e || dead[1] -> 2 : 0))
#define MEMBERS_DEAD(f) ((!IN(f, 0) && dead[0]) || (!IN(f, 1) && dead[1]))
#else
#define ALL_POSTED(e) ((request[0] >= e || dead[0]) && (request[1] >= e || dead[1]) && (request[2] >= e || dead[2]))
#define PROPOSAL(e) ((request[0] < e || dead[0] -> 1 : 0) | (request[1] < e || dead[1] -> 2 : 0) | \
                     (request[2] < e || dead[2] -> 4 : 0))
#define MEMBERS_DEAD(f) ((!IN(f, 0) && dead[0]) || (!IN(f, 1) && dead[1]) || (!IN(f, 2) && dead[2]))
#endif

proctype Rank(byte me) {
  byte my_epoch = 0, e, d, w, f, t1, t2, cnt, i, early;
next_epoch:
  e = my_epoch + 1;
  assert(e < E); /* the losses bound the attempts */
  if :: late -> timedout[me] = true; goto end :: else -> skip fi;
  DIE;
  if
  :: dec_epoch >= e -> goto decided
  :: else -> request[me] = e
  fi;
  early = PROPOSAL(e);
  DIE;
#ifndef MUTANT_NO_WAIT
  if
  :: dec_epoch >= e -> skip
  :: ALL_POSTED(e) -> skip
  :: late -> skip /* the ranks that have not posted are proposed as failed */
  fi;
#endif
  DIE;
  if
  :: dec_epoch < e ->
#ifdef MUTANT_NO_WAIT
    f = early;
#else
    f = PROPOSAL(e);
#endif
#ifndef MUTANT_UNTAGGED
    tag[me] = 0;
    bits[me] = f;
    tag[me] = e;
#endif
    DIE;
#ifdef MUTANT_STORE
    if :: dec_epoch < e -> skip :: else -> goto decided fi;
    dec_epoch = e; dec_winner = me;
#else
    atomic { if :: dec_epoch < e -> dec_epoch = e; dec_winner = me :: else -> skip fi }
#endif
#ifdef MUTANT_UNTAGGED
    bits[me] = f;
    tag[me] = e;
#endif
  :: else -> skip
  fi;
decided:
  atomic { d = dec_epoch; w = dec_winner };
  t1 = tag[w];
  f = bits[w];
  t2 = tag[w];
#ifndef MUTANT_UNTAGGED
  if
  :: t1 != d || t2 != d -> if :: late -> timedout[me] = true; goto end :: else -> goto decided fi
  :: else -> skip
  fi;
#endif
  my_epoch = d;
  atomic {
    if
    :: agreed[d] == NONE -> agreed[d] = f
    :: else -> assert(agreed[d] == f) /* one failed set per epoch */
    fi
  };
  if
  :: IN(f, me) ->
    assert(late); /* only a deadline leaves a live rank out */
    out[me] = true;
    goto end
  :: else -> skip
  fi;
  cnt = 0;
  i = 0;
  do
  :: i < N -> if :: !IN(f, i) -> cnt++ :: else -> skip fi; i++
  :: else -> break
  od;

  /* Form: join, then wait for every member, giving up once a member is dead while the group is
   * short (or the old group decided a later epoch, or the deadline passed). */
  DIE;
  joined[d]++;
  DIE;
  if
  :: joined[d] >= cnt -> skip
#ifndef MUTANT_NO_ABANDON
  :: joined[d] < cnt && (MEMBERS_DEAD(f) || dec_epoch > d) -> goto failed
  :: late -> goto failed
#endif
  fi;
#ifndef MUTANT_NO_COMMIT
  /* Commit: the new group's barrier, decided once. */
  DIE;
  atomic { if :: !commit_failed[d] -> commit_count[d]++ :: else -> skip fi };
  if
  :: commit_count[d] >= cnt && !commit_failed[d] -> skip
  :: commit_failed[d] -> goto retry
  :: MEMBERS_DEAD(f) -> goto failed
  :: aborts < ABORTS -> aborts++; goto failed
  :: late -> goto failed
  fi;
#endif
  atomic { finished[me] = true; done_epoch[me] = d; done_set[me] = f };
  /* It may free the old group now: to a peer still in the shrink, that is a death. */
  if :: true -> skip :: true -> dead[me] = true fi;
  goto end;
failed:
  atomic { if :: commit_count[d] < cnt -> commit_failed[d] = true :: else -> skip fi };
#ifndef MUTANT_NO_COMMIT
  if :: !commit_failed[d] -> atomic { finished[me] = true; done_epoch[me] = d; done_set[me] = f }; goto end
     :: else -> skip fi;
#endif
retry:
  goto next_epoch;
gone:
  skip;
end:
  ended++
}

init {
  byte i, j, first = NONE;
  atomic {
    i = 0;
    do :: i < E -> agreed[i] = NONE; i++ :: else -> break od;
    i = 0;
    do :: i < N -> run Rank(i); i++ :: else -> break od
  };
  (ended == N);
  /* One outcome: every finished rank is in the same group, and its members are the finished ranks
   * and the dead. */
  i = 0;
  do
  :: i < N ->
    if
    :: finished[i] && first == NONE -> first = i
    :: finished[i] && first != NONE ->
      assert(done_epoch[i] == done_epoch[first] && done_set[i] == done_set[first])
    :: else -> skip
    fi;
    i++
  :: else -> break
  od;
  if
  :: first != NONE ->
    j = 0;
    do
    :: j < N -> assert(IN(done_set[first], j) || finished[j] || dead[j]); j++
    :: else -> break
    od
  :: else -> skip
  fi;
  /* Without a deadline passing, every rank that did not die finished (none was left out or
   * stuck). */
  j = 0;
  do
  :: j < N -> assert(late || finished[j] || dead[j]); j++
  :: else -> break
  od
}

#if DEADLINE
active proctype Clock() {
  late = true
}
#endif

#else /* GROW */

#define J N       /* the joiner */
#define P (N + 1) /* participants of the grown group */

bool dead[P];
byte deaths, aborts;
bool late;
bool stop; /* the old group's stop word: an abort, or a member whose grow failed */
byte agree_n;
bool agree_bad;
bool in_lobby[P], lobby_gone[P]; /* member 0 and the joiner */
byte offer_n;
bool offer_bad;
bool in_form[P], form_gone[P];
byte commit_n;
bool commit_bad;
bool ok[P], failed[P];
byte ended;

#define DIE if :: deaths < DEATHS -> deaths++; dead[me] = true; goto gone :: true -> skip fi
#define LOST(i) ((in_form[i] && dead[i]) || form_gone[i])
#define GONE(i) (dead[i] || form_gone[i])
#if N == 2
#define MEMBER_DEAD (dead[0] || dead[1])
#define ALL_FORMED (in_form[0] && in_form[1] && in_form[2])
#define FORM_LOST (LOST(0) || LOST(1) || LOST(2))
#define ANY_GONE (GONE(0) || GONE(1) || GONE(2))
#define MEMBER_LEFT_FORM (form_gone[0] || form_gone[1])
#else
#define MEMBER_DEAD (dead[0] || dead[1] || dead[2])
#define ALL_FORMED (in_form[0] && in_form[1] && in_form[2] && in_form[3])
#define FORM_LOST (LOST(0) || LOST(1) || LOST(2) || LOST(3))
#define ANY_GONE (GONE(0) || GONE(1) || GONE(2) || GONE(3))
#define MEMBER_LEFT_FORM (form_gone[0] || form_gone[1] || form_gone[2])
#endif
#ifdef MUTANT_LOBBY_FREED
#define PARTNER_LOST(p) false
#else
#define PARTNER_LOST(p) (dead[p] || lobby_gone[p])
#endif

/* A round decided once: arrive unless it failed; it went ahead once `need` arrived; a rank that
 * sees a cause of failure first fails it, unless it is complete. */
#define ROUND(n, bad, need, cause)                                             \
  atomic { if :: !bad -> n++ :: else -> skip fi };                             \
  if                                                                           \
  :: n >= need && !bad -> skip                                                 \
  :: bad -> goto fail                                                          \
  :: cause -> atomic { if :: n < need -> bad = true :: else -> skip fi };      \
              if :: bad -> goto fail :: else -> skip fi                        \
  fi

proctype Member(byte me) {
  /* 1. Agree: a round of the old group. */
  DIE;
  ROUND(agree_n, agree_bad, N, MEMBER_DEAD || stop || late);
  /* 2. Admit: member 0 meets the joiner in the lobby and broadcasts the offer there. */
  if
  :: me == 0 ->
    DIE;
    in_lobby[0] = true;
    DIE;
    if
    :: in_lobby[J] -> skip
    :: (in_lobby[J] && dead[J]) || MEMBER_DEAD || stop || late -> goto fail
    fi;
    DIE;
    ROUND(offer_n, offer_bad, 2, dead[J] || lobby_gone[J] || late)
  :: else -> skip
  fi;
  /* 3. Form the grown group. Member 0 also watches the joiner through the lobby it keeps. */
  DIE;
  in_form[me] = true;
  DIE;
  if
  :: ALL_FORMED -> skip
  :: FORM_LOST || MEMBER_DEAD || stop || late || (me == 0 && PARTNER_LOST(J)) ->
    /* A member that left the forming group stopped the old group first: the others learn that its
     * grow failed (E_ABORTED, reset) rather than take its leaving for a death (E_REMOTE, shrink). */
    assert(!MEMBER_LEFT_FORM || stop);
    goto fail
  fi;
#ifndef MUTANT_GROW_NO_COMMIT
  /* 4. Commit: a barrier of the grown group. */
  DIE;
  ROUND(commit_n, commit_bad, P, ANY_GONE || late);
#endif
  ok[me] = true;
  goto end;
fail:
  /* The old group is stopped before this member leaves the groups it was forming. */
#if !defined(MUTANT_GROW_NO_STOP) && !defined(MUTANT_GROW_LEAVE_FIRST)
  stop = true;
#endif
  atomic {
    if :: me == 0 -> in_lobby[0] = false; lobby_gone[0] = true :: else -> skip fi;
    if :: in_form[me] -> in_form[me] = false; form_gone[me] = true :: else -> skip fi
  };
#ifdef MUTANT_GROW_LEAVE_FIRST
  stop = true;
#endif
  failed[me] = true;
  goto end;
gone:
  skip;
end:
  ended++
}

proctype Joiner(byte me) {
#if DEADLINE
  DIE; /* before the lobby: the members wait for it until their deadline */
#endif
  in_lobby[J] = true;
  DIE;
end_lobby: /* valid to stay here: the joiner's own deadline ends this wait */
  if
  :: in_lobby[0] -> skip
  :: lobby_gone[0] || late -> goto fail
  fi;
  DIE;
  ROUND(offer_n, offer_bad, 2, dead[0] || lobby_gone[0] || late);
  DIE;
  in_form[J] = true;
  DIE;
  if
  :: ALL_FORMED -> skip
  :: FORM_LOST || late || PARTNER_LOST(0) -> goto fail
  fi;
#ifndef MUTANT_GROW_NO_COMMIT
  DIE;
  ROUND(commit_n, commit_bad, P, ANY_GONE || late);
#endif
  ok[me] = true;
  goto end;
fail:
  atomic {
    in_lobby[J] = false;
    lobby_gone[J] = true;
    if :: in_form[J] -> in_form[J] = false; form_gone[J] = true :: else -> skip fi
  };
  failed[me] = true;
  goto end;
gone:
  skip;
end:
  ended++
}

init {
  byte i, j;
  atomic {
    i = 0;
    do :: i < N -> run Member(i); i++ :: else -> break od;
    run Joiner(J)
  };
  /* Every participant ends, except a joiner whose members never came: it waits in the lobby
   * until its own deadline (its timeout, not the members'). */
  if
  :: ended == P -> skip
  :: ended == P - 1 && !ok[J] && !failed[J] && !dead[J] && (stop || MEMBER_DEAD) -> skip
  fi;
  i = 0;
  do
  :: i < P ->
    j = 0;
    do
    :: j < P -> assert(!(ok[i] && failed[j])); j++ /* one outcome */
    :: else -> break
    od;
    assert(i == J || !failed[i] || stop); /* a member that failed leaves the old group stopped */
    assert(late || aborts > 0 || deaths > 0 || ok[i]); /* nothing went wrong: everyone grew */
    i++
  :: else -> break
  od
}

#if ABORTS
active proctype Abort() {
  atomic { stop = true; aborts++ }
}
#endif

#if DEADLINE
active proctype Clock() {
  late = true
}
#endif

#endif /* GROW */
