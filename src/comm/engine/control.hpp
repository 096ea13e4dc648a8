// SPDX-License-Identifier: Apache-2.0
#pragma once
// The control block of a group whose ranks share memory (threads of one process, or processes
// mapping one /dev/shm segment): the words the round engine agrees through, the per-rank slots,
// and the areas where ranks publish small payloads, buffer addresses and staged chunks.
//
// Plain atomics and trivially copyable data only, at fixed offsets, because the same structures
// live in process memory (thread transport) and in a segment mapped by processes of possibly
// different builds (shm transport). Only the owner of a slot writes it; group words change by CAS
// (stop, reset, a barrier's failure, a reset's resumption of the barrier word) so the first writer
// wins, or by adding (arrivals).
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "comm/call_signature.hpp"
#include "common/wait.hpp"

namespace gradsync::comm {

// A small collective's whole payload travels inline, per rank and round parity, so it needs only
// one barrier (two for an allreduce whose ranks differ on whether peers reach their buffers). The
// same threshold on every shared-memory transport.
constexpr size_t kInlineBytes = 16 * 1024;
// The copy path stages its input in chunks of this many bytes per rank, kStageDepth of them in
// flight, so that a rank can run a few chunks ahead of a descheduled peer instead of lockstepping.
constexpr size_t kChunkBytes = 256 * 1024;
constexpr uint64_t kStageDepth = 4;
// Per rank and round parity: addresses of buffers that peers read and write directly; longer
// fused lists take the copy path.
constexpr size_t kMaxTableBuffers = 256;
constexpr uint64_t kNoAddress = ~uint64_t{0};
// The most ranks a shared-memory group (threads or processes) has: its control block grows with
// the size (slots, inline areas, stages), so a size is checked before anything is allocated.
constexpr int kMaxLocalRanks = 1024;

// Why the group stopped; stored once (first cause wins) so every rank reports the same cause.
// Corrupt: a rank found a peer's published buffer outside the memory peers may publish.
// Failed: a rank left a round by an error of its own (out of memory, say) that its peers do not share.
// Shrinking: a rank began to shrink the group (comm/membership.hpp); its calls are over.
enum class StopReason : uint32_t {
  None = 0,
  Aborted = 1,
  Timeout = 2,
  PeerDied = 3,
  Left = 4,
  Corrupt = 5,
  Failed = 6,
  Shrinking = 7
};

// The stop word: reason (bits 0-7) | rank + 1 (bits 8-19) | generation modulo 4096 (bits 20-31).
// Every stop counts the generation up and a reset clears only the reason, so a reset can clear
// exactly the stop it recovers from: a newer stop has another value, and the CAS leaves it.
constexpr uint32_t kStopReasonMask = 0xffu;
constexpr uint32_t stop_code(StopReason reason, int rank, uint32_t generation) noexcept {
  return static_cast<uint32_t>(reason) | (static_cast<uint32_t>(rank + 1) << 8) | ((generation & 0xfffu) << 20);
}
constexpr StopReason stop_reason(uint32_t code) noexcept { return static_cast<StopReason>(code & kStopReasonMask); }
constexpr int stop_rank(uint32_t code) noexcept { return static_cast<int>((code >> 8) & 0xfffu) - 1; }
constexpr uint32_t stop_generation(uint32_t code) noexcept { return code >> 20; }
// The same stop, cleared (its generation kept).
constexpr uint32_t stop_cleared(uint32_t code) noexcept { return code & ~((uint32_t{1} << 20) - 1); }
// Whether stop word a is newer than b: a later generation, or the same one cleared.
constexpr bool stop_newer(uint32_t a, uint32_t b) noexcept {
  const uint32_t ahead = (stop_generation(a) - stop_generation(b)) & 0xfffu;
  return ahead != 0 ? ahead < 0x800u : (stop_reason(a) == StopReason::None && stop_reason(b) != StopReason::None);
}
// Stops the group unless it is stopped already (first cause wins). Call notify() after.
inline void raise_stop(std::atomic<uint32_t>& word, StopReason reason, int rank) noexcept {
  uint32_t cur = word.load(std::memory_order_seq_cst);
  while (
      stop_reason(cur) == StopReason::None &&
      !word.compare_exchange_weak(cur, stop_code(reason, rank, stop_generation(cur) + 1), std::memory_order_seq_cst)) {
  }
}

// The barrier word. While barriers go ahead it counts every rank's arrivals over the group's life
// (one fetch_add each, and each rank arrives at each barrier once), so barrier b (1, 2, ...) is
// complete once it reaches b x size. A rank that gives up on a barrier still short of that
// replaces the count, by CAS, with barrier_failure(b): far above any count, and naming b. The
// arrivals that follow add to it (fewer than kBarrierSpan: only ranks that had not arrived at b),
// so b is read back exactly. Completion and failure are thus ordered on one word: a barrier went
// ahead if the count reached it first, or if the failure names a later barrier; it fell if the
// failure names it. A reset puts the count back (RoundEngine::resume_barriers).
constexpr uint64_t kBarrierFailed = uint64_t{1} << 62;
constexpr uint64_t kBarrierSpan = 2 * kMaxLocalRanks;
constexpr uint64_t barrier_failure(uint64_t b) noexcept { return kBarrierFailed + b * kBarrierSpan; }
constexpr bool barrier_fell(uint64_t word) noexcept { return word >= kBarrierFailed; }
constexpr uint64_t barrier_failed_at(uint64_t word) noexcept { return (word - kBarrierFailed) / kBarrierSpan; }
enum class BarrierState { Open, WentAhead, Fell };
constexpr BarrierState barrier_state(uint64_t word, uint64_t b, uint64_t size) noexcept {
  if (barrier_fell(word)) return barrier_failed_at(word) > b ? BarrierState::WentAhead : BarrierState::Fell;
  return word >= b * size ? BarrierState::WentAhead : BarrierState::Open;
}
// The last barrier any arrival so far concerns: the one that fell, or the latest begun.
constexpr uint64_t barrier_spent(uint64_t word, uint64_t size) noexcept {
  return barrier_fell(word) ? barrier_failed_at(word) : (word + size - 1) / size;
}

// The reset word: epoch (bits 32-63) | attempt (bits 1-31) | open (bit 0). An epoch opens at
// attempt 0, moves to the next attempt when a rank gives up waiting, and closes (done) once every
// rank has asked for the same attempt. Only ever grows, so a CAS on it cannot be fooled (no ABA).
constexpr uint64_t reset_code(uint32_t epoch, uint32_t attempt, bool open) noexcept {
  return (uint64_t{epoch} << 32) | (uint64_t{attempt & 0x7fffffffu} << 1) | (open ? 1 : 0);
}
constexpr uint32_t reset_code_epoch(uint64_t code) noexcept { return static_cast<uint32_t>(code >> 32); }
constexpr uint32_t reset_code_attempt(uint64_t code) noexcept { return static_cast<uint32_t>(code >> 1) & 0x7fffffffu; }
constexpr bool reset_code_open(uint64_t code) noexcept { return (code & 1) != 0; }

// Descriptor::direct. kDirectShared: every buffer is reachable by the peers in memory they share;
// its addresses are in the table. kDirectCrossProcess (an shm allreduce past the inline size):
// this rank can copy to and from every peer's process memory (Fabric::reaches_peer_processes),
// and, unless kDirectShared is set too, the table holds its buffers' addresses in its own process.
constexpr uint32_t kDirectShared = 1;
constexpr uint32_t kDirectCrossProcess = 2;

// What a rank is about to do in a round; peers compare the calls before touching each other's data.
// Stored only when it changed (a loop repeats its calls), so that it stays valid in the peers'
// caches: keep what changes on every call out of it (the arrival stamp lives beside the barrier
// word; a weighted mean's weight is the one field that may).
//
// Parity double buffering (descriptors, stamps, tables, inline areas) keeps a round's copy until
// every peer has read it: rank r writes its parity-p copy again in round N+2 only, which it enters
// after every rank arrived at round N+1, i.e. finished reading round N; or after a reset, which
// every rank joins once its call is over.
struct Descriptor {
  CallSignature call;
  uint32_t direct;  // kDirect* bits
  uint32_t pad;
  uint64_t reserved;  // 0
  uint64_t weight;    // weighted mean: this rank's sample count

