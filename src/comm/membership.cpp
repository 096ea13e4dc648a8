// SPDX-License-Identifier: Apache-2.0
#include "comm/membership.hpp"

#include <algorithm>
#include <limits>
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

// What rank 0 tells the joiners in the lobby: where they start, and the group's options, which the
// grown group has on every member.
enum OfferWord : size_t { kOldSize, kFirstId, kNonce, kTimeoutMs, kCheckMismatch, kDeterministic, kOfferWords };

// The grown group's name: the join name cut to 40 bytes, a dot and a hash of what makes this grow
// unique (as split and shrink name their groups).
std::string grown_name(const std::string& join_name, uint64_t nonce, int64_t first_id) {
  const uint64_t words[2] = {nonce, static_cast<uint64_t>(first_id)};
  uint64_t h = fnv1a64(join_name.data(), join_name.size());
  h = fnv1a64(words, sizeof words, h);
  return fmt::format("{}.{:016x}", join_name.substr(0, 40), h);
}
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
      if (!lost_peer(e.status())) throw;
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

GrowResult Membership::grow(Communicator& group, JoinGroup join_group, const std::string& join_name, int joiners) {
  GS_REQUIRE(joiners >= 1 && joiners <= kMaxLocalRanks - size_, GRADSYNC_E_INVALID_ARG,
             "grow of {}: {} joiner(s); a group of {} takes 1 to {} (at most {} ranks)", group_name(), joiners, size_,
             kMaxLocalRanks - size_, kMaxLocalRanks);
  // The lobby is a group of that name: it would be taken for comm itself.
  GS_REQUIRE(join_name != group.group_options().name, GRADSYNC_E_INVALID_ARG,
             "grow of {}: join_name '{}' is the group's own name; the joiners meet rank 0 in a group of that name",
             group_name(), join_name);
  const ControlArea& c = fabric_.control();
  std::atomic<uint32_t>& stop = c.words().stop_word;
  GrowResult result;
  const auto start = WaitClock::now();
  // Rank 0's lobby with the joiners, kept until the grown group commits: a joiner lost between the
  // offer and the grown group (which does not yet know it) is seen through it.
  std::unique_ptr<Communicator> meeting;
  // The grown group while it forms. Declared out here so that a failure raises comm's stop before
  // it is torn down: its other members, seeing this one leave it, then know the grow failed here
  // rather than that this member died.
  std::unique_ptr<Communicator> grown;
  // Asked while a step's group forms: why this member stops waiting for it, and with what status.
  int gave_up = GRADSYNC_OK;
  auto why_give_up = [this, &stop, &gave_up, &meeting](WaitClock::time_point deadline) -> std::string {
    if (meeting) {
      if (std::string lost = meeting->lost_member(); !lost.empty()) {
        gave_up = GRADSYNC_E_REMOTE;
        return fmt::format("a joiner is lost: {}", lost);
      }
    }
    for (int r = 0; r < size_; ++r) {
      if (r != rank_ && !fabric_.alive(r)) {
        gave_up = GRADSYNC_E_REMOTE;
        return fmt::format("rank {} of {} died", r, group_name());
      }
    }
    const uint32_t s = stop.load(std::memory_order_seq_cst);
    if (stop_reason(s) != StopReason::None) {
      gave_up = GRADSYNC_E_ABORTED;
      return stop_reason(s) == StopReason::Aborted
                 ? fmt::format("{} was aborted (by rank {})", group_name(), stop_rank(s))
                 : fmt::format("{} was stopped by rank {}: its grow failed (its error says why)", group_name(),
                               stop_rank(s));
    }
    if (WaitClock::now() >= deadline) {
      gave_up = GRADSYNC_E_TIMEOUT;
      return fmt::format("the grow's deadline ({} ms) passed", timeout_.count());
    }
    return {};
  };
  auto watch = [this, &stop, &why_give_up](WaitClock::time_point deadline) {
    return [this, &stop, &why_give_up, deadline]() -> std::string {
      std::string why = why_give_up(deadline);
      // Stop the other members now, before this member leaves the group it was forming.
      if (!why.empty()) raise_stop(stop, StopReason::Failed, rank_);
      return why;
    };
  };
  // On any failure: the other members stop waiting for this one (they fail too, E_ABORTED naming
  // it, unless they failed on their own), and only then are the groups this member was forming
  // left; comm needs a reset, as after a failed collective.
  auto stop_others = [this, &stop, &c, &meeting, &grown] {
    raise_stop(stop, StopReason::Failed, rank_);
    notify(c.words().wake);
    grown.reset();
    meeting.reset();  // the joiners waiting with rank 0 see it leave the lobby
  };
  try {
    // 1. Agree: every member checks every member's call alike, so all reach one verdict. Rank 0's
    // nonce names the grown group.
    const int64_t call_nonce = static_cast<int64_t>(random_nonce());
    const std::vector<int64_t> all = agree_grow(group, group_name(), join_name, joiners, {&call_nonce, 1});
    // One deadline for admitting the joiners and forming the grown group, on every member: the
    // members other than rank 0 start forming while rank 0 still admits, so a deadline of its own
    // for each step would let rank 0 outwait them (or them give up on a rank 0 still in time).
    const auto admit_and_form_deadline = deadline_after(timeout_, WaitClock::now());
    const int64_t first_id = all[kGrowNext];
    const auto nonce = static_cast<uint64_t>(all[kGrowWords]);
    const int new_size = size_ + joiners;
    // 2. Admit: rank 0 meets the joiners in the lobby and tells them the offer.
    if (rank_ == 0) {
      Options lobby = group.group_options();
      lobby.name = join_name;
      lobby.rank = 0;
      lobby.size = joiners + 1;
      lobby.forming_abandoned = watch(admit_and_form_deadline);
      meeting = join_group(lobby);
      meeting->establish(lobby);
      int64_t offer[kOfferWords] = {};
      offer[kOldSize] = size_;
      offer[kFirstId] = first_id;
      offer[kNonce] = static_cast<int64_t>(nonce);
      offer[kTimeoutMs] = timeout_.count();
      offer[kCheckMismatch] = group.group_options().check_mismatch ? 1 : 0;
      offer[kDeterministic] = group.group_options().deterministic ? 1 : 0;
      meeting->broadcast(offer, kOfferWords, DType::I64, 0);
    }
    // 3. Form the grown group, 4. commit it.
    const auto formed_start = WaitClock::now();
    result.agree = formed_start - start;
    Options o = group.group_options();
    o.name = grown_name(join_name, nonce, first_id);
    o.rank = rank_;
    o.size = new_size;
    o.forming_abandoned = watch(admit_and_form_deadline);
    grown = join_group(o);
    grown->establish(o);
    grown->take_identity(group.member_id(), first_id + joiners);
    grown->barrier();
    result.form = WaitClock::now() - formed_start;
    result.comm = std::move(grown);
    result.old_size = size_;
    result.new_size = new_size;
    result.first_member_id = first_id;
    GS_LOG_INFO("grow of {}: rank {} is rank {} of {} in group '{}' ({} joiner(s) by '{}', member ids from {})",
                group_name(), rank_, rank_, new_size, o.name, joiners, join_name, first_id);
    return result;
  } catch (const Error& e) {
    // Raised by this member's watch when it gave up, or first by another member (or an abort).
    const uint32_t before = stop.load(std::memory_order_seq_cst);
    stop_others();
    if (gave_up != GRADSYNC_OK && e.status() == GRADSYNC_E_REMOTE) {
      throw Error(gave_up, fmt::format("grow of {}: rank {}: {}", group_name(), rank_, e.what()));
    }
    // A member that failed first (or an abort) also ends the others' steps in ways that look like
    // their own failures: a member leaving a forming group looks dead to it. Name the first cause.
    const StopReason first = stop_reason(before);
    if ((first == StopReason::Failed || first == StopReason::Aborted) && stop_rank(before) != rank_ &&
        (e.status() == GRADSYNC_E_REMOTE || e.status() == GRADSYNC_E_TIMEOUT)) {
      throw Error(GRADSYNC_E_ABORTED,
                  fmt::format("grow of {}: rank {}: rank {} {} first ({})", group_name(), rank_, stop_rank(before),
                              first == StopReason::Aborted ? "aborted the group" : "failed its grow", e.what()));
    }
    throw;
  } catch (...) {
    stop_others();
    throw;
  }
}

