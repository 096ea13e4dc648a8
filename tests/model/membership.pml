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
 * (valid end states); the epochs needed are bounded by the losses. */

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
