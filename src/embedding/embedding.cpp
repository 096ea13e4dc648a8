// SPDX-License-Identifier: Apache-2.0
#include "embedding/embedding.hpp"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <new>
#include <system_error>

#include "comm/types.hpp"
#include "common/error.hpp"
#include "common/fnv.hpp"
#include "optim/optim.hpp"

namespace gradsync::embedding {

namespace {

// Fields of a rank's row of the plan round (int64 words): its verdict, what it believes the table
// is (ranks that disagree fail alike), what it is calling, then one count per owner, then the text
// of its error.
enum PlanField : size_t { kStatus, kRows, kDim, kSharding, kOp, kOptimizer, kReplicas, kRefill, kHead };
constexpr size_t kMessageWords = 32;  // 256 bytes of message, NUL-terminated
constexpr const char* kOpNames[] = {"", "lookup", "push"};

std::string message_of(const int64_t* words) {
  char text[kMessageWords * 8];
  std::memcpy(text, words, sizeof text);
  text[sizeof text - 1] = '\0';
  return text;
}

// v's storage with room for n elements (at least one, so that it is never NULL): the buffers of
// the calls are kept and only grow, so a steady run allocates (and faults in) nothing per call.
template <class T>
T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < std::max<size_t>(n, 1)) v.resize(std::max<size_t>(n, 1));
  return v.data();
}

// The accumulator's add, element by element in f32 (the order of a row's sum is what matters).
void add_row(float* __restrict to, const float* __restrict from, size_t d) noexcept {
  for (size_t j = 0; j < d; ++j) to[j] += from[j];
}

void put_message(int64_t* words, const std::string& message) {
  char text[kMessageWords * 8] = {};
  std::memcpy(text, message.data(), std::min(message.size(), sizeof text - 1));
  std::memcpy(words, text, sizeof text);
}

}  // namespace

struct ShardedTable::Plan {
  // counts[s * P + d]: ids rank s sends owner d.
  std::vector<uint64_t> counts;
  uint64_t ranks = 0;
  bool refill = false;  // some rank's mirrors or shard changed outside a push: refill every mirror
  uint64_t at(uint64_t s, uint64_t d) const noexcept { return counts[s * ranks + d]; }
};

void validate(const Options& o) {
  GS_REQUIRE(o.rows >= 1, GRADSYNC_E_INVALID_ARG, "rows must be >= 1, got {}", o.rows);
  GS_REQUIRE(o.dim >= 1 && o.dim <= (int64_t{1} << 24), GRADSYNC_E_INVALID_ARG, "dim must be in [1, 2^24], got {}",
             o.dim);
  GS_REQUIRE(o.rows <= (int64_t{1} << 48) / o.dim, GRADSYNC_E_INVALID_ARG, "{} x {} floats is too large a table",
             o.rows, o.dim);
  GS_REQUIRE(o.sharding == Sharding::Contiguous || o.sharding == Sharding::Hash, GRADSYNC_E_INVALID_ARG,
             "unknown sharding {} (0 contiguous, 1 hash)", static_cast<int32_t>(o.sharding));
  GS_REQUIRE(optim::finite_in_float(o.lr), GRADSYNC_E_INVALID_ARG, "learning rate must be finite, got {}", o.lr);
  GS_REQUIRE(o.optimizer == accumulator::OptimizerKind::Sgd || o.optimizer == accumulator::OptimizerKind::RowAdagrad ||
                 o.optimizer == accumulator::OptimizerKind::Adam,
             GRADSYNC_E_INVALID_ARG, "unknown optimizer {} (0 sgd, 1 row-wise Adagrad, 2 Adam)",
             static_cast<int32_t>(o.optimizer));
  GS_REQUIRE(std::isfinite(o.eps) && o.eps > 0.0f, GRADSYNC_E_INVALID_ARG, "eps must be finite and > 0, got {}", o.eps);
  GS_REQUIRE(o.beta1 >= 0.0 && o.beta1 < 1.0 && o.beta2 >= 0.0 && o.beta2 < 1.0, GRADSYNC_E_INVALID_ARG,
             "beta1 and beta2 must be in [0, 1), got ({}, {})", o.beta1, o.beta2);
  GS_REQUIRE(o.threads >= 1 && static_cast<uint64_t>(o.threads) <= accumulator::kMaxOwnerPartitions,
             GRADSYNC_E_INVALID_ARG, "threads must be in [1, {}], got {}", accumulator::kMaxOwnerPartitions, o.threads);
  GS_REQUIRE(o.init == table::Init::Zeros || o.init == table::Init::Uniform, GRADSYNC_E_INVALID_ARG,
             "unknown init {} (0 zeros, 1 uniform)", static_cast<int32_t>(o.init));
  GS_REQUIRE(std::isfinite(o.lo) && std::isfinite(o.hi) && o.lo <= o.hi, GRADSYNC_E_INVALID_ARG,
             "uniform init needs finite lo <= hi, got [{}, {}]", o.lo, o.hi);
  GS_REQUIRE(o.replicas >= 0 && o.replicas <= 64, GRADSYNC_E_INVALID_ARG, "replicas must be in [0, 64], got {}",
             o.replicas);
}