  // Field by field: a memcmp's wide loads would wait for the narrow stores that just built it.
  friend bool operator==(const Descriptor&, const Descriptor&) = default;
};
static_assert(std::is_trivially_copyable_v<Descriptor> && sizeof(Descriptor) == 64,
              "a descriptor is the one line each peer reads of a rank's call");

struct alignas(64) RankSlot {
  std::atomic<int32_t> pid;
  std::atomic<uint64_t> generation;  // shm: the segment generation this rank joined
  // The CPU this rank last arrived or published from (a hint for the waits of its peers; see
  // AdaptiveWait); -1 until it does (and for good when its own waits count as oversubscribed).
  // Written only when it changes, in a line of such words, so peers read it from their caches.
  std::atomic<int32_t> cpu{-1};
  // shm: the CPU time the cgroups of the thread that joined as this rank allow it
  // (wait_detail::cgroup_cpu_limit; 0 for no limit), written with cpu_mask: the group's CPU count
  // is at most the least of them. Here rather than beside the mask, in this line's spare room, so
  // that the slot keeps its size.
  std::atomic<int32_t> cpu_limit{0};
  // shm: a random token in this rank's process memory, and its address there, written before it
  // counts as joined. A peer that reads the token back through process_vm_readv knows both that
  // it may copy to and from this process and that the pid in this slot is this rank's (not a
  // process of another PID namespace that happens to bear the number). 0: not offered.
  std::atomic<uint64_t> reach_token{0};
  std::atomic<uint64_t> reach_token_address{0};
  // Barriers this rank has arrived at, written just before its add to the barrier word; only its
  // owner writes it. Peers poll the barrier word, not this: it names the ranks a wait is waiting
  // for, and tells a wait that must hold its buffers which live peers are done with them.
  alignas(64) std::atomic<uint64_t> arrivals;
  // Copy-path allreduce progress, in chunks counted over the group's life: staged in, own slice
  // reduced, result copied out. Peers read them to know when a stage is full or free again.
  alignas(64) std::atomic<uint64_t> staged;
  alignas(64) std::atomic<uint64_t> reduced;
  alignas(64) std::atomic<uint64_t> drained;
  // The reset attempt this rank takes part in (reset_code(epoch, attempt, open)), and its round,
  // barrier and chunk counts for it, by epoch parity.
  alignas(64) std::atomic<uint64_t> reset_request;
  // Atomics (relaxed: reset_request orders them) because a rank may post again for the next
  // attempt while a peer that saw every request of this one still reads them.
  std::atomic<uint64_t> reset_rounds[2];
  std::atomic<uint64_t> reset_arrivals[2];
  std::atomic<uint64_t> reset_chunks[2];
  std::atomic<uint32_t> reset_stop[2];  // the stop word this rank saw when it asked
  alignas(64) Descriptor desc[2];       // by round parity
  // shm: the CPUs the thread that joined as this rank may run on (wait_detail::CpuMask), written
  // before it counts as joined; the group's CPU count is read from every rank's (Fabric::cpus).
  alignas(64) std::atomic<uint64_t> cpu_mask[16];
};
// Segments of one format have one slot layout: a field added in a line's spare room keeps it.
static_assert(sizeof(RankSlot) == 640 && offsetof(RankSlot, arrivals) == 64 && offsetof(RankSlot, desc) == 384 &&
                  offsetof(RankSlot, reach_token_address) + 8 <= 64,
              "RankSlot's layout changed: change the segment format (shm::kFormatVersion) and its fuzz seeds");

// The group's own words.
struct GroupWords {
  WaitWord wake;  // every wait of the group sleeps here
  // Why the group stopped (stop_code); a reason makes every abortable wait return.
  alignas(64) std::atomic<uint32_t> stop_word;
  // reset_code of the latest reset epoch: one CAS decides, for every rank, whether an attempt
  // went ahead (closed) or was given up (moved to the next attempt).
  alignas(64) std::atomic<uint64_t> reset_state;
};

static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free);

