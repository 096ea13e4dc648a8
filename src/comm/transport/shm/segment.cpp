// SPDX-License-Identifier: Apache-2.0
#include "comm/transport/shm/segment.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <vector>

#include <boost/interprocess/exceptions.hpp>

#include "common/bounded_wait.hpp"
#include "common/error.hpp"
#include "common/liveness.hpp"
#include "common/log.hpp"
#include "common/ofd_lock.hpp"
#include "common/random.hpp"

namespace gradsync::comm::shm {
namespace bip = boost::interprocess;
namespace {

constexpr uint64_t kPage = 4096;
// Joiners poll the set-up state; joining is rare, so a short sleep beats any cleverness.
constexpr auto kPollInterval = std::chrono::microseconds(200);
// The last member leaving polls the locks of members being killed at most this far apart.
constexpr auto kDyingPoll = std::chrono::milliseconds(5);
// The heap of each rank is reserved (sparse) at this size or the size of /dev/shm, whichever is
// smaller; only allocated pages take space.
constexpr uint64_t kMaxHeapBytesPerRank = uint64_t{32} << 30;

constexpr uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// The file behind fd is still the one the name refers to (a leaver may have removed the name
// between our open and our lock).
bool still_linked(int fd, const std::string& shm_name) {
  struct stat by_fd {
  }, by_name{};
  if (fstat(fd, &by_fd) != 0) return false;
  if (stat(("/dev/shm/" + shm_name).c_str(), &by_name) != 0) return false;
  return by_fd.st_ino == by_name.st_ino && by_fd.st_dev == by_name.st_dev;
}

uint64_t shm_available(int fd) {
  struct statvfs vfs {};
  if (fstatvfs(fd, &vfs) != 0) fail(GRADSYNC_E_IO, "fstatvfs on /dev/shm failed: {}", std::strerror(errno));
  return static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
}

uint64_t shm_capacity(int fd) {
  struct statvfs vfs {};
  if (fstatvfs(fd, &vfs) != 0) fail(GRADSYNC_E_IO, "fstatvfs on /dev/shm failed: {}", std::strerror(errno));
  return static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize;
}

// Every member maps every rank's heap (peers read buffers in place), so the group's address space
// is size x heap. Under an address-space limit (ulimit -v) the heaps share a quarter of it, leaving
// the rest to the process: a group must not fail to map, or starve its host, for space it may
// never use.
uint64_t heap_budget_per_rank(int size) {
  rlimit rl{};
  if (getrlimit(RLIMIT_AS, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return ~uint64_t{0};
  return static_cast<uint64_t>(rl.rlim_cur) / 4 / static_cast<uint64_t>(size) / kPage * kPage;
}

// Backs [offset, offset+bytes) with real pages now, so that a later touch cannot SIGBUS.
void reserve_space(int fd, uint64_t offset, uint64_t bytes, const std::string& what) {
  const uint64_t avail = shm_available(fd);
  GS_REQUIRE(bytes <= avail, GRADSYNC_E_NO_SPACE, "{} needs {} bytes but /dev/shm has only {} bytes available", what,
             bytes, avail);
  const int rc = posix_fallocate(fd, static_cast<off_t>(offset), static_cast<off_t>(bytes));
  if (rc == ENOSPC) fail(GRADSYNC_E_NO_SPACE, "{} needs {} bytes but /dev/shm is full", what, bytes);
  if (rc != 0) fail(GRADSYNC_E_IO, "posix_fallocate of {} bytes for {} failed: {}", bytes, what, std::strerror(rc));
}

uint64_t new_generation() {
  std::random_device rd;
  const uint64_t r = (uint64_t{rd()} << 32) ^ rd();
  return (r ^ static_cast<uint64_t>(Clock::now().time_since_epoch().count()) ^ (uint64_t(getpid()) << 16)) | 1;
}

// A segment that another user created, or that others may open, could be read or rewritten under
// the group (its gradients, its control words): refuse it before reading a byte. Ours are created
// 0600 (O_EXCL), so this only ever refuses a segment someone else put there.
void require_private(int fd, const std::string& shm_name, const std::string& group) {
  struct stat st {};
  if (fstat(fd, &st) != 0) fail(GRADSYNC_E_IO, "fstat of /dev/shm/{} failed: {}", shm_name, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) fail(GRADSYNC_E_PERMISSION, "/dev/shm/{} is not a regular file", shm_name);
  if (st.st_uid != geteuid()) {
    fail(GRADSYNC_E_PERMISSION,
         "shared-memory segment /dev/shm/{} belongs to uid {}, not to this user (uid {}): "
         "another user created group '{}' first; refusing to use it (pick another name)",
         shm_name, st.st_uid, geteuid(), group);
  }
  if ((st.st_mode & 077) != 0) {
    fail(GRADSYNC_E_PERMISSION,
         "shared-memory segment /dev/shm/{} has mode {:04o}, which lets other users open it; "
         "refusing to use it (remove it, or make it 0600)",
         shm_name, st.st_mode & 07777);
  }
}

// Written under the set-up lock by a joiner that a forming group refuses: the group cannot form
// as configured, and its members learn it at their next poll.
void refuse_forming(const bip::shared_memory_object& object, int rank, int size) {
  bip::mapped_region mark(object, bip::read_write, 0, sizeof(Header));
  const mapguard::Registration guard(mark.get_address(), mark.get_size(), PROT_READ | PROT_WRITE);
  Header* h = static_cast<Header*>(mark.get_address());
  h->refused_rank.store(rank, std::memory_order_relaxed);
  h->refused_size.store(size, std::memory_order_relaxed);
  h->refused_pid.store(static_cast<int32_t>(getpid()), std::memory_order_release);
}

}  // namespace

Layout compute_layout(int size, uint64_t heap_bytes_per_rank) {
  Layout l{};
  l.control = control_layout(size, sizeof(Header));
  l.heap_offset = l.control.end;
  l.heap_bytes_per_rank = heap_bytes_per_rank;
  l.total_bytes = l.heap_offset + static_cast<uint64_t>(size) * heap_bytes_per_rank;
  return l;
}

void remove_segment_name(const std::string& name) noexcept {
  try {
    bip::shared_memory_object::remove(segment_name(name).c_str());
  } catch (...) {  // out of memory for the name: the segment stays, as a crash would leave it
  }
}

std::string segment_name(const std::string& group) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out = "gradsync.";
  for (unsigned char c : group) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
        c == '-') {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

std::unique_ptr<Segment> Segment::join(const std::string& name, int rank, int size, Clock::time_point deadline,
                                       const std::function<std::string()>& abandoned) {
  GS_REQUIRE(size <= kMaxRanks, GRADSYNC_E_INVALID_ARG, "shm group size {} exceeds the maximum {}", size, kMaxRanks);
  std::unique_ptr<Segment> seg(new Segment());
  seg->group_ = name;
  seg->shm_name_ = segment_name(name);
  seg->rank_ = rank;
  seg->size_ = size;
  const std::string& shm_name = seg->shm_name_;

  // What this rank publishes of its CPUs, read before the set-up lock is taken: the limit parses
  // /proc/self/mountinfo, which can be long.
  const wait_detail::CpuMask cpu_mask = wait_detail::usable_cpu_mask();
  const int cpu_limit = wait_detail::cgroup_cpu_limit();

  // Phase 1, under the set-up lock: find a joinable segment (building or rebuilding it as
  // needed) and claim our rank in it. The first attempt is made whatever the deadline.
  std::string waiting_for;  // why we are still polling, for the timeout message
  auto claim = [&]() -> WaitResult {
    bip::shared_memory_object object;
    try {
      object =
          bip::shared_memory_object(bip::open_or_create, shm_name.c_str(), bip::read_write, bip::permissions(0600));
    } catch (const bip::interprocess_exception& e) {
      if (e.get_native_error() == EACCES) {
        fail(GRADSYNC_E_PERMISSION,
             "cannot open shared-memory segment /dev/shm/{}: it belongs to another user "
             "(someone else uses the group name '{}'; pick another)",
             shm_name, name);
      }
      fail(GRADSYNC_E_IO, "cannot open shared-memory segment /dev/shm/{}: {}", shm_name, e.what());
    }
    const int fd = object.get_mapping_handle().handle;
    require_private(fd, shm_name, name);
    if (!ofd_lock(fd, kSetupLockByte, F_WRLCK)) return WaitResult::Timeout;
    struct Unlock {
      int fd;
      ~Unlock() { ofd_lock(fd, kSetupLockByte, F_UNLCK); }
    } unlock_setup{fd};
    if (!still_linked(fd, shm_name)) return WaitResult::Timeout;  // removed by a leaver in between: start over

    struct stat st {};
    if (fstat(fd, &st) != 0) fail(GRADSYNC_E_IO, "fstat of /dev/shm/{} failed: {}", shm_name, std::strerror(errno));
    const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);

    bool valid = false, live = false, open_state = false, formed = false;
    int existing_size = 0, existing_creator = 0;
    uint64_t heap_bytes = 0;  // per rank, as validated against the file's size
    if (file_bytes >= sizeof(Header)) {
      bip::mapped_region peek(object, bip::read_only, 0, sizeof(Header));
      // Every short-lived view is guarded too: a process may truncate the file as we read it.
      const mapguard::Registration peek_guard(peek.get_address(), peek.get_size(), PROT_READ);
      const Header* h = static_cast<const Header*>(peek.get_address());
      if (h->magic.load(std::memory_order_acquire) == kSegmentMagic && h->format_version == kFormatVersion &&
          h->size >= 1 && h->size <= kMaxRanks && h->total_bytes == file_bytes) {
        const Layout l = compute_layout(h->size, h->heap_bytes_per_rank);
        valid = l.total_bytes == h->total_bytes && l.heap_offset == h->heap_offset;
        heap_bytes = h->heap_bytes_per_rank;
      }
      if (!valid && h->magic.load(std::memory_order_acquire) == kSegmentMagic && h->format_version != kFormatVersion) {
        // A segment of another build's format: rebuilding it would pull it from under its
        // members, if any is alive. Refused, so neither run loses a call.
        bool held = false;
        for (int r = 0; r < kMaxRanks && !held; ++r) held = ofd_held_by_other(fd, kRankLockByte + r);
        if (held) {
          fail(GRADSYNC_E_MISMATCH,
               "shm group '{}': /dev/shm/{} is in use by processes of another libgradsync build (segment format {}, "
               "this build's {}); run every member with the same build, or use another group name",
               name, shm_name, h->format_version, kFormatVersion);
        }
      }
      if (valid) {
        existing_size = h->size;
        existing_creator = h->creator_pid;
        open_state = h->state.load(std::memory_order_acquire) == static_cast<uint32_t>(GroupState::Open);
        formed = h->joined.load(std::memory_order_acquire) >= static_cast<uint32_t>(h->size);
        for (int r = 0; r < h->size && !live; ++r) live = ofd_held_by_other(fd, kRankLockByte + r);
      }
    }

    if (valid && live) {
      if (open_state && formed && existing_size == size && !ofd_held_by_other(fd, kRankLockByte + rank)) {
        // Every rank joined once, yet a rank's lock is free: that member died unnoticed. Its
        // place in a running group cannot be taken over; the group must end first.
        bip::mapped_region mark(object, bip::read_write, 0, sizeof(Header));
        const mapguard::Registration mark_guard(mark.get_address(), mark.get_size(), PROT_READ | PROT_WRITE);
        static_cast<Header*>(mark.get_address())->state.store(static_cast<uint32_t>(GroupState::Closing));
        open_state = false;
      }
      if (!open_state) {
        // Survivors of a failed or finished run still hold it: wait for them to leave.
        waiting_for = fmt::format("the previous group of that name is still held by members that have not freed it");
        return WaitResult::Timeout;
      }
      if (existing_size != size) {
        if (!formed) refuse_forming(object, rank, size);
        fail(GRADSYNC_E_MISMATCH,
             "shm group '{}': this member (rank {}) says size {}, but the group was created with size {} (by pid {})",
             name, rank, size, existing_size, existing_creator);
      }
    } else {
      // Fresh, half-initialised, or left by a run whose members are all dead: build it anew.
      if (valid) {
        GS_LOG_WARN("shm group '{}': reclaiming the segment /dev/shm/{} left by a run whose members all died", name,
                    shm_name);
      }
      const uint64_t heap =
          std::min({kMaxHeapBytesPerRank, align_up(shm_capacity(fd), kPage), heap_budget_per_rank(size)});
      const Layout l = compute_layout(size, heap);
      heap_bytes = heap;
      bip::mapped_region init;
      try {
        object.truncate(0);  // drops every old byte: nothing of a stale run survives
        object.truncate(static_cast<bip::offset_t>(l.total_bytes));
        reserve_space(fd, 0, l.heap_offset, fmt::format("the control area of shm group '{}'", name));
        init = bip::mapped_region(object, bip::read_write, 0, l.heap_offset);
      } catch (...) {
        // Nobody else uses it (we hold the set-up lock, no member is alive): leave no junk behind.
        bip::shared_memory_object::remove(shm_name.c_str());
        try {
          throw;
        } catch (const bip::interprocess_exception& e) {
          fail(GRADSYNC_E_IO, "cannot set up shared-memory segment /dev/shm/{}: {}", shm_name, e.what());
        }
      }
      Header* h = new (init.get_address()) Header();
      h->format_version = kFormatVersion;
      h->generation = new_generation();
      h->size = size;
      h->creator_pid = static_cast<int32_t>(getpid());
      h->total_bytes = l.total_bytes;
      h->heap_offset = l.heap_offset;
      h->heap_bytes_per_rank = l.heap_bytes_per_rank;
      construct_control(static_cast<char*>(init.get_address()), l.control, size);
      h->magic.store(kSegmentMagic, std::memory_order_release);
    }

    // Claim the rank: its lock is our liveness for as long as the process lives.
    if (!ofd_lock(fd, kRankLockByte + rank, F_WRLCK)) {
      if (valid && !formed) refuse_forming(object, rank, size);
      // The holder's pid, for the message: read where the size checked above puts its slot, and
      // only if the file (which any process may have changed since) still reaches that far.
      int32_t holder = 0;
      const uint64_t slot_end =
          control_layout(size, sizeof(Header)).slots + (static_cast<uint64_t>(rank) + 1) * sizeof(RankSlot);
      struct stat now {};
      if (fstat(fd, &now) == 0 && static_cast<uint64_t>(now.st_size) >= slot_end) {
        bip::mapped_region peek(object, bip::read_only, 0, slot_end);
        const mapguard::Registration peek_guard(peek.get_address(), peek.get_size(), PROT_READ);
        holder = reinterpret_cast<const RankSlot*>(static_cast<const char*>(peek.get_address()) + slot_end -
                                                   sizeof(RankSlot))
                     ->pid.load();
      }
      fail(GRADSYNC_E_MISUSE, "rank {} of shm group '{}' has already joined (pid {}) and is alive", rank, name, holder);
    }
    seg->object_.swap(object);
    seg->fd_ = fd;
    try {
      seg->region_ = bip::mapped_region(seg->object_, bip::read_write);
    } catch (const bip::interprocess_exception& e) {
      ofd_lock(fd, kRankLockByte + rank, F_UNLCK);
      struct stat now {};
      fstat(fd, &now);
      // Leave nothing behind: with no member left (we hold the set-up lock), the segment goes.
      bool others = false;
      for (int r = 0; r < size && !others; ++r) others = ofd_held_by_other(fd, kRankLockByte + r);
      if (!others) bip::shared_memory_object::remove(shm_name.c_str());
      fail(e.get_native_error() == ENOMEM ? GRADSYNC_E_NOMEM : GRADSYNC_E_IO,
           "cannot map shared-memory segment /dev/shm/{} ({} bytes of address space for {} ranks): {}", shm_name,
           static_cast<uint64_t>(now.st_size), size, e.what());
    }
    seg->base_ = static_cast<char*>(seg->region_.get_address());
    seg->guard_ = mapguard::Registration(seg->base_, seg->region_.get_size(), PROT_READ | PROT_WRITE);
    seg->header_ = reinterpret_cast<Header*>(seg->base_);
    // The layout comes from the size checked above, never from the segment again: a member gone
    // bad (or a process truncating the file since) must not move the heaps past the mapping.
    seg->layout_ = compute_layout(size, heap_bytes);
    GS_REQUIRE(seg->region_.get_size() >= seg->layout_.total_bytes, GRADSYNC_E_CORRUPT,
               "shm group '{}': /dev/shm/{} is {} bytes, its layout needs {}: it changed while this rank joined", name,
               shm_name, seg->region_.get_size(), seg->layout_.total_bytes);
    seg->control_ = ControlArea(&seg->header_->words, seg->base_, seg->layout_.control, size,
                                reinterpret_cast<uintptr_t>(seg->base_));
    // Peers publish buffers from the heaps only (gradsync_comm_alloc), never the control area.
    seg->control_.set_reachable(seg->layout_.heap_offset, seg->layout_.total_bytes);
    RankSlot& mine = seg->slot(rank);
    for (size_t i = 0; i < 16; ++i) mine.cpu_mask[i].store(cpu_mask.bits[i], std::memory_order_relaxed);
    mine.cpu_limit.store(cpu_limit, std::memory_order_relaxed);
    mine.pid.store(static_cast<int32_t>(getpid()), std::memory_order_relaxed);
    seg->reach_token_ = random_nonce() | 1;
    mine.reach_token.store(seg->reach_token_, std::memory_order_relaxed);
    mine.reach_token_address.store(reinterpret_cast<uintptr_t>(&seg->reach_token_), std::memory_order_relaxed);
    mine.generation.store(seg->header_->generation, std::memory_order_release);
    seg->header_->joined.fetch_add(1, std::memory_order_acq_rel);
    seg->free_.emplace(0, seg->layout_.heap_bytes_per_rank);
    return WaitResult::Ready;
  };
  if (bounded_wait(polled(claim, kPollInterval, kPollInterval), wait_never, wait_never, wait_silent, wait_ends,
                   deadline, std::chrono::nanoseconds::max()) != WaitEnd::Ready) {
    fail(GRADSYNC_E_TIMEOUT, "could not join shm group '{}' within the timeout: {}", name,
         waiting_for.empty() ? "the segment's set-up lock stayed busy" : waiting_for);
  }

  // Phase 2: wait for the others (a late joiner within the deadline is fine).
  const uint64_t generation = seg->header_->generation;
  std::vector<int> missing;
  auto formed = [&] {
    seg->check_intact();
    // Checked before completeness: a refusal is recorded only while the group is incomplete, so a
    // member that sees every rank joined also sees any refusal, and all members agree.
    if (seg->header_->refused_pid.load(std::memory_order_acquire) != 0) return WaitResult::Aborted;
    missing.clear();
    for (int r = 0; r < size; ++r) {
      if (seg->slot(r).generation.load(std::memory_order_acquire) != generation) missing.push_back(r);
    }
    return missing.empty() ? WaitResult::Ready : WaitResult::Timeout;
  };
  // A member gone once every rank has joined left a formed group (it may free its communicator
  // and exit before a slower member sees the group complete): the first collective reports it.
  int dead = -1;
  std::string gave_up;
  auto gone = [&] {
    for (int r = 0; r < size && dead < 0; ++r) {
      if (seg->slot(r).generation.load(std::memory_order_acquire) == generation && !seg->alive(r)) dead = r;
    }
    if (dead >= 0) return true;
    if (abandoned) gave_up = abandoned();
    return !gave_up.empty();
  };
  auto report = [&](std::chrono::nanoseconds) {
    GS_LOG_WARN("shm group '{}' rank {}: waiting for rank(s) {} to join ({} of {} joined)", name, rank,
                fmt::join(missing, ", "), size - static_cast<int>(missing.size()), size);
  };
  switch (bounded_wait(polled(formed, kPollInterval, kPollInterval), wait_never, gone, report, wait_ends, deadline,
                       kPollInterval)) {
    case WaitEnd::Ready: break;
    case WaitEnd::Stopped: {
      const int32_t pid = seg->header_->refused_pid.load(std::memory_order_acquire);
      const int32_t who = seg->header_->refused_rank.load(), claimed = seg->header_->refused_size.load();
      if (claimed == size) {
        fail(GRADSYNC_E_MISUSE, "shm group '{}' (size {}) cannot form: rank {} was claimed a second time (by pid {})",
             name, size, who, pid);
      }
      fail(GRADSYNC_E_MISMATCH, "shm group '{}' (size {}) cannot form: rank {} (pid {}) tried to join it with size {}",
           name, size, who, pid, claimed);
    }
    case WaitEnd::PeerGone:
      if (dead >= 0) {
        // A member that gave up forming (its own call failed) leaves, raising the stop as it goes.
        const uint32_t why = seg->header_->words.stop_word.load(std::memory_order_seq_cst);
        const bool left = stop_reason(why) == StopReason::Left && stop_rank(why) == dead;
        seg->close_group();
        fail(GRADSYNC_E_REMOTE, "rank {} (pid {}) of shm group '{}' {} while the group was forming", dead,
             seg->slot(dead).pid.load(), name, left ? "left (its own call failed)" : "died");
      }
      fail(GRADSYNC_E_REMOTE, "shm group '{}' (rank {}) gave up forming: {}", name, rank, gave_up);
    case WaitEnd::Interrupted:
    case WaitEnd::Deadline:
      fail(GRADSYNC_E_TIMEOUT, "shm group '{}': rank(s) {} did not join within the timeout ({} of {} joined)", name,
           fmt::join(missing, ", "), size - static_cast<int>(missing.size()), size);
  }
  std::vector<wait_detail::CpuMask> masks(static_cast<size_t>(size));
  std::vector<int> limits(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    for (size_t i = 0; i < 16; ++i) {
      masks[static_cast<size_t>(r)].bits[i] = seg->slot(r).cpu_mask[i].load(std::memory_order_relaxed);
    }
    limits[static_cast<size_t>(r)] = seg->slot(r).cpu_limit.load(std::memory_order_relaxed);
  }
  seg->cpus_ = wait_detail::ranks_with_own_cpu(masks, limits);
  seg->probe_peers();
  return seg;
}

void Segment::probe_peers() {
  peer_pids_.assign(static_cast<size_t>(size_), 0);
  reaches_peers_ = false;
  if (const char* env = std::getenv("GRADSYNC_SHM_CROSS_PROCESS"); env != nullptr && std::strcmp(env, "0") == 0) return;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const RankSlot& s = slot(r);
    const uint64_t token = s.reach_token.load(std::memory_order_relaxed);
    peer_pids_[static_cast<size_t>(r)] = s.pid.load(std::memory_order_relaxed);
    uint64_t got = 0;
    const char* why = nullptr;
    if (token == 0) {
      why = "it offers none";
    } else if (!peer_copy(r, s.reach_token_address.load(std::memory_order_relaxed), &got, sizeof got, false)) {
      why = std::strerror(errno);
    } else if (got != token) {
      why = "its pid names another process here";
    }
    if (why != nullptr) {
      GS_LOG_DEBUG(
          "shm group '{}': rank {} cannot copy to and from rank {}'s process ({}); allreduces of ordinary "
          "buffers are staged through the segment",
          group_, rank_, r, why);
      return;
    }
  }
  reaches_peers_ = true;
}

bool Segment::peer_copy(int r, uint64_t address, void* local, size_t bytes, bool write) const noexcept {
  const pid_t pid = peer_pids_[static_cast<size_t>(r)];
  char* at = static_cast<char*>(local);
  while (bytes > 0) {
    iovec here{at, bytes};
    iovec there{reinterpret_cast<void*>(address), bytes};
    const ssize_t moved =
        write ? process_vm_writev(pid, &here, 1, &there, 1, 0) : process_vm_readv(pid, &here, 1, &there, 1, 0);
    if (moved <= 0) return false;  // a partial copy stops at the first page it could not reach
    at += moved;
    address += static_cast<uint64_t>(moved);
    bytes -= static_cast<size_t>(moved);
  }
  return true;
}

bool Segment::alive(int r) const {
  return r == rank_ || !peer_gone({slot(r).pid.load(std::memory_order_acquire), fd_, kRankLockByte + r});
}

void Segment::check_intact() const {
  struct stat st {};
  const bool shrank = fstat(fd_, &st) == 0 && static_cast<uint64_t>(st.st_size) < layout_.total_bytes;
  if (!shrank && !guard_.faulted()) return;
  fail(GRADSYNC_E_IO,
       "shm group '{}': its segment /dev/shm/{} shrank under the group (now {} bytes, {} expected): "
       "a process truncated it; free the communicator and form a new group",
       group_, shm_name_, static_cast<uint64_t>(st.st_size), layout_.total_bytes);
}

void Segment::close_group() noexcept {
  header_->state.store(static_cast<uint32_t>(GroupState::Closing), std::memory_order_release);
}

uint64_t Segment::own_heap_offset(const void* p, size_t bytes) const noexcept {
  const char* c = static_cast<const char*>(p);
  const char* heap = base_ + layout_.heap_offset + static_cast<uint64_t>(rank_) * layout_.heap_bytes_per_rank;
  if (c < heap || c > heap + layout_.heap_bytes_per_rank) return kNoAddress;
  if (bytes > static_cast<uint64_t>(heap + layout_.heap_bytes_per_rank - c)) return kNoAddress;
  return static_cast<uint64_t>(c - base_);
}

void* Segment::allocate(size_t bytes) {
  check_intact();  // fallocate would grow a truncated file back, hiding the damage
  const uint64_t want = align_up(std::max<uint64_t>(bytes, 1), kPage);
  GS_REQUIRE(bytes <= layout_.heap_bytes_per_rank, GRADSYNC_E_NO_SPACE,
             "cannot allocate {} bytes in shm group '{}': each rank's heap holds at most {} bytes", bytes, group_,
             layout_.heap_bytes_per_rank);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < want) continue;
    const uint64_t offset = it->first;
    const uint64_t in_file = layout_.heap_offset + static_cast<uint64_t>(rank_) * layout_.heap_bytes_per_rank + offset;
    reserve_space(fd_, in_file, want, fmt::format("a buffer of shm group '{}'", group_));
#ifdef MADV_POPULATE_WRITE
    // Maps the pages just reserved in one call (a hint: older kernels refuse it, and touching them
    // maps them as well), rather than one fault per 4 KiB page at the caller's first write.
    madvise(base_ + in_file, want, MADV_POPULATE_WRITE);
#endif
    const uint64_t rest = it->second - want;
    free_.erase(it);
    if (rest > 0) free_.emplace(offset + want, rest);
    used_.emplace(offset, want);
    return base_ + in_file;
  }
  fail(GRADSYNC_E_NO_SPACE, "cannot allocate {} bytes in shm group '{}': rank {}'s heap has no free range that large",
       bytes, group_, rank_);
}

