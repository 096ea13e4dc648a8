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
#include <chrono>
#include <cstdint>
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