struct BufferAddress {
  uint64_t send;
  uint64_t recv;
};

// The membership words of a group (comm/membership.hpp): what the survivors of a lost member
// agree through when they shrink it. Touched only by a shrink, so they sit apart from the round's
// lines. The decision word holds the latest decided shrink attempt: shrink_code(epoch, winner),
// set by CAS from an older epoch, so each epoch is decided once, by one rank, whose proposal
// (MemberSlot::failed) every rank then reads.
constexpr uint64_t kMemberWords = kMaxLocalRanks / 64;
struct alignas(64) MemberSlot {
  std::atomic<uint64_t> request;  // the latest shrink epoch this rank entered
  // The epoch whose proposal `failed` holds, 0 while it is written: a reader that finds the same
  // epoch before and after reading the bits read that epoch's proposal whole.
  std::atomic<uint64_t> tag;
  std::atomic<uint64_t> nonce;                 // names the group that epoch's members form
  std::atomic<uint64_t> failed[kMemberWords];  // bit r: rank r is out
};
struct alignas(64) MembershipWords {
  std::atomic<uint64_t> decision;
};
constexpr uint64_t shrink_code(uint64_t epoch, int winner) noexcept {
  return (epoch << 20) | static_cast<uint64_t>(winner + 1);
}
constexpr uint64_t shrink_epoch(uint64_t code) noexcept { return code >> 20; }
constexpr int shrink_winner(uint64_t code) noexcept { return static_cast<int>(code & 0xfffffu) - 1; }

// Where each part of the control block lies, as offsets from its start (after `header_bytes`).
// barrier: the barrier word (see barrier_state), then every rank's arrival stamp by round parity
// (int64_t, Telemetry::stamp), in the same line for groups of up to 3 ranks. Every rank arrives on
// the word and every waiter polls it, so a barrier costs each rank one atomic add and the polls of
// one line, and the stamps of a round's arrivals travel with it: a rank stores its stamp in the
// line its add then finds in its cache, and a waiter reads them from the copy its polls brought.
struct ControlLayout {
  uint64_t barrier, slots, tables, inline_data, stage_in, stage_out, membership, end;
};
ControlLayout control_layout(int size, uint64_t header_bytes) noexcept;
// Constructs the shared words of a control block of `l` in zeroed memory at `block`.
void construct_control(char* block, const ControlLayout& l, int size) noexcept;