bool Segment::deallocate(void* p) {
  const char* heap = base_ + layout_.heap_offset + static_cast<uint64_t>(rank_) * layout_.heap_bytes_per_rank;
  const char* c = static_cast<const char*>(p);
  if (c < heap || c >= heap + layout_.heap_bytes_per_rank) return false;
  auto it = used_.find(static_cast<uint64_t>(c - heap));
  if (it == used_.end()) return false;
  uint64_t offset = it->first, bytes = it->second;
  used_.erase(it);
  // Give the pages back to /dev/shm; the range stays reserved in the (sparse) file.
  fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(c - base_), static_cast<off_t>(bytes));
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && offset + bytes == next->first) {
    bytes += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += bytes;
      return true;
    }
  }
  free_.emplace(offset, bytes);
  return true;
}

void Segment::leave() noexcept {
  if (header_ == nullptr) return;
  // Bounded: a member that cannot get the set-up lock still leaves; the name is then removed by
  // a later member, or reclaimed as stale by the next group.
  auto setup_lock = [&] {
    try {
      return ofd_lock(fd_, kSetupLockByte, F_WRLCK) ? WaitResult::Ready : WaitResult::Timeout;
    } catch (const Error&) {
      return WaitResult::Aborted;
    }
  };
  auto until = Clock::now() + std::chrono::seconds(2);
  const bool have_setup =
      bounded_wait(polled(setup_lock, kPollInterval, kPollInterval), wait_never, wait_never, wait_silent, wait_ends,
                   until, std::chrono::nanoseconds::max()) == WaitEnd::Ready;
  close_group();
  // Peers still waiting on this rank learn that it left (rather than died).
  raise_stop(header_->words.stop_word, StopReason::Left, rank_);
  notify(header_->words.wake);
  try {
    ofd_lock(fd_, kRankLockByte + rank_, F_UNLCK);
    if (have_setup) {
      // The last member removes the name. A member SIGKILLed as the group ends holds its rank's
      // lock while the kernel tears it down, yet it will never leave: when every lock still held
      // is such a member's, this rank is the last, and waits (within the bound above) for those
      // locks to go. A live holder leaves later, and removes the name then.
      auto last = [&] {
        bool dying = false;
        for (int r = 0; r < size_; ++r) {
          if (!ofd_held_by_other(fd_, kRankLockByte + r)) continue;
          if (!process_exiting(slot(r).pid.load(std::memory_order_acquire))) return WaitResult::Aborted;
          dying = true;
        }
        return dying ? WaitResult::Timeout : WaitResult::Ready;
      };
      const bool alone = bounded_wait(polled(last, kPollInterval, kDyingPoll), wait_never, wait_never, wait_silent,
                                      wait_ends, until, std::chrono::nanoseconds::max()) == WaitEnd::Ready;
      if (alone && still_linked(fd_, shm_name_)) bip::shared_memory_object::remove(shm_name_.c_str());
      ofd_lock(fd_, kSetupLockByte, F_UNLCK);
    }
  } catch (const std::exception& e) {
    GS_LOG_WARN("leaving shm group '{}': {}", group_, e.what());
  }
}

void Segment::release_after_fork() noexcept {
  guard_.reset();
  bip::mapped_region().swap(region_);
  bip::shared_memory_object().swap(object_);
  fd_ = -1;
  base_ = nullptr;
  header_ = nullptr;
}

Segment::~Segment() { leave(); }

}  // namespace gradsync::comm::shm
