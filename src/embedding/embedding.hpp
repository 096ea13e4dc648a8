// SPDX-License-Identifier: Apache-2.0
#pragma once
// An embedding table sharded row-wise over the ranks of a communicator (include/gradsync/embedding.h
// is the contract). Each rank's shard is the library's own storage: a parameter table, an
// accumulator in owner mode (which adds a batch's gradients to each row in position order, whatever
// its thread count) and, for row-wise Adagrad or Adam, a rows x state_width() state table. Local row l holds the l-th
// smallest global id this rank owns, so a shard's rows are in ascending global order, which is the
// order of a checkpoint's part.
//
// Exactness rests on one invariant: an owner adds the ids of a push in global batch order, one
// add_batch per sender in rank order (each sender's part in its own order; its own part from where
// it packed it, the others' from the exchange), and owner-mode add_batch calls enter one sequence in
// call order, so every row's sum has the order a single process gives the global batch. Rank 0's
// part may arrive summed per distinct id (ShardedTable::push says why that is the same sum).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "accumulator/accumulator.hpp"
#include "comm/communicator.hpp"
#include "table/table.hpp"

namespace gradsync::embedding {

enum class Sharding : int32_t { Contiguous = 0, Hash = 1 };

struct Options {
  int64_t rows = 0;
  int64_t dim = 0;
  Sharding sharding = Sharding::Contiguous;
  accumulator::OptimizerKind optimizer = accumulator::OptimizerKind::Sgd;
  float lr = 0.01f;
  float eps = 1e-10f;
  double beta1 = 0.9, beta2 = 0.999;  // Adam
  table::Init init = table::Init::Zeros;
  int threads = 1;
  uint64_t seed = 0;
  float lo = -0.5f, hi = 0.5f;
  // Each rank's rows and their optimizer state also live on the next `replicas` ranks of the
  // replica ring (capped at the group's size - 1), so that a reshard after losing them needs no
  // checkpoint.
  int replicas = 0;
  std::string dir;  // empty: anonymous memory
};

// Throws E_INVALID_ARG naming the first bad field.
void validate(const Options& o);

// Who owns what, for a world of `ranks`: a pure function of (rows, ranks, rule), used by the live
// table and by a load that reads parts written under another layout.
class Layout {
 public:
  Layout(int64_t rows, int ranks, Sharding sharding) noexcept : rows_(rows), ranks_(ranks), sharding_(sharding) {}
  int owner(int64_t id) const noexcept;
  // The ids rank r owns, ascending.
  std::vector<int64_t> owned(int r) const;
  // How many rows each rank owns.
  std::vector<uint64_t> counts() const;
  int64_t rows() const noexcept { return rows_; }
  int ranks() const noexcept { return ranks_; }
  Sharding sharding() const noexcept { return sharding_; }

 private:
  int64_t rows_;
  int ranks_;
  Sharding sharding_;
};

// Where rank `rank` of a `ranks`-rank layout keeps its shard in `dir`: this stem plus each of
// kShardFiles (include/gradsync/embedding.h names them).
std::string shard_stem(const std::string& dir, int rank, int ranks);
inline constexpr const char* kShardFiles[] = {".params", ".state", ".grad"};

// Routes of a plan's counts (counts[s * p + d]: items s sends d), each item carrying `width`
// elements: forward (sources to owners) or back. A rank's part for itself does not travel.
comm::Routes routes_of(const std::vector<uint64_t>& counts, uint64_t p, uint64_t width, bool back);
using Ring = comm::ReplicaRing;

// The routes of the replicas' exchanges (embedding.cpp): every owner's items (per_owner[o] of
// `width` elements, one run from the start of its send buffer) to its holders at distances first
// .. last on the ring; a holder receives them mirror after mirror, `incoming` elements in all for
// holder `me`.
comm::Routes mirror_routes(const std::vector<uint64_t>& per_owner, const Ring& ring, int first, int last,
                           uint64_t width, uint64_t me, uint64_t& incoming);

class ShardedTable {
 public:
  // Local: opens or creates this rank's shard; no communication.
  ShardedTable(comm::Communicator& comm, const Options& options);
  ~ShardedTable();
  ShardedTable(const ShardedTable&) = delete;
  ShardedTable& operator=(const ShardedTable&) = delete;

  int64_t rows() const noexcept { return options_.rows; }
  int64_t dim() const noexcept { return options_.dim; }
  int64_t local_rows() const noexcept { return static_cast<int64_t>(owned_.size()); }
  int64_t steps() const noexcept { return steps_; }
  const Layout& layout() const noexcept { return layout_; }
  const Options& options() const noexcept { return options_; }
  void set_lr(double lr);
  // Floats of optimizer state per row (accumulator::state_width): what a checkpoint or a move of
  // rows carries beside each row's values.
  int state_width() const noexcept {
    return static_cast<int>(accumulator::state_width(options_.optimizer, options_.dim));
  }