GrowResult Membership::join(const Options& options, JoinGroup join_group) {
  GS_REQUIRE(options.size >= 1 && options.size < kMaxLocalRanks, GRADSYNC_E_INVALID_ARG,
             "join: size (the joiners of this grow) is {}; it is 1 to {}", options.size, kMaxLocalRanks - 1);
  GS_REQUIRE(options.rank >= 0 && options.rank < options.size, GRADSYNC_E_OUT_OF_RANGE,
             "join: rank (this joiner's index) {} out of range [0, {})", options.rank, options.size);
  GrowResult result;
  const auto start = WaitClock::now();
  int64_t offer[kOfferWords] = {};
  // Kept until the grown group commits: the members' rank 0 (and the other joiners) are watched
  // through it while the grown group forms; rank 0 leaves it when the members' grow fails.
  Options lobby = options;
  lobby.rank = options.rank + 1;
  lobby.size = options.size + 1;
  lobby.forming_abandoned = nullptr;
  // The members' grow failing reaches a joiner as a peer that left one of its groups (rank 0 the
  // lobby, a member the grown group while it forms or commits): a call there reports that as
  // E_ABORTED, but nothing can abort or fail a joiner's groups but the members' failure, which
  // comm.h gives a joiner as E_REMOTE.
  auto members_failed = [&options](const Error& e) {
    return Error(GRADSYNC_E_REMOTE,
                 fmt::format("join '{}': the grow failed on the members' side: {}", options.name, e.what()));
  };
  const std::unique_ptr<Communicator> meeting = join_group(lobby);
  try {
    meeting->establish(lobby);
    meeting->broadcast(offer, kOfferWords, DType::I64, 0);
  } catch (const Error& e) {
    if (e.status() != GRADSYNC_E_ABORTED) throw;
    throw members_failed(e);
  }
  const int64_t old_size = offer[kOldSize], first_id = offer[kFirstId];
  // Read from another process: every field is checked before it sizes, names or times anything.
  // Any positive timeout is one the members could have (INT64_MAX is none; deadlines saturate).
  const bool flags_ok = (offer[kCheckMismatch] == 0 || offer[kCheckMismatch] == 1) &&
                        (offer[kDeterministic] == 0 || offer[kDeterministic] == 1);
  GS_REQUIRE(old_size >= 1 && old_size <= kMaxLocalRanks - options.size && first_id >= old_size &&
                 first_id <= std::numeric_limits<int64_t>::max() - kMaxLocalRanks && offer[kTimeoutMs] > 0 && flags_ok,
             GRADSYNC_E_CORRUPT,
             "join '{}': the offer read from the members' rank 0 is corrupt (group size {}, {} joiner(s), member ids "
             "from {}, timeout {} ms, flags {}/{}); a grown group holds at most {} ranks and member ids below {}",
             options.name, old_size, options.size, first_id, offer[kTimeoutMs], offer[kCheckMismatch],
             offer[kDeterministic], kMaxLocalRanks, std::numeric_limits<int64_t>::max() - kMaxLocalRanks);
  const auto formed_start = WaitClock::now();
  result.agree = formed_start - start;
  Options o = options;
  o.name = grown_name(options.name, static_cast<uint64_t>(offer[kNonce]), first_id);
  o.rank = static_cast<int32_t>(old_size) + options.rank;
  o.size = static_cast<int32_t>(old_size) + options.size;
  o.timeout = std::chrono::milliseconds(offer[kTimeoutMs]);
  o.check_mismatch = offer[kCheckMismatch] != 0;
  o.deterministic = offer[kDeterministic] != 0;
  std::string lost;
  o.forming_abandoned = [&meeting, &lost] { return lost = meeting->lost_member(); };
  std::unique_ptr<Communicator> grown;
  try {
    grown = join_group(o);
    grown->establish(o);
  } catch (const Error& e) {
    if (e.status() == GRADSYNC_E_ABORTED) throw members_failed(e);
    if (lost.empty() || e.status() != GRADSYNC_E_REMOTE) throw;
    throw Error(GRADSYNC_E_REMOTE,
                fmt::format("join '{}': the grow failed on the members' side ({}): {}", options.name, lost, e.what()));
  }
  grown->take_identity(first_id + options.rank, first_id + options.size);
  try {
    grown->barrier();
  } catch (const Error& e) {
    if (e.status() != GRADSYNC_E_ABORTED) throw;
    throw members_failed(e);
  }
  result.form = WaitClock::now() - formed_start;
  result.comm = std::move(grown);
  result.old_size = static_cast<int>(old_size);
  result.new_size = o.size;
  result.first_member_id = first_id;
  GS_LOG_INFO("join '{}': rank {} of {} in group '{}', member id {}", options.name, o.rank, o.size, o.name,
              first_id + options.rank);
  return result;
}

}  // namespace gradsync::comm
