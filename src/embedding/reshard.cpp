// SPDX-License-Identifier: Apache-2.0
// Moving a live sharded embedding onto another communicator (gradsync_embedding_reshard): the
// members of a shrunk, grown or re-ruled group exchange the rows that change owner, each with its
// optimizer state, in an all-to-all-v of the values and one of the states; when an old rank's rows
// are gone, every row comes from the last checkpoint instead, or nothing changes. A shard in files
// is built under staging names beside the old one and renamed into place only once every rank has
// it filled and written back, so that a failure leaves the old files as they were.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "comm/types.hpp"
#include "common/durable.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "embedding/checkpoint.hpp"
#include "embedding/embedding.hpp"

namespace gradsync::embedding {

namespace {
const char* rule_name(int64_t s) { return s == static_cast<int64_t>(Sharding::Hash) ? "hash" : "contiguous"; }

// The rows an old rank owned, for a message: a range, or the hash rule's class and its size.
std::string rows_of(const Layout& old, int j) {
  if (old.sharding() == Sharding::Contiguous) {
    const Part p =
        partition(static_cast<uint64_t>(old.rows()), static_cast<uint64_t>(old.ranks()), static_cast<uint64_t>(j));
    return fmt::format("old rank {}'s rows [{}, {})", j, p.start, p.start + p.len);
  }
  return fmt::format("old rank {}'s {} rows (ids g with splitmix64(g) % {} == {})", j, old.owned(j).size(), old.ranks(),
                     j);
}
}  // namespace

ShardedTable::ReshardReport ShardedTable::reshard(comm::Communicator& next, bool on_next, std::optional<Sharding> rule,
                                                  const std::string& checkpoint) {
  const Sharding sharding = rule.value_or(options_.sharding);
  constexpr int64_t kUnknownRule = -2;
  const int np = next.size(), me = next.rank();
  const auto n = static_cast<size_t>(np);
  const Layout fresh_layout(options_.rows, np, sharding);
  // This rank's rows by new owner: what it sends if it turns out to be a member (a joiner's table,
  // made on next, holds nothing of the old group's and sends nothing).
  enum : size_t {
    kOldRank,
    kOldSize,
    kOldRule,
    kNewRule,
    kRows,
    kDim,
    kWidth,
    kConfig,
    kSteps,
    kOnNext,
    kHasDir,
    kReplicas,
    kMirrorsValid,
    kRing,
    kHead
  };
  const size_t width = kHead + n;
  std::vector<int64_t> all(n * width);
  int64_t* mine = &all[static_cast<size_t>(me) * width];
  mine[kOldRank] = rank_;
  mine[kOldSize] = layout_.ranks();
  mine[kOldRule] = static_cast<int64_t>(options_.sharding);
  mine[kNewRule] = rule ? static_cast<int64_t>(sharding) : kUnknownRule;
  mine[kRows] = options_.rows;
  mine[kDim] = options_.dim;
  mine[kWidth] = state_width();
  mine[kConfig] = config_word();
  mine[kSteps] = steps_;
  mine[kOnNext] = on_next ? 1 : 0;
  mine[kHasDir] = checkpoint.empty() ? 0 : 1;
  mine[kReplicas] = options_.replicas;
  mine[kMirrorsValid] = mirrors_valid_ ? 1 : 0;
  mine[kRing] = static_cast<int64_t>(ring_.fingerprint());
  for (int64_t g : owned_) ++mine[kHead + static_cast<size_t>(fresh_layout.owner(g))];
  if (np > 1) next.allgather(nullptr, all.data(), all.size(), DType::I64);
  auto word = [&](int r, size_t w) { return all[static_cast<size_t>(r) * width + w]; };

  // Every rank judges the same table, so all reach the same verdict and the same message.
  for (int r = 0; r < np; ++r) {
    GS_REQUIRE(word(r, kNewRule) != kUnknownRule, GRADSYNC_E_INVALID_ARG,
               "reshard: rank {} passed an unknown sharding (-1 keep, 0 contiguous, 1 hash)", r);
  }
  for (int r = 1; r < np; ++r) {
    GS_REQUIRE(
        word(r, kRows) == word(0, kRows) && word(r, kDim) == word(0, kDim) && word(r, kWidth) == word(0, kWidth) &&
            word(r, kConfig) == word(0, kConfig) && word(r, kReplicas) == word(0, kReplicas),
        GRADSYNC_E_MISMATCH,
        "reshard: rank {}'s table is {} x {} (or has another optimizer, learning rate, eps, betas or replicas) and "
        "rank 0's {} x {}",
        r, word(r, kRows), word(r, kDim), word(0, kRows), word(0, kDim));
    GS_REQUIRE(word(r, kNewRule) == word(0, kNewRule), GRADSYNC_E_MISMATCH,
               "reshard: rank {} asks for {} sharding, rank 0 for {}", r, rule_name(word(r, kNewRule)),
               rule_name(word(0, kNewRule)));
    GS_REQUIRE(word(r, kHasDir) == word(0, kHasDir), GRADSYNC_E_INVALID_ARG,
               "reshard: rank {} passes {} checkpoint directory, rank 0 {}", r, word(r, kHasDir) ? "a" : "no",
               word(0, kHasDir) ? "one" : "none");
  }
  // Joiners: tables made on next, beside members that bring theirs from an old group. When every
  // table is on next (a change of rule on the same group) every rank is a member.
  bool from_old = false;
  for (int r = 0; r < np; ++r) from_old = from_old || word(r, kOnNext) == 0;
  auto is_joiner = [&](int r) { return from_old && word(r, kOnNext) == 1; };
  int held_by = 0;
  while (held_by < np && is_joiner(held_by)) ++held_by;
  GS_REQUIRE(held_by < np, GRADSYNC_E_MISUSE, "reshard: no rank of the new group holds the table (all are joiners)");
  const int old_size = static_cast<int>(word(held_by, kOldSize));
  const Layout old_layout(options_.rows, old_size, static_cast<Sharding>(word(held_by, kOldRule)));
  std::vector<int> holder(static_cast<size_t>(old_size), -1);  // old rank -> its member's new rank
  for (int r = 0; r < np; ++r) {
    if (is_joiner(r)) continue;
    GS_REQUIRE(word(r, kOldSize) == old_size && word(r, kOldRule) == word(held_by, kOldRule), GRADSYNC_E_MISMATCH,
               "reshard: member {} was in a group of {} ({} sharding), member {} in one of {} ({} sharding)", r,
               word(r, kOldSize), rule_name(word(r, kOldRule)), held_by, old_size, rule_name(word(held_by, kOldRule)));
    const auto j = static_cast<size_t>(word(r, kOldRank));
    GS_REQUIRE(holder[j] < 0, GRADSYNC_E_MISMATCH, "reshard: members {} and {} both held old rank {}", holder[j], r, j);
    holder[j] = r;
  }
  ReshardReport report;
  std::vector<std::string> lost;
  for (int j = 0; j < old_size; ++j) {
    if (holder[static_cast<size_t>(j)] >= 0) continue;
    report.lost_old_ranks.push_back(j);
    lost.push_back(rows_of(old_layout, j));
  }
  // Members at different steps cannot move their rows as one table; after a loss they may be
  // (a rank whose last push failed alone), and the checkpoint then gives every row and the step.
  bool same_steps = true;
  for (int r = 0; r < np; ++r) same_steps = same_steps && (is_joiner(r) || word(r, kSteps) == word(held_by, kSteps));
  for (int r = 0; r < np; ++r) {
    GS_REQUIRE(!lost.empty() || is_joiner(r) || word(r, kSteps) == word(held_by, kSteps), GRADSYNC_E_MISMATCH,
               "reshard: member {} has applied {} pushes, member {} {}: they are at different steps", r,
               word(r, kSteps), held_by, word(held_by, kSteps));
  }
  const int64_t steps = word(held_by, kSteps);
  // A lost rank's rows live on in a mirror when one of the `replicas` old ranks after it on the
  // old group's ring survived with valid mirrors at the members' common step: that member supplies
  // them from its mirror supplier[j] (1 when old rank j was just behind it on the ring), and
  // nothing is lost. Members hold the old ring alike (the same group made it); joiners get it from
  // the first member (every rank sees the same words, so all or none take part in the broadcast).
  const int old_k = std::min(static_cast<int>(word(held_by, kReplicas)), old_size - 1);
  std::vector<int> supplier(static_cast<size_t>(old_size), 0);
  const std::vector<int> members = holder;  // the old ranks that are members (holder gains the lost ones')
  bool eligible = !lost.empty() && same_steps && old_k > 0, joiners = false;
  for (int r = 0; r < np; ++r) {
    joiners = joiners || is_joiner(r);
    eligible = eligible && (is_joiner(r) || word(r, kRing) == word(held_by, kRing));
  }
  const auto from_first_member = [&](int64_t* words, size_t count) {
    next.broadcast(words, count, DType::I64, held_by);
  };
  const Ring old_ring =
      eligible && joiners ? Ring::broadcast(from_first_member, ring_, old_size, me == held_by) : ring_;
  std::vector<std::string> uncovered;  // the lost rows no surviving replica holds
  std::vector<int> supplied_by = holder;
  for (int j : report.lost_old_ranks) {
    if (!eligible) break;
    int i = 1;
    while (i <= old_k) {
      const int h = members[static_cast<size_t>(old_ring.ahead(j, i))];
      if (h >= 0 && word(h, kMirrorsValid) == 1) break;
      ++i;
    }
    if (i > old_k) {
      uncovered.push_back(rows_of(old_layout, j));
      continue;
    }
    supplier[static_cast<size_t>(j)] = i;
    supplied_by[static_cast<size_t>(j)] = members[static_cast<size_t>(old_ring.ahead(j, i))];
  }
  if (eligible && uncovered.empty()) {
    lost.clear();
    holder = supplied_by;
    report.from_mirrors = true;
  } else if (eligible) {
    lost = uncovered;
  }

  // The new shard, filled before anything of the table changes: a failure leaves it as it was.
  // What a rank allocates (the shard, the rows it reads or the exchange's buffers) may fail on it
  // alone: each path agrees on that before any row moves, so its peers fail with it instead of
  // waiting for it.
  Storage fresh;
  const bool files = !options_.dir.empty();
  struct Unstage {  // the staging files of a reshard that did not get them into place
    std::string stem;
    ~Unstage() {
      if (!stem.empty())
        for (const char* ext : kShardFiles) ::unlink((stem + ext).c_str());
    }
  } unstage;
  if (files) unstage.stem = shard_stem(options_.dir, me, np) + kStaging;
  const auto d = static_cast<size_t>(options_.dim), sw = static_cast<size_t>(state_width());
  const size_t row_floats = d + sw;
  if (!lost.empty()) {
    // The lost rows' live state is gone, and the survivors' rows are ahead of any copy of them:
    // one consistent table exists only as of the last checkpoint, so every row comes from there.
    GS_REQUIRE(!checkpoint.empty(), GRADSYNC_E_LOST,
               "reshard: {} lived only on lost ranks{}; nothing was changed: pass the directory of the last "
               "checkpoint to restore every row from it (then replay the pushes since)",
               fmt::join(lost, ", "), old_k > 0 ? fmt::format(" (replicas = {})", old_k) : std::string());
    checkpoint::Shape shape;
    shape.rows = options_.rows;
    shape.dim = options_.dim;
    shape.state_width = state_width();
    shape.optimizer = static_cast<int32_t>(options_.optimizer);
    checkpoint::Staged staged;
    const Outcome read = capture([&] {
      fresh = build(me, fresh_layout, false, Place::Staging);
      staged = checkpoint::read_rows(checkpoint, shape, fresh.owned);
    });
    const uint64_t last = read.status == GRADSYNC_OK ? staged.manifest.layers.back().nonce : 0;
    const std::vector<int64_t> seen =
        agree_over(next, read.status, read.message, static_cast<int64_t>(last), staged.manifest.header.steps);
    for (size_t r = 1; r < seen.size() / 2; ++r) {
      GS_REQUIRE(seen[2 * r] == seen[0], GRADSYNC_E_MISMATCH,
                 "reshard: rank {} read another checkpoint than rank 0 in '{}' (was it being saved meanwhile?)", r,
                 checkpoint);
    }
    if (!fresh.owned.empty()) {
      std::memcpy(fresh.params->data(), staged.values.get(), fresh.owned.size() * d * sizeof(float));
      if (sw != 0) std::memcpy(fresh.state->data(), staged.state.data(), staged.state.size() * sizeof(float));
    }
    report.from_checkpoint = true;
    bases_[0] = Base{checkpoint, last};
    bases_[1] = Base{};
    steps_ = seen[1];
  } else {
    // Each member sends a new owner its rows for it in ascending id order (its shard's order), the
    // values of them all and then their states. The receiver knows which of its rows come from whom
    // (the old rule and the members' old ranks), so ids need not travel. Under the contiguous rule
    // on both sides the rows a member sends an owner are a run of its new shard too: the exchange
    // lands them in place, and a moved row is copied twice in all (packed, then received into its
    // row). Otherwise a source's rows interleave with others' in the new shard, and each goes from
    // the receive buffer to its row: one copy more.
    const bool member = !is_joiner(me);
    // A row this member holds: its own, or one of a mirror it supplies.
    auto held = [&](int64_t g, const float*& value, const float*& state) {
      const int o = old_layout.owner(g);
      const table::Table* values = params_.get();
      const table::Table* states = state_.get();
      int64_t k = 0;
      if (o == rank_) {
        k = local_of(g);
      } else {
        const Storage& m = mirrors_[static_cast<size_t>(ring_.distance(rank_, o) - 1)];
        k = local_in(m.owned, m.buckets, old_layout.sharding(), g);
        values = m.params.get();
        states = m.state.get();
      }
      value = values->row_ptr(k);
      state = sw != 0 ? states->row_ptr(k) : nullptr;
    };
    // What this member sends, in ascending id order: its rows, and the lost ranks' it supplies.
    std::vector<int64_t> supplied;
    const std::vector<int64_t>* sending_rows = &owned_;
    if (report.from_mirrors && member) {
      supplied = owned_;
      for (int j : report.lost_old_ranks) {
        if (holder[static_cast<size_t>(j)] != me) continue;
        const Storage& m = mirrors_[static_cast<size_t>(supplier[static_cast<size_t>(j)] - 1)];
        supplied.insert(supplied.end(), m.owned.begin(), m.owned.end());
      }
      std::sort(supplied.begin(), supplied.end());
      sending_rows = &supplied;
    }
    std::vector<uint64_t> counts(n * n, 0);
    if (report.from_mirrors) {  // the suppliers send more than their own rows: count again
      std::vector<int64_t> sends(n * n, 0);
      for (int64_t g : *sending_rows)
        if (member) ++sends[static_cast<size_t>(me) * n + static_cast<size_t>(fresh_layout.owner(g))];
      next.allgather(nullptr, sends.data(), sends.size(), DType::I64);
      for (size_t i = 0; i < n * n; ++i) counts[i] = i / n == i % n ? 0 : static_cast<uint64_t>(sends[i]);
    } else {
      for (int s = 0; s < np; ++s) {
        if (is_joiner(s)) continue;
        for (int t = 0; t < np; ++t)
          if (s != t)
            counts[static_cast<size_t>(s) * n + static_cast<size_t>(t)] = word(s, kHead + static_cast<size_t>(t));
      }
    }
    // In place: each member's rows for an owner are one run of the owner's new shard, which holds
    // only while every member sends just its own contiguous range.
    const bool in_place =
        old_layout.sharding() == Sharding::Contiguous && sharding == Sharding::Contiguous && !report.from_mirrors;
    // Where member s's rows for t begin: in s's send buffer, and in t's new shard (in place) or
    // receive buffer, in rows; every rank computes every part, as the exchange compares them.
    std::vector<uint64_t> send_at(n * n, 0), recv_at(n * n, 0);
    std::vector<uint64_t> sent(n, 0), received(n, 0);
    for (size_t s = 0; s < n; ++s) {
      for (size_t t = 0; t < n; ++t) {
        const uint64_t c = counts[s * n + t];
        if (c == 0) continue;
        send_at[s * n + t] = sent[s];
        recv_at[s * n + t] = received[t];
        if (in_place) {
          const Part was = partition(static_cast<uint64_t>(options_.rows), static_cast<uint64_t>(old_size),
                                     static_cast<uint64_t>(word(static_cast<int>(s), kOldRank)));
          const Part is = partition(static_cast<uint64_t>(options_.rows), n, t);
          recv_at[s * n + t] = std::max(was.start, is.start) - is.start;
        }
        sent[s] += c;
        received[t] += c;
      }
    }
    auto routes = [&](uint64_t w) {
      comm::Routes r(comm::Collective::Alltoall, -1, n);
      for (size_t i = 0; i < n * n; ++i) {
        r.count[i] = counts[i] * w;
        r.send_displ[i] = send_at[i] * w;
        r.recv_displ[i] = recv_at[i] * w;
      }
      return r;
    };
    const uint64_t sending = sent[static_cast<size_t>(me)], incoming = received[static_cast<size_t>(me)];
    // The send buffer in the group's memory when it has room, where shared-memory peers read it
    // directly; the receive buffers (when not in place) are this process's.
    struct GroupMemory {
      comm::Communicator& c;
      void* p = nullptr;
      ~GroupMemory() {
        try {
          if (p != nullptr) c.dealloc(p);
        } catch (...) {
        }
      }
    } group{next};
    std::vector<float> own_send, recv_values, recv_state;
    float* send = nullptr;
    const Outcome made = capture([&] {
      fresh = build(me, fresh_layout, false, Place::Staging);
      if (!in_place) {
        recv_values.resize(std::max<uint64_t>(incoming * d, 1));
        recv_state.resize(std::max<uint64_t>(incoming * sw, 1));
      }
      if (sending == 0) return;
      try {
        group.p = next.alloc(sending * row_floats * sizeof(float));
        send = static_cast<float*>(group.p);
      } catch (const Error&) {  // the group's memory is full: the exchange takes the copy path
        own_send.resize(sending * row_floats);
        send = own_send.data();
      }
    });
    agree_over(next, made.status, made.message, 0, 0);
    float* const send_state = send == nullptr ? nullptr : send + sending * d;
    if (member) {
      std::vector<uint64_t> at(send_at.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(me) * n),
                               send_at.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(me + 1) * n));
      for (const int64_t g : *sending_rows) {
        const auto t = static_cast<size_t>(fresh_layout.owner(g));
        if (t == static_cast<size_t>(me)) continue;
        const uint64_t k = at[t]++;
        const float *value = nullptr, *state = nullptr;
        held(g, value, state);
        std::memcpy(send + k * d, value, d * sizeof(float));
        if (sw != 0) std::memcpy(send_state + k * sw, state, sw * sizeof(float));
      }
    }
    if (np > 1) {
      next.exchange(send, in_place ? fresh.params->data() : recv_values.data(), routes(d), DType::F32);
      if (sw != 0)
        next.exchange(send_state, in_place ? fresh.state->data() : recv_state.data(), routes(sw), DType::F32);
    }
    // A member whose rows are the same keeps its tables: nothing arrived, and nothing is copied
    // (in files, the new shard's names differ, and its staging files are filled instead).
    const bool keeps = member && fresh.owned == owned_ && !files;
    std::vector<uint64_t> from(recv_at.begin(), recv_at.end());  // each source's next row, when not in place
    for (size_t l = 0; l < fresh.owned.size() && !keeps; ++l) {
      const int64_t g = fresh.owned[l];
      const auto s = static_cast<size_t>(holder[static_cast<size_t>(old_layout.owner(g))]);
      const float* value = nullptr;
      const float* state = nullptr;
      if (s == static_cast<size_t>(me)) {
        held(g, value, state);
      } else if (in_place) {
        continue;
      } else {
        const uint64_t k = from[s * n + static_cast<size_t>(me)]++;
        // Every rank derives the sources from the same words; a row from a source that sent fewer
        // would be another's row, so a disagreement must never pass unseen.
        GS_REQUIRE(k < recv_at[s * n + static_cast<size_t>(me)] + counts[s * n + static_cast<size_t>(me)],
                   GRADSYNC_E_INTERNAL, "reshard: rank {} takes row {} from rank {}, which sent it fewer rows", me, g,
                   s);
        value = recv_values.data() + k * d;
        state = recv_state.data() + k * sw;
      }
      std::memcpy(fresh.params->row_ptr(static_cast<int64_t>(l)), value, d * sizeof(float));
      if (sw != 0) std::memcpy(fresh.state->row_ptr(static_cast<int64_t>(l)), state, sw * sizeof(float));
    }
    if (member) params_->check_mapping();
    if (keeps) {
      fresh.params = std::move(params_);
      fresh.state = std::move(state_);
    }
    report.moved_rows = incoming;
    // The rows pushed since the last checkpoint are not tracked across the move: the next save is
    // a full one.
    bases_[0] = bases_[1] = Base{};
    steps_ = steps;
  }
  // The new layout's mirrors, from the new shards, before anything is renamed or adopted.
  std::vector<Storage> mirrors;
  const Ring fresh_ring(next.topology(), next.size());
  fill_mirrors(next, me, fresh_layout, fresh_ring, fresh.params->data(),
               fresh.state != nullptr ? fresh.state->data() : nullptr, mirrors);
  // Files: written back on every rank before any takes its new names.
  const Outcome written = capture([&] {
    if (!files) return;
    fresh.params->flush();
    if (fresh.state != nullptr) fresh.state->flush();
    fresh.accum->flush();
  });
  agree_over(next, written.status, written.message, 0, 0);
  if (files) {
    place_files(fresh, me, np);
    unstage.stem.clear();
    // The old shard's names: another member's new ones in a shared directory when the sizes are
    // equal (a rule change, whose same rank renamed over them); otherwise nobody's, removed (with
    // the lost ranks' by the new rank 0, should they share its directory) so that a later create
    // of the old layout does not reopen rows that moved on.
    auto remove = [&](int r) {
      for (const char* ext : kShardFiles) ::unlink((shard_stem(options_.dir, r, old_size) + ext).c_str());
    };
    if (old_size != np) {
      if (!is_joiner(me)) remove(rank_);
      if (me == 0)
        for (int j : report.lost_old_ranks) remove(j);
    }
    try {
      fsync_directory(options_.dir);
    } catch (const Error& e) {
      GS_LOG_WARN("reshard: {}", e.what());
    }
  }
  // Everything arrived: switch to the new group. The lookup and push buffers were the old group's
  // memory; when that is not next (which this thread holds), they stay with it until its end.
  if (on_next) {
    try {
      send_ids_.release();
      send_rows_.release();
    } catch (const Error&) {  // not a pointer of next's: leave it to the group's end
    }
  }
  send_ids_.forget();
  send_rows_.forget();
  comm_ = &next;
  rank_ = me;
  layout_ = fresh_layout;
  options_.sharding = sharding;
  adopt(std::move(fresh));
  mirrors_ = std::move(mirrors);
  mirrors_valid_ = true;
  ring_ = fresh_ring;
  return report;
}

void ShardedTable::place_files(Storage& fresh, int rank, int ranks) const {
  const std::string stem = shard_stem(options_.dir, rank, ranks);
  table::Table* const tables[] = {fresh.params.get(), fresh.state.get(), &fresh.accum->table()};
  for (size_t i = 0; i < std::size(tables); ++i) {
    if (tables[i] == nullptr) continue;
    const std::string from = stem + kStaging + kShardFiles[i], to = stem + kShardFiles[i];
    if (::rename(from.c_str(), to.c_str()) != 0) {
      GS_LOG_WARN("reshard: cannot rename '{}' to '{}' ({}): the shard keeps it under the first name", from, to,
                  errno_text(errno));
      continue;
    }
    tables[i]->renamed(to);
  }
}

}  // namespace gradsync::embedding
