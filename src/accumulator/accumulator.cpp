// SPDX-License-Identifier: Apache-2.0
#include "accumulator/accumulator.hpp"

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "accumulator/team.hpp"
#include "common/bounded_wait.hpp"
#include "common/cpu_relax.hpp"
#include "common/error.hpp"
#include "common/fork.hpp"
#include "common/liveness.hpp"
#include "common/log.hpp"
#include "common/ofd_lock.hpp"
#include "common/partition.hpp"
#include "common/wait.hpp"
#include "optim/optim.hpp"

#ifndef GS_ADD_AHEAD
#define GS_ADD_AHEAD 4
#endif

namespace gradsync::accumulator {

using table::Table;

const char* concurrency_name(Concurrency c) noexcept {
  switch (c) {
    case Concurrency::Striped: return "striped";
    case Concurrency::LockFree: return "lock-free";
    case Concurrency::None: return "none";
    case Concurrency::Owner: return "owner";
  }
  return "unknown";
}

namespace {

constexpr uint64_t round64(uint64_t n) { return (n + 63) / 64 * 64; }

template <class T>
std::atomic_ref<T> atomic(T& x) noexcept {
  return std::atomic_ref<T>(x);
}

void init_new_aux(void* aux, uint64_t, int64_t rows, void* user) {
  // A new file: zeros everywhere (fallocate / anonymous memory) except the header.
  const auto* spec = static_cast<const AuxHeader*>(user);
  (void)rows;
  std::memcpy(aux, spec, sizeof(AuxHeader));
}

}  // namespace

uint64_t lock_count(int64_t rows, uint64_t rows_per_lock) {
  const uint64_t want = std::max<uint64_t>(1, static_cast<uint64_t>(rows) / rows_per_lock);
  return uint64_t{1} << (63 - __builtin_clzll(want));  // a power of two <= want, so <= rows
}

uint64_t lock_count(Concurrency mode, int64_t rows, uint64_t rows_per_lock) {
  const uint64_t n = lock_count(rows, rows_per_lock);
  return mode == Concurrency::Owner ? std::min(n, kMaxOwnerPartitions) : n;
}

AuxLayout aux_layout(int64_t rows) {
  const auto r = static_cast<uint64_t>(rows);
  AuxLayout l;
  uint64_t locks = 0, list = 0;
  if (__builtin_mul_overflow(r, uint64_t{4}, &locks) || __builtin_mul_overflow(r, uint64_t{8}, &list))
    fail(GRADSYNC_E_INVALID_ARG, "{} rows are too many for an accumulator", rows);
  l.flags_off = l.locks_off + round64(locks);
  l.list_off = l.flags_off + round64(r);
  l.bytes = l.list_off + list;
  return l;
}

// An owner's share of one batch.
struct Accumulator::OwnerScratch {
  std::vector<uint64_t> bitmap;     // rows of this owner's chunk of positions (see conflict_bit)
  std::vector<uint32_t> idx;        // positions to add now, in order
  std::vector<uint32_t> conflicts;  // positions of this chunk whose row another chunk has too
  std::vector<uint32_t> later;      // positions of this chunk whose partition another process held
  std::vector<uint32_t> held;       // partition locks held
  std::vector<uint32_t> retry;      // phases 2 and 3: positions of this owner's partitions, in order
  // add_partitionwise: where each partition's positions start, where its next one goes, and the
  // partitions found busy.
  std::vector<uint32_t> bucket, next, deferred;
  bool other_process = false;  // this job found one of its partitions held by another process
};

std::unique_ptr<Accumulator> Accumulator::open(const AccumSpec& spec) {
  GS_REQUIRE(spec.concurrency == -1 || (spec.concurrency >= 0 && spec.concurrency <= 3), GRADSYNC_E_INVALID_ARG,
             "unknown concurrency mode {}", spec.concurrency);
  GS_REQUIRE(spec.rows_per_lock == -1 || spec.rows_per_lock >= 1, GRADSYNC_E_INVALID_ARG,
             "rows_per_lock must be at least 1, got {}", spec.rows_per_lock);
  GS_REQUIRE(spec.threads == -1 || (spec.threads >= 1 && spec.threads <= static_cast<int64_t>(kMaxOwnerPartitions)),
             GRADSYNC_E_INVALID_ARG, "threads must be in [1, {}], got {}", kMaxOwnerPartitions, spec.threads);
  std::unique_ptr<Accumulator> a(new Accumulator());
  table::OpenSpec ts;
  ts.path = spec.path;
  ts.mode = spec.mode;
  ts.rows = spec.rows;
  ts.dim = spec.dim;
  ts.access = spec.access;
  ts.kind = table::FileKind::Accumulator;
  ts.keep_exclusive = true;

  ts.aux_bytes_for_rows = [](int64_t rows) { return aux_layout(rows).bytes; };
  if (spec.mode != table::OpenMode::Open) {
    GS_REQUIRE(spec.rows >= 1, GRADSYNC_E_INVALID_ARG, "rows must be at least 1 to create an accumulator, got {}",
               spec.rows);
    aux_layout(spec.rows);  // rejects row counts whose state region would overflow
  }

  AuxHeader fresh{};
  fresh.magic = kAuxMagic;
  fresh.layout_version = kAuxLayoutVersion;
  fresh.concurrency = spec.concurrency == -1 ? static_cast<int32_t>(Concurrency::Striped) : spec.concurrency;
  fresh.rows_per_lock = static_cast<uint64_t>(spec.rows_per_lock == -1 ? kDefaultRowsPerLock : spec.rows_per_lock);
  fresh.nlocks =
      spec.rows >= 1 ? lock_count(static_cast<Concurrency>(fresh.concurrency), spec.rows, fresh.rows_per_lock) : 1;
  ts.init_aux = init_new_aux;
  ts.init_aux_user = &fresh;

  a->table_ = Table::open(ts);
  const AuxLayout layout = aux_layout(a->table_->rows());
  auto* base = static_cast<char*>(a->table_->aux());
  a->aux_header_ = reinterpret_cast<AuxHeader*>(base);
  a->count_ = reinterpret_cast<uint64_t*>(base + layout.count_off);
  a->locks_ = reinterpret_cast<uint32_t*>(base + layout.locks_off);
  a->flags_ = reinterpret_cast<uint8_t*>(base + layout.flags_off);
  a->list_ = reinterpret_cast<int64_t*>(base + layout.list_off);
  const bool shared = !a->table_->exclusive();  // another process has the file open
  a->attach_aux(spec);
  a->claim_holder_slot();
  if (a->mode_ == Concurrency::Owner) {
    a->usable_cpus_ = wait_detail::usable_cpus();
    const auto owners = static_cast<unsigned>(
        spec.threads != -1 ? spec.threads
                           : std::clamp<int64_t>(a->usable_cpus_, 1, static_cast<int64_t>(kMaxOwnerPartitions)));
    a->scratch_.resize(owners);
    // A partition lock taken must always find room in `held` (else it would never be released).
    for (auto& s : a->scratch_) {
      s.held.reserve(a->nlocks_);
      s.deferred.reserve(a->nlocks_);
    }
    // A file other processes have open: they are expected to add too.
    if (shared) a->contended_.store(kContendedBatches, std::memory_order_relaxed);
    if (owners > 1) {
      // One bit per row up to 2^23 rows (1 MiB an owner), hashed beyond.
      const uint64_t rows = static_cast<uint64_t>(a->rows());
      const uint64_t bits = std::clamp<uint64_t>(std::bit_ceil(rows), 64, uint64_t{1} << 23);
      for (auto& s : a->scratch_) s.bitmap.assign(bits / 64, 0);
    }
    a->team_ = std::make_unique<Team>(owners);
  }
  a->table_->check_mapping();
  return a;
}

void Accumulator::attach_aux(const AccumSpec& spec) {
  const int64_t rows = table_->rows();
  AuxHeader& h = *aux_header_;
  if (table_->exclusive()) {
    // Nobody else has the file open: lock words and the list may hold the remains of a process that
    // died mid-add. Reset the locks, rebuild the list from the flags, and (re)choose the mode.
    const AuxLayout l = aux_layout(rows);
    if (!table_->created()) {
      std::memset(locks_, 0, l.flags_off - l.locks_off);
      uint64_t n = 0;
      for (int64_t r = 0; r < rows; ++r) {
        if (flags_[r] == 0) continue;
        flags_[r] = 1;  // any non-zero byte means touched; normalise it
        list_[n++] = r;
      }
      *count_ = n;
      const bool valid = h.magic == kAuxMagic && h.layout_version == kAuxLayoutVersion && h.concurrency >= 0 &&
                         h.concurrency <= 3 && h.rows_per_lock >= 1;
      if (!valid) GS_LOG_WARN("'{}': accumulator state header was damaged; rebuilt it", table_->path());
      h.magic = kAuxMagic;
      h.layout_version = kAuxLayoutVersion;
      h.torn = 0;  // the locks are reset and the rows' sums kept: what a dead adder left is the caller's to judge
      if (spec.concurrency != -1 || !valid) h.concurrency = spec.concurrency == -1 ? 0 : spec.concurrency;
      if (spec.rows_per_lock != -1 || !valid)
        h.rows_per_lock = static_cast<uint64_t>(spec.rows_per_lock == -1 ? kDefaultRowsPerLock : spec.rows_per_lock);
      h.nlocks = lock_count(static_cast<Concurrency>(h.concurrency), rows, h.rows_per_lock);
    }
  } else {
    GS_REQUIRE(h.magic != kAuxMagic || h.layout_version == kAuxLayoutVersion, GRADSYNC_E_VERSION_MISMATCH,
               "'{}' is open in a process of another libgradsync version (state layout {}, this one {})",
               table_->path(), h.layout_version, kAuxLayoutVersion);
    GS_REQUIRE(h.magic == kAuxMagic && h.layout_version == kAuxLayoutVersion && h.concurrency >= 0 &&
                   h.concurrency <= 3 && h.rows_per_lock >= 1 &&
                   h.nlocks == lock_count(static_cast<Concurrency>(h.concurrency), rows, h.rows_per_lock),
               GRADSYNC_E_CORRUPT, "'{}': the accumulator state header is damaged", table_->path());
    const auto file_mode = static_cast<Concurrency>(h.concurrency);
    if ((spec.concurrency != -1 && spec.concurrency != h.concurrency) ||
        (spec.rows_per_lock != -1 && static_cast<uint64_t>(spec.rows_per_lock) != h.rows_per_lock &&
         (file_mode == Concurrency::Striped || file_mode == Concurrency::Owner))) {
      fail(GRADSYNC_E_MISMATCH,
           "'{}' is open in another process in mode {} ({} rows per lock); asked for {} ({} rows per lock): every "
           "process must use the same mode",
           table_->path(), concurrency_name(file_mode), h.rows_per_lock,
           spec.concurrency == -1 ? "the same mode" : concurrency_name(static_cast<Concurrency>(spec.concurrency)),
           spec.rows_per_lock == -1 ? std::string("default") : std::to_string(spec.rows_per_lock));
    }
  }
  mode_ = static_cast<Concurrency>(h.concurrency);
  rows_per_lock_ = static_cast<int64_t>(h.rows_per_lock);
  nlocks_ = h.nlocks;
  lock_shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(nlocks_));
  table_->release_exclusive();
}

