// SPDX-License-Identifier: Apache-2.0
// The MPI transport's shrink, under mpirun --enable-recovery (Open MPI 4.1 keeps the survivors of a
// lost process alive, and reports nothing about it: docs/mpi.md, "Surviving a lost process across
// hosts"). Open MPI gives no agreement, so the survivors make one over point-to-point messages on
// the group's base communicator, with deadlines; tests/model/mpi_shrink.pml checks it.
//
// Per attempt (epoch e), each rank holds a set F of ranks it takes as failed:
// 1. Propose: it sends PROP(e, F) to every rank, again whenever F grows. F starts with the peers it
//    sees dead (a process of its host that is gone) and grows by the union of every set that a
//    rank outside F proposes (a rank on another host learns a death it could only time out on),
//    by a peer seen dead, and at the deadline (the timeout since F last grew) by the ranks outside F
//    whose latest proposal is not F: they did not answer. Older epochs are stale; a later one (its
//    sender gave an attempt up) is followed; ranks in F are not heard.
// 2. Decide: once every rank outside F has proposed exactly F in epoch e. A rank that finds itself
//    in F is out (E_REMOTE). Every rank that decides in an epoch decides the same F.
// 3. Confirm: CONF(e, F) to every member of the new group, and CONF(e, F) from every one of them,
//    before anyone enters MPI_Comm_create_group, which cannot be abandoned: a member that grew its
//    set after proposing F never confirms, so nobody enters a group that a member will not enter.
//    A member seen dead, a member's other proposal or later epoch, or the deadline gives the
//    attempt up (epoch e + 1; the deadline excludes nobody here: a member that proposed F is alive,
//    and may be waiting on a third rank).
// 4. Form: MPI_Comm_create_group over the members (make_subgroup) under a watchdog that ends the
//    job with MPI_Abort at half the timeout: a member lost after it began to confirm, or inside the call,
//    leaves the others there forever. Then the new communicator's own setup, bounded as every wait
//    is (if it fails, a member was lost meanwhile: the shrink fails, E_REMOTE, see below), and a
//    commit barrier on it (if that fails, the new group lost a member: its members shrink it).
// A decided set that holds every rank of another host, with every survivor on this host: step 4
// forms a shared-memory group over them instead (by a name from the lowest survivor's nonce, which
// its messages carry), bounded as any shm group's forming, with no MPI call: the group `auto` gives
// ranks of one host. Survivors on several hosts form theirs with create_group, as after any loss
// (measured across namespace hosts whose lost host took its Open MPI daemon: docs/mpi.md).
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/transport/mpi/mpi_internal.hpp"
#include "comm/transport/mpi/mpi_runtime.hpp"
#include "comm/transport/shm/shm_communicator.hpp"
#include "common/bounded_wait.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "common/random.hpp"

