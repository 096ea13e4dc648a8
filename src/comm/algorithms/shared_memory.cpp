// SPDX-License-Identifier: Apache-2.0
// The collectives of every transport whose ranks share memory (threads of one process; processes
// mapping one /dev/shm segment), written once over a Fabric and the round engine. Each collective
// picks one of three data paths, the same choice on every rank:
// - inline (payload <= kInlineBytes): the payload travels in the rank's inline area; one barrier,
//   and every rank reduces the whole (small) vector itself, in rank order (same code, same bits).
//   An allreduce past kInPlaceFromBytes goes direct instead when every rank can (and ranks do not
//   outnumber the group's CPUs); when only some can, those stage their payload after the first
//   barrier, and a second one precedes the reads.
// - direct (every rank's buffers are reachable by its peers: always for threads, buffers from
//   comm.alloc() for shm): ranks publish addresses; each rank reduces ITS slice (partition rule
//   over the concatenation of all buffers) straight from the peers' buffers into all of them, then
//   a completion barrier keeps every caller in the call while peers touch its buffers. Element i
//   is read and written only by the owner of its slice, all reads of a block before any write, so
//   in place needs no extra phase.
// - cross-process (shm allreduce of ordinary caller buffers past the inline size, when every rank
//   can copy to and from its peers' processes, Fabric::reaches_peer_processes, and ranks do not
//   outnumber the group's CPUs): the direct path's
//   owner slices, each rank reading its slice of the peers' buffers with process_vm_readv and
//   writing the result back with process_vm_writev, then the same completion barrier, holding.
// - copy (shm, ordinary caller buffers): allreduce streams chunks of kChunkBytes through
//   kStageDepth stages: each rank stages the slices its peers reduce, reduces its own slice
//   straight from its own buffer and the peers' stages (into its buffer and the result stage),
//   and copies the other slices out; each step waits only for the counters it depends on.
//   broadcast, allgather, reduce_scatter and alltoall stage double-buffered blocks, one barrier
//   per block.
// Parity double buffering of descriptors and inline areas is enough: a rank can only overwrite its
// round-r area in round r+2, which it cannot enter before every rank has arrived at round r+1,
// i.e. finished reading round r.
#include "comm/algorithms/shared_memory.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "comm/engine/round_engine.hpp"
#include "comm/membership.hpp"
#include "comm/reduce.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "common/wait.hpp"

namespace gradsync::comm {
namespace {

// Results bigger than the caches are copied out with non-temporal stores: the destination is
// written once and not read back soon, so this saves the read-for-ownership of every line (a third
// of the copy path's memory traffic). Smaller results stay in cache for the caller.
constexpr uint64_t kStreamingBytes = 8u << 20;

// An allreduce past this size is faster read in place by owner slices (two waits, half the data
// per rank) than through the inline areas (one wait, but each rank copies its input in and
// reduces every element from every peer's area): 1.3 against 1.5 us at 1 KiB, 1.3 against 2.2 at
// 2 KiB, 0.8 against 1.2 at 256 bytes the other way. Not when ranks outnumber their CPUs
// (Fabric::cpus; N = 4 on 2: 4.7 against 7.6 us at 1 KiB): a second wait costs a descheduled
// peer's time slice. Up to kInlineBytes the inline path remains the fallback of a round in which
// some rank's buffers are out of its peers' reach (shm buffers not from comm.alloc()).
constexpr uint64_t kInPlaceFromBytes = 512;

// Where cross_process_allreduce looked for a peer's range it could not reach.
constexpr const char* kOutsideHeaps = "outside the group's shared heaps";
constexpr const char* kNotMapped = "that its process does not map";

void copy_streaming(char* dst, const char* src, size_t bytes) noexcept {
#if defined(__SSE2__)
  const size_t head = std::min(bytes, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  bytes -= head;
  size_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, bytes - i);
  _mm_sfence();
#else
  std::memcpy(dst, src, bytes);
#endif
}

// A vector without a heap allocation for up to 16 entries: one per rank, or per fused buffer, of
// the usual calls (collectives of small buffers are dominated by fixed costs).
// Its entries start unset, inline or on the heap alike: every user fills all n before reading any,
// and zeroing even the few in use (a `rep stos`, slow to start) took a few percent of a small call.
template <class T>
class SmallVector {
  static_assert(std::is_trivially_default_constructible_v<T> && std::is_trivially_copyable_v<T>);

 public:
  explicit SmallVector(size_t n) : size_(n) {
    if (size_ > kInline) heap_.reset(new T[size_]);
  }
  T* data() noexcept { return size_ > kInline ? heap_.get() : inline_; }
  const T* data() const noexcept { return size_ > kInline ? heap_.get() : inline_; }
  T& operator[](size_t i) noexcept { return data()[i]; }
  const T& operator[](size_t i) const noexcept { return data()[i]; }
  size_t size() const noexcept { return size_; }

 private:
  static constexpr size_t kInline = 16;
  size_t size_;
  T inline_[kInline];
  std::unique_ptr<T[]> heap_;
};

// The fused list seen as one concatenated vector of elements.
class Concat {
 public:
  Concat(std::span<const BufferRef> buffers, size_t elem)
      : buffers_(buffers), elem_(elem), starts_(buffers.size() + 1) {
    uint64_t total = 0;
    for (size_t i = 0; i < buffers.size(); ++i) {
      starts_[i] = total;
      total += buffers[i].count;
    }
    starts_[buffers.size()] = total;
  }
  uint64_t total() const { return starts_[buffers_.size()]; }
  const char* send(size_t i) const { return static_cast<const char*>(buffers_[i].send); }
  char* recv(size_t i) const { return static_cast<char*>(buffers_[i].recv); }
  uint64_t start(size_t i) const { return starts_[i]; }

