// SPDX-License-Identifier: Apache-2.0
#pragma once
// The sparse gradient accumulator: a gradient table (rows x dim f32, in a file or anonymous
// memory) plus the set of rows touched since the last apply/zero. Many threads, and several
// processes mapping the same file, add row gradients concurrently; apply() then updates only the
// touched rows of a parameter table and zeroes exactly those.
//
// Everything shared between processes lives in the file's aux region (format below), so two
// processes that open one gradient file coordinate through the mapping itself:
// - striped mode: one 32-bit lock word per stripe, holding its holder's slot + 1 (0 = free). nlocks is
//   the largest power of two <= rows / rows_per_lock, and row r uses stripe
//   (r * 0x9E3779B97F4A7C15) >> (64 - log2 nlocks): a multiply instead of a division, and hot
//   neighbouring ids (Zipf-skewed embeddings) spread over different locks. A process that
//   opens the file claims a slot: an OFD lock on byte kHolderLockBase + slot of the file, which
//   the kernel drops when the process exits, however it exits. A waiter that spins long checks
//   that lock: a holder gone is taken over (its row may hold part of its add, so the file is then
//   marked torn, and reads of the sums fail until zero()); a holder alive but stuck (stopped)
//   makes the wait fail with E_TIMEOUT after kRowLockTimeout. No pid is involved, so zombies,
//   reused pids and other pid namespaces cannot fool it.
// - lock-free mode: each element is added with an atomic compare-and-swap on the mapped float.
// - touched set: one flag byte per row plus an append list. Whoever flips a row's flag from 0 to 1
//   (under the row's lock in striped mode, with an atomic exchange otherwise) owns appending it; a
//   batch appends its new rows with one fetch_add at its end, so tracking costs no locked
//   instruction per row in striped mode (a locked instruction drains the store buffer and would
//   serialise the row misses that prefetching overlaps). The flag is set BEFORE the gradient is
//   added, so a crash can leave a touched row with a zero gradient (harmless) but never a gradient
//   that apply would miss. The list is rebuilt from the flags whenever a process opens the file alone.
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include "optim/optim.hpp"
#include "table/table.hpp"

namespace gradsync::accumulator {

class Team;

enum class Concurrency : int32_t { Striped = 0, LockFree = 1, None = 2, Owner = 3 };
using OptimizerKind = optim::RowOptimizer;
using optim::default_eps;
using optim::optimizer_name;
using optim::state_width;

constexpr int64_t kDefaultRowsPerLock = 16;
// Owner mode: rows fall into at most this many partitions (one lock word each); a team of T owner
// threads owns partition p by p % T. Few enough that a batch is bucketed by partition cheaply,
// enough that 2..16 owners get even shares.
constexpr uint64_t kMaxOwnerPartitions = 64;
// Owner mode: batches this small are added by the calling thread under the partition locks (a
// hand-off to the team costs a wake-up, which a handful of rows does not repay).
constexpr size_t kHandOffRows = 256;
// Owner mode: after a batch found a partition held by another process (or at an open that found
// the file open elsewhere), this many batches go partition by partition (each lock held only while
// its rows are added).
constexpr unsigned kContendedBatches = 16;

const char* concurrency_name(Concurrency c) noexcept;

struct AccumSpec {
  std::string path;
  table::OpenMode mode = table::OpenMode::CreateOrOpen;
  int64_t rows = -1;  // -1: take it from the existing file
  int64_t dim = -1;
  int32_t concurrency = -1;    // -1: the mode of the processes that have the file open, else striped
  int64_t rows_per_lock = -1;  // -1: likewise, else kDefaultRowsPerLock
  int64_t threads = -1;        // owner mode: owners (the caller + threads - 1); -1: the CPUs this process may use
  table::FileAccess access;
};

struct OptimizerSpec {
  OptimizerKind kind = OptimizerKind::Sgd;
  float lr = 0.01f;
  float eps = 1e-10f;                 // added to sqrt(state) (row-wise Adagrad) or to sqrt(v) (Adam)
  double beta1 = 0.9, beta2 = 0.999;  // Adam
};

// The aux region of a gradient file, at aux_offset (all offsets relative to it, 64-byte aligned):
//   0          AuxHeader
//   64         touched count (uint64), alone in its cache line
//   128        lock words: rows x uint32 (only the first nlocks are used)
//   flags_off  touched flags: rows x uint8 (1 = touched)
//   list_off   touched list: rows x int64, entries [0, count) valid
struct AuxHeader {
  uint32_t magic;           // kAuxMagic
  uint32_t layout_version;  // 1
  int32_t concurrency;      // the mode every process that has the file open uses
  uint32_t reserved0;
  uint64_t rows_per_lock;
  uint64_t nlocks;
  uint64_t torn;  // stripe + 1 of a row lock taken over from a process that died holding it; 0: none
  uint64_t reserved[3];
};
static_assert(sizeof(AuxHeader) == 64);
constexpr uint32_t kAuxMagic = 0x58415347u;  // "GSAX"
// 2: lock words hold holder slots (1: pids).
constexpr uint32_t kAuxLayoutVersion = 2;
// Holder slot i is the OFD lock on this byte + i of the file: far past any file's end.
constexpr off_t kHolderLockBase = off_t{1} << 60;
// How long a row lock may be waited for before the add fails with E_TIMEOUT.
constexpr std::chrono::seconds kRowLockTimeout{5};
// How often a waiter for a row lock looks whether its holder is gone.
constexpr std::chrono::milliseconds kRowLockLiveness{1};

struct AuxLayout {
  uint64_t count_off = 64;
  uint64_t locks_off = 128;
  uint64_t flags_off = 0;
  uint64_t list_off = 0;
  uint64_t bytes = 0;
};
AuxLayout aux_layout(int64_t rows);
// The number of stripes: the largest power of two <= max(1, rows / rows_per_lock).
uint64_t lock_count(int64_t rows, uint64_t rows_per_lock);
// The lock words a mode uses: lock_count, capped at kMaxOwnerPartitions in owner mode.
uint64_t lock_count(Concurrency mode, int64_t rows, uint64_t rows_per_lock);

class Accumulator {
 public:
  static std::unique_ptr<Accumulator> open(const AccumSpec& spec);
  ~Accumulator();
  Accumulator(const Accumulator&) = delete;
  Accumulator& operator=(const Accumulator&) = delete;