int Layout::owner(int64_t id) const noexcept {
  const auto g = static_cast<uint64_t>(id), p = static_cast<uint64_t>(ranks_);
  if (sharding_ == Sharding::Hash) return static_cast<int>(table::splitmix64(g) % p);
  // The inverse of the partition rule: the first rows % p parts hold one row more.
  const uint64_t n = static_cast<uint64_t>(rows_), base = n / p, extra = n % p;
  const uint64_t big = extra * (base + 1);
  return static_cast<int>(g < big ? g / (base + 1) : extra + (g - big) / base);
}

std::vector<uint64_t> Layout::counts() const {
  std::vector<uint64_t> n(static_cast<size_t>(ranks_), 0);
  if (sharding_ == Sharding::Contiguous) {
    for (int r = 0; r < ranks_; ++r)
      n[static_cast<size_t>(r)] =
          partition(static_cast<uint64_t>(rows_), static_cast<uint64_t>(ranks_), static_cast<uint64_t>(r)).len;
    return n;
  }
  for (int64_t g = 0; g < rows_; ++g) ++n[static_cast<size_t>(owner(g))];
  return n;
}

std::vector<int64_t> Layout::owned(int r) const {
  std::vector<int64_t> ids;
  if (sharding_ == Sharding::Contiguous) {
    const Part part = partition(static_cast<uint64_t>(rows_), static_cast<uint64_t>(ranks_), static_cast<uint64_t>(r));
    ids.resize(part.len);
    for (uint64_t i = 0; i < part.len; ++i) ids[i] = static_cast<int64_t>(part.start + i);
    return ids;
  }
  ids.reserve(static_cast<size_t>(rows_ / ranks_ + 16));
  for (int64_t g = 0; g < rows_; ++g)
    if (owner(g) == r) ids.push_back(g);
  return ids;
}

ShardedTable::ShardedTable(comm::Communicator& comm, const Options& options)
    : comm_(&comm), rank_(comm.rank()), options_(options), layout_(options.rows, comm.size(), options.sharding) {
  validate(options_);
  adopt(build(comm_->rank(), layout_, true));
  // The mirrors start as their owners' shards do when created, from the seed. In files some owner
  // may have reopened its shard instead, which its holders cannot know: the first push refills them.
  ring_ = Ring(comm.topology(), comm.size());
  for (int j = 1; j <= mirror_count(layout_); ++j)
    mirrors_.push_back(build(ring_.behind(rank_, j), layout_, true, Place::Mirror));
  mirrors_valid_ = options_.dir.empty();
}

std::string shard_stem(const std::string& dir, int rank, int ranks) {
  return fmt::format("{}/shard-{}-of-{}", dir, rank, ranks);
}