namespace gradsync::comm::mpi {
namespace {

constexpr int kShrinkTag = 7005;
constexpr uint64_t kPropose = 1;
constexpr uint64_t kConfirm = 2;
// How often a wait of the shrink looks at its peers' liveness (as the shm shrink does).
constexpr auto kLookEvery = std::chrono::milliseconds(10);

using Set = std::vector<uint64_t>;  // a bit per rank of the old group
bool has(const Set& s, int r) { return ((s[static_cast<size_t>(r) / 64] >> (r % 64)) & 1) != 0; }
void add(Set& s, int r) { s[static_cast<size_t>(r) / 64] |= uint64_t{1} << (r % 64); }
bool unite(Set& s, const uint64_t* t) {
  bool grew = false;
  for (size_t i = 0; i < s.size(); ++i) {
    grew |= (t[i] & ~s[i]) != 0;
    s[i] |= t[i];
  }
  return grew;
}
std::vector<int> ranks_of(const Set& s, int size) {
  std::vector<int> out;
  for (int r = 0; r < size; ++r)
    if (has(s, r)) out.push_back(r);
  return out;
}

// The protocol's messages and requests: buried when the shrink ends, since its receives stay
// posted (a peer may still send) and its sends to a dead peer never complete.
struct Wire {
  size_t words = 0;          // kind, epoch, the sender's nonce, then the set
  std::vector<uint64_t> in;  // by peer
  std::vector<MPI_Request> receives;
  std::vector<std::shared_ptr<std::vector<uint64_t>>> out;
  std::vector<MPI_Request> sends;
};

}  // namespace

Watchdog::Watchdog(Clock::time_point deadline, std::string why, bool before_init)
    : thread_([this, deadline, why = std::move(why), before_init] {
        std::unique_lock lock(mutex_);
        if (cv_.wait_until(lock, deadline, [this] { return done_; })) return;
        if (before_init) {
          GS_LOG_ERROR("MPI transport: {}. Nothing can end that call: ending this process (_Exit(1)) rather than hang",
                       why);
          std::_Exit(1);
        }
        GS_LOG_ERROR(
            "MPI transport: {}. Nothing can end that call: calling MPI_Abort(MPI_COMM_WORLD, 1) to end the job rather "
            "than hang",
            why);
        mpi::lib().Abort(mpi::lib().comm_world, 1);
      }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard lock(mutex_);
    done_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

ShrinkResult MpiCommunicator::shrink() {
  const mpi::Api& m = mpi::lib();
  const auto start = Clock::now();
  const auto timeout = options_.timeout;
  // The old group is stopped for good: calls in other threads return, and peers still waiting in a
  // call hear of it (the notices) and come to the shrink. Its requests, and the shrink's own
  // receives on base_, may stay posted: its communicators are never freed, and the job ends with
  // MPI_Abort (MPI_Finalize would wait for the lost rank).
  abort();
  if (!aborted_) {
    aborted_ = true;
    aborted_reason_ = "the group was shrunk: use the survivors' communicator";
  }
  comm_pending_ = true;
  base_pending_ = true;
  if (!holds_abandoned_) {
    holds_abandoned_ = true;
    mpi::mark_abandoned();
  }
  const std::string group =
      options_.name.empty() ? std::string("the MPI group") : fmt::format("MPI group '{}'", options_.name);
  ShrinkResult result;

  auto wire = std::make_shared<Wire>();
  struct Bury {
    std::shared_ptr<Wire>& w;
    ~Bury() { bury(w); }
  } bury_wire{wire};
  const size_t set_words = (static_cast<size_t>(size_) + 63) / 64;
  wire->words = 3 + set_words;
  // Names the survivors' shared-memory group when they are left on one host (the lowest's).
  std::vector<uint64_t> nonce(static_cast<size_t>(size_), 0);
  nonce[static_cast<size_t>(rank_)] = random_nonce();
  const int bytes = static_cast<int>(wire->words * sizeof(uint64_t));
  wire->in.assign(wire->words * static_cast<size_t>(size_), 0);
  wire->receives.assign(static_cast<size_t>(size_), m.request_null);
  std::vector<char> broken(static_cast<size_t>(size_), 0);  // a receive from that peer failed: its connection broke
  auto post = [&](int q) {
    if (m.Irecv(&wire->in[wire->words * static_cast<size_t>(q)], bytes, m.byte, q, kShrinkTag, base_,
                &wire->receives[static_cast<size_t>(q)]) != MPI_SUCCESS) {
      broken[static_cast<size_t>(q)] = 1;
      wire->receives[static_cast<size_t>(q)] = m.request_null;
    }
  };
  for (int q = 0; q < size_; ++q)
    if (q != rank_) post(q);

  uint64_t e = 1;
  Set failed(set_words, 0);
  bool confirming = false;
  std::vector<Set> latest(static_cast<size_t>(size_)), confirmed(static_cast<size_t>(size_));
  Clock::time_point deadline{};
  auto reset_views = [&] {
    for (Set& s : latest) s.clear();
    for (Set& s : confirmed) s.clear();
  };
  auto send = [&](uint64_t kind) {
    for (int q = 0; q < size_; ++q) {
      // Never to a peer seen dead: Open MPI's TCP path may end this process on writing to a
      // connection that the peer's death closed, and the dead hear nothing anyway.
      if (q == rank_ || (kind == kConfirm && has(failed, q)) || peer_dead(q)) continue;
      auto message = std::make_shared<std::vector<uint64_t>>(wire->words);
      (*message)[0] = kind;
      (*message)[1] = e;
      (*message)[2] = nonce[static_cast<size_t>(rank_)];
      std::copy(failed.begin(), failed.end(), message->begin() + 3);
      MPI_Request r = m.request_null;
      if (m.Isend(message->data(), bytes, m.byte, q, kShrinkTag, base_, &r) == MPI_SUCCESS) {
        wire->out.push_back(std::move(message));
        wire->sends.push_back(r);
      }
    }
  };
  auto propose = [&] {
    send(kPropose);
    deadline = deadline_after(timeout);
  };
  // Gives the attempt up: the next epoch, keeping what the peer that moved there first said.
  auto give_up = [&](int from, uint64_t kind, const uint64_t* set) {
    confirming = false;
    ++e;
    reset_views();
    if (from >= 0) {
      latest[static_cast<size_t>(from)].assign(set, set + set_words);
      if (kind == kConfirm) confirmed[static_cast<size_t>(from)].assign(set, set + set_words);
    }
    propose();
  };
  auto lost = [&](int q) { return peer_dead(q) || broken[static_cast<size_t>(q)] != 0; };
  // Adds the peers seen lost; whether any was new.
  auto see_lost = [&] {
    bool grew = false;
    for (int q = 0; q < size_; ++q) {
      if (q != rank_ && !has(failed, q) && lost(q)) {
        add(failed, q);
        grew = true;
      }
    }
    return grew;
  };
  auto equal = [&](const Set& s) { return !s.empty() && std::equal(s.begin(), s.end(), failed.begin()); };
  auto handle = [&](int q, const uint64_t* msg) {
    const uint64_t kind = msg[0], ep = msg[1];
    const uint64_t* set = msg + 3;
    if (has(failed, q) || ep < e || (kind != kPropose && kind != kConfirm)) return;
    const auto qs = static_cast<size_t>(q);
    nonce[qs] = msg[2];
    if (!confirming) {
      const bool moved = ep > e;
      if (moved) {
        e = ep;
        reset_views();
      }
      latest[qs].assign(set, set + set_words);
      if (kind == kConfirm) confirmed[qs].assign(set, set + set_words);
      if (unite(failed, set) || moved) propose();
      return;
    }
    if (ep == e && kind == kConfirm) {
      confirmed[qs].assign(set, set + set_words);
      if (!equal(confirmed[qs])) {
        unite(failed, set);
        give_up(-1, 0, nullptr);
      }
    } else if (ep == e) {
      // Its proposal after the one this rank decided on: it grew, and will not confirm.
      if (!std::equal(failed.begin(), failed.end(), set)) {
        unite(failed, set);
        give_up(-1, 0, nullptr);
      }
    } else {
      unite(failed, set);
      e = ep - 1;
      give_up(q, kind, set);
    }
  };
  // Takes in every message that has come; whether any did.
  auto poll = [&] {
    bool any = false;
    for (int q = 0; q < size_; ++q) {
      MPI_Request& r = wire->receives[static_cast<size_t>(q)];
      while (r != m.request_null) {
        int arrived = 0;
        if (m.Test(&r, &arrived, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
          broken[static_cast<size_t>(q)] = 1;
          r = m.request_null;
          any = true;
          break;
        }
        if (!arrived) break;
        std::vector<uint64_t> msg(wire->in.begin() + static_cast<ptrdiff_t>(wire->words * static_cast<size_t>(q)),
                                  wire->in.begin() + static_cast<ptrdiff_t>(wire->words * static_cast<size_t>(q + 1)));
        post(q);
        handle(q, msg.data());
        any = true;
      }
    }
    // Completed sends free their requests (MPI_Test sets them to null).
    for (MPI_Request& r : wire->sends) {
      int done = 0;
      if (r != m.request_null) m.Test(&r, &done, MPI_STATUS_IGNORE);
    }
    return any;
  };
  auto agreed = [&] {
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && !has(failed, q) && !equal(latest[static_cast<size_t>(q)])) return false;
    return true;
  };
  auto all_confirmed = [&] {
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && !has(failed, q) && !equal(confirmed[static_cast<size_t>(q)])) return false;
    return true;
  };
  // Every wait is bounded by the timeout; the epochs by the losses (each attempt given up lost a
  // member or found one silent): the whole shrink by this.
  const auto give_up_at = start + timeout * (size_ + 2);
  see_lost();
  propose();
  Clock::time_point decided_at{};
  bool on_host = false;  // the decided set holds a whole host of several, and every survivor is on this one
  for (;;) {
    if (has(failed, rank_)) {
      fail(GRADSYNC_E_REMOTE,
           "shrink of {}: the other members decided without rank {} (it answered after their deadline of {} ms, "
           "or a peer could not hear it); it is out of the group",
           group, rank_, timeout.count());
    }
    if (!confirming && agreed()) {
      // Every survivor that decides decides this set, and so how all of them form the group.
      const uint64_t mine = peers_[static_cast<size_t>(rank_)].host_key;
      bool survivors_here = true, other_hosts = false;
      for (int r = 0; r < size_; ++r) {
        const bool here = peers_[static_cast<size_t>(r)].host_key == mine;
        other_hosts |= !here;
        if (!has(failed, r)) survivors_here &= here;
      }
      on_host = survivors_here && other_hosts;
      // A host none of whose ranks survive is taken as lost with its Open MPI daemon (a grow refuses).
      for (int r = 0; r < size_; ++r) {
        bool whole = has(failed, r);
        for (int q = 0; q < size_ && whole; ++q)
          whole = peers_[static_cast<size_t>(q)].host_key != peers_[static_cast<size_t>(r)].host_key || has(failed, q);
        if (whole) mpi::mark_host_lost();
      }
      confirming = true;
      decided_at = Clock::now();
      send(kConfirm);
      deadline = deadline_after(timeout);
      continue;
    }
    if (confirming && all_confirmed()) break;
    GS_REQUIRE(Clock::now() < give_up_at, GRADSYNC_E_TIMEOUT,
               "shrink of {}: rank {} could not agree on the lost ranks within {} attempt(s) of {} ms each", group,
               rank_, e, timeout.count());
    auto slice = [&](Clock::time_point until) {
      for (int polls = 0;; ++polls) {
        if (poll()) return WaitResult::Ready;
        const auto now = Clock::now();
        if (now >= until) return WaitResult::Timeout;
        if (polls < 64) {
          sched_yield();
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
      }
    };
    auto gone = [&] {
      for (int q = 0; q < size_; ++q)
        if (q != rank_ && !has(failed, q) && lost(q)) return true;
      return false;
    };
    auto report = [&](Clock::duration waited) {
      GS_LOG_WARN("shrink of {}: rank {} waiting {} s for the others to {} (epoch {}, lost so far: {})", group, rank_,
                  std::chrono::duration_cast<std::chrono::seconds>(waited).count(), confirming ? "confirm" : "agree", e,
                  fmt::join(ranks_of(failed, size_), ", "));
    };
    switch (bounded_wait(slice, wait_never, gone, report, wait_ends, deadline, kLookEvery)) {
      case WaitEnd::Ready: break;
      case WaitEnd::PeerGone:
        see_lost();
        if (confirming) {
          give_up(-1, 0, nullptr);  // a member is lost: it may not enter create_group
        } else {
          propose();
        }
        break;
      case WaitEnd::Deadline:
        if (confirming) {
          give_up(-1, 0, nullptr);
        } else {
          // Who did not answer F as it stood at the deadline: compared with the set being grown, a
          // member that proposed F would be excluded with the first silent one before it.
          Set silent(set_words, 0);
          for (int q = 0; q < size_; ++q)
            if (q != rank_ && !has(failed, q) && !equal(latest[static_cast<size_t>(q)])) add(silent, q);
          if (unite(failed, silent.data())) {
            propose();
          } else {
            deadline = deadline_after(timeout);
          }
        }
        break;
      case WaitEnd::Stopped:
      case WaitEnd::Interrupted: break;
    }
  }
  result.attempts = static_cast<int>(e);
  const auto formed_start = Clock::now();
  result.agree = formed_start - start;
  Subgroup sub;
  for (int r = 0; r < size_; ++r)
    if (!has(failed, r)) sub.members.push_back(r);
  sub.rank = static_cast<int>(std::find(sub.members.begin(), sub.members.end(), rank_) - sub.members.begin());
  sub.name = fmt::format("{}.shrunk{}", options_.name.substr(0, 40), e);
  std::unique_ptr<Communicator> formed;
  if (on_host) {
    try {
      formed = form_on_host(sub, nonce[static_cast<size_t>(sub.members[0])]);
    } catch (const Error& err) {
      if (!lost_peer(err.status())) throw;
      fail(GRADSYNC_E_REMOTE,
           "shrink of {}: rank {}: a whole host was lost, and a member was lost while the survivors' "
           "shared-memory group (rank(s) {}) was being formed ({})",
           group, rank_, fmt::join(sub.members, ", "), err.what());
    }
  } else {
    try {
      // Half the timeout: a member that gave the attempt up after this rank entered (a death in the
      // window) excludes this rank only after a whole timeout of silence, so the watchdog's
      // MPI_Abort comes first, and no survivor goes on alone in a group of its own meanwhile.
      create_deadline_ = deadline_after(timeout / 2, formed_start);
      formed = form_subgroup(sub);
      create_deadline_.reset();
    } catch (const Error& err) {
      // The survivors' group did not get set up (a member lost inside MPI_Comm_create_group's
      // aftermath: the new communicator's duplication or its exchange of process ids). Another
      // create_group over the old group was tried here, and Open MPI 4.1 then crashed (a
      // segmentation fault in mca_pml_ob1_add_comm, 2 runs in 25): the shrink fails instead.
      create_deadline_.reset();
      if (!lost_peer(err.status())) throw;
      fail(GRADSYNC_E_REMOTE,
           "shrink of {}: rank {}: a member was lost while the survivors' group (rank(s) {}) was being set up ({}); "
           "Open MPI 4.1 cannot be trusted with another MPI_Comm_create_group after that: end the job",
           group, rank_, fmt::join(sub.members, ", "), err.what());
    }
  }
  const auto committed_start = Clock::now();
  result.failed = ranks_of(failed, size_);
  try {
    formed->barrier();  // the commit: every member has its communicator
  } catch (const Error& err) {
    if (!lost_peer(err.status())) throw;
    // A member lost once the group existed on every member: the new group lost it. Its members
    // shrink it (those whose commit completed fail their next call there, and shrink it too), on
    // its own messages: nothing of this group's epochs can mix in.
    GS_LOG_INFO("shrink of {}: rank {}: the survivors' group lost a member as it committed ({}); shrinking it", group,
                rank_, err.what());
    ShrinkResult again = formed->shrink();
    for (int f : again.failed) add(failed, sub.members[static_cast<size_t>(f)]);
    again.failed = ranks_of(failed, size_);
    again.attempts += static_cast<int>(e);
    // Forming: this group's create_group and commit, and the new group's shrink but its agreement.
    again.form = Clock::now() - formed_start - again.agree;
    again.agree += result.agree;
    return again;
  }
  const auto end = Clock::now();
  result.form = end - formed_start;
  result.comm = std::move(formed);
  GS_LOG_INFO(
      "shrink of {}: rank {} is rank {} of {} (lost rank(s) {}; epoch {}; agree {} us, of which confirm {} us; "
      "create_group and setup {} us; commit {} us)",
      group, rank_, sub.rank, sub.members.size(), fmt::join(result.failed, ", "), e,
      std::chrono::duration_cast<std::chrono::microseconds>(formed_start - start).count(),
      std::chrono::duration_cast<std::chrono::microseconds>(formed_start - decided_at).count(),
      std::chrono::duration_cast<std::chrono::microseconds>(committed_start - formed_start).count(),
      std::chrono::duration_cast<std::chrono::microseconds>(end - committed_start).count());
  return result;
}

std::unique_ptr<Communicator> MpiCommunicator::form_on_host(const Subgroup& sub, uint64_t nonce) {
  Options o = subgroup_options(sub);
  o.transport = Transport::Shm;
  o.name = fmt::format("gs-s{:016x}", nonce);
  o.grow_refused =
      "it is the shared-memory group that a shrink of an MPI group formed once a whole host was lost and every "
      "survivor was on this one: its joiners could come only by MPI_Comm_spawn, which Open MPI 4.1 refuses in a job "
      "that lost a host (it ends the job); go on with the survivors, or restart the job with the hosts it needs";
  std::unique_ptr<Communicator> formed = create_shm_communicator(o);
  pass_identity(*formed, o, topology().restricted(sub.members, sub.rank));
  return formed;
}

}  // namespace gradsync::comm::mpi