// ---------------------------------------------------------------- striped locks

void Accumulator::claim_holder_slot() {
  const int fd = table_->fd();
  if (fd < 0 || (mode_ != Concurrency::Striped && mode_ != Concurrency::Owner))
    return;  // anonymous: this process alone
  for (uint32_t slot = 0; slot < (1u << 30); ++slot) {
    if (ofd_lock(fd, kHolderLockBase + static_cast<off_t>(slot), F_WRLCK)) {
      holder_ = slot + 1;
      return;
    }
  }
  fail(GRADSYNC_E_IO, "'{}': no free row-lock holder slot", table_->path());
}

uint64_t Accumulator::held_row_locks() const noexcept {
  uint64_t n = 0;
  for (uint64_t i = 0; i < nlocks_; ++i) n += atomic(locks_[i]).load(std::memory_order_relaxed) != 0 ? 1 : 0;
  return n;
}

void Accumulator::require_whole(const char* what) const {
  const uint64_t torn = atomic(aux_header_->torn).load(std::memory_order_acquire);
  GS_REQUIRE(torn == 0, GRADSYNC_E_CORRUPT,
             "'{}': cannot {}: a process died while adding to rows of row lock {}, which may hold part of its "
             "gradient; zero() the accumulator (or reopen it with no other process) to go on",
             table_->path(), what, torn - 1);
}

