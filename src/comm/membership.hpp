// SPDX-License-Identifier: Apache-2.0
#pragma once
// Shrinking a group whose ranks share memory (threads, shared-memory processes) after it lost a
// member: the survivors agree on ONE failed set, then form a group of the others with dense ranks.
//
// The protocol, per attempt ("epoch" e = 1, 2, ... of this group; tests/model/membership.pml
// models it and spin checks it):
// 1. Enter: stop the old group (StopReason::Shrinking: a survivor still in a call returns), mark it
//    unjoinable, post e in this rank's MemberSlot::request.
// 2. Wait until every rank has posted e or is dead (the fabric's liveness: a process gone, a
//    thread's communicator freed), or epoch e is decided by another rank, or the deadline passes
//    (then the ranks that have not posted count as failed: they do not answer).
// 3. Propose and decide: unless e is decided already, write the proposal (the ranks that have not
//    posted e or are dead) into this rank's slot, then CAS the group's decision word from an
//    older epoch to shrink_code(e, this rank). One CAS wins per epoch; every rank reads the
//    winner's proposal (validated by its tag), so every rank of epoch e has the same failed set.
//    A rank that finds itself in it (it came after the deadline) is out: E_REMOTE.
// 4. Form the group of the others, in old rank order, by a name from the winner's nonce and e
//    (Communicator::form_subgroup, as split does). Forming is abandoned as soon as a member of the
//    new group is dead in the old one, or the old group decided a later epoch.
// 5. Commit: one barrier on the new group, which the round engine decides once for all its
//    members. If forming failed anywhere (a member died in between), the barrier fails for every
//    member, and every survivor goes back to step 1 with e + 1: a second death is a second shrink.
// Every step (agreeing, forming and committing) is bounded by the group's timeout, and the
// attempts by the group's size: each failed attempt lost a member.
//
// Growing a running group by new ranks (the joiners), at a round boundary:
// 1. Agree: the members allgather (joiners, the join name's hash, the next member id, a nonce) over
//    the group and check them alike: every member reaches the same verdict, with rank 0's nonce
//    and the group's next member id.
// 2. Admit: rank 0 and the joiners form a lobby group by the join name (rank 0 as its rank 0,
//    joiner j as j + 1; the counts must agree, as any group's size), and rank 0 broadcasts the
//    offer there: the group's size, next member id, nonce and options. The lobby is kept until
//    the grown group commits: rank 0 and the joiners watch each other through it (a joiner lost
//    before it joined the grown group, or rank 0 leaving after a failure).
// 3. Form the grown group by a name from the join name and the nonce (members at their ranks,
//    joiner j at size + j). A member gives up forming as soon as a member of the group is dead or
//    the group is stopped (an abort, or a member that failed its grow), a lobby peer is lost
//    (rank 0), or the deadline passes; a joiner, as soon as a lobby peer is lost.
// 4. Commit: one barrier on the grown group, decided once for all its members. A member that fails
//    any step stops the group (StopReason::Failed) so that the others stop waiting; they then fail
//    with E_ABORTED naming it, and the group needs a reset (or a shrink, when a member died).
// A joiner's steps end at its deadline (the lobby's: its own timeout; forming and the commit: the
// group's), or when the members' failure reaches it through the lobby or the grown group. Each
// member's step is bounded by the group's timeout. tests/model/membership.pml (-DGROW) checks
// this over deaths of a member or the joiner at every step and an abort racing each step, and
// that the commit, the stop and the kept lobby are each needed.
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/engine/fabric.hpp"

namespace gradsync::comm {

class Membership {
 public:
  Membership(Fabric& fabric, int rank, int size, std::chrono::milliseconds timeout)
      : fabric_(fabric), rank_(rank), size_(size), timeout_(timeout) {}

  // Collective over the survivors of `group` (this rank's communicator over the fabric).
  ShrinkResult shrink(Communicator& group);
  // Collective over `group` (this rank's communicator over the fabric), with the joiners (join()).
  // join_group forms the lobby and the grown group (the transport's own, as for subgroups).
  GrowResult grow(Communicator& group, JoinGroup join_group, const std::string& join_name, int joiners);
  // A joiner's side (comm::join).
  static GrowResult join(const Options& options, JoinGroup join_group);

 private:
  struct Decision {
    uint64_t epoch;
    uint64_t nonce;
    std::vector<int> failed;  // ascending ranks of the old group
  };
  // Steps 1-3 of an attempt: the decided failed set of the next epoch (or of a later one that the
  // group decided without this rank).
  Decision agree(WaitClock::time_point deadline);
  // The winner's proposal for `epoch`, or false when the winner has moved on to a later one.
  bool read_proposal(int winner, uint64_t epoch, Decision& out) const;
  std::string group_name() const;

  Fabric& fabric_;
  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  uint64_t epoch_ = 0;  // the last epoch this rank took part in
};

}  // namespace gradsync::comm
