// SPDX-License-Identifier: Apache-2.0
#include "comm/membership.hpp"

#include <algorithm>
#include <string>

#include "common/bounded_wait.hpp"
#include "common/error.hpp"
#include "common/fnv.hpp"
#include "common/log.hpp"
#include "common/random.hpp"
#include "common/wait.hpp"

namespace gradsync::comm {
namespace {
// How often a wait of the shrink looks at its peers' liveness: a peer found dead is no longer
// waited for. The round engine's interval, so a death is seen as fast in a shrink as in a call.
constexpr auto kLookEvery = std::chrono::milliseconds(10);

bool has(const std::vector<int>& ranks, int r) { return std::binary_search(ranks.begin(), ranks.end(), r); }
}  // namespace

std::string Membership::group_name() const {
  return fmt::format("{} group '{}'", transport_name(fabric_.transport()), fabric_.group());
}

bool Membership::read_proposal(int winner, uint64_t epoch, Decision& out) const {
  const MemberSlot& s = fabric_.control().member(winner);
  if (s.tag.load(std::memory_order_seq_cst) != epoch) return false;
  uint64_t bits[kMemberWords];
  for (uint64_t i = 0; i < kMemberWords; ++i) bits[i] = s.failed[i].load(std::memory_order_seq_cst);
  const uint64_t nonce = s.nonce.load(std::memory_order_seq_cst);
  if (s.tag.load(std::memory_order_seq_cst) != epoch) return false;
  out.epoch = epoch;
  out.nonce = nonce;
  out.failed.clear();
  for (int r = 0; r < size_; ++r) {
    if ((bits[r / 64] >> (r % 64)) & 1) out.failed.push_back(r);
  }
  return true;
}

Membership::Decision Membership::agree(WaitClock::time_point deadline) {
  const ControlArea& c = fabric_.control();
  MembershipWords& m = c.membership();
  WaitWord& wake = c.words().wake;
  MemberSlot& mine = c.member(rank_);
  std::vector<char> dead(static_cast<size_t>(size_), 0);
  for (;;) {
    const uint64_t e = epoch_ + 1;
    if (shrink_epoch(m.decision.load(std::memory_order_seq_cst)) < e) {
      mine.request.store(e, std::memory_order_seq_cst);
      notify(wake);
      auto look = [&] {
        for (int r = 0; r < size_; ++r) {
          if (r != rank_ && !dead[static_cast<size_t>(r)] && !fabric_.alive(r)) dead[static_cast<size_t>(r)] = 1;
        }
      };
      auto ready = [&] {
        if (shrink_epoch(m.decision.load(std::memory_order_seq_cst)) >= e) return true;
        for (int r = 0; r < size_; ++r) {
          if (!dead[static_cast<size_t>(r)] && c.member(r).request.load(std::memory_order_seq_cst) < e) return false;
        }
        return true;
      };
      look();
      // Ends ready or at the deadline; a dead peer is not waited for (look), it does not end the wait.
      auto until = deadline;
      bounded_wait([&](WaitClock::time_point t) { return wait_until(wake, ready, t); }, wait_never,
                   [&] {
                     look();
                     return false;
                   },
                   wait_silent, wait_ends, until, kLookEvery);
      if (shrink_epoch(m.decision.load(std::memory_order_seq_cst)) < e) {
        look();
        // The proposal: every rank that has not entered this epoch, or is dead.
        uint64_t bits[kMemberWords] = {};
        for (int r = 0; r < size_; ++r) {
          if (dead[static_cast<size_t>(r)] || c.member(r).request.load(std::memory_order_seq_cst) < e) {
            bits[r / 64] |= uint64_t{1} << (r % 64);
          }
        }
        mine.tag.store(0, std::memory_order_seq_cst);
        for (uint64_t i = 0; i < kMemberWords; ++i) mine.failed[i].store(bits[i], std::memory_order_seq_cst);
        mine.nonce.store(random_nonce(), std::memory_order_seq_cst);
        mine.tag.store(e, std::memory_order_seq_cst);
        uint64_t cur = m.decision.load(std::memory_order_seq_cst);
        while (shrink_epoch(cur) < e &&
               !m.decision.compare_exchange_weak(cur, shrink_code(e, rank_), std::memory_order_seq_cst)) {
        }
        notify(wake);
      }
    }
    // Epoch e, or a later one the group decided without this rank, is decided: take it.
    const uint64_t d = m.decision.load(std::memory_order_seq_cst);
    Decision out;
    if (!read_proposal(shrink_winner(d), shrink_epoch(d), out)) {
      // The winner is writing a later proposal already: the group moved on; look again.
      GS_REQUIRE(WaitClock::now() < deadline, GRADSYNC_E_TIMEOUT,
                 "shrink of {}: rank {} could not read the group's decision before the deadline ({} ms)", group_name(),
                 rank_, timeout_.count());
      continue;
    }
    epoch_ = out.epoch;
    return out;
  }
}

ShrinkResult Membership::shrink(Communicator& group) {
  const ControlArea& c = fabric_.control();
  // Survivors still waiting in a call of the old group return now; nobody may join it any more.
  raise_stop(c.words().stop_word, StopReason::Shrinking, rank_);
  fabric_.close_group();
  notify(c.words().wake);
  ShrinkResult result;
  for (;;) {
    ++result.attempts;
    // Each step has the group's timeout: agreeing (which may spend all of it on a member that does
    // not answer), then forming.
    const auto agree_start = WaitClock::now();
    const Decision decision = agree(deadline_after(timeout_, agree_start));
    const auto formed_start = WaitClock::now();
    const auto deadline = deadline_after(timeout_, formed_start);
    result.agree += formed_start - agree_start;
    if (has(decision.failed, rank_)) {
      fail(GRADSYNC_E_REMOTE,
           "shrink of {}: the other members decided without rank {} (it came after the deadline of {} ms); "
           "it is out of the group",
           group_name(), rank_, timeout_.count());
    }
    Communicator::Subgroup sub;
    for (int r = 0; r < size_; ++r) {
      if (!has(decision.failed, r)) sub.members.push_back(r);
    }
    sub.rank = static_cast<int>(std::find(sub.members.begin(), sub.members.end(), rank_) - sub.members.begin());
    const std::string& parent = fabric_.group();
    const uint64_t words[2] = {decision.nonce, decision.epoch};
    uint64_t h = fnv1a64(parent.data(), parent.size());
    h = fnv1a64(words, sizeof words, h);
    sub.name = fmt::format("{}.{:016x}", parent.substr(0, 40), h);
    const uint64_t epoch = decision.epoch;
    sub.abandoned = [this, &sub, epoch, deadline]() -> std::string {
      for (int r : sub.members) {
        if (r != rank_ && !fabric_.alive(r)) return fmt::format("rank {} of the old group died while it formed", r);
      }
      if (shrink_epoch(fabric_.control().membership().decision.load(std::memory_order_seq_cst)) > epoch) {
        return "the old group decided a later shrink";
      }
      if (WaitClock::now() >= deadline) return fmt::format("the shrink's deadline ({} ms) passed", timeout_.count());
      return {};
    };
    try {
      std::unique_ptr<Communicator> formed = group.form_subgroup(sub);
      // The commit, decided once for every member by the new group's round engine.
      formed->barrier();
      result.form += WaitClock::now() - formed_start;
      result.comm = std::move(formed);
      result.failed = decision.failed;
      GS_LOG_INFO("shrink of {}: rank {} is rank {} of {} in group '{}' (lost rank(s) {}; {} attempt(s))", group_name(),
                  rank_, sub.rank, sub.members.size(), sub.name, fmt::join(decision.failed, ", "), result.attempts);
      return result;
    } catch (const Error& e) {
      result.form += WaitClock::now() - formed_start;
      const int s = e.status();
      if (s != GRADSYNC_E_REMOTE && s != GRADSYNC_E_ABORTED && s != GRADSYNC_E_TIMEOUT) throw;
      // Every failed attempt lost a member, or ran out of time: the attempts are bounded.
      if (WaitClock::now() >= deadline || result.attempts > size_) {
        fail(GRADSYNC_E_TIMEOUT, "shrink of {}: rank {} could not form the new group ({} attempt(s), {} ms each): {}",
             group_name(), rank_, result.attempts, timeout_.count(), e.what());
      }
      // A member was lost while the group formed: agree again, on the next epoch.
      GS_LOG_INFO("shrink of {}: rank {}: forming group '{}' failed ({}); agreeing again", group_name(), rank_,
                  sub.name, e.what());
    }
  }
}

}  // namespace gradsync::comm