void Accumulator::lock_stripe(uint32_t* word) {
  uint32_t expected = 0;
  if (atomic(*word).compare_exchange_weak(expected, holder_, std::memory_order_acquire, std::memory_order_relaxed))
    return;
  lock_stripe_slow(word);
}

void Accumulator::lock_stripe_slow(uint32_t* word) {
  auto a = atomic(*word);
  uint32_t owner = 0;
  uint64_t spins = 0;
  auto free_or_until = [&](WaitClock::time_point until) {
    for (;;) {
      owner = a.load(std::memory_order_relaxed);
      if (owner == 0) {
        if (a.compare_exchange_weak(owner, holder_, std::memory_order_acquire, std::memory_order_relaxed)) {
          return WaitResult::Ready;
        }
        continue;
      }
      // On an oversubscribed machine the owner may be descheduled: yield rather than burn its slice.
      if ((++spins & 63) == 0) {
        sched_yield();
        if (WaitClock::now() >= until) return WaitResult::Timeout;
      } else {
        cpu_relax();
      }
    }
  };
  // Another process's slot whose OFD lock is gone: that process has exited while holding the row
  // lock. Waiting would hang every survivor forever, so the lock is taken over (and the file then
  // marked torn: the row may hold part of that process's add).
  auto taken_over = [&] {
    uint32_t gone = owner;
    return gone != holder_ && table_->fd() >= 0 &&
           peer_gone({0, table_->fd(), kHolderLockBase + static_cast<off_t>(gone - 1)}) &&
           a.compare_exchange_strong(gone, holder_, std::memory_order_acquire, std::memory_order_relaxed);
  };
  auto deadline = WaitClock::now() + kRowLockTimeout;
  switch (bounded_wait(free_or_until, wait_never, taken_over, wait_silent, wait_ends, deadline, kRowLockLiveness)) {
    case WaitEnd::Ready: return;
    case WaitEnd::PeerGone: {
      const uint64_t stripe = static_cast<uint64_t>(word - locks_);
      uint64_t none = 0;
      atomic(aux_header_->torn).compare_exchange_strong(none, stripe + 1, std::memory_order_acq_rel);
      GS_LOG_ERROR("'{}': took over row lock {} from a process that exited holding it; the file is marked torn",
                   table_->path(), stripe);
      return;
    }
    default: break;
  }
  fail(GRADSYNC_E_TIMEOUT,
       "'{}': a row lock was held for more than {} s by {} (stopped or stuck); the batch was added in part",
       table_->path(), kRowLockTimeout.count(),
       owner == holder_ ? std::string("another thread of this process") : fmt::format("holder slot {}", owner - 1));
}

bool Accumulator::try_lock_stripe(uint32_t* word) noexcept {
  uint32_t expected = 0;
  return atomic(*word).compare_exchange_strong(expected, holder_, std::memory_order_acquire, std::memory_order_relaxed);
}

void Accumulator::unlock_stripe(uint32_t* word) noexcept { atomic(*word).store(0, std::memory_order_release); }

bool Accumulator::held_elsewhere(uint32_t* word) const noexcept {
  const uint32_t holder = atomic(*word).load(std::memory_order_relaxed);
  return holder != 0 && holder != holder_;
}

Accumulator::Accumulator() = default;
Accumulator::~Accumulator() { team_.reset(); }

int Accumulator::threads() const noexcept { return team_ ? static_cast<int>(team_->size()) : 0; }

// ---------------------------------------------------------------- adds

// Rows whose flag this batch flipped, appended to the shared list in chunks: one fetch_add each.
struct Accumulator::Pending {
  static constexpr size_t kCap = 1024;
  int64_t rows[kCap];
  size_t n = 0;
};

size_t Accumulator::append_touched(const int64_t* rows, size_t n) noexcept {
  if (n == 0) return 0;
  const uint64_t slot = atomic(*count_).fetch_add(n, std::memory_order_acq_rel);
  // A row enters the list once per flag flip, so the count never exceeds rows unless a peer
  // damaged the shared count: never write past the list then (the caller reports it).
  const uint64_t limit = static_cast<uint64_t>(table_->rows());
  size_t lost = 0;
  for (size_t i = 0; i < n; ++i) {
    if (slot > limit || slot + i >= limit) {
      ++lost;
      continue;
    }
    atomic(list_[slot + i]).store(rows[i], std::memory_order_release);
  }
  return lost;
}

namespace {
// Wider vectors mean fewer stores per row waiting in the store buffer when the next row's lock
// (a locked instruction, which drains it) is taken; the library is built for the baseline ISA, so
// the widest the CPU has is picked at load time.
#if defined(__x86_64__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("avx512f", "avx2", "default"), noinline))
#endif
void add_row_plain(float* __restrict g, const float* __restrict s, size_t d) noexcept {
  for (size_t j = 0; j < d; ++j) g[j] += s[j];
}
}  // namespace

