// SPDX-License-Identifier: Apache-2.0
#pragma once
// The shared-memory segment of one shm group ("gradsync.<name>" in /dev/shm): its layout, the
// rendezvous that creates, joins or reclaims it, the liveness of its members, and the per-rank
// heap that gradsync_comm_alloc carves buffers from.
//
// Invariants of the layout (format kFormatVersion):
// - Header.magic is written last, with release order, by the creator holding the set-up lock;
//   a segment whose magic, version or size disagree is half-initialised and is rebuilt, unless it
//   is another build's format with a live member (refused: E_MISMATCH).
// - Liveness is not a PID alone (a SIGKILLed child stays a zombie, and kill(pid, 0) succeeds on
//   it until its parent reaps it): rank r holds an open-file-description lock on byte kRankLockByte+r
//   of the segment's file, which the kernel drops when the process dies; its pid is checked too
//   (common/liveness.hpp).
// - A group is joinable only while state == Open. The first member that leaves (or sees a peer
//   die) sets Closing, so nobody joins a half-dead group; the last member to leave removes the
//   name (a member being killed, whose lock the kernel has yet to drop, counts as gone), and a
//   joiner that finds Closing waits until the survivors have left, then rebuilds.
// - Every shared word is a lock-free std::atomic (address-free, so valid across processes).
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>

#include "comm/engine/control.hpp"
#include "common/mapguard.hpp"
#include "common/wait.hpp"

namespace gradsync::comm::shm {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kSegmentMagic = 0x4D485347u;  // "GSHM" read as little-endian bytes
constexpr uint32_t kFormatVersion = 11;
constexpr off_t kSetupLockByte = 0;
constexpr off_t kRankLockByte = 1;
constexpr int kMaxRanks = kMaxLocalRanks;

enum class GroupState : uint32_t { Open = 0, Closing = 1 };
struct Header {
  std::atomic<uint32_t> magic;
  uint32_t format_version;
  uint64_t generation;
  int32_t size;
  int32_t creator_pid;
  uint64_t total_bytes;
  uint64_t heap_offset;
  uint64_t heap_bytes_per_rank;
  alignas(64) std::atomic<uint32_t> state;  // a GroupState
  std::atomic<uint32_t> joined;
  // A joiner refused while the group forms (it claims another size, or a rank already claimed)
  // leaves its rank, size and pid here (pid last), so the forming members fail at once rather than
  // wait out their deadline for it.
  std::atomic<int32_t> refused_rank;
  std::atomic<int32_t> refused_size;
  std::atomic<int32_t> refused_pid;
  // The round engine's words; the rest of its control block follows the header (control_layout).
  GroupWords words;
};

static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free);

// The segment: the header, the round engine's control block, then one heap per rank. Always
// computed here from the size, never read from the segment, so a member gone bad cannot move it.
struct Layout {
  ControlLayout control;
  uint64_t heap_offset, heap_bytes_per_rank, total_bytes;
};
Layout compute_layout(int size, uint64_t heap_bytes_per_rank);

// "gradsync." + the group name, with bytes outside [A-Za-z0-9._-] escaped as %XX.
std::string segment_name(const std::string& group);
// Removes group `name`'s segment name, for a group whose members are all gone with nobody left to
// leave it (its mappings stay valid); nothing when there is none.
void remove_segment_name(const std::string& name) noexcept;

class Segment {
 public:
  // Joins group `name` as `rank` of `size`: creates the segment, joins a forming one, or
  // reclaims one left by a crashed run; returns when all `size` ranks have joined. abandoned (when
  // set) is asked while waiting for them: a non-empty answer gives up with E_REMOTE.
  static std::unique_ptr<Segment> join(const std::string& name, int rank, int size, Clock::time_point deadline,
                                       const std::function<std::string()>& abandoned = {});
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  Header& header() const noexcept { return *header_; }
  // The round engine's control block in this segment; published addresses are segment offsets.
  const ControlArea& control() const noexcept { return control_; }
  RankSlot& slot(int r) const noexcept { return control_.slot(r); }
  char* base() const noexcept { return base_; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  // How many members can each have a CPU of its own (Fabric::cpus), by the masks and CPU limits
  // their slots held when the group formed: read once, so that a member gone bad cannot change it
  // under a call.
  int cpus() const noexcept { return cpus_; }
  const std::string& group() const noexcept { return group_; }

  // False once rank r's process has died (its lock is gone or its PID no longer exists).
  bool alive(int r) const;
  // Throws E_IO once the segment's file is shorter than the group's layout (a process truncated
  // /dev/shm/gradsync.<name>) or a touch of the missing part faulted (the mapping is anonymous
  // memory now, common/mapguard.hpp). The waits check it with liveness, so every member fails
  // within one liveness interval instead of dying of SIGBUS or waiting out its deadline.
  void check_intact() const;
  // Marks the group unjoinable: used when a peer died, so nobody joins what is left of it.
  void close_group() noexcept;

  // Whether this rank can copy to and from every peer's process (process_vm_readv/writev): each
  // peer's reach_token was read back from its process as the group formed. Not when
  // GRADSYNC_SHM_CROSS_PROCESS=0, nor where the kernel refuses (another user, a non-dumpable
  // process, a seccomp filter, another PID namespace).
  bool reaches_peers() const noexcept { return reaches_peers_; }
  // process_vm_readv/writev with rank r's process, as it joined; false unless every byte moved.
  bool peer_copy(int r, uint64_t address, void* local, size_t bytes, bool write) const noexcept;

  // Offset of p in the segment when [p, p+bytes) lies inside this rank's own heap, else kNoAddress.
  uint64_t own_heap_offset(const void* p, size_t bytes) const noexcept;
  // Allocates in this rank's heap (page-granular, backed by posix_fallocate so touching it can
  // never SIGBUS, and asked to be mapped at once where the kernel can (MADV_POPULATE_WRITE));
  // E_NO_SPACE when /dev/shm or the heap is full.
  void* allocate(size_t bytes);
  // Returns a pointer from allocate(); false when p is not one.
  bool deallocate(void* p);
  // In a child forked from the member: unmaps the segment and closes this process's descriptor,
  // touching nothing the group shares (the rank's lock belongs to the open file, which the parent
  // keeps). The segment is then never used again, and its destructor does nothing.
  void release_after_fork() noexcept;

 private:
  Segment() = default;
  void leave() noexcept;
  // Sets reaches_peers_ (see reaches_peers), once every rank has joined.
  void probe_peers();

  std::string group_;
  std::string shm_name_;
  int rank_ = 0;
  int size_ = 0;
  int cpus_ = 1;
  int fd_ = -1;
  boost::interprocess::shared_memory_object object_;
  boost::interprocess::mapped_region region_;
  mapguard::Registration guard_;  // declared after region_: forgotten before the unmap
  char* base_ = nullptr;
  Header* header_ = nullptr;
  Layout layout_{};
  ControlArea control_;
  // Read back by the peers (RankSlot::reach_token); lives as long as the group, at a fixed address.
  uint64_t reach_token_ = 0;
  bool reaches_peers_ = false;
  std::vector<pid_t> peer_pids_;  // as the peers joined: a slot rewritten later cannot redirect a copy
  // This rank's heap: free ranges and live allocations, by offset within the heap.
  std::map<uint64_t, uint64_t> free_;
  std::map<uint64_t, uint64_t> used_;
};

}  // namespace gradsync::comm::shm