  // Collective calls.
  void lookup(const int64_t* ids, size_t n, float* out, size_t count);
  void push(const int64_t* ids, size_t n, const float* grads, size_t count);
  // incremental: only the rows pushed since the checkpoint in dir, as a layer on it: dir is where this
  // table last saved or loaded, or where it saved before that (two alternating generations).
  void save(const std::string& dir, bool incremental);
  void load(const std::string& dir);

  // What a reshard did.
  struct ReshardReport {
    uint64_t moved_rows = 0;       // rows this rank received from others (in-memory reshard)
    bool from_checkpoint = false;  // rows were lost, and every row came from the checkpoint
    bool from_mirrors = false;     // rows of lost ranks came from the replicas of them
    std::vector<int> lost_old_ranks;
  };
  // Collective over next (include/gradsync/embedding.h, gradsync_embedding_reshard, is the
  // contract): moves the table onto next under `sharding`, in memory when every old rank's rows
  // survive on a member (its own, or a mirror of a lost rank's), else from `checkpoint` (every
  // row; empty: E_LOST naming the rows).
  // on_next: the table already runs on next (a joiner's, or a change of rule in place); otherwise
  // its old communicator is not touched (it may have been freed). sharding empty: the caller passed
  // an unknown rule, judged in the call's one agreement so that every rank fails alike.
  ReshardReport reshard(comm::Communicator& next, bool on_next, std::optional<Sharding> sharding,
                        const std::string& checkpoint);

  // Gives the buffers of lookup and push in the communicator's memory back to it (call it
  // holding the communicator, which must still be alive; a table freed without it leaves them
  // to the communicator's end).
  void release_buffers();

  // This rank's rows in ascending global id order (capacity checked by the caller).
  void local_rows(int64_t* ids, float* values, float* state) const;

 private:
  struct Plan;
  // Where this rank's shard lives and what it holds, built apart from the table's so that a reshard
  // can fill a new one while the old one is read, and adopt it only once everything arrived.
  struct Bucket;
  struct Storage;
  // This rank's check of a call's arguments: GRADSYNC_OK, or the first problem's status and text.
  int check_call(int op, const int64_t* ids, size_t n, const void* buf, size_t count, std::string& problem) const;
  // The round every lookup and push starts with: each rank's verdict of check_call and its count
  // of the ids it routes (`routed`, n of them, counted only when its verdict is OK) for every
  // owner, allgathered; throws on every rank alike when any rank's check failed.
  Plan plan(int op, int status, const std::string& problem, const int64_t* routed, size_t n);
  // The distinct ids of ids[0, n) (all in range) into scratch_unique_, in order of first
  // appearance, and for each position the index of its id there into scratch_which_; returns
  // their number.
  size_t distinct(const int64_t* ids, size_t n);
  // The mirrors' part of a push (embedding.cpp says what it moves).
  const float* replicate(const Plan& pl, const float* own, const float* recv);
  // distinct, its failure to allocate turned into a verdict for plan (E_NOMEM and problem).
  int distinct_before_plan(const int64_t* ids, size_t n, size_t& u, std::string& problem);
  // The optimizer and its hyperparameters as one word, which ranks compare.
  int64_t config_word() const noexcept;
  // Position of a global id among this rank's rows (the id must be owned here).
  int64_t local_of(int64_t id) const noexcept { return local_in(owned_, buckets_, options_.sharding, id); }
  static int64_t local_in(const std::vector<int64_t>& owned, const std::vector<Bucket>& buckets, Sharding sharding,
                          int64_t id) noexcept;
  // Collective verdict of a step with a local outcome: throws the first failing rank's error on
  // every rank (naming it), or returns each rank's two payload words.
  std::vector<int64_t> agree(int status, const std::string& message, int64_t word0 = 0, int64_t word1 = 0);
  static std::vector<int64_t> agree_over(comm::Communicator& c, int status, const std::string& message, int64_t word0,
                                         int64_t word1);

