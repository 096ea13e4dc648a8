// SPDX-License-Identifier: Apache-2.0
#include "comm/telemetry.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "comm/types.hpp"
#include "common/error.hpp"
#include "common/log.hpp"

namespace gradsync::comm {
namespace {

uint64_t ns_between(Telemetry::Clock::time_point from, Telemetry::Clock::time_point to) noexcept {
  return to > from ? static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(to - from).count()) : 0;
}

// Chrome trace timestamps are microseconds; fractions keep sub-microsecond calls visible.
double us(Telemetry::Clock::time_point t) noexcept { return static_cast<double>(Telemetry::stamp(t)) / 1000.0; }

}  // namespace

Telemetry::Call::Call(Telemetry& t, Collective what, uint64_t bytes) noexcept
    : t_(t), outer_(t.depth_++ == 0), what_(what), bytes_(bytes) {
  if (outer_) t.current_ = this;
}

Telemetry::Call::~Call() {
  --t_.depth_;
  if (!outer_) return;
  t_.current_ = nullptr;
  t_.finish(*this);
}

void Telemetry::forget() noexcept {
  for (Totals& t : totals_) {
    t.calls.zero();
    t.failed.zero();
    t.bytes.zero();
    t.wait_ns.zero();
    t.move_ns.zero();
  }
  rounds_.zero();
  peers_.reset();
  npeers_.store(0, std::memory_order_relaxed);
  calls_ = 0;
}

void Telemetry::arrival(Clock::time_point arrived, Clock::time_point decided, const int64_t* stamps, int n) noexcept {
  // A nested call's arrival belongs to the outer call, which records its first one.
  Call* c = current_;
  if (c == nullptr || c->arrived_ != Clock::time_point{}) return;
  c->arrived_ = arrived;
  c->decided_ = decided;
  if (stamps == nullptr || n < 2) return;
  if (npeers_.load(std::memory_order_relaxed) != n) {
    if (npeers_.load(std::memory_order_relaxed) != 0) return;  // cannot happen: a group keeps its size
    std::lock_guard lock(mutex_);
    try {
      peers_.reset(new Peer[static_cast<size_t>(n)]);
    } catch (...) {
      return;  // out of memory: statistics are not worth failing a call for
    }
    npeers_.store(n, std::memory_order_release);
  }
  int64_t first = stamps[0], last = stamps[0];
  int last_rank = 0;
  for (int r = 1; r < n; ++r) {
    first = std::min(first, stamps[r]);
    if (stamps[r] > last) last = stamps[r], last_rank = r;
  }
  rounds_.add(1);
  for (int r = 0; r < n; ++r) {
    // In unsigned arithmetic: the stamps of an shm group are whatever its members wrote, and a
    // member gone bad must not make this a signed overflow.
    const uint64_t late = static_cast<uint64_t>(stamps[r]) - static_cast<uint64_t>(first);
    peers_[static_cast<size_t>(r)].late_ns.add(late);
    peers_[static_cast<size_t>(r)].max_late_ns.raise_to(late);
  }
  // Ties (equal stamps) name the lower rank, the same on every rank.
  if (last > first) peers_[static_cast<size_t>(last_rank)].last.add(1);
}

void Telemetry::finish(const Call& c) noexcept {
  const Clock::time_point end = now();
  const bool ok = !c.failed_;
  const bool waited = c.arrived_ != Clock::time_point{};
  // A call is timed from its arrival: what comes before (checking and publishing its arguments)
  // is a few instructions, not worth a clock read.
  const uint64_t wait = waited ? ns_between(c.arrived_, c.decided_) : 0;
  const uint64_t move = waited ? ns_between(c.decided_, end) : 0;
  ++calls_;
  Totals& t = totals_[static_cast<size_t>(c.what_) % kCollectiveSlots];
  (ok ? t.calls : t.failed).add(1);
  t.bytes.add(c.bytes_);
  t.wait_ns.add(wait);
  t.move_ns.add(move);
  if (!timeline_on_.load(std::memory_order_relaxed)) return;
  std::lock_guard lock(mutex_);
  if (file_ == nullptr) return;
  try {
    events_.push_back(Event{c.what_, ok, c.bytes_, calls_, waited ? c.arrived_ : end, waited ? c.arrived_ : end,
                            waited ? c.decided_ : end, end});
  } catch (...) {
    write_failed_ = true;  // reported at close: a timeline with a hole is not the one asked for
  }
  if (events_.size() >= kTimelineBatch) write_events();
}