  // f(buffer index, first element within it, last, position of that first element in [begin, end)).
  template <class F>
  void for_range(uint64_t begin, uint64_t end, F&& f) const {
    if (begin >= end) return;
    const uint64_t* s = starts_.data();
    size_t i = static_cast<size_t>(std::upper_bound(s, s + buffers_.size() + 1, begin) - s) - 1;
    for (; i < buffers_.size() && starts_[i] < end; ++i) {
      const uint64_t lo = std::max(begin, starts_[i]), hi = std::min(end, starts_[i + 1]);
      if (lo < hi) f(i, lo - starts_[i], hi - starts_[i], lo - begin);
    }
  }
  void gather(uint64_t begin, uint64_t end, char* dst) const {
    for_range(begin, end, [&](size_t i, uint64_t a, uint64_t b, uint64_t at) {
      std::memcpy(dst + at * elem_, static_cast<const char*>(buffers_[i].send) + a * elem_, (b - a) * elem_);
    });
  }
  void scatter(uint64_t begin, uint64_t end, const char* src, bool streaming) const {
    for_range(begin, end, [&](size_t i, uint64_t a, uint64_t b, uint64_t at) {
      char* dst = static_cast<char*>(buffers_[i].recv) + a * elem_;
      if (streaming) {
        copy_streaming(dst, src + at * elem_, (b - a) * elem_);
      } else {
        std::memcpy(dst, src + at * elem_, (b - a) * elem_);
      }
    });
  }

 private:
  std::span<const BufferRef> buffers_;
  size_t elem_;
  SmallVector<uint64_t> starts_;
};

using Round = RoundEngine::Round;

// Rank r's part: counts[r] elements after the parts before it (pack_parts).
SmallVector<Part> parts_of(std::span<const size_t> counts) {
  SmallVector<Part> parts(counts.size());
  pack_parts(counts, parts.data());
  return parts;
}

class SharedMemoryCommunicator final : public Communicator {
 public:
  SharedMemoryCommunicator(const Options& options, std::unique_ptr<Fabric> fabric, JoinGroup join)
      : options_(options),
        join_(join),
        fabric_(std::move(fabric)),
        control_(fabric_->control()),
        engine_(*fabric_, options.rank, options.size, options.timeout, options.check_mismatch, interrupt_, telemetry_) {
  }
  ~SharedMemoryCommunicator() override { engine_.leave(); }

  int rank() const noexcept override { return options_.rank; }
  int size() const noexcept override { return options_.size; }
  Transport transport() const noexcept override { return fabric_->transport(); }

  void allreduce(std::span<const BufferRef> buffers, DType dtype, ReduceOp op) override;
  void broadcast(void* buf, size_t count, DType dtype, int root) override;
  void allgatherv(const void* send, void* recv, std::span<const size_t> counts, DType dtype) override;
  void reduce_scatterv(const void* send, void* recv, std::span<const size_t> counts, DType dtype, ReduceOp op,
                       std::optional<int> root) override;
  void exchange(const void* send, void* recv, const Routes& routes, DType dtype) override;
  void barrier() override;
  void weighted_mean(const void* send, void* recv, size_t count, DType dtype, uint64_t weight,
                     uint64_t* total_weight) override;
  void abort() noexcept override { engine_.abort(); }
  void reset() override { engine_.reset(); }
  ShrinkResult shrink() override { return membership_.shrink(*this); }
  std::string lost_member() const override {
    for (int r = 0; r < size(); ++r) {
      if (r != rank() && !fabric_->alive(r)) {
        return fmt::format("rank {} (pid {}) of {} group '{}' is gone", r, fabric_->pid(r), transport_name(transport()),
                           fabric_->group());
      }
    }
    return {};
  }
  GrowResult grow(const std::string& join_name, int joiners) override {
    // The same on every member: a property of the group since it formed.
    GS_REQUIRE(group_options().grow_refused.empty(), GRADSYNC_E_UNSUPPORTED, "grow of {} group '{}': {}",
               transport_name(transport()), fabric_->group(), group_options().grow_refused);
    return membership_.grow(*this, join_, join_name, joiners);
  }
  void* alloc(size_t bytes) override { return fabric_->alloc(bytes); }
  void dealloc(void* p) override { fabric_->dealloc(p); }
  void release_after_fork() noexcept override { fabric_->release_after_fork(); }

 protected:
  bool shares_memory() const noexcept override { return true; }
  std::unique_ptr<Communicator> make_subgroup(const Subgroup& sub) override { return join_(subgroup_options(sub)); }