ShardedTable::Storage ShardedTable::build(int rank, const Layout& layout, bool init, Place place) const {
  Storage s;
  s.owned = layout.owned(rank);
  if (layout.sharding() == Sharding::Hash) {
    s.buckets.assign(static_cast<size_t>((options_.rows >> kBucketShift) + 1), Bucket{0, 0, 0});
    for (size_t l = s.owned.size(); l-- > 0;) {
      Bucket& bk = s.buckets[static_cast<size_t>(s.owned[l] >> kBucketShift)];
      bk.base = static_cast<int64_t>(l);  // the last written is the bucket's first owned id
      bk.mine |= uint32_t{1} << (s.owned[l] & ((int64_t{1} << kBucketShift) - 1));
    }
  }
  // A table has at least one row: an owner of none keeps one that no id ever reaches.
  const int64_t local = std::max<int64_t>(1, static_cast<int64_t>(s.owned.size()));
  const bool files = !options_.dir.empty() && place != Place::Mirror;
  const bool staging = place == Place::Staging;
  std::string stem;
  if (files) {
    std::error_code ec;
    std::filesystem::create_directories(options_.dir, ec);
    GS_REQUIRE(!ec, GRADSYNC_E_IO, "cannot create the directory '{}': {}", options_.dir, ec.message());
    stem = shard_stem(options_.dir, rank, layout.ranks());
    if (staging) {
      // What a reshard that failed on the way left (the rank's own names: nobody else's).
      stem += kStaging;
      for (const char* ext : kShardFiles) ::unlink((stem + ext).c_str());
    }
  }
  table::OpenSpec spec;
  spec.mode = !files ? table::OpenMode::Anonymous : staging ? table::OpenMode::Create : table::OpenMode::CreateOrOpen;
  spec.rows = local;
  spec.dim = options_.dim;
  spec.path = files ? stem + ".params" : "";
  s.params = table::Table::open(spec);
  if (init && s.params->created() && options_.init == table::Init::Uniform) {
    // Element j of global row g takes the value a whole rows x dim table filled from the seed
    // gives element g * dim + j: the values do not depend on the sharding.
    const auto d = static_cast<uint64_t>(options_.dim);
    for (size_t l = 0; l < s.owned.size(); ++l) {
      float* row = s.params->row_ptr(static_cast<int64_t>(l));
      const uint64_t base = static_cast<uint64_t>(s.owned[l]) * d;
      for (uint64_t j = 0; j < d; ++j) row[j] = table::uniform_at(options_.seed, base + j, options_.lo, options_.hi);
    }
  }
  if (state_width() != 0) {
    spec.dim = state_width();
    spec.path = files ? stem + ".state" : "";
    s.state = table::Table::open(spec);
  }
  accumulator::AccumSpec aspec;
  aspec.path = files ? stem + ".grad" : "";
  aspec.mode = spec.mode;
  aspec.rows = local;
  aspec.dim = options_.dim;
  aspec.concurrency = static_cast<int32_t>(accumulator::Concurrency::Owner);
  // A mirror adds its owner's batch as the owner does, on one thread: the sum does not depend on it.
  aspec.threads = place == Place::Mirror ? 1 : options_.threads;
  s.accum = accumulator::Accumulator::open(aspec);
  s.dirty.assign(s.owned.size(), 0);
  return s;
}

void ShardedTable::adopt(Storage&& s) noexcept {
  owned_ = std::move(s.owned);
  buckets_ = std::move(s.buckets);
  params_ = std::move(s.params);
  state_ = std::move(s.state);
  accum_ = std::move(s.accum);
  dirty_ = std::move(s.dirty);
}

ShardedTable::~ShardedTable() = default;

void ShardedTable::set_lr(double lr) {
  GS_REQUIRE(optim::finite_in_float(lr), GRADSYNC_E_INVALID_ARG, "learning rate must be finite, got {}", lr);
  options_.lr = static_cast<float>(lr);
}

int64_t ShardedTable::local_in(const std::vector<int64_t>& owned, const std::vector<Bucket>& buckets, Sharding sharding,
                               int64_t id) noexcept {
  if (sharding == Sharding::Contiguous) return owned.empty() ? 0 : id - owned.front();
  const Bucket& bk = buckets[static_cast<size_t>(id >> kBucketShift)];
  const uint32_t below = (uint32_t{1} << (id & ((int64_t{1} << kBucketShift) - 1))) - 1;
  return bk.base + std::popcount(bk.mine & below);
}

std::vector<int64_t> ShardedTable::agree(int status, const std::string& message, int64_t word0, int64_t word1) {
  return agree_over(*comm_, status, message, word0, word1);
}

std::vector<int64_t> ShardedTable::agree_over(comm::Communicator& c, int status, const std::string& message,
                                              int64_t word0, int64_t word1) {
  const auto p = static_cast<size_t>(c.size());
  const size_t width = 3 + kMessageWords;
  std::vector<int64_t> rows(p * width);
  int64_t* mine = &rows[static_cast<size_t>(c.rank()) * width];
  mine[0] = status;
  mine[1] = word0;
  mine[2] = word1;
  put_message(mine + 3, message);
  c.allgather(nullptr, rows.data(), rows.size(), DType::I64);
  for (size_t r = 0; r < p; ++r) {
    const int64_t* row = &rows[r * width];
    if (row[0] != GRADSYNC_OK)
      throw Error(static_cast<int>(row[0]), fmt::format("rank {}: {}", r, message_of(row + 3)));
  }
  std::vector<int64_t> words(2 * p);
  for (size_t r = 0; r < p; ++r) {
    words[2 * r] = rows[r * width + 1];
    words[2 * r + 1] = rows[r * width + 2];
  }
  return words;
}