  int64_t rows() const noexcept { return table_->rows(); }
  int64_t dim() const noexcept { return table_->dim(); }
  Concurrency concurrency() const noexcept { return mode_; }
  int64_t rows_per_lock() const noexcept { return rows_per_lock_; }
  // Owner mode: the owners of this handle, the calling thread included (0 in the other modes).
  int threads() const noexcept;
  table::Table& table() noexcept { return *table_; }
  // Row locks held right now, by any process (for tests that need a holder caught holding).
  uint64_t held_row_locks() const noexcept;
  // Owner mode: batches still to go partition by partition (for tests).
  unsigned contended_batches() const noexcept { return contended_.load(std::memory_order_relaxed); }

  // Thread-safe (and process-safe on a shared file) in the striped and lock-free modes.
  void add(int64_t row, const float* grad, size_t count);
  // Validates every id and the length before touching any row. Repeated ids are summed.
  void add_batch(const int64_t* rows, size_t n, const float* grads, size_t count);
  void get(int64_t row, float* out, size_t count);

  // These exclude adds of this process for their duration; across processes the caller makes
  // sure no other process adds meanwhile (e.g. after a barrier).
  void zero();
  uint64_t touched_count();
  // Copies the touched rows (in the order they were first touched) when capacity suffices and
  // returns how many it copied (entries a dead process left half-written are skipped); otherwise
  // returns how many there are at most.
  size_t touched(int64_t* out, size_t capacity);
  void apply(table::Table& params, const OptimizerSpec& opt, table::Table* state);
  void flush() { table_->flush(); }

 private:
  Accumulator();  // defined where OwnerScratch is complete (its vector's cleanup needs it)
  void attach_aux(const AccumSpec& spec);
  template <Concurrency M>
  void add_rows(const int64_t* rows, size_t n, const float* grads, const uint32_t* pos = nullptr);
  struct Pending;
  struct OwnerScratch;
  struct OwnerBatch;
  // Owner mode: owner w's share of a batch, each row added by one owner in position order: split
  // by chunks of positions when rows repeat little, by partitions when they repeat much (the
  // phases are described at the definition); rows of partitions another process held come last.
  void add_owned(OwnerBatch& b, unsigned w, unsigned owners);
  // Owner w's partitions' rows among positions pos[0..count) (0..count without pos), partition
  // by partition, each lock held only while its rows are added. Returns whether another process
  // held one.
  bool add_partitionwise(const int64_t* rows, const float* grads, const uint32_t* pos, size_t count, unsigned w,
                         unsigned owners);
  // Returns how many rows found no place in the list (a damaged shared count).
  size_t append_touched(const int64_t* rows, size_t n) noexcept;
  void claim_holder_slot();
  void lock_stripe(uint32_t* word);
  void lock_stripe_slow(uint32_t* word);
  // Takes the lock if it is free, at once; never waits.
  bool try_lock_stripe(uint32_t* word) noexcept;
  void unlock_stripe(uint32_t* word) noexcept;
  // Another process holds the lock (a hint: it may be free by now).
  bool held_elsewhere(uint32_t* word) const noexcept;
  // Error(E_CORRUPT) when a row lock was taken over from a dead process (AuxHeader::torn).
  void require_whole(const char* what) const;
  uint32_t* stripe_of(int64_t row) noexcept {
    // nlocks == 1 gives a shift of 64, which C++ leaves undefined: mask it to 0 words instead.
    const uint64_t h = static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ull;
    return locks_ + (nlocks_ == 1 ? 0 : h >> lock_shift_);
  }
  // The index of a row's lock word (owner mode: its partition).
  uint64_t partition_of(int64_t row) noexcept { return static_cast<uint64_t>(stripe_of(row) - locks_); }
  template <class RowFn>
  void for_each_touched(RowFn&& fn);
  template <class RowFn>
  uint64_t touched_range(uint64_t begin, uint64_t end, RowFn& fn);

  std::unique_ptr<table::Table> table_;
  Concurrency mode_ = Concurrency::Striped;
  int64_t rows_per_lock_ = kDefaultRowsPerLock;
  uint64_t nlocks_ = 1;
  unsigned lock_shift_ = 64;
  uint32_t holder_ = 1;  // this process's slot + 1 (1 for an anonymous accumulator)
  AuxHeader* aux_header_ = nullptr;
  uint64_t* count_ = nullptr;
  uint32_t* locks_ = nullptr;
  uint8_t* flags_ = nullptr;
  int64_t* list_ = nullptr;
  // Adds hold it shared; apply, zero and touched hold it exclusively, so within a process every
  // add lands either wholly before an apply (and is applied) or after it (and stays touched).
  std::shared_mutex phase_;
  int usable_cpus_ = 1;  // owner mode: the CPUs at open (owners spin at their barriers only when each has one)
  // Owner mode: the owner threads and their per-batch scratch (declared last: stopped first).
  std::vector<OwnerScratch> scratch_;
  std::atomic<unsigned> contended_{0};  // batches left to add partition by partition (kContendedBatches)
  std::unique_ptr<Team> team_;
};

}  // namespace gradsync::accumulator