template <Concurrency M>
void Accumulator::add_rows(const int64_t* rows, size_t n, const float* grads, const uint32_t* pos) {
  const size_t d = static_cast<size_t>(dim());
  const size_t row_lines = std::min<size_t>((d * sizeof(float) + 63) / 64, 16);
  constexpr size_t kAhead = GS_ADD_AHEAD;
  Pending pending;
  size_t lost = 0;
  // In locals: the row kernel is an opaque call, after which members would be loaded again.
  float* const table = table_->data();
  uint8_t* const flags = flags_;
  // Entry k is position pos[k] of the batch (k itself without pos).
  auto at = [pos](size_t k) { return pos == nullptr ? k : static_cast<size_t>(pos[k]); };
  auto prefetch = [&](size_t k) {
    const size_t i = at(k);
    const int64_t r = rows[i];
    const char* p = reinterpret_cast<const char*>(table + static_cast<size_t>(r) * d);
    for (size_t q = 0; q < row_lines; ++q) __builtin_prefetch(p + 64 * q, 1, 3);
    __builtin_prefetch(&flags[r], 1, 3);
    if constexpr (M == Concurrency::Striped) __builtin_prefetch(stripe_of(r), 1, 3);
    // Positions with gaps (an owner's share): the hardware's stream prefetch does not see them.
    if (pos != nullptr) {
      const char* g = reinterpret_cast<const char*>(grads + i * d);
      for (size_t q = 0; q < row_lines; ++q) __builtin_prefetch(g + 64 * q, 0, 0);
    }
  };
  for (size_t k = 0; k < n && k < kAhead; ++k) prefetch(k);
  for (size_t k = 0; k < n; ++k) {
    if (k + kAhead < n) prefetch(k + kAhead);
    const size_t i = at(k);
    const int64_t r = rows[i];
    const float* src = grads + i * d;
    float* g = table + static_cast<size_t>(r) * d;
    auto flag = atomic(flags[r]);
    // The flag goes up before the add: a crash can never hide a gradient from apply.
    if constexpr (M == Concurrency::Striped) {
      uint32_t* w = stripe_of(r);
      try {
        lock_stripe(w);
      } catch (...) {
        append_touched(pending.rows, pending.n);  // the rows added so far stay listed
        throw;
      }
      if (flag.load(std::memory_order_relaxed) == 0) {  // the lock orders every writer of this flag
        flag.store(1, std::memory_order_relaxed);
        pending.rows[pending.n++] = r;
      }
      add_row_plain(g, src, d);
      unlock_stripe(w);
    } else {
      if constexpr (M == Concurrency::Owner) {
        // The partition's lock (held by the caller while it adds) orders every writer of
        // the flag: a plain store, no locked instruction on a line the other owners' flags share.
        if (flag.load(std::memory_order_relaxed) == 0) {
          flag.store(1, std::memory_order_relaxed);
          pending.rows[pending.n++] = r;
        }
      } else if (flag.load(std::memory_order_relaxed) == 0 && flag.exchange(1, std::memory_order_acq_rel) == 0) {
        pending.rows[pending.n++] = r;
      }
      if constexpr (M == Concurrency::LockFree) {
        for (size_t j = 0; j < d; ++j) atomic(g[j]).fetch_add(src[j], std::memory_order_relaxed);
      } else {
        add_row_plain(g, src, d);
      }
    }
    if (pending.n == Pending::kCap) {
      lost += append_touched(pending.rows, pending.n);
      pending.n = 0;
    }
  }
  lost += append_touched(pending.rows, pending.n);
  // The gradients are in and their rows flagged, so a lone opener's rebuild recovers them.
  GS_REQUIRE(lost == 0, GRADSYNC_E_CORRUPT,
             "'{}': the touched count in the shared state region exceeds its {} rows (damaged by another "
             "process); {} rows were added but not listed: reopen the file with no other process holding it, "
             "which rebuilds the list from the row flags",
             table_->path(), table_->rows(), lost);
}

// One batch's state shared by its owners for the length of the job (on the submitter's stack).
struct Accumulator::OwnerBatch {
  const int64_t* rows = nullptr;
  size_t n = 0;
  const float* grads = nullptr;
  // Per partition, written by its owner before the first barrier: held by this process, or
  // deferred (another process held it when tried).
  uint8_t held[kMaxOwnerPartitions] = {};
  std::atomic<uint32_t> arrived[3] = {0, 0, 0};
  std::atomic<size_t> repeats{0};   // positions whose row came earlier in the same chunk
  std::atomic<bool> failed{false};  // an owner failed before the adds: none adds anything
  bool partitionwise = false;       // the file is contended: add_partitionwise, for every owner
  WaitWord word;
};

namespace {
// The conflict bitmap's bit of a row: the row itself when the table has no more rows than bits
// (exact), else a hash (a collision only sends a row to the second phase: never wrong).
inline uint64_t conflict_bit(int64_t row, uint64_t bits) noexcept {
  const auto r = static_cast<uint64_t>(row);
  return r < bits ? r : (r * 0xD6E8FEB86659FD93ull) & (bits - 1);
}
}  // namespace