int64_t ShardedTable::config_word() const noexcept {
  // The optimizer and its hyperparameters, as one word: a rank that updates its rows otherwise
  // would break the equality with one process as surely as a wrong id.
  const double hyper[4] = {options_.lr, options_.eps, options_.beta1, options_.beta2};
  return static_cast<int64_t>(fnv1a64(hyper, sizeof hyper, static_cast<uint64_t>(options_.optimizer)));
}

int ShardedTable::check_call(int op, const int64_t* ids, size_t n, const void* buf, size_t count,
                             std::string& problem) const {
  const auto d = static_cast<size_t>(options_.dim);
  if (n > 0 && ids == nullptr) {
    problem = fmt::format("{}: ids is NULL with n = {}", kOpNames[op], n);
    return GRADSYNC_E_INVALID_ARG;
  }
  if (n > 0 && buf == nullptr) {
    problem = fmt::format("{}: the {} buffer is NULL with n = {}", kOpNames[op], op == 1 ? "output" : "gradient", n);
    return GRADSYNC_E_INVALID_ARG;
  }
  if (n > SIZE_MAX / d || count != n * d) {
    problem = fmt::format("{}: count is {}, but {} ids x dim {} need {}", kOpNames[op], count, n, d,
                          n > SIZE_MAX / d ? std::string("more than fits") : std::to_string(n * d));
    return GRADSYNC_E_INVALID_ARG;
  }
  // distinct numbers positions in 32 bits.
  if (op == 1 && n > UINT32_MAX - 1) {
    problem = fmt::format("lookup: {} ids in one call, more than {}", n, UINT32_MAX - 1);
    return GRADSYNC_E_INVALID_ARG;
  }
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= options_.rows) {
      problem = fmt::format("{}: id {} at position {} is outside [0, {})", kOpNames[op], ids[i], i, options_.rows);
      return GRADSYNC_E_OUT_OF_RANGE;
    }
  }
  return GRADSYNC_OK;
}

size_t ShardedTable::distinct(const int64_t* ids, size_t n) {
  size_t cap = 16;
  while (cap < 2 * n) cap *= 2;  // at most half full: short probes
  const size_t mask = cap - 1;
  uint32_t* slots = grow(scratch_slots_, cap);
  std::fill(slots, slots + cap, 0u);
  int64_t* unique = grow(scratch_unique_, n);
  uint32_t* which = grow(scratch_which_, n);
  size_t u = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    size_t s = static_cast<size_t>(table::splitmix64(static_cast<uint64_t>(id))) & mask;
    while (slots[s] != 0 && unique[slots[s] - 1] != id) s = (s + 1) & mask;
    if (slots[s] == 0) {
      unique[u] = id;
      slots[s] = static_cast<uint32_t>(++u);
    }
    which[i] = slots[s] - 1;
  }
  return u;
}

// distinct's scratch grows with the call, before the plan round: a rank that cannot have it says
// so in that round, which fails every rank alike, rather than leave its peers waiting there.
int ShardedTable::distinct_before_plan(const int64_t* ids, size_t n, size_t& u, std::string& problem) {
  try {
    u = distinct(ids, n);
    return GRADSYNC_OK;
  } catch (const std::bad_alloc&) {
    u = 0;
    problem = fmt::format("no memory to merge the call's {} ids", n);
    return GRADSYNC_E_NOMEM;
  }
}