  // Rank `rank`'s shard of `layout`: fresh tables, initialised from the seed when `init` (a reshard
  // fills them itself). In files, Staging creates them anew under the stem plus kStaging (a
  // reshard's, which renames them into place once filled: place_files). A Mirror, another rank's
  // replica, lives in this process's memory whatever the table's place.
  enum class Place { Shard, Staging, Mirror };
  Storage build(int rank, const Layout& layout, bool init, Place place = Place::Shard) const;
  void adopt(Storage&& s) noexcept;
  static constexpr const char* kStaging = ".resharding";
  // A reshard's new shard, written back, from its staging names to those of rank `rank` of
  // `ranks` (a name that cannot be renamed stays the shard's, with a warning).
  void place_files(Storage& fresh, int rank, int ranks) const;
  // Replicas held here under `layout`: min(replicas, ranks - 1). Mirror j - 1 holds the rows of
  // ring_.behind(this rank, j).
  int mirror_count(const Layout& layout) const noexcept { return std::min(options_.replicas, layout.ranks() - 1); }
  // Collective over c: every rank's rows (rank `rank` of `layout`: its `values` and `state`, row
  // after row) copied into the mirrors the next mirror_count ranks of `ring` hold, built afresh
  // into `mirrors` (this rank's, of the ranks behind it), which change only when every row arrived.
  void fill_mirrors(comm::Communicator& c, int rank, const Layout& layout, const Ring& ring, const float* values,
                    const float* state, std::vector<Storage>& mirrors) const;

  comm::Communicator* comm_;
  int rank_;  // in comm_, kept so that a reshard need not ask a communicator that may be gone
  Options options_;
  Layout layout_;
  std::vector<int64_t> owned_;  // ascending
  // Hash sharding: ids in buckets of 32; a bucket's first owned id is local row `base`, and bit j
  // of `mine` says whether this rank owns its j-th id, so an id's local row is base plus the
  // owned ids before it in its bucket: one small table (rows / 2 bytes), so a lookup costs one
  // table read and a popcount, not a search of owned_ with a cache miss per step.
  struct Bucket {
    int64_t base;
    uint32_t mine;
    uint32_t unused;
  };
  struct Storage {
    std::vector<int64_t> owned;
    std::vector<Bucket> buckets;
    std::unique_ptr<table::Table> params;
    std::unique_ptr<table::Table> state;
    std::unique_ptr<accumulator::Accumulator> accum;
    std::vector<uint8_t> dirty;
  };
  static constexpr unsigned kBucketShift = 5;
  std::vector<Bucket> buckets_;
  std::unique_ptr<table::Table> params_;
  std::unique_ptr<table::Table> state_;
  std::unique_ptr<accumulator::Accumulator> accum_;
  // The replicas of other ranks' shards this rank holds (mirror_count), which every push updates as
  // their owners update theirs. mirrors_valid_: they equal their owners' rows; false from the
  // creation of a table in files (an owner may have reopened its shard) until the next push
  // refills them, and when a push failed between the owners' update and theirs.
  std::vector<Storage> mirrors_;
  bool mirrors_valid_ = false;
  Ring ring_;  // of comm_, kept as layout_ is
  int64_t steps_ = 0;
  // Per local row, bit k: pushed since bases_[k], the checkpoint this table last saved or loaded (0)
  // and the one it saved before that, in another directory (1); an incremental save into a base's
  // directory writes the rows of its bit as a layer on it.
  std::vector<uint8_t> dirty_;
  // A send buffer of the exchanges, kept between calls and only grown: in the group's memory
  // (Communicator::alloc) when it has room, where shared-memory peers read it directly (one copy
  // instead of two through the staging chunks), else in this process's. The group's memory is the
  // communicator's, freed at its end at the latest: the destructor leaves it alone, since the
  // table may outlive the communicator; release() gives it back while the communicator is held.
  class SendBuffer {
   public:
    explicit SendBuffer(comm::Communicator*& comm) noexcept : comm_(comm) {}
    SendBuffer(const SendBuffer&) = delete;
    SendBuffer& operator=(const SendBuffer&) = delete;
    // Room for at least `bytes` (never NULL), 8-byte aligned.
    void* get(size_t bytes);
    void release();
    // Drops the buffer without giving it back (it stays the communicator's until its end): for a
    // reshard that leaves a communicator this thread does not hold.
    void forget() noexcept;

   private:
    comm::Communicator*& comm_;  // the table's: it follows a reshard
    void* group_ = nullptr;
    std::vector<uint64_t> own_;
    size_t bytes_ = 0;
  };
  // The buffers of lookup and push, kept between calls.
  SendBuffer send_ids_{comm_}, send_rows_{comm_};
  std::vector<int64_t> scratch_asked_;
  std::vector<int64_t> scratch_unique_;
  std::vector<uint32_t> scratch_which_;
  // distinct's open-addressing table: slot -> index into scratch_unique_ + 1 (0: empty).
  std::vector<uint32_t> scratch_slots_;
  std::vector<size_t> scratch_order_;
  std::vector<float> scratch_recv_;
  std::vector<float> scratch_forward_, scratch_mirrored_;  // replicate's
  struct Base {
    std::string dir;     // empty: none
    uint64_t nonce = 0;  // its top layer's
  };
  Base bases_[2];
};

}  // namespace gradsync::embedding