void Accumulator::add_owned(OwnerBatch& b, unsigned w, unsigned owners) {
  OwnerScratch& s = scratch_[w];
  const uint64_t parts = nlocks_;
  if (b.partitionwise) {
    if (add_partitionwise(b.rows, b.grads, nullptr, b.n, w, owners)) {
      contended_.store(kContendedBatches, std::memory_order_relaxed);
    }
    return;
  }
  const Part chunk = partition(b.n, owners, w);
  const size_t lo = chunk.start, hi = chunk.start + chunk.len;
  const uint64_t bits = static_cast<uint64_t>(s.bitmap.size()) * 64;
  s.held.clear();
  auto release = [&] {
    for (uint32_t p : s.held) unlock_stripe(&locks_[p]);
    s.held.clear();
  };
  // The owners work at once, so a waiting one spins while each has a CPU of its own: the
  // default (20 us, then a futex sleep) would put it to sleep at every barrier of a noisy run.
  WaitPolicy barrier_policy;
  if (owners <= static_cast<unsigned>(usable_cpus_)) {
    barrier_policy.spin = std::chrono::microseconds(300);
    barrier_policy.yield_for = std::chrono::microseconds(1000);
  }
  // Every owner passes every barrier, failed or not, so that none waits for ever for another.
  auto barrier = [&](int k) {
    b.arrived[k].fetch_add(1, std::memory_order_seq_cst);
    notify(b.word);
    wait_until(
        b.word, [&] { return b.arrived[k].load(std::memory_order_seq_cst) == owners; }, WaitClock::time_point::max(),
        nullptr, ~0u, barrier_policy);
  };
  std::exception_ptr error;
  // Before the first barrier: the rows of this owner's chunk of positions marked in its bitmap
  // (which cannot fail).
  if (owners > 1) {
    size_t repeats = 0;
    for (size_t i = lo; i < hi; ++i) {
      const uint64_t bit = conflict_bit(b.rows[i], bits);
      uint64_t& word = s.bitmap[bit >> 6];
      repeats += (word >> (bit & 63)) & 1;
      word |= uint64_t{1} << (bit & 63);
    }
    b.repeats.fetch_add(repeats, std::memory_order_seq_cst);
  }
  barrier(0);
  // Every owner is past the job before, so none waits for a partition lock any more: a lock
  // taken now is held at the barriers only while the other owners do work that never blocks. (A
  // lock held while an owner of the job before waited for another process's lock could close a
  // cycle with that process's owners.) This owner's partitions are tried; one that another
  // process holds is deferred. The lists are emptied first: if what follows fails, the other
  // owners find them empty rather than the job before's.
  s.conflicts.clear();
  s.later.clear();
  s.other_process = false;
  try {
    for (uint64_t p = w; p < parts; p += owners) {
      const bool got = try_lock_stripe(&locks_[p]);
      b.held[p] = got ? 1 : 0;
      if (got) {
        s.held.push_back(static_cast<uint32_t>(p));
      } else {
        s.other_process |= held_elsewhere(&locks_[p]);
      }
    }
  } catch (...) {
    error = std::current_exception();
    b.failed.store(true, std::memory_order_seq_cst);
  }
  barrier(1);
  const bool go = !b.failed.load(std::memory_order_seq_cst);
  // Phase 1. Few repeated rows (uniform ids): each owner adds the rows of its chunk that no other
  // chunk has, reading the chunk's gradients in order (an owner that reads every other row of a
  // shared batch runs ~30% slower: the cores' prefetchers fetch each other's rows). Many (skewed
  // ids, where most rows are in every chunk and phase 2 would get nearly all): each owner adds the
  // rows of its own partitions, from the whole batch. Either way each row is added by one owner
  // in position order, and all owners choose alike from the counts they published. Sorted out
  // branch-free: a position is written to every list and kept by the one whose count moves.
  if (go) {
    bool sorted = false;
    try {
      const bool by_partition = b.repeats.load(std::memory_order_seq_cst) * 8 > b.n;
      const size_t from = by_partition ? 0 : lo, to = by_partition ? b.n : hi;
      // Sized only now: until every owner is past the first barrier, one may still be reading
      // this owner's lists of the job before.
      s.idx.resize(to - from + 1);
      s.conflicts.resize(to - from + 1);
      s.later.resize(to - from + 1);
      uint32_t* direct = s.idx.data();
      uint32_t* shared = s.conflicts.data();
      uint32_t* later = s.later.data();
      size_t nd = 0, nc = 0, nl = 0;
      for (size_t i = from; i < to; ++i) {
        const int64_t r = b.rows[i];
        const uint64_t p = partition_of(r);
        const bool mine = b.held[p] != 0;
        bool elsewhere = false, skip = false;
        if (by_partition) {
          skip = p % owners != w;
        } else {
          const uint64_t bit = conflict_bit(r, bits);
          for (unsigned o = 0; o < owners; ++o)
            elsewhere |= o != w && ((scratch_[o].bitmap[bit >> 6] >> (bit & 63)) & 1) != 0;
        }
        direct[nd] = shared[nc] = later[nl] = static_cast<uint32_t>(i);
        nd += !skip && mine && !elsewhere;
        nc += !skip && mine && elsewhere;
        nl += !skip && !mine;
      }
      s.idx.resize(nd);
      s.conflicts.resize(nc);
      s.later.resize(nl);
      sorted = true;
      add_rows<Concurrency::Owner>(b.rows, nd, b.grads, s.idx.data());
    } catch (...) {
      // Lists sized but not sorted out yet hold no positions of this batch: the others must not take them.
      if (!sorted) {
        s.conflicts.clear();
        s.later.clear();
      }
      if (!error) error = std::current_exception();
    }
  }
  barrier(2);
  // After the last barrier nobody reads the bitmaps: this owner clears the bits it set.
  if (owners > 1)
    for (size_t i = lo; i < hi; ++i) s.bitmap[conflict_bit(b.rows[i], bits) >> 6] = 0;
  if (!go) {
    release();
    if (error) std::rethrow_exception(error);
    return;
  }
  try {
    // Phase 2: rows in more than one chunk, each added by its partition's owner, chunk after
    // chunk (so in position order).
    // The positions of this owner's partitions in every owner's list of one kind, chunk after chunk.
    auto gather = [&](std::vector<uint32_t> OwnerScratch::*list) {
      s.retry.clear();
      for (unsigned c = 0; c < owners; ++c)
        for (uint32_t i : scratch_[c].*list)
          if (partition_of(b.rows[i]) % owners == w) s.retry.push_back(i);
    };
    gather(&OwnerScratch::conflicts);
    add_rows<Concurrency::Owner>(b.rows, s.retry.size(), b.grads, s.retry.data());
    // Phase 3: rows of partitions another process held, from every chunk, in position order,
    // partition by partition as they come free. Every add to this owner's held partitions is done
    // by now (the other owners' at the barrier), so they are released first.
    release();
    gather(&OwnerScratch::later);
    // Another process adds to this file: the next batches go partition by partition. (A
    // partition this process held, for a small batch of another calling thread, says nothing.)
    if (!s.retry.empty() &&
        (add_partitionwise(b.rows, b.grads, s.retry.data(), s.retry.size(), w, owners) || s.other_process)) {
      contended_.store(kContendedBatches, std::memory_order_relaxed);
    }
  } catch (...) {
    release();
    if (!error) error = std::current_exception();
  }
  if (error) std::rethrow_exception(error);
}

