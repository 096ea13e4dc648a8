// SPDX-License-Identifier: Apache-2.0
#pragma once
// What a communicator measures about its own calls: statistics (gradsync_comm_stats) and a
// Chrome-trace timeline (GRADSYNC_TIMELINE, gradsync_comm_timeline). Written once for every
// transport: a transport runs each collective through measure(); whatever decides that every rank
// has arrived (the round engine for threads and shm, the MPI transport's exchange) reports the arrival wait
// and every rank's arrival stamp to arrival(), once per call.
//
// A call's time splits into waiting for peers (this rank's arrival until the group's verdict that
// every rank is there) and the rest, data movement (staging, reducing, copying, and the barriers
// that pace them). Per-peer lateness is a rank's arrival after the round's first arrival, from
// stamps that every rank of the round sees alike, so every rank computes the same figures and
// names the same straggler.
//
// Cost to a call: two clock reads (arrival and end; StampClock, a TSC read where the kernel keeps
// time with it) and a few relaxed stores; a third (the verdict) only after a wait longer than its
// first polls: otherwise the verdict came as the last rank arrived, and its stamp says when. Only the thread inside a
// call writes the figures (one call at a time per communicator), so they are single-writer atomics: stats() may read
// them from any thread without a lock, each figure whole, the set of them possibly mid-update. The timeline, when on,
// appends under a mutex to a buffer written out every kTimelineBatch events and at close.
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/types.hpp"
#include "common/stamp_clock.hpp"

namespace gradsync::comm {

// Indexed by Collective (1..7); entry 0 is unused.
inline constexpr size_t kCollectiveSlots = 8;

struct CollectiveTotals {
  uint64_t calls = 0;   // completed without error
  uint64_t failed = 0;  // ended in an error
  uint64_t bytes = 0;   // payload bytes of the calls (the whole vector: count x element size)
  uint64_t wait_ns = 0;
  uint64_t move_ns = 0;
};

struct PeerLateness {
  uint64_t late_ns = 0;      // summed over rounds: arrival after the round's first arrival
  uint64_t max_late_ns = 0;  // the largest of them
  uint64_t last = 0;         // rounds where this rank arrived last (of two or more ranks)
};

struct StatsSnapshot {
  std::array<CollectiveTotals, kCollectiveSlots> collectives{};
  std::vector<PeerLateness> peers;  // by rank; empty until a round has compared arrivals
  uint64_t rounds = 0;              // rounds whose arrivals were compared
  int straggler = -1;               // the rank with the largest summed lateness, -1 if none
};

class Telemetry {
 public:
  using Clock = std::chrono::steady_clock;

  Telemetry() = default;
  ~Telemetry();
  Telemetry(const Telemetry&) = delete;
  Telemetry& operator=(const Telemetry&) = delete;

  // Runs body, one collective of `what` with `bytes` of payload, as one call: timed, counted, and
  // counted as failed when it throws. A call inside another (a collective built from another one)
  // is not counted again: the outer call is the caller's. (A catch, not std::uncaught_exceptions()
  // in a destructor: that costs a call into the C++ runtime each time, a few percent of a small
  // collective, where a try block costs nothing until something is thrown.)
  template <class Body>
  void measure(Collective what, uint64_t bytes, Body&& body) {
    Call call(*this, what, bytes);
    try {
      body();
    } catch (...) {
      call.failed_ = true;
      throw;
    }
  }

  // The open call's arrival wait: this rank arrived at `arrived`, the group's verdict came at
  // `decided`. stamps (n entries, in one clock common to the ranks, ns) are every rank's arrival
  // when every rank arrived, or null.
  void arrival(Clock::time_point arrived, Clock::time_point decided, const int64_t* stamps, int n) noexcept;

  StatsSnapshot stats() const;
  // Zeroes the statistics: the calls a communicator makes while it is being set up (its topology
  // exchange) are not the caller's. Before any other thread can read them.
  void forget() noexcept;

  // Writes this rank's timeline to `path` (truncated) from now on, as Chrome-trace JSON with
  // events of process `rank`; an empty path stops it. Ends a timeline already open first.
  // Throws Error(GRADSYNC_E_IO) naming the path when it cannot be written.
  void open_timeline(const std::string& path, int rank);
  // Writes what is buffered and closes the JSON document. Throws Error(GRADSYNC_E_IO).
  void close_timeline();

  // This communicator's reading of Clock for its calls' statistics: by the thread in a call only
  // (a communicator's calls are ordered, whichever thread makes them).
  Clock::time_point now() noexcept { return clock_.now(); }

  // A call's arrival stamp in the clock that peers on the same host share (threads, processes).
  static int64_t stamp(Clock::time_point t) noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  }

 private:
  struct Event {
    Collective what;
    bool ok;
    uint64_t bytes;
    uint64_t number;  // this rank's call number on the communicator
    Clock::time_point start, arrived, decided, end;
  };
  static constexpr size_t kTimelineBatch = 4096;

  // A figure written by the calling thread only, read by any.
  struct Counter {
    std::atomic<uint64_t> v{0};
    void add(uint64_t x) noexcept { v.store(v.load(std::memory_order_relaxed) + x, std::memory_order_relaxed); }
    void raise_to(uint64_t x) noexcept {
      if (x > v.load(std::memory_order_relaxed)) v.store(x, std::memory_order_relaxed);
    }
    uint64_t get() const noexcept { return v.load(std::memory_order_relaxed); }
    void zero() noexcept { v.store(0, std::memory_order_relaxed); }
  };
  struct Totals {
    Counter calls, failed, bytes, wait_ns, move_ns;
  };
  struct Peer {
    Counter late_ns, max_late_ns, last;
  };

  // One call of measure(), from its start to its end (finish()).
  class Call {
   public:
    Call(Telemetry& t, Collective what, uint64_t bytes) noexcept;
    ~Call();
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;

    Telemetry& t_;
    const bool outer_;
    const Collective what_;
    const uint64_t bytes_;
    bool failed_ = false;
    Clock::time_point arrived_{}, decided_{};  // the arrival wait; unset when none was made
  };

  void finish(const Call& c) noexcept;
  // Writes events_ out; false (and the timeline marked failed) on a write error.
  bool write_events() noexcept;

  StampClock clock_;
  int depth_ = 0;  // calls open (only the calling thread of the moment touches it)
  Call* current_ = nullptr;
  std::array<Totals, kCollectiveSlots> totals_;
  Counter rounds_;
  // Allocated at the first round that compares arrivals (a group's size never changes).
  std::unique_ptr<Peer[]> peers_;
  std::atomic<int> npeers_{0};
  uint64_t calls_ = 0;
  // The timeline. timeline_on_ lets calls skip the mutex while no timeline is open.
  std::atomic<bool> timeline_on_{false};
  mutable std::mutex mutex_;
  // The timeline, when on.
  std::FILE* file_ = nullptr;
  std::string path_;
  int rank_ = 0;
  bool first_event_ = true;
  bool write_failed_ = false;
  std::vector<Event> events_;
};

}  // namespace gradsync::comm