ShardedTable::Plan ShardedTable::plan(int op, int status, const std::string& problem, const int64_t* routed, size_t n) {
  const auto p = static_cast<size_t>(comm_->size());
  const size_t width = kHead + p + kMessageWords;
  std::vector<int64_t> rows(p * width);
  int64_t* mine = &rows[static_cast<size_t>(comm_->rank()) * width];
  mine[kRows] = options_.rows;
  mine[kDim] = options_.dim;
  mine[kSharding] = static_cast<int64_t>(options_.sharding);
  mine[kOp] = op;
  mine[kOptimizer] = config_word();
  mine[kReplicas] = options_.replicas;
  mine[kRefill] = op == 2 && mirror_count(layout_) > 0 && !mirrors_valid_ ? 1 : 0;
  // This rank's verdict travels with its counts per owner, so a bad id fails every rank in this
  // round, before any id or row moves.
  if (status == GRADSYNC_OK) {
    int64_t* counts = mine + kHead;
    for (size_t i = 0; i < n; ++i) ++counts[layout_.owner(routed[i])];
  }
  mine[kStatus] = status;
  put_message(mine + kHead + p, problem);
  comm_->allgather(nullptr, rows.data(), rows.size(), DType::I64);

  auto row = [&](size_t r) { return &rows[r * width]; };
  for (size_t r = 1; r < p; ++r) {
    GS_REQUIRE(row(r)[kOp] == row(0)[kOp], GRADSYNC_E_MISMATCH, "rank {} called {} but rank 0 called {}", r,
               kOpNames[row(r)[kOp] == 2 ? 2 : 1], kOpNames[row(0)[kOp] == 2 ? 2 : 1]);
    GS_REQUIRE(row(r)[kRows] == row(0)[kRows] && row(r)[kDim] == row(0)[kDim] && row(r)[kSharding] == row(0)[kSharding],
               GRADSYNC_E_MISMATCH, "rank {}'s table is {} x {} ({} sharding), rank 0's {} x {} ({} sharding)", r,
               row(r)[kRows], row(r)[kDim], row(r)[kSharding] == 0 ? "contiguous" : "hash", row(0)[kRows], row(0)[kDim],
               row(0)[kSharding] == 0 ? "contiguous" : "hash");
    GS_REQUIRE(row(r)[kOptimizer] == row(0)[kOptimizer], GRADSYNC_E_MISMATCH,
               "rank {}'s optimizer, learning rate, eps or betas differ from rank 0's", r);
    GS_REQUIRE(row(r)[kReplicas] == row(0)[kReplicas], GRADSYNC_E_MISMATCH,
               "rank {}'s table keeps {} replicas, rank 0's {}", r, row(r)[kReplicas], row(0)[kReplicas]);
  }
  for (size_t r = 0; r < p; ++r) {
    if (row(r)[kStatus] != GRADSYNC_OK)
      throw Error(static_cast<int>(row(r)[kStatus]), fmt::format("rank {}: {}", r, message_of(row(r) + kHead + p)));
  }
  Plan plan;
  plan.ranks = p;
  for (size_t r = 0; r < p; ++r) plan.refill = plan.refill || row(r)[kRefill] != 0;
  plan.counts.resize(p * p);
  for (size_t s = 0; s < p; ++s)
    for (size_t d2 = 0; d2 < p; ++d2) plan.counts[s * p + d2] = static_cast<uint64_t>(row(s)[kHead + d2]);
  return plan;
}

// A rank's part for itself does not travel (the caller handles it in place): the owners pack
// only what others send them, in sender order; a sender's buffer keeps room for its own part.
comm::Routes routes_of(const std::vector<uint64_t>& counts, uint64_t p, uint64_t width, bool back) {
  comm::Routes routes(comm::Collective::Alltoall, -1, p);
  std::vector<uint64_t> recv_at(p, 0);
  for (uint64_t s = 0; s < p; ++s) {
    uint64_t send_at = 0;
    for (uint64_t d = 0; d < p; ++d) {
      const uint64_t c = counts[s * p + d] * width;
      if (s == d) {
        send_at += c;
        continue;
      }
      const size_t i = back ? routes.at(d, s) : routes.at(s, d);
      routes.count[i] = c;
      if (back) {
        routes.send_displ[i] = recv_at[d];
        routes.recv_displ[i] = send_at;
      } else {
        routes.send_displ[i] = send_at;
        routes.recv_displ[i] = recv_at[d];
      }
      send_at += c;
      recv_at[d] += c;
    }
  }
  return routes;
}

namespace {

// A push carries each global id's bits in two floats of its part.
constexpr size_t kIdFloats = 2;

// Copies n rows of d floats, row k from src(k) to dst(k), fetching the sources ahead: they are
// scattered over the shard, and a miss at a time would leave the copy waiting on each.
template <class Src, class Dst>
void copy_rows(size_t n, size_t d, Src&& src, Dst&& dst) {
  constexpr size_t kAhead = 8;
  const size_t lines = (d * sizeof(float) + 63) / 64;
  for (size_t k = 0; k < n; ++k) {
    if (k + kAhead < n) {
      const char* p = reinterpret_cast<const char*>(src(k + kAhead));
      for (size_t c = 0; c < lines; ++c) __builtin_prefetch(p + 64 * c, 0, 0);
    }
    std::memcpy(dst(k), src(k), d * sizeof(float));
  }
}

}  // namespace

void ShardedTable::SendBuffer::release() {
  if (group_ != nullptr) comm_->dealloc(group_);
  group_ = nullptr;
  own_ = {};
  bytes_ = 0;
}

void ShardedTable::SendBuffer::forget() noexcept {
  group_ = nullptr;
  own_ = {};
  bytes_ = 0;
}

void ShardedTable::release_buffers() {
  send_ids_.release();
  send_rows_.release();
}