// Owner w adds the rows of its partitions among `count` positions (pos[0..count), or 0..count
// without pos) partition by partition, each partition held only while its rows are added, so that
// the owners of other processes add to the others meanwhile. (Holding every partition it could take
// for the length of a batch made two such processes take turns, batch by batch.) No barrier is
// needed: each row is still added by its partition's owner, in position order, after the batches
// before. The partitions are visited from a place that depends on the holder slot, so that
// processes start apart; one another process holds is waited for at the end, holding nothing: no
// deadlock with the owners of other processes. Returns whether another process held one.
bool Accumulator::add_partitionwise(const int64_t* rows, const float* grads, const uint32_t* pos, size_t count,
                                    unsigned w, unsigned owners) {
  OwnerScratch& s = scratch_[w];
  const uint64_t parts = nlocks_;
  auto at = [pos](size_t k) { return pos == nullptr ? static_cast<uint32_t>(k) : pos[k]; };
  // This owner's positions sorted by partition, stably: each row's positions stay in order.
  s.bucket.assign(parts + 1, 0);
  for (size_t k = 0; k < count; ++k) {
    const uint64_t p = partition_of(rows[at(k)]);
    s.bucket[p + 1] += p % owners == w ? 1 : 0;
  }
  for (uint64_t p = 0; p < parts; ++p) s.bucket[p + 1] += s.bucket[p];
  s.idx.resize(s.bucket[parts]);
  s.next.assign(s.bucket.begin(), s.bucket.end() - 1);
  for (size_t k = 0; k < count; ++k) {
    const uint64_t p = partition_of(rows[at(k)]);
    if (p % owners == w) s.idx[s.next[p]++] = at(k);
  }
  // A failed add (a damaged shared count: its rows are added, not all listed) does not stop the
  // others; the first error is rethrown once every partition is done.
  std::exception_ptr error;
  auto add_partition = [&](uint64_t p) {
    try {
      add_rows<Concurrency::Owner>(rows, s.bucket[p + 1] - s.bucket[p], grads, s.idx.data() + s.bucket[p]);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    unlock_stripe(&locks_[p]);
  };
  s.deferred.clear();
  bool other_process = false;
  // The start: the holder slot hashed onto this owner's partitions (w, w + owners, ...), so that
  // processes start apart.
  const uint64_t mine = w < parts ? (parts - w + owners - 1) / owners : 0;  // owners may outnumber partitions
  const uint64_t first = mine > 0 ? partition_of(holder_ - 1) % mine : 0;
  for (uint64_t k = 0; k < mine; ++k) {
    const uint64_t p = w + (first + k) % mine * owners;
    if (s.bucket[p + 1] == s.bucket[p]) continue;
    if (try_lock_stripe(&locks_[p])) {
      add_partition(p);
    } else {
      s.deferred.push_back(static_cast<uint32_t>(p));
      other_process |= held_elsewhere(&locks_[p]);
    }
  }
  // The busy ones: any that came free is taken first; only when none has, one is waited for.
  while (!s.deferred.empty()) {
    bool took = false;
    for (size_t k = 0; k < s.deferred.size();) {
      if (try_lock_stripe(&locks_[s.deferred[k]])) {
        add_partition(s.deferred[k]);
        s.deferred[k] = s.deferred.back();
        s.deferred.pop_back();
        took = true;
      } else {
        ++k;
      }
    }
    if (took || s.deferred.empty()) continue;
    try {
      lock_stripe(&locks_[s.deferred.back()]);  // holding nothing
    } catch (...) {
      // A holder stuck past the timeout: the partitions left are not added; the first error wins.
      if (!error) error = std::current_exception();
      break;
    }
    add_partition(s.deferred.back());
    s.deferred.pop_back();
  }
  if (error) std::rethrow_exception(error);
  return other_process;
}

void Accumulator::add(int64_t row, const float* grad, size_t count) { add_batch(&row, 1, grad, count); }

void Accumulator::add_batch(const int64_t* rows, size_t n, const float* grads, size_t count) {
  GS_REQUIRE(n == 0 || grads != nullptr, GRADSYNC_E_INVALID_ARG, "gradients are NULL");
  // The count first: n may be absurd, and the ids must not be read past what count vouches for.
  table_->check_count(count, n, "the gradient");
  table_->check_rows(rows, n);
  if (n == 0) return;
  table_->check_mapping();
  std::shared_lock phase(phase_);
  switch (mode_) {
    case Concurrency::Striped: add_rows<Concurrency::Striped>(rows, n, grads); break;
    case Concurrency::LockFree: add_rows<Concurrency::LockFree>(rows, n, grads); break;
    case Concurrency::None: add_rows<Concurrency::None>(rows, n, grads); break;
    case Concurrency::Owner: {
      if (n < kHandOffRows) {
        // Under the same partition locks as the owners: exact, and in a single caller's order.
        add_rows<Concurrency::Striped>(rows, n, grads);
        break;
      }
      // Handed to the owners in chunks (positions fit 32 bits), each a job of the sequence.
      constexpr size_t kChunk = size_t{1} << 22;
      for (size_t off = 0; off < n; off += kChunk) {
        struct Batch {
          Accumulator* self;
          OwnerBatch b;
        } batch;
        batch.self = this;
        batch.b.rows = rows + off;
        batch.b.n = std::min(kChunk, n - off);
        batch.b.grads = grads + off * static_cast<size_t>(dim());
        // One choice for all the owners of a job (the other way needs all of them at its barriers).
        unsigned left = contended_.load(std::memory_order_relaxed);
        while (left > 0 && !contended_.compare_exchange_weak(left, left - 1, std::memory_order_relaxed)) {
        }
        batch.b.partitionwise = left > 0;
        team_->run(
            [](void* ctx, unsigned w, unsigned owners) {
              auto& job = *static_cast<Batch*>(ctx);
              job.self->add_owned(job.b, w, owners);
            },
            &batch);
      }
      break;
    }
  }
  table_->check_mapping();  // the file shrank during the add: its gradients did not reach the file
}

void Accumulator::get(int64_t row, float* out, size_t count) {
  GS_REQUIRE(out != nullptr, GRADSYNC_E_INVALID_ARG, "output buffer is NULL");
  table_->check_row(row);
  table_->check_count(count, 1, "the output buffer");
  table_->check_mapping();
  std::shared_lock phase(phase_);
  require_whole("read a row");
  float* g = table_->row_ptr(row);
  const size_t d = count;
  switch (mode_) {
    case Concurrency::Striped:
    case Concurrency::Owner: {
      uint32_t* w = stripe_of(row);
      lock_stripe(w);
      std::memcpy(out, g, d * sizeof(float));
      unlock_stripe(w);
      break;
    }
    case Concurrency::LockFree:
      for (size_t j = 0; j < d; ++j) out[j] = atomic(g[j]).load(std::memory_order_relaxed);
      break;
    case Concurrency::None: std::memcpy(out, g, d * sizeof(float)); break;
  }
  table_->check_mapping();
}

// ---------------------------------------------------------------- whole-set operations

template <class RowFn>
uint64_t Accumulator::touched_range(uint64_t begin, uint64_t end, RowFn& fn) {
  const uint64_t rows = static_cast<uint64_t>(table_->rows());
  const size_t row_lines = std::min<size_t>((static_cast<size_t>(dim()) * sizeof(float) + 63) / 64, 16);
  constexpr uint64_t kAhead = 4;
  uint64_t stale = 0;
  for (uint64_t i = begin; i < end; ++i) {
    if (i + kAhead < end) {
      const auto ahead = static_cast<uint64_t>(list_[i + kAhead]);
      if (ahead < rows) {
        const char* p = reinterpret_cast<const char*>(table_->row_ptr(static_cast<int64_t>(ahead)));
        for (size_t k = 0; k < row_lines; ++k) __builtin_prefetch(p + 64 * k, 1, 3);
        fn.prefetch(static_cast<int64_t>(ahead));
      }
    }
    const auto r = static_cast<uint64_t>(atomic(list_[i]).load(std::memory_order_acquire));
    // An entry that is out of range or whose flag is down is the remains of a process that died
    // mid-append; the next exclusive open rebuilds the list.
    if (r >= rows || atomic(flags_[r]).load(std::memory_order_relaxed) == 0) {
      ++stale;
      continue;
    }
    fn(static_cast<int64_t>(r));
    atomic(flags_[r]).store(0, std::memory_order_release);
  }
  return stale;
}

template <class RowFn>
void Accumulator::for_each_touched(RowFn&& fn) {
  const uint64_t n =
      std::min<uint64_t>(atomic(*count_).load(std::memory_order_acquire), static_cast<uint64_t>(table_->rows()));
  uint64_t stale = 0;
  // Owner mode: the owners split the list (each row is listed once, so their rows are disjoint,
  // and each row's update depends on that row alone: the result does not depend on the split).
  constexpr uint64_t kSplitFrom = 1024;
  if (team_ && n >= kSplitFrom) {
    using F = std::remove_reference_t<RowFn>;
    struct Split {
      Accumulator* self;
      F* fn;
      uint64_t n;
      std::atomic<uint64_t> stale{0};
    } split{this, &fn, n};
    team_->run(
        [](void* ctx, unsigned w, unsigned owners) {
          auto& sp = *static_cast<Split*>(ctx);
          const Part part = partition(sp.n, owners, w);
          F fn_copy = *sp.fn;
          sp.stale.fetch_add(sp.self->touched_range(part.start, part.start + part.len, fn_copy),
                             std::memory_order_relaxed);
        },
        &split);
    stale = split.stale.load(std::memory_order_relaxed);
  } else {
    stale = touched_range(0, n, fn);
  }
  atomic(*count_).store(0, std::memory_order_release);
  if (stale > 0) GS_LOG_WARN("'{}': skipped {} stale entries of the touched list", table_->path(), stale);
}

void Accumulator::zero() {
  table_->check_mapping();
  std::unique_lock phase(phase_);
  const size_t bytes = static_cast<size_t>(dim()) * sizeof(float);
  struct Zero {
    Accumulator* self;
    size_t bytes;
    void prefetch(int64_t) {}
    void operator()(int64_t r) { std::memset(self->table_->row_ptr(r), 0, bytes); }
  } fn{this, bytes};
  if (atomic(aux_header_->torn).load(std::memory_order_acquire) == 0) {
    for_each_touched(fn);
    table_->check_mapping();
    return;
  }
  // A process died mid-add: a row it flagged may not have reached the touched list (appended at
  // the end of a batch), so every flagged row is cleared, by the flags.
  for (int64_t r = 0; r < rows(); ++r) {
    if (atomic(flags_[r]).load(std::memory_order_relaxed) == 0) continue;
    fn(r);
    atomic(flags_[r]).store(0, std::memory_order_relaxed);
  }
  atomic(*count_).store(0, std::memory_order_release);
  atomic(aux_header_->torn).store(0, std::memory_order_release);
  table_->check_mapping();
}

uint64_t Accumulator::touched_count() {
  table_->check_mapping();
  std::unique_lock phase(phase_);
  const uint64_t n = std::min<uint64_t>(atomic(*count_).load(std::memory_order_acquire), static_cast<uint64_t>(rows()));
  table_->check_mapping();
  return n;
}

size_t Accumulator::touched(int64_t* out, size_t capacity) {
  table_->check_mapping();
  std::unique_lock phase(phase_);
  const auto n = static_cast<size_t>(
      std::min<uint64_t>(atomic(*count_).load(std::memory_order_acquire), static_cast<uint64_t>(rows())));
  if (capacity < n || n == 0) return n;
  GS_REQUIRE(out != nullptr, GRADSYNC_E_INVALID_ARG, "output buffer is NULL");
  // The list of a file another process holds is read as it is (only a lone opener rebuilds it):
  // an entry out of range or whose flag is down is the remains of a process that died mid-append,
  // skipped here as apply skips it.
  const auto limit = static_cast<uint64_t>(rows());
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto r = static_cast<uint64_t>(atomic(list_[i]).load(std::memory_order_acquire));
    if (r < limit && atomic(flags_[r]).load(std::memory_order_relaxed) != 0) out[k++] = static_cast<int64_t>(r);
  }
  table_->check_mapping();
  return k;
}