// A view of one group's control block: where each rank's slot and areas are, and how a
// published address becomes a pointer in this process.
class ControlArea {
 public:
  ControlArea() = default;
  // `block` holds the layout computed for `size`; `words` may lie inside it (shm header) or not.
  // Published addresses are offsets from address_base (0 for plain pointers).
  ControlArea(GroupWords* words, char* block, const ControlLayout& layout, int size, uintptr_t address_base) noexcept
      : words_(words),
        barrier_(reinterpret_cast<std::atomic<uint64_t>*>(block + layout.barrier)),
        stamps_(reinterpret_cast<int64_t*>(block + layout.barrier + sizeof(std::atomic<uint64_t>))),
        slots_(reinterpret_cast<RankSlot*>(block + layout.slots)),
        tables_(reinterpret_cast<BufferAddress*>(block + layout.tables)),
        inline_(block + layout.inline_data),
        in_(block + layout.stage_in),
        out_(block + layout.stage_out),
        membership_(reinterpret_cast<MembershipWords*>(block + layout.membership)),
        members_(reinterpret_cast<MemberSlot*>(block + layout.membership + sizeof(MembershipWords))),
        size_(size),
        address_base_(address_base) {}

  GroupWords& words() const noexcept { return *words_; }
  std::atomic<uint64_t>& barrier() const noexcept { return *barrier_; }
  // Rank r's arrival stamp in the rounds of `parity`: written by r before it arrives, read by its
  // peers once every rank arrived (parity double buffering keeps it until they have read it).
  int64_t& arrival_stamp(int r, uint64_t parity) const noexcept {
    return stamps_[static_cast<uint64_t>(r) * 2 + parity];
  }
  RankSlot& slot(int r) const noexcept { return slots_[r]; }
  BufferAddress* table(int r, uint64_t parity) const noexcept {
    return tables_ + (static_cast<uint64_t>(r) * 2 + parity) * kMaxTableBuffers;
  }
  // Publishes this rank's i-th buffer addresses for the round of `parity`, storing them only when
  // they changed: a training loop passes the same buffers every step, and a line left unwritten
  // stays valid in the peers' caches instead of missing there every round.
  void publish_address(int r, uint64_t parity, size_t i, BufferAddress a) const noexcept {
    BufferAddress& entry = table(r, parity)[i];
    if (entry.send != a.send || entry.recv != a.recv) entry = a;
  }
  char* inline_area(int r, uint64_t parity) const noexcept {
    return inline_ + (static_cast<uint64_t>(r) * 2 + parity) * kInlineBytes;
  }
  char* in_area(int r, uint64_t stage) const noexcept {
    return in_ + (static_cast<uint64_t>(r) * kStageDepth + stage % kStageDepth) * kChunkBytes;
  }
  char* out_area(uint64_t stage) const noexcept { return out_ + (stage % kStageDepth) * kChunkBytes; }
  char* at(uint64_t address) const noexcept { return reinterpret_cast<char*>(address_base_ + address); }
  MembershipWords& membership() const noexcept { return *membership_; }
  MemberSlot& member(int r) const noexcept { return members_[r]; }
  // The pointer for a peer's published [address, address + bytes), or nullptr when the range is
  // not inside the memory peers may publish (set_reachable): a member gone bad cannot make its
  // peers read or write elsewhere.
  char* reach(uint64_t address, uint64_t bytes) const noexcept {
    if (address < reach_lo_ || address > reach_hi_ || bytes > reach_hi_ - address) return nullptr;
    return at(address);
  }
  void set_reachable(uint64_t lo, uint64_t hi) noexcept {
    reach_lo_ = lo;
    reach_hi_ = hi;
  }
  int size() const noexcept { return size_; }

 private:
  GroupWords* words_ = nullptr;
  std::atomic<uint64_t>* barrier_ = nullptr;
  int64_t* stamps_ = nullptr;
  RankSlot* slots_ = nullptr;
  BufferAddress* tables_ = nullptr;
  char* inline_ = nullptr;
  char* in_ = nullptr;
  char* out_ = nullptr;
  MembershipWords* membership_ = nullptr;
  MemberSlot* members_ = nullptr;
  int size_ = 0;
  uintptr_t address_base_ = 0;
  uint64_t reach_lo_ = 0;
  uint64_t reach_hi_ = ~uint64_t{0};
};

}  // namespace gradsync::comm