void* ShardedTable::SendBuffer::get(size_t bytes) {
  bytes = std::max<size_t>(bytes, 8);
  if (bytes <= bytes_) return group_ != nullptr ? group_ : static_cast<void*>(own_.data());
  release();
  const size_t want = bytes + bytes / 4;  // batches vary: room to spare, not a reallocation per call
  try {
    group_ = comm_->alloc(want);
  } catch (const Error&) {  // the group's memory is full: the exchange takes the copy path
    own_.resize((want + 7) / 8);
  }
  bytes_ = want;
  return group_ != nullptr ? group_ : static_cast<void*>(own_.data());
}

void ShardedTable::lookup(const int64_t* ids, size_t n, float* out, size_t count) {
  std::string problem;
  int status = check_call(1, ids, n, out, count, problem);
  // Only the distinct ids travel, and each row is read and sent once however often it is asked
  // (a lookup only reads, so this is exact); the answer is then spread in the caller's order.
  size_t u = 0;
  if (status == GRADSYNC_OK) status = distinct_before_plan(ids, n, u, problem);
  const int64_t* unique = scratch_unique_.data();
  const uint32_t* which = scratch_which_.data();
  const Plan pl = plan(1, status, problem, unique, u);
  const uint64_t p = pl.ranks, me = static_cast<uint64_t>(comm_->rank());
  const auto d = static_cast<size_t>(options_.dim);
  // Stable counting sort of the distinct ids by owner: each owner's keep their first order.
  std::vector<uint64_t> at(p, 0);
  for (uint64_t o = 1; o < p; ++o) at[o] = at[o - 1] + pl.at(me, o - 1);
  const uint64_t own_begin = at[me], own_end = own_begin + pl.at(me, me);
  size_t* slot = grow(scratch_order_, u);  // where distinct id j went among the sorted
  auto* send = static_cast<int64_t*>(send_ids_.get(u * sizeof(int64_t)));
  for (size_t j = 0; j < u; ++j) {
    const uint64_t k = at[static_cast<size_t>(layout_.owner(unique[j]))]++;
    slot[j] = k;
    send[k] = unique[j];
  }
  uint64_t incoming = 0;  // ids other ranks ask this one for
  for (uint64_t s = 0; s < p; ++s) incoming += s == me ? 0 : pl.at(s, me);
  int64_t* asked = grow(scratch_asked_, incoming);
  comm_->exchange(send, asked, routes_of(pl.counts, p, 1, false), DType::I64);

  auto* reply = static_cast<float*>(send_rows_.get(incoming * d * sizeof(float)));
  copy_rows(
      incoming, d, [&](size_t k) { return params_->row_ptr(local_of(asked[k])); },
      [&](size_t k) { return reply + k * d; });
  float* rows = grow(scratch_recv_, u * d);
  comm_->exchange(reply, rows, routes_of(pl.counts, p, d, true), DType::F32);
  // In the caller's order, so that the output is written in sequence.
  copy_rows(
      n, d,
      [&](size_t i) -> const float* {
        const uint64_t k = slot[which[i]];
        return k >= own_begin && k < own_end ? params_->row_ptr(local_of(ids[i])) : rows + k * d;
      },
      [&](size_t i) { return out + i * d; });
  params_->check_mapping();
}