StatsSnapshot Telemetry::stats() const {
  StatsSnapshot out;
  for (size_t i = 0; i < kCollectiveSlots; ++i) {
    const Totals& t = totals_[i];
    out.collectives[i] = {t.calls.get(), t.failed.get(), t.bytes.get(), t.wait_ns.get(), t.move_ns.get()};
  }
  out.rounds = rounds_.get();
  const int n = npeers_.load(std::memory_order_acquire);
  out.peers.resize(static_cast<size_t>(n));
  uint64_t most = 0;
  for (int r = 0; r < n; ++r) {
    const Peer& p = peers_[static_cast<size_t>(r)];
    out.peers[static_cast<size_t>(r)] = {p.late_ns.get(), p.max_late_ns.get(), p.last.get()};
    if (out.peers[static_cast<size_t>(r)].late_ns > most)
      most = out.peers[static_cast<size_t>(r)].late_ns, out.straggler = r;
  }
  return out;
}

bool Telemetry::write_events() noexcept {
  for (const Event& e : events_) {
    const char* name = collective_name(e.what);
    const double start = us(e.start), arrived = us(e.arrived), decided = us(e.decided), end = us(e.end);
    // The call, then its two phases nested inside it on the same track (the viewer stacks them).
    const int n = std::fprintf(
        file_,
        "%s\n{\"name\":\"%s\",\"cat\":\"collective\",\"ph\":\"X\",\"pid\":%d,\"tid\":0,\"ts\":%.3f,\"dur\":%.3f,"
        "\"args\":{\"call\":%llu,\"bytes\":%llu,\"status\":\"%s\"}},"
        "\n{\"name\":\"wait for peers\",\"cat\":\"phase\",\"ph\":\"X\",\"pid\":%d,\"tid\":0,\"ts\":%.3f,\"dur\":%.3f,"
        "\"args\":{\"call\":%llu}},"
        "\n{\"name\":\"data movement\",\"cat\":\"phase\",\"ph\":\"X\",\"pid\":%d,\"tid\":0,\"ts\":%.3f,\"dur\":%.3f,"
        "\"args\":{\"call\":%llu}}",
        first_event_ ? "" : ",", name, rank_, start, end - start, static_cast<unsigned long long>(e.number),
        static_cast<unsigned long long>(e.bytes), e.ok ? "ok" : "failed", rank_, arrived, decided - arrived,
        static_cast<unsigned long long>(e.number), rank_, decided, end - decided,
        static_cast<unsigned long long>(e.number));
    first_event_ = false;
    if (n < 0) write_failed_ = true;
  }
  events_.clear();
  if (std::fflush(file_) != 0) write_failed_ = true;
  if (write_failed_) GS_LOG_ERROR("timeline {}: write failed ({}); events are missing", path_, std::strerror(errno));
  return !write_failed_;
}

void Telemetry::open_timeline(const std::string& path, int rank) {
  close_timeline();
  if (path.empty()) return;
  std::lock_guard lock(mutex_);
  std::FILE* f = std::fopen(path.c_str(), "w");
  GS_REQUIRE(f != nullptr, GRADSYNC_E_IO, "cannot write the timeline to '{}': {}", path, std::strerror(errno));
  file_ = f;
  timeline_on_.store(true, std::memory_order_relaxed);
  path_ = path;
  rank_ = rank;
  first_event_ = true;
  write_failed_ = false;
  std::fprintf(file_,
               "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n"
               "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}}",
               rank, rank);
  first_event_ = false;
}

void Telemetry::close_timeline() {
  std::lock_guard lock(mutex_);
  if (file_ == nullptr) return;
  write_events();
  std::fprintf(file_, "\n]}\n");
  const bool closed = std::fclose(file_) == 0;
  file_ = nullptr;
  timeline_on_.store(false, std::memory_order_relaxed);
  GS_REQUIRE(closed && !write_failed_, GRADSYNC_E_IO, "the timeline '{}' could not be written completely", path_);
}

Telemetry::~Telemetry() {
  try {
    close_timeline();
  } catch (const std::exception& e) {
    GS_LOG_ERROR("{}", e.what());
  }
}

}  // namespace gradsync::comm