void Accumulator::apply(Table& params, const OptimizerSpec& opt, Table* state) {
  GS_REQUIRE(&params != table_.get(), GRADSYNC_E_INVALID_ARG, "the parameter table is the gradient table itself");
  params.check_writable();
  GS_REQUIRE(params.dim() == dim() && params.rows() == rows(), GRADSYNC_E_MISMATCH,
             "parameter table has {} x {}, the accumulator {} x {}", params.rows(), params.dim(), rows(), dim());
  GS_REQUIRE(std::isfinite(opt.lr), GRADSYNC_E_INVALID_ARG, "learning rate must be finite, got {}", opt.lr);
  require_whole("apply");
  const size_t d = static_cast<size_t>(dim());
  const float lr = opt.lr;
  // Any of the three files may shrink under its mapping, before or during the update.
  auto check_mappings = [&] {
    table_->check_mapping();
    params.check_mapping();
    if (state != nullptr) state->check_mapping();
  };
  check_mappings();
  if (opt.kind == OptimizerKind::Sgd) {
    GS_REQUIRE(state == nullptr, GRADSYNC_E_INVALID_ARG, "SGD keeps no state: pass no state table");
    std::unique_lock phase(phase_);
    struct Sgd {
      Table& g;
      Table& p;
      size_t d;
      float lr;
      void prefetch(int64_t r) { __builtin_prefetch(p.row_ptr(r), 1, 3); }
      void operator()(int64_t r) {
        float* gr = g.row_ptr(r);
        optim::sgd(p.row_ptr(r), gr, d, lr, 0.0f);
        std::fill(gr, gr + d, 0.0f);
      }
    } fn{*table_, params, d, lr};
    for_each_touched(fn);
    check_mappings();
    return;
  }
  GS_REQUIRE(opt.kind == OptimizerKind::RowAdagrad || opt.kind == OptimizerKind::Adam, GRADSYNC_E_INVALID_ARG,
             "unknown optimizer {}", static_cast<int32_t>(opt.kind));
  const int64_t width = state_width(opt.kind, dim());
  const char* name = optimizer_name(opt.kind);
  GS_REQUIRE(state != nullptr, GRADSYNC_E_INVALID_ARG, "{} needs a state table of {} x {}", name, rows(), width);
  GS_REQUIRE(state != &params && state != table_.get(), GRADSYNC_E_INVALID_ARG,
             "the state table must be a table of its own");
  state->check_writable();
  GS_REQUIRE(state->rows() == rows() && state->dim() == width, GRADSYNC_E_MISMATCH,
             "{} state table has {} x {}, needs {} x {}", name, state->rows(), state->dim(), rows(), width);
  GS_REQUIRE(std::isfinite(opt.eps) && opt.eps > 0.0f, GRADSYNC_E_INVALID_ARG, "eps must be finite and > 0, got {}",
             opt.eps);
  if (opt.kind == OptimizerKind::RowAdagrad) {
    std::unique_lock phase(phase_);
    // PyTorch-BigGraph's row-wise Adagrad: state[r] += mean(g^2); p -= lr * g / (sqrt(state[r]) + eps).
    struct Adagrad {
      Table& g;
      Table& p;
      Table& s;
      size_t d;
      float lr, eps;
      void prefetch(int64_t r) { __builtin_prefetch(p.row_ptr(r), 1, 3); }
      void operator()(int64_t r) {
        float* gr = g.row_ptr(r);
        optim::row_adagrad(p.row_ptr(r), gr, *s.row_ptr(r), d, lr, eps);
        std::fill(gr, gr + d, 0.0f);
      }
    } fn{*table_, params, *state, d, lr, opt.eps};
    for_each_touched(fn);
    check_mappings();
    return;
  }
  GS_REQUIRE(opt.beta1 >= 0.0 && opt.beta1 < 1.0 && opt.beta2 >= 0.0 && opt.beta2 < 1.0, GRADSYNC_E_INVALID_ARG,
             "Adam's betas must be in [0, 1), got ({}, {})", opt.beta1, opt.beta2);
  std::unique_lock phase(phase_);
  // torch.optim.SparseAdam on the touched rows, each row with its own update count t (its bias
  // correction counts the steps that updated it): m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
  // w -= (lr * sqrt(1 - b2^t) / (1 - b1^t)) * m / (sqrt(v) + eps). The count is a float of the
  // row's state, exact to 2^24 updates, where it stays: both corrections are then 1 in double for
  // any beta up to 1 - 2^-18, so the bits are those of an exact count.
  struct Adam {
    Table& g;
    Table& p;
    Table& s;
    size_t d;
    const OptimizerSpec& o;
    // step_size by count: pow per row would cost as much as the row's update.
    std::array<float, 256> cache;
    float step_size(float t) {
      const auto k = static_cast<size_t>(t);
      if (k < cache.size() && !std::isnan(cache[k])) return cache[k];
      const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(t));
      const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(t));
      const auto step = static_cast<float>(static_cast<double>(o.lr) * std::sqrt(bc2) / bc1);
      if (k < cache.size()) cache[k] = step;
      return step;
    }
    void prefetch(int64_t r) {
      __builtin_prefetch(p.row_ptr(r), 1, 3);
      __builtin_prefetch(s.row_ptr(r), 1, 3);
    }
    void operator()(int64_t r) {
      float* gr = g.row_ptr(r);
      float* st = s.row_ptr(r);
      const float t = st[2 * d] + 1.0f;
      st[2 * d] = t;
      optim::adam(p.row_ptr(r), gr, st, st + d, d, step_size(t), 1.0f, o.eps, static_cast<float>(o.beta1),
                  static_cast<float>(o.beta2), 0.0f, 1.0f);
      std::fill(gr, gr + d, 0.0f);
    }
  } fn{*table_, params, *state, d, opt, {}};
  fn.cache.fill(std::numeric_limits<float>::quiet_NaN());
  for_each_touched(fn);
  check_mappings();
}

}  // namespace gradsync::accumulator