void ShardedTable::push(const int64_t* ids, size_t n, const float* grads, size_t count) {
  std::string problem;
  int status = check_call(2, ids, n, grads, count, problem);
  // Rank 0 sends each distinct id once, with the sum of its gradients in its own order, starting
  // from zero: rank 0's contributions come first in every row's sum, which starts from zero, so
  // that partial sum is the very value the owner's sum reaches after them, and the owner's
  // 0 + partial gives it back bit for bit (a sum from +0 is never -0, and 0 + NaN keeps the NaN's
  // bits). Another rank's contributions follow some of another's, whose sum it does not know: it
  // sends each of its ids as they come.
  // (distinct numbers positions in 32 bits: a larger push goes as it comes.)
  const bool merge = status == GRADSYNC_OK && comm_->rank() == 0 && n <= UINT32_MAX - 1;
  size_t m = n;
  if (merge) status = distinct_before_plan(ids, n, m, problem);
  const int64_t* routed = merge ? scratch_unique_.data() : ids;
  const Plan pl = plan(2, status, problem, routed, m);
  const uint64_t p = pl.ranks, me = static_cast<uint64_t>(comm_->rank());
  if (pl.refill) {
    std::vector<Storage> fresh;
    fill_mirrors(*comm_, rank_, layout_, ring_, params_->data(), state_ != nullptr ? state_->data() : nullptr, fresh);
    mirrors_ = std::move(fresh);
    mirrors_valid_ = true;
  }
  const auto d = static_cast<size_t>(options_.dim);
  const size_t width = kIdFloats + d;
  // The part for owner o: its c ids (kIdFloats floats each), then their c gradients, each in the
  // caller's order; so an owner receives every sender's gradients contiguous, with no repacking.
  std::vector<uint64_t> base(p, 0), next(p, 0);
  for (uint64_t o = 1; o < p; ++o) base[o] = base[o - 1] + pl.at(me, o - 1) * width;
  auto* send = static_cast<float*>(send_rows_.get(m * width * sizeof(float)));
  size_t* sum_at = merge ? grow(scratch_order_, m) : nullptr;  // where distinct id j's sum is in send
  for (size_t j = 0; j < m; ++j) {
    const auto o = static_cast<size_t>(layout_.owner(routed[j]));
    const uint64_t k = next[o]++;
    float* part = send + base[o];
    std::memcpy(part + k * kIdFloats, &routed[j], sizeof(int64_t));
    float* g = part + pl.at(me, o) * kIdFloats + k * d;
    if (merge) {
      std::fill(g, g + d, 0.0f);
      sum_at[j] = static_cast<size_t>(g - send);
    } else {
      std::memcpy(g, grads + j * d, d * sizeof(float));
    }
  }
  if (merge) {
    const uint32_t* which = scratch_which_.data();
    for (size_t i = 0; i < n; ++i) add_row(send + sum_at[which[i]], grads + i * d, d);
  }
  uint64_t incoming = 0;  // ids other ranks push to this one
  for (uint64_t s = 0; s < p; ++s) incoming += s == me ? 0 : pl.at(s, me);
  float* recv = grow(scratch_recv_, incoming * width);
  comm_->exchange(send, recv, routes_of(pl.counts, p, width, false), DType::F32);
  // The mirrors get what their owners got before anyone applies anything, so that a push that
  // fails leaves owners and mirrors alike at the last step.
  const float* mirrored = replicate(pl, send + base[me], recv);
  mirrors_valid_ = false;  // until both updates are done

  // Sender after sender, each in its own order: the global batch's order. Owner-mode add_batch
  // calls enter one sequence in call order, so each row's sum keeps that order.
  uint64_t widest = 0;  // the largest sender's part, own part included
  for (uint64_t s = 0; s < p; ++s) widest = std::max(widest, pl.at(s, me));
  int64_t* local = grow(scratch_asked_, widest);
  uint64_t from = 0;
  for (uint64_t s = 0; s < p; ++s) {
    const uint64_t c = pl.at(s, me);
    if (c == 0) continue;
    // This rank's own part stayed where it packed it.
    const float* part = s == me ? send + base[me] : recv + from * width;
    for (uint64_t k = 0; k < c; ++k) {
      int64_t id;
      std::memcpy(&id, part + k * kIdFloats, sizeof id);
      local[k] = local_of(id);
      dirty_[static_cast<size_t>(local[k])] = 3;  // pushed since either base
    }
    accum_->add_batch(local, c, part + c * kIdFloats, c * d);
    if (s != me) from += c;
  }
  accumulator::OptimizerSpec opt;
  opt.kind = options_.optimizer;
  opt.lr = options_.lr;
  opt.eps = options_.eps;
  opt.beta1 = options_.beta1;
  opt.beta2 = options_.beta2;
  accum_->apply(*params_, opt, state_.get());
  // Mirror j took the batch of ring_.behind(rank, j) as one add_batch: the sequence its owner's
  // calls form.
  for (size_t j = 0; j < mirrors_.size(); ++j) {
    const auto o = static_cast<uint64_t>(ring_.behind(rank_, static_cast<int>(j) + 1));
    uint64_t c = 0;
    for (uint64_t s2 = 0; s2 < p; ++s2) c += pl.at(s2, o);
    if (c != 0) {
      int64_t* ids_here = grow(scratch_asked_, c);
      std::memcpy(ids_here, mirrored, c * sizeof(int64_t));
      Storage& mirror = mirrors_[j];
      mirror.accum->add_batch(ids_here, c, mirrored + c * kIdFloats, c * d);
      mirror.accum->apply(*mirror.params, opt, mirror.state.get());
    }
    mirrored += c * width;
  }
  ++steps_;
  mirrors_valid_ = true;
}

