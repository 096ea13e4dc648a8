#pragma once
// The shared-memory segment of one shm group ("gradsync.<name>" in /dev/shm): its layout, the
// rendezvous that creates, joins or reclaims it, the liveness of its members, and the per-rank
// heap that gradsync_comm_alloc carves buffers from.
//
// Invariants of the layout (format kFormatVersion):
// - Header.magic is written last, with release order, by the creator holding the set-up lock;
//   a segment whose magic, version or size disagree is half-initialised and is rebuilt.
// - Liveness is not a PID alone (a SIGKILLed child stays a zombie, and kill(pid, 0) succeeds on
//   it until its parent reaps it): rank r holds an open-file-description lock on byte kRankLockByte+r
//   of the segment's file, which the kernel drops when the process dies. kill(pid, 0) is checked too.
// - A group is joinable only while state == Open. The first member that leaves (or sees a peer
//   die) sets Closing, so nobody joins a half-dead group; the last member to leave removes the
//   name, and a joiner that finds Closing waits until the survivors have left, then rebuilds.
// - Every shared word is a lock-free std::atomic (address-free, so valid across processes).
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>

#include "comm/call_signature.hpp"
#include "common/wait.hpp"

namespace gradsync::comm::shm {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kSegmentMagic = 0x4D485347u;  // "GSHM" read as little-endian bytes
constexpr uint32_t kFormatVersion = 3;
// Per rank, per round parity: a small collective's whole payload travels inline here, so it
// needs only one barrier.
constexpr size_t kSmallBytes = 16 * 1024;
// The copy path stages its input in chunks of this many bytes per rank, kStageDepth of them in
// flight, so that a rank can run a few chunks ahead of a descheduled peer instead of lockstepping.
constexpr size_t kChunkBytes = 256 * 1024;
constexpr uint64_t kStageDepth = 4;
// Per rank, per round parity: offsets of zero-copy buffers; longer fused lists take the copy path.
constexpr size_t kMaxTableBuffers = 256;
constexpr uint64_t kNoOffset = ~uint64_t{0};
constexpr off_t kSetupLockByte = 0;
constexpr off_t kRankLockByte = 1;
constexpr int kMaxRanks = 1024;

enum class GroupState : uint32_t { Open = 0, Closing = 1 };
// Why the group stopped; stored in the segment so every rank reports the same cause.
enum class StopReason : uint32_t { None = 0, Aborted = 1, Timeout = 2, PeerDied = 3, Left = 4 };

// The stop word: reason (bits 0-7) | rank + 1 (bits 8-19) | reset epoch modulo 4096 (bits 20-31).
// The epoch lets a reset clear only the stops older than itself.
constexpr uint32_t stop_code(StopReason reason, int rank, uint32_t epoch) noexcept {
  return static_cast<uint32_t>(reason) | (static_cast<uint32_t>(rank + 1) << 8) | ((epoch & 0xfffu) << 20);
}
constexpr StopReason stop_reason(uint32_t code) noexcept { return static_cast<StopReason>(code & 0xffu); }
constexpr int stop_rank(uint32_t code) noexcept { return static_cast<int>((code >> 8) & 0xfffu) - 1; }
constexpr uint32_t stop_epoch(uint32_t code) noexcept { return code >> 20; }

// What a rank is about to do in a round; peers compare the calls before touching each other's data.
struct Descriptor {
  CallSignature call;
  uint32_t zero_copy;  // every buffer lies in this rank's heap; offsets in the table
  uint32_t pad;
  uint64_t round;
};

struct alignas(64) RankSlot {
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> reset_request;  // the reset epoch this rank asks for
  std::atomic<uint64_t> generation;     // the segment generation this rank joined
  // Barriers this rank has arrived at; only its owner writes it. A barrier completes when every
  // rank's count reaches it, so a count never needs rewinding (reset adopts the maximum).
  alignas(64) std::atomic<uint64_t> arrivals;
  // Copy-path allreduce progress, in chunks counted over the group's life: staged in, own slice
  // reduced, result copied out. Peers read them to know when a stage is full or free again.
  alignas(64) std::atomic<uint64_t> staged;
  alignas(64) std::atomic<uint64_t> reduced;
  alignas(64) std::atomic<uint64_t> drained;
  uint64_t reset_rounds[2];    // this rank's round, arrival and chunk counts when it asked for a reset,
  uint64_t reset_arrivals[2];  // by epoch parity
  uint64_t reset_chunks[2];
  alignas(64) Descriptor desc[2];  // indexed by round parity
};

struct BufferOffsets {
  uint64_t send;
  uint64_t recv;
};

struct Header {
  std::atomic<uint32_t> magic;
  uint32_t format_version;
  uint64_t generation;
  int32_t size;
  int32_t creator_pid;
  uint64_t total_bytes;
  uint64_t control_bytes;
  uint64_t slots_offset;
  uint64_t tables_offset;
  uint64_t small_offset;
  uint64_t in_offset;
  uint64_t out_offset;
  uint64_t heap_offset;
  uint64_t heap_bytes_per_rank;
  WaitWord barrier_wake;
  // Why the group stopped (stop_code), set once (first cause wins); non-zero makes every abortable
  // waiter return.
  alignas(64) std::atomic<uint32_t> stop_word;
  std::atomic<uint32_t> reset_epoch;  // completed resets
  // (round << 1) | aborted for the latest round whose fate is decided: one CAS decides whether a
  // round runs (every rank arrived) or not, so no rank returns while a peer still uses its buffers.
  alignas(64) std::atomic<uint64_t> decision;
  alignas(64) std::atomic<uint32_t> state;  // a GroupState
  std::atomic<uint32_t> joined;
};

static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free);