 private:
  // begin() for a collective whose peers read this rank's send buffer (bytes long): it is copied
  // into the inline area when small (a decision every rank makes alike), or published as an
  // address when peers reach it. Nothing to read (0 bytes) needs no address.
  Round begin_reading(const CallSignature& call, const void* send, uint64_t bytes, bool small);
  Round begin_reading(const CallSignature& call, const void* send, uint64_t bytes) {
    return begin_reading(call, send, bytes, bytes <= kInlineBytes);
  }
  // The copy path of allreduce over the concatenation `all` (also the weighted mean's, on its
  // staged contributions).
  void pipeline_allreduce(const Round& round, const Concat& all, DType dtype, ReduceOp op);
  // The allreduce of a round whose ranks all reach each other's processes (Round::all_cross).
  void cross_process_allreduce(const Round& round, const Concat& all, std::span<const BufferRef> buffers, DType dtype,
                               ReduceOp op);
  // The copy path of reduce_scatter and the exchange: in step k every rank stages block k of each
  // of its parts of `in` (its part for rank j in slot j, `block` elements each) and consumes block
  // k-1 of what every rank staged for it: consume(first element, block, from) with from[r] rank
  // r's slot, while first < incoming (the longest part this rank receives). longest: the longest
  // part of any rank, so that every rank runs the same steps.
  template <class Consume>
  void exchange_parts(const Round& round, Collective what, const char* in, const SmallVector<Part>& parts,
                      uint64_t incoming, uint64_t longest, size_t es, Consume&& consume);
  // Runs body as one collective: measured, and its round failed for every rank when an error
  // leaves it once it holds the round (RoundEngine::run_call).
  template <class Body>
  void run(Collective what, uint64_t bytes, Body&& body) {
    telemetry_.measure(what, bytes, [&] { engine_.run_call(body); });
  }
  // A group of one: nothing to agree on, but the group's failure still fails the call.
  bool alone() {
    if (size() != 1) return false;
    engine_.fail_fast();
    return true;
  }
  // Rank r's published [address, address + bytes) as a pointer; a range outside the memory peers
  // may publish (a member gone bad) stops the group rather than being touched.
  char* peer(const Round& round, int r, uint64_t address, uint64_t bytes) {
    char* p = control_.reach(address, bytes);
    if (p == nullptr) engine_.refuse_peer_buffer(round, r, address, bytes);
    return p;
  }
  static void require_reducible(const char* what, DType dtype) {
    GS_REQUIRE(reducible(dtype), GRADSYNC_E_UNSUPPORTED, "{} of {} is not supported", what, dtype_name(dtype));
  }