comm::Routes mirror_routes(const std::vector<uint64_t>& per_owner, const Ring& ring, int first, int last,
                           uint64_t width, uint64_t me, uint64_t& incoming) {
  const uint64_t p = per_owner.size();
  comm::Routes routes(comm::Collective::Alltoall, -1, p);
  for (uint64_t h = 0; h < p; ++h) {
    uint64_t at = 0;
    for (int j = first; j <= last; ++j) {
      const auto o = static_cast<uint64_t>(ring.behind(static_cast<int>(h), j));
      const size_t i = routes.at(o, h);
      routes.count[i] = per_owner[o] * width;
      routes.recv_displ[i] = at;
      at += per_owner[o] * width;
    }
    if (h == me) incoming = at;
  }
  return routes;
}

void ShardedTable::fill_mirrors(comm::Communicator& c, int rank, const Layout& layout, const Ring& ring,
                                const float* values, const float* state, std::vector<Storage>& mirrors) const {
  const int k = mirror_count(layout);
  std::vector<Storage> fresh;
  fresh.reserve(static_cast<size_t>(k));
  for (int j = 1; j <= k; ++j) fresh.push_back(build(ring.behind(rank, j), layout, false, Place::Mirror));
  // Mirror after mirror, the owners' values and then their states, straight from the owners'
  // tables into the mirrors' (no staging copy: a refill moves whole shards).
  const std::vector<uint64_t> count = k > 0 ? layout.counts() : std::vector<uint64_t>{};
  const auto d = static_cast<uint64_t>(options_.dim), sw = static_cast<uint64_t>(state_width());
  const auto me = static_cast<uint64_t>(rank);
  for (int j = 1; j <= k; ++j) {
    Storage& m = fresh[static_cast<size_t>(j - 1)];
    uint64_t incoming = 0;
    c.exchange(values, m.params->data(), mirror_routes(count, ring, j, j, d, me, incoming), DType::F32);
    if (sw != 0) c.exchange(state, m.state->data(), mirror_routes(count, ring, j, j, sw, me, incoming), DType::F32);
  }
  mirrors = std::move(fresh);
}

// Every owner's batch of a push (what it adds: each sender's part in rank order, its own from
// `own`, the others' from `recv`) to the ranks that hold its mirrors, as local rows and their
// gradients; returns where this rank received its mirrors' batches, mirror after mirror, each as
// its c local ids (kIdFloats floats each) then their c gradients.
const float* ShardedTable::replicate(const Plan& pl, const float* own, const float* recv) {
  const int k = mirror_count(layout_);
  if (k == 0) return nullptr;
  const uint64_t p = pl.ranks, me = static_cast<uint64_t>(rank_);
  const auto d = static_cast<size_t>(options_.dim);
  const size_t width = kIdFloats + d;
  std::vector<uint64_t> total(p, 0);  // what owner o adds
  for (uint64_t o = 0; o < p; ++o)
    for (uint64_t s = 0; s < p; ++s) total[o] += pl.at(s, o);
  const uint64_t c = total[me];
  float* forward = grow(scratch_forward_, c * width);
  uint64_t k_at = 0, from = 0;
  for (uint64_t s = 0; s < p; ++s) {
    const uint64_t n = pl.at(s, me);
    if (n == 0) continue;
    const float* part = s == me ? own : recv + from * width;
    for (uint64_t i = 0; i < n; ++i) {
      int64_t id;
      std::memcpy(&id, part + i * kIdFloats, sizeof id);
      const int64_t local = local_of(id);
      std::memcpy(forward + (k_at + i) * kIdFloats, &local, sizeof local);
    }
    std::memcpy(forward + c * kIdFloats + k_at * d, part + n * kIdFloats, n * d * sizeof(float));
    k_at += n;
    if (s != me) from += n;
  }
  uint64_t incoming = 0;
  const comm::Routes routes = mirror_routes(total, ring_, 1, k, width, me, incoming);
  float* got = grow(scratch_mirrored_, incoming);
  comm_->exchange(forward, got, routes, DType::F32);
  return got;
}

void ShardedTable::local_rows(int64_t* ids, float* values, float* state) const {
  const size_t n = owned_.size(), d = static_cast<size_t>(options_.dim);
  if (ids != nullptr) std::copy(owned_.begin(), owned_.end(), ids);
  if (values != nullptr && n > 0) std::memcpy(values, params_->data(), n * d * sizeof(float));
  if (state != nullptr) {
    if (state_)
      std::memcpy(state, state_->data(), n * static_cast<size_t>(state_width()) * sizeof(float));
    else
      std::fill(state, state + n, 0.0f);
  }
  params_->check_mapping();
}

}  // namespace gradsync::embedding
