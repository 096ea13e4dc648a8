/* SPDX-License-Identifier: Apache-2.0 */
/* The MPI transport's reset and join (MpiCommunicator::reset, the constructor, duplicate): fresh
 * communicators duplicated from a parent (the group's base for a reset, the caller's MPI
 * communicator for a join), D of them one after the other. A duplication is an MPI collective on
 * the parent: each rank's j-th duplication matches every peer's j-th, in the order each rank posts
 * them, and completes once every rank has posted it. A rank's wait for one can give up (a deadline,
 * an abort), leaving it posted; the reset (or create) then fails on that rank, and comm.h says to
 * call it again on every rank, which the ranks here do, round after round, until every rank's
 * returns OK. Checked over every interleaving, with up to GIVEUPS waits given up in all:
 * - the rounds settle: no state where ranks wait for each other forever (invalid end state);
 * - once every rank's call returned OK, each fresh communicator k is the same duplication on every
 *   rank (its matched index), so the ranks' calls meet on the same communicators.
 * MUTANT_REPOST: a failed call forgets its duplications and the next posts new ones (the rule
 * before: the ranks stayed one step apart forever). */
#ifndef N
#define N 2
#endif
#ifndef D
#define D 2
#endif
#ifndef GIVEUPS
#define GIVEUPS 2
#endif
/* A reset succeeds on one rank and fails on another only when a wait gave up as its duplication
   completed; the next round is then a step apart, and fails by its deadline, and the one after
   settles: the model checks that this many rounds always suffice. */
#define ROUNDS (2 * GIVEUPS + 2)

byte posted[4];      /* duplications rank r has posted on the base, over every reset (255: no rank r) */
byte slot[N * D];    /* rank r's fresh communicator k: the index of the duplication it is */
byte made[N];        /* of the current fresh: complete ones */
byte pending[N];     /* of the current fresh: posted ones (made, or made + 1) */
byte giveups = 0;
bool ok[ROUNDS * N]; /* round's outcome on rank r: ok[round * N + r] */
byte arrived = 0;
bool settled = false;

/* Duplication j has completed: every rank has posted it. */
#define ALL_POSTED(j) (posted[0] >= (j) && posted[1] >= (j) && posted[2] >= (j) && posted[3] >= (j))

proctype Rank(byte r) {
  byte k, i, my_round = 0;
  bool all_ok;
  do
  :: my_round < ROUNDS && !settled ->
    /* one reset attempt: resume the fresh communicators where the last attempt stopped */
    ok[my_round * N + r] = true;
    k = made[r];
    do
    :: k < D ->
      if
      :: pending[r] == k -> atomic { posted[r]++; slot[r * D + k] = posted[r]; pending[r] = k + 1 }
      :: else -> skip
      fi;
      if
      :: ALL_POSTED(slot[r * D + k]) -> made[r] = k + 1; k++
      :: atomic { giveups < GIVEUPS -> giveups++ } -> goto gave_up /* an abort, or a deadline just as it completes */
      :: timeout -> goto gave_up /* the deadline: nothing else can happen first */
      fi;
      skip
    :: else -> break
    od;
    goto outcome;
gave_up:
    ok[my_round * N + r] = false;
#ifdef MUTANT_REPOST
    made[r] = 0;
    pending[r] = 0;
#endif
outcome:
    if
    :: ok[my_round * N + r] -> made[r] = 0; pending[r] = 0 /* the next reset starts a fresh set */
    :: else -> skip
    fi;
    /* every rank meets and learns every outcome (the caller's own channel), then all go again
       unless every reset returned OK */
    atomic { arrived++ };
    (arrived >= (my_round + 1) * N);
    all_ok = true;
    i = 0;
    do
    :: i < N -> all_ok = all_ok && ok[my_round * N + i]; i++
    :: else -> break
    od;
    if
    :: all_ok -> settled = true
    :: else -> skip
    fi;
    my_round++
  :: else -> break
  od
}

init {
  byte r;
  atomic {
    r = N;
    do
    :: r < 4 -> posted[r] = 255; r++
    :: else -> break
    od;
    r = 0;
    do
    :: r < N -> run Rank(r); r++
    :: else -> break
    od
  }
  (_nr_pr == 1);
  assert(settled);
  /* the last round succeeded on every rank: each one's communicator k is the same duplication */
  byte k = 0;
  do
  :: k < D ->
    r = 1;
    do
    :: r < N -> assert(slot[r * D + k] == slot[k]); r++
    :: else -> break
    od;
    k++
  :: else -> break
  od
}