  Options options_;
  JoinGroup join_;
  std::unique_ptr<Fabric> fabric_;
  const ControlArea& control_;
  RoundEngine engine_;
  Membership membership_{*fabric_, options_.rank, options_.size, options_.timeout};
  // Allreduces past kInPlaceFromBytes go direct when they can (see there).
  const bool direct_from_small_sizes_ = options_.size <= fabric_->cpus();
  // cross_process_allreduce's copies of the peers' blocks, one chunk per peer; grown once.
  std::unique_ptr<char[]> cross_scratch_;
  size_t cross_scratch_bytes_ = 0;
};

Round SharedMemoryCommunicator::begin_reading(const CallSignature& call, const void* send, uint64_t bytes, bool small) {
  const uint64_t address = small || bytes == 0 ? kNoAddress : fabric_->address_of(send, bytes);
  Descriptor d{};
  d.call = call;
  d.direct = address != kNoAddress || bytes == 0 ? 1 : 0;
  return engine_.begin(d, [&](uint64_t parity) {
    if (small) {
      if (bytes > 0) std::memcpy(control_.inline_area(rank(), parity), send, bytes);
    } else if (address != kNoAddress) {
      control_.publish_address(rank(), parity, 0, {address, kNoAddress});
    }
  });
}

void SharedMemoryCommunicator::allreduce(std::span<const BufferRef> buffers, DType dtype, ReduceOp op) {
  run(Collective::Allreduce, payload_bytes(buffers, dtype), [&] {
    const size_t es = dtype_size(dtype);
    if (alone()) {
      require_reducible("allreduce", dtype);
      for (const auto& b : buffers) copy(dtype, b.send, b.recv, 0, b.count);
      return;
    }
    const Concat all(buffers, es);
    const uint64_t total = all.total(), bytes = total * es;
    const bool fits_table = buffers.size() <= kMaxTableBuffers;
    // A payload up to kInlineBytes travels inline, unless it is past kInPlaceFromBytes and every
    // rank's buffers are reachable: then the round goes direct.
    const bool fits_inline = bytes <= kInlineBytes;
    const bool small = fits_inline && !(direct_from_small_sizes_ && fits_table && bytes > kInPlaceFromBytes);
    bool direct = !small && fits_table;
    for (size_t i = 0; i < buffers.size() && direct; ++i) {
      direct = fabric_->address_of(buffers[i].send, buffers[i].count * es) != kNoAddress &&
               fabric_->address_of(buffers[i].recv, buffers[i].count * es) != kNoAddress;
    }
    // Past the inline size, a rank that reaches its peers' processes offers to read and write
    // their slices where they are (cross_process_allreduce); ranks that all do skip the stages.
    // Not while ranks outnumber their CPUs: the staged pipeline, whose ranks wait a chunk at a
    // time, measured faster there than one long pass per rank before one wait (N = 4 on 2 CPUs,
    // loaded: 8K floats 16-26 against 26-40 us, 16M 0.09-0.13 against 0.27-1.3 s).
    // Only where the round compares the ranks' calls (check_mismatch): a peer's buffer lengths
    // are taken from this rank's own call, and a peer whose call differed would be written past
    // its buffer, in another process, where no reach check bounds the copy.
    const bool cross = options_.check_mismatch && !fits_inline && fits_table && direct_from_small_sizes_ &&
                       fabric_->reaches_peer_processes();
    Descriptor d{};
    d.call = allreduce_call(buffers, dtype, op);
    d.direct = (direct ? kDirectShared : 0) | (cross ? kDirectCrossProcess : 0);
    auto stage = [&](uint64_t parity) { all.gather(0, total, control_.inline_area(rank(), parity)); };
    const Round round = engine_.begin(d, [&](uint64_t parity) {
      if (direct) {
        for (size_t i = 0; i < buffers.size(); ++i) {
          control_.publish_address(rank(), parity, i,
                                   {fabric_->address_of(buffers[i].send, 0), fabric_->address_of(buffers[i].recv, 0)});
        }
      } else if (cross) {
        for (size_t i = 0; i < buffers.size(); ++i) {
          control_.publish_address(
              rank(), parity, i,
              {reinterpret_cast<uintptr_t>(buffers[i].send), reinterpret_cast<uintptr_t>(buffers[i].recv)});
        }
      } else if (fits_inline) {
        stage(parity);
      }
    });
    engine_.hold_round();
    const size_t n = static_cast<size_t>(size());
    SmallVector<const void*> srcs(n);
    SmallVector<void*> dsts(n);

    if (fits_inline && !round.all_direct) {
      if (round.any_direct) {
        // The ranks that offered the direct path stage their payload only now: reading a whole
        // buffer before each direct round would pull back every line that peers wrote into it in
        // the last one (1.2 us a call at 1K, in the host's slow mode). Then all meet again.
        if (direct) stage(round.parity);
        engine_.barrier(round, Collective::Allreduce, false);
      }
      for (size_t i = 0; i < buffers.size(); ++i) {
        for (size_t r = 0; r < n; ++r) {
          srcs[r] = control_.inline_area(static_cast<int>(r), round.parity) + all.start(i) * es;
        }
        reduce(dtype, op, srcs.data(), n, buffers[i].recv, 0, buffers[i].count);
      }
      // Reading the inline areas is done before this rank arrives at the next round, which is what
      // lets peers reuse this parity two rounds later.
      return;
    }

    if (round.all_direct) {
      const Part mine = my_part(total);
      all.for_range(mine.start, mine.start + mine.len, [&](size_t i, uint64_t a, uint64_t b, uint64_t) {
        // This rank's own recv first: the reduced block lands there and is copied on from cache.
        for (size_t k = 0; k < n; ++k) {
          const int r = static_cast<int>((static_cast<size_t>(rank()) + k) % n);
          const BufferAddress& o = control_.table(r, round.parity)[i];
          const uint64_t bytes = buffers[i].count * es;
          srcs[static_cast<size_t>(r)] = peer(round, r, o.send, bytes);
          dsts[k] = peer(round, r, o.recv, bytes);
        }
        reduce_to_all(dtype, op, srcs.data(), n, dsts.data(), n, a, b);
      });
      // Peers may not reuse their buffers until everyone has written its slice into them.
      engine_.barrier(round, Collective::Allreduce, true);
      return;
    }
    if (round.all_cross) {
      cross_process_allreduce(round, all, buffers, dtype, op);
      return;
    }
    pipeline_allreduce(round, all, dtype, op);
  });
}

// The direct path's owner slices over ordinary buffers in other processes: each rank reads its
// slice of every peer's input from the peer's process into this rank's scratch, reduces it (in
// rank order) into its own buffer, and writes the result into every peer's, block by block.
// Every line of a buffer is thus touched by one core only, its slice's owner, as on the direct
// path, while the staged copy path moves each line between cores twice a call (in through the
// input stage, out through the result stage): on hosts where those transfers slow down (cores far
// apart), that was the copy path's slow mode, and this path does not have it.
void SharedMemoryCommunicator::cross_process_allreduce(const Round& round, const Concat& all,
                                                       std::span<const BufferRef> buffers, DType dtype, ReduceOp op) {
  const size_t es = dtype_size(dtype);
  const size_t n = static_cast<size_t>(size());
  const uint64_t block = kChunkBytes / es;
  if (cross_scratch_bytes_ < (n - 1) * kChunkBytes) {
    cross_scratch_.reset(new char[(n - 1) * kChunkBytes]);
    cross_scratch_bytes_ = (n - 1) * kChunkBytes;
  }
  SmallVector<const void*> srcs(n);
  const Part mine = my_part(all.total());
  all.for_range(mine.start, mine.start + mine.len, [&](size_t i, uint64_t a, uint64_t b, uint64_t) {
    char* own_recv = all.recv(i);
    for (uint64_t lo = a; lo < b; lo += block) {
      const uint64_t len = std::min(block, b - lo);
      const uint64_t offset = lo * es, bytes = len * es;
      char* scratch = cross_scratch_.get();
      for (size_t r = 0; r < n; ++r) {
        const int rr = static_cast<int>(r);
        if (rr == rank()) {
          srcs[r] = all.send(i) + offset;
          continue;
        }
        const uint32_t how = engine_.desc(rr, round.parity).direct;
        const BufferAddress& o = control_.table(rr, round.parity)[i];
        if ((how & kDirectShared) != 0) {
          const char* p = control_.reach(o.send, buffers[i].count * es);
          if (p == nullptr)
            engine_.refuse_peer_range(round, Collective::Allreduce, rr, o.send, buffers[i].count * es, kOutsideHeaps);
          srcs[r] = p + offset;
        } else {
          if (!fabric_->read_peer(rr, o.send + offset, scratch, bytes)) {
            engine_.refuse_peer_range(round, Collective::Allreduce, rr, o.send + offset, bytes, kNotMapped);
          }
          srcs[r] = scratch;
          scratch += kChunkBytes;
        }
      }
      reduce(dtype, op, srcs.data(), n, own_recv + offset, 0, len);
      for (size_t r = 0; r < n; ++r) {
        const int rr = static_cast<int>(r);
        if (rr == rank()) continue;
        const uint32_t how = engine_.desc(rr, round.parity).direct;
        const BufferAddress& o = control_.table(rr, round.parity)[i];
        if ((how & kDirectShared) != 0) {
          char* p = control_.reach(o.recv, buffers[i].count * es);
          if (p == nullptr)
            engine_.refuse_peer_range(round, Collective::Allreduce, rr, o.recv, buffers[i].count * es, kOutsideHeaps);
          std::memcpy(p + offset, own_recv + offset, bytes);
        } else if (!fabric_->write_peer(rr, o.recv + offset, own_recv + offset, bytes)) {
          engine_.refuse_peer_range(round, Collective::Allreduce, rr, o.recv + offset, bytes, kNotMapped);
        }
      }
    }
  });
  // Peers write into this rank's own memory: it holds its buffers until every peer is done.
  engine_.barrier(round, Collective::Allreduce, true, true);
}

// A pipeline of kStageDepth chunks. Each rank stages chunk j of its input, reduces its slice of
// chunk j from every rank's stage into the shared result stage, and copies the whole result of
// chunk j out, each step as soon as its inputs are there and its stage is free, as the peers'
// counters say. No lockstep: a rank runs ahead while a peer is descheduled.
void SharedMemoryCommunicator::pipeline_allreduce(const Round& round, const Concat& all, DType dtype, ReduceOp op) {
  const size_t es = dtype_size(dtype);
  const uint64_t total = all.total();
  const size_t n = static_cast<size_t>(size());
  const uint64_t per_chunk = kChunkBytes / es;
  const uint64_t chunks = (total + per_chunk - 1) / per_chunk;
  const uint64_t base = engine_.chunks();  // group-wide index of this round's first chunk
  auto chunk_len = [&](uint64_t k) { return std::min(per_chunk, total - k * per_chunk); };
  auto least = [&](std::atomic<uint64_t> RankSlot::*counter) {
    uint64_t m = ~uint64_t{0};
    for (int r = 0; r < size(); ++r) m = std::min(m, (control_.slot(r).*counter).load(std::memory_order_seq_cst));
    return m;
  };
  const bool streaming = total * es >= kStreamingBytes;
  SmallVector<const void*> srcs(n);
  uint64_t staged = 0, reduced = 0, drained = 0;  // this round's chunks done by this rank
  // Stage j+base is free once every rank reduced chunk j+base-depth; the result stage once every
  // rank drained it.
  auto can_stage = [&] { return staged < chunks && least(&RankSlot::reduced) + kStageDepth > base + staged; };
  auto can_reduce = [&] {
    return reduced < staged && least(&RankSlot::staged) > base + reduced &&
           least(&RankSlot::drained) + kStageDepth > base + reduced;
  };
  auto can_drain = [&] { return drained < reduced && least(&RankSlot::reduced) > base + drained; };
  while (drained < chunks) {
    bool moved = false;
    if (can_drain()) {
      // This rank's own slice is already in place (written by its reduction).
      const uint64_t first = drained * per_chunk;
      const Part own = partition(chunk_len(drained), n, static_cast<uint64_t>(rank()));
      const char* out = control_.out_area(base + drained);
      all.scatter(first, first + own.start, out, streaming);
      all.scatter(first + own.start + own.len, first + chunk_len(drained), out + (own.start + own.len) * es, streaming);
      engine_.publish(&RankSlot::drained, base + ++drained);
      moved = true;
    }
    if (can_reduce()) {
      // The own slice comes straight from the caller's buffer (it was never staged), and its result
      // goes straight into the caller's buffer as well as into the result stage for the peers.
      const uint64_t first = reduced * per_chunk;
      const Part own = partition(chunk_len(reduced), n, static_cast<uint64_t>(rank()));
      char* out = control_.out_area(base + reduced);
      all.for_range(first + own.start, first + own.start + own.len, [&](size_t i, uint64_t a, uint64_t b, uint64_t at) {
        const uint64_t in_chunk = (own.start + at) * es;
        for (size_t r = 0; r < n; ++r) {
          srcs[r] = static_cast<int>(r) == rank() ? all.send(i) + a * es
                                                  : control_.in_area(static_cast<int>(r), base + reduced) + in_chunk;
        }
        void* dst[2] = {all.recv(i) + a * es, out + in_chunk};
        reduce_to_all(dtype, op, srcs.data(), n, dst, 2, 0, b - a);
      });
      engine_.publish(&RankSlot::reduced, base + ++reduced);
      moved = true;
    }
    if (can_stage()) {
      // Only the slices the peers reduce; this rank's own slice is read in place.
      const uint64_t first = staged * per_chunk;
      const Part own = partition(chunk_len(staged), n, static_cast<uint64_t>(rank()));
      char* stage = control_.in_area(rank(), base + staged);
      all.gather(first, first + own.start, stage);
      all.gather(first + own.start + own.len, first + chunk_len(staged), stage + (own.start + own.len) * es);
      engine_.publish(&RankSlot::staged, base + ++staged);
      moved = true;
    }
    if (!moved) engine_.wait_for([&] { return can_drain() || can_reduce() || can_stage(); }, round, "allreduce");
  }
  engine_.set_chunks(base + chunks);
  // The round ends together: a rank that failed mid-pipeline decided this barrier failed, so no rank
  // returns OK without it.
  engine_.barrier(round, Collective::Allreduce, false);
}

void SharedMemoryCommunicator::broadcast(void* buf, size_t count, DType dtype, int root) {
  run(Collective::Broadcast, count * dtype_size(dtype), [&] {
    if (alone()) {
      GS_REQUIRE(root == 0, GRADSYNC_E_OUT_OF_RANGE, "broadcast: root {} out of range [0, 1)", root);
      return;
    }
    const size_t es = dtype_size(dtype);
    const uint64_t bytes = count * es;
    const bool is_root = rank() == root;
    const bool small = bytes <= kInlineBytes;
    const uint64_t address = !small && is_root ? fabric_->address_of(buf, bytes) : kNoAddress;
    Descriptor d{};
    d.call = broadcast_call(count, dtype, root);
    d.direct = address != kNoAddress ? 1 : 0;
    const Round round = engine_.begin(d, [&](uint64_t parity) {
      if (!is_root) return;
      if (small) {
        if (bytes > 0) std::memcpy(control_.inline_area(rank(), parity), buf, bytes);
      } else if (address != kNoAddress) {
        control_.publish_address(rank(), parity, 0, {address, kNoAddress});
      }
    });
    engine_.hold_round();
    char* out = static_cast<char*>(buf);
    if (small) {
      if (!is_root && bytes > 0) std::memcpy(out, control_.inline_area(root, round.parity), bytes);
      return;
    }
    if (engine_.desc(root, round.parity).direct != 0) {
      if (!is_root) std::memcpy(out, peer(round, root, control_.table(root, round.parity)[0].send, bytes), bytes);
      engine_.barrier(round, Collective::Broadcast, true);
      return;
    }
    // Copy path: the root stages chunk k while the others copy out chunk k-1.
    const uint64_t chunks = (bytes + kChunkBytes - 1) / kChunkBytes;
    auto chunk_bytes = [&](uint64_t k) { return std::min<uint64_t>(kChunkBytes, bytes - k * kChunkBytes); };
    for (uint64_t k = 0; k <= chunks; ++k) {
      if (k >= 1 && !is_root) {
        const uint64_t c = k - 1;
        std::memcpy(out + c * kChunkBytes, control_.in_area(root, c & 1), chunk_bytes(c));
      }
      if (k < chunks) {
        if (is_root) std::memcpy(control_.in_area(rank(), k & 1), out + k * kChunkBytes, chunk_bytes(k));
        engine_.barrier(round, Collective::Broadcast, false);
      }
    }
  });
}

void SharedMemoryCommunicator::allgatherv(const void* send, void* recv, std::span<const size_t> counts, DType dtype) {
  const size_t es = dtype_size(dtype);
  const uint64_t n = static_cast<uint64_t>(size());
  SmallVector<Part> parts = parts_of(counts);
  uint64_t total = 0, longest = 0;
  for (uint64_t r = 0; r < n; ++r) {
    total += parts[r].len;
    longest = std::max<uint64_t>(longest, parts[r].len);
  }
  run(Collective::Allgather, total * es, [&] {
    const Part mine = parts[static_cast<uint64_t>(rank())];
    char* out = static_cast<char*>(recv);
    const char* own = send != nullptr ? static_cast<const char*>(send) : out + mine.start * es;
    if (alone()) {
      if (send != nullptr) copy(dtype, send, out + mine.start * es, 0, mine.len);
      return;
    }
    const bool small = total * es <= kInlineBytes;
    const uint64_t address = small ? kNoAddress : fabric_->address_of(own, mine.len * es);
    const bool direct = address != kNoAddress && fabric_->address_of(recv, total * es) != kNoAddress;
    Descriptor d{};
    d.call = allgather_call(counts, dtype);
    d.direct = direct ? 1 : 0;
    const Round round = engine_.begin(d, [&](uint64_t parity) {
      if (small) {
        if (mine.len > 0) std::memcpy(control_.inline_area(rank(), parity), own, mine.len * es);
      } else if (direct) {
        control_.publish_address(rank(), parity, 0, {address, fabric_->address_of(recv, 0)});
      }
    });
    engine_.hold_round();
    if (small) {
      if (send != nullptr) copy(dtype, send, out + mine.start * es, 0, mine.len);
      for (uint64_t r = 0; r < n; ++r) {
        if (static_cast<int>(r) == rank()) continue;
        const Part p = parts[r];
        const char* from = control_.inline_area(static_cast<int>(r), round.parity);
        if (p.len > 0) std::memcpy(out + p.start * es, from, p.len * es);
      }
      return;
    }
    if (round.all_direct) {
      // Each rank writes its own part into every rank's recv (read once, written N times).
      if (mine.len > 0) {
        SmallVector<void*> dsts(n);
        for (uint64_t k = 0; k < n; ++k) {
          const int r = static_cast<int>((static_cast<uint64_t>(rank()) + k) % n);
          dsts[k] = peer(round, r, control_.table(r, round.parity)[0].recv, total * es) + mine.start * es;
        }
        copy_to_all(dtype, own, dsts.data(), n, 0, mine.len);
      }
      engine_.barrier(round, Collective::Allgather, true);
      return;
    }
    if (send != nullptr) copy(dtype, send, out + mine.start * es, 0, mine.len);
    // Copy path: every rank stages block k of its own part while copying out block k-1 of the others'.
    const uint64_t block = kChunkBytes / es;
    const uint64_t steps = (longest + block - 1) / block;
    for (uint64_t k = 0; k <= steps; ++k) {
      if (k >= 1) {
        const uint64_t c = k - 1;
        for (uint64_t r = 0; r < n; ++r) {
          const Part p = parts[r];
          if (static_cast<int>(r) == rank() || c * block >= p.len) continue;
          const uint64_t len = std::min(block, p.len - c * block);
          std::memcpy(out + (p.start + c * block) * es, control_.in_area(static_cast<int>(r), c & 1), len * es);
        }
      }
      if (k < steps) {
        if (k * block < mine.len) {
          const uint64_t len = std::min(block, mine.len - k * block);
          std::memcpy(control_.in_area(rank(), k & 1), own + k * block * es, len * es);
        }
        engine_.barrier(round, Collective::Allgather, false);
      }
    }
  });
}

void SharedMemoryCommunicator::reduce_scatterv(const void* send, void* recv, std::span<const size_t> counts,
                                               DType dtype, ReduceOp op, std::optional<int> root) {
  const size_t es = dtype_size(dtype);
  const size_t n = static_cast<size_t>(size());
  SmallVector<Part> parts = parts_of(counts);
  const uint64_t total = parts[n - 1].start + parts[n - 1].len;
  run(Collective::ReduceScatter, total * es, [&] {
    const Part mine = parts[static_cast<size_t>(rank())];
    const char* in = static_cast<const char*>(send);
    if (alone()) {
      require_reducible("reduce_scatter", dtype);
      GS_REQUIRE(!root || *root == 0, GRADSYNC_E_OUT_OF_RANGE, "reduce: root {} out of range [0, 1)", root.value_or(0));
      if (total > 0) std::memmove(recv, send, total * es);  // NULL buffers are allowed for 0 elements
      return;
    }
    const bool small = total * es <= kInlineBytes;
    const Round round = begin_reading(reduce_scatter_call(counts, dtype, op, root), send, total * es);
    engine_.hold_round();
    SmallVector<const void*> srcs(n);
    if (small) {
      for (size_t r = 0; r < n; ++r) {
        srcs[r] = control_.inline_area(static_cast<int>(r), round.parity) + mine.start * es;
      }
      reduce(dtype, op, srcs.data(), n, recv, 0, mine.len);
      return;
    }
    if (round.all_direct) {
      // recv may be this rank's own part of send: the kernel allows dst == a source.
      for (size_t r = 0; r < n; ++r) {
        const int rr = static_cast<int>(r);
        srcs[r] = peer(round, rr, control_.table(rr, round.parity)[0].send, total * es) + mine.start * es;
      }
      reduce(dtype, op, srcs.data(), n, recv, 0, mine.len);
      engine_.barrier(round, Collective::ReduceScatter, true);
      return;
    }
    char* out = static_cast<char*>(recv);
    uint64_t longest = 0;
    for (size_t r = 0; r < n; ++r) longest = std::max<uint64_t>(longest, parts[r].len);
    exchange_parts(round, Collective::ReduceScatter, in, parts, mine.len, longest, es,
                   [&](uint64_t first, uint64_t block, const void* const* from) {
                     reduce(dtype, op, from, n, out + first * es, 0, std::min(block, mine.len - first));
                   });
  });
}

void SharedMemoryCommunicator::exchange(const void* send, void* recv, const Routes& routes, DType dtype) {
  const size_t es = dtype_size(dtype);
  const uint64_t n = routes.n, me = static_cast<uint64_t>(rank());
  uint64_t sent = 0;
  for (uint64_t d = 0; d < n; ++d) sent += routes.count[routes.at(me, d)];
  run(Collective::Alltoall, sent * es, [&] {
    const char* in = static_cast<const char*>(send);
    char* out = static_cast<char*>(recv);
    if (alone()) {
      GS_REQUIRE(routes.form == Collective::Alltoall || routes.root == 0, GRADSYNC_E_OUT_OF_RANGE,
                 "{}: root {} out of range [0, 1)", collective_name(routes.form), routes.root);
      if (routes.count[0] > 0)
        std::memcpy(out + routes.recv_displ[0] * es, in + routes.send_displ[0] * es, routes.count[0] * es);
      return;
    }
    uint64_t widest = 0, incoming = 0;
    for (uint64_t r = 0; r < n; ++r) {
      widest = std::max(widest, routes.send_extent(r));
      incoming = std::max(incoming, routes.count[routes.at(r, me)]);
    }
    const bool small = widest * es <= kInlineBytes;
    const Round round = begin_reading(exchange_call(routes, dtype), send, routes.send_extent(me) * es, small);
    engine_.hold_round();
    if (small || round.all_direct) {
      for (uint64_t s = 0; s < n; ++s) {
        const size_t part = routes.at(s, me);
        if (routes.count[part] == 0) continue;
        const char* from =
            small ? control_.inline_area(static_cast<int>(s), round.parity)
                  : peer(round, static_cast<int>(s), control_.table(static_cast<int>(s), round.parity)[0].send,
                         routes.send_extent(s) * es);
        std::memcpy(out + routes.recv_displ[part] * es, from + routes.send_displ[part] * es, routes.count[part] * es);
      }
      // Direct: peers may not reuse their send buffers until everyone has read its part.
      if (!small) engine_.barrier(round, Collective::Alltoall, true);
      return;
    }
    SmallVector<Part> parts(n);
    for (uint64_t d = 0; d < n; ++d) {
      parts[d] = Part{routes.send_displ[routes.at(me, d)], routes.count[routes.at(me, d)]};
    }
    exchange_parts(round, Collective::Alltoall, in, parts, incoming, routes.longest(), es,
                   [&](uint64_t first, uint64_t block, const void* const* from) {
                     for (uint64_t s = 0; s < n; ++s) {
                       const size_t part = routes.at(s, me);
                       if (first >= routes.count[part]) continue;
                       std::memcpy(out + (routes.recv_displ[part] + first) * es, from[s],
                                   std::min(block, routes.count[part] - first) * es);
                     }
                   });
  });
}

template <class Consume>
void SharedMemoryCommunicator::exchange_parts(const Round& round, Collective what, const char* in,
                                              const SmallVector<Part>& parts, uint64_t incoming, uint64_t longest,
                                              size_t es, Consume&& consume) {
  const uint64_t n = static_cast<uint64_t>(size());
  const uint64_t block = kChunkBytes / es / n;
  const uint64_t steps = (longest + block - 1) / block;
  SmallVector<const void*> from(n);
  for (uint64_t k = 0; k <= steps; ++k) {
    if (k >= 1) {
      const uint64_t c = k - 1;
      if (c * block < incoming) {
        for (uint64_t r = 0; r < n; ++r) {
          from[r] = control_.in_area(static_cast<int>(r), c & 1) + static_cast<uint64_t>(rank()) * block * es;
        }
        consume(c * block, block, from.data());
      }
    }
    if (k < steps) {
      char* stage = control_.in_area(rank(), k & 1);
      for (uint64_t j = 0; j < n; ++j) {
        const Part p = parts[j];
        if (k * block >= p.len) continue;
        const uint64_t len = std::min(block, p.len - k * block);
        std::memcpy(stage + j * block * es, in + (p.start + k * block) * es, len * es);
      }
      engine_.barrier(round, what, false);
    }
  }
}

void SharedMemoryCommunicator::barrier() {
  run(Collective::Barrier, 0, [&] {
    if (alone()) return;
    Descriptor d{};
    d.call = barrier_call();
    engine_.begin(d, [](uint64_t) {});
  });
}

// comm::weighted_mean (reduce.hpp) on the three paths. The engine has checked every rank's dtype
// and weight, so every rank fails alike and nothing is read or written on a bad one.
void SharedMemoryCommunicator::weighted_mean(const void* send, void* recv, size_t count, DType dtype, uint64_t weight,
                                             uint64_t* total_weight) {
  run(Collective::WeightedMean, count * dtype_size(dtype), [&] {
    if (size() == 1) {
      engine_.fail_fast();
      Communicator::weighted_mean(send, recv, count, dtype, weight, total_weight);
      return;
    }
    const size_t es = dtype_size(dtype);
    const bool small = count * es <= kInlineBytes;
    const uint64_t address = small ? kNoAddress : fabric_->address_of(send, count * es);
    const bool direct = address != kNoAddress && fabric_->address_of(recv, count * es) != kNoAddress;
    Descriptor d{};
    d.call = weighted_mean_call(count, dtype);
    d.weight = weight;
    d.direct = direct ? 1 : 0;
    const Round round = engine_.begin(d, [&](uint64_t parity) {
      if (small) {
        if (count > 0) std::memcpy(control_.inline_area(rank(), parity), send, count * es);
      } else if (direct) {
        control_.publish_address(rank(), parity, 0, {address, fabric_->address_of(recv, 0)});
      }
    });
    const size_t n = static_cast<size_t>(size());
    SmallVector<double> w(n);
    uint64_t total = 0;
    for (size_t r = 0; r < n; ++r) {
      const uint64_t wr = engine_.desc(static_cast<int>(r), round.parity).weight;
      w[r] = static_cast<double>(wr);
      total += wr;
    }
    if (total_weight != nullptr) *total_weight = total;
    const double denom = static_cast<double>(total);
    // Every rank sees the same total, so every rank fails alike, before anyone touches a buffer.
    GS_REQUIRE(total > 0, GRADSYNC_E_ZERO_WEIGHT, "total weight (sample count) over {} ranks is 0", size());
    engine_.hold_round();
    SmallVector<const void*> srcs(n);
    if (small) {
      for (size_t r = 0; r < n; ++r) srcs[r] = control_.inline_area(static_cast<int>(r), round.parity);
      comm::weighted_mean(dtype, srcs.data(), w.data(), n, denom, recv, 0, count);
      return;
    }
    if (round.all_direct) {
      {
        const Part part = my_part(count);
        for (size_t r = 0; r < n; ++r) {
          const int rr = static_cast<int>(r);
          srcs[r] = peer(round, rr, control_.table(rr, round.parity)[0].send, count * es);
        }
        // Into this rank's recv, then on to the others from cache, block by block.
        const size_t block = kBlockBytes / es;
        SmallVector<void*> dsts(n - 1);
        size_t k = 0;
        for (size_t r = 0; r < n; ++r) {
          if (static_cast<int>(r) == rank()) continue;
          dsts[k++] =
              peer(round, static_cast<int>(r), control_.table(static_cast<int>(r), round.parity)[0].recv, count * es);
        }
        for (uint64_t lo = part.start; lo < part.start + part.len; lo += block) {
          const uint64_t hi = std::min<uint64_t>(part.start + part.len, lo + block);
          char* mine_out = static_cast<char*>(recv) + lo * es;
          comm::weighted_mean(dtype, srcs.data(), w.data(), n, denom, mine_out, lo, hi);
          for (size_t j = 0; j < n - 1; ++j) {
            std::memcpy(static_cast<char*>(dsts[j]) + lo * es, mine_out, (hi - lo) * es);
          }
        }
      }
      engine_.barrier(round, Collective::WeightedMean, true);
      return;
    }
    // Copy path: each window's contributions in double go through the allreduce pipeline (a sum in
    // rank order from c_0, the same operations as the kernel), then one division by the total of the
    // descriptors' weights; the staging is the communicator's own (no fresh memory to fault in).
    windowed_weighted_mean(
        send, recv, count, dtype, weight, /* total_weight, set above: */ nullptr, kWeightedWindow,
        [&](double* data, size_t n) {
          const BufferRef buffer{data, data, n};
          const Concat all(std::span<const BufferRef>(&buffer, 1), sizeof(double));
          pipeline_allreduce(round, all, DType::F64, ReduceOp::Sum);
        },
        denom);
  });
}

}  // namespace

std::unique_ptr<Communicator> make_shared_memory_communicator(const Options& options, std::unique_ptr<Fabric> fabric,
                                                              JoinGroup join) {
  Options kept = options;
  kept.forming_abandoned = nullptr;  // it was for create() only
  return std::make_unique<SharedMemoryCommunicator>(kept, std::move(fabric), join);
}

}  // namespace gradsync::comm