struct Layout {
  uint64_t slots_offset, tables_offset, small_offset, in_offset, out_offset, heap_offset;
  uint64_t control_bytes, heap_bytes_per_rank, total_bytes;
};
Layout compute_layout(int size, uint64_t heap_bytes_per_rank);

// "gradsync." + the group name, with bytes outside [A-Za-z0-9._-] escaped as %XX.
std::string segment_name(const std::string& group);

class Segment {
 public:
  // Joins group `name` as `rank` of `size`: creates the segment, joins a forming one, or
  // reclaims one left by a crashed run; returns when all `size` ranks have joined.
  static std::unique_ptr<Segment> join(const std::string& name, int rank, int size, Clock::time_point deadline);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  Header& header() const noexcept { return *header_; }
  RankSlot& slot(int r) const noexcept;
  BufferOffsets* table(int r, uint64_t parity) const noexcept;
  char* small_area(int r, uint64_t parity) const noexcept;
  char* in_area(int r, uint64_t stage) const noexcept;  // stage is taken modulo kStageDepth
  char* out_area(uint64_t stage) const noexcept;
  char* base() const noexcept { return base_; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const std::string& group() const noexcept { return group_; }

  // False once rank r's process has died (its lock is gone or its PID no longer exists).
  bool alive(int r) const;
  // Marks the group unjoinable: used when a peer died, so nobody joins what is left of it.
  void close_group() noexcept;

  // Offset of p in the segment when [p, p+bytes) lies inside this rank's own heap, else kNoOffset.
  uint64_t own_heap_offset(const void* p, size_t bytes) const noexcept;
  // Allocates in this rank's heap (page-granular, backed by posix_fallocate so touching it can
  // never SIGBUS); E_NO_SPACE when /dev/shm or the heap is full.
  void* allocate(size_t bytes);
  // Returns a pointer from allocate(); false when p is not one.
  bool deallocate(void* p);

 private:
  Segment() = default;
  void leave() noexcept;

  std::string group_;
  std::string shm_name_;
  int rank_ = 0;
  int size_ = 0;
  int fd_ = -1;
  boost::interprocess::shared_memory_object object_;
  boost::interprocess::mapped_region region_;
  char* base_ = nullptr;
  Header* header_ = nullptr;
  // This rank's heap: free ranges and live allocations, by offset within the heap.
  std::map<uint64_t, uint64_t> free_;
  std::map<uint64_t, uint64_t> used_;
};

}  // namespace gradsync::comm::shm
