// SPDX-License-Identifier: Apache-2.0
#pragma once
// The conformance suite's harness as its scenarios (scenarios.cpp) use it: the context of a rank
// in a scenario and its checks, the scenario's own groups, the element types and their inputs, the
// one reference reduction, and the registry's entry. The runner (conformance.cpp) runs the
// registry on every transport and reports.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../half_reference.hpp"
#include "gradsync/gradsync.h"

namespace conformance {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr int kMaxRanks = 64;
constexpr int kMaxScenarios = 64;
// The main group carries the data scenarios and the verdicts: generous, for loaded CI machines.
constexpr int64_t kMainTimeoutMs = 30000;
// Scenarios that provoke failures get a group of their own (created after a barrier, freed after
// the scenario), so a transport that wrongly leaves a rank waiting costs seconds, not the main
// timeout, and cannot leave the main group stopped.
constexpr int64_t kGroupTimeoutMs = 3000;
constexpr int64_t kShortTimeoutMs = 300;  // the timeout scenario's group
constexpr int kStallSeconds = 120;        // watchdog: no rank finished a scenario for this long

// ---------------------------------------------------------------- recording failures

// One rank's outcome of one scenario; 256 bytes, so that MPI ranks can allgather it as 64 i32.
struct Record {
  int32_t failures;
  int32_t reserved;
  char message[248];
};
static_assert(sizeof(Record) == 256);

inline std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline std::string vformat(const char* fmt, va_list ap) {
  char buf[1024];
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  return buf;
}
inline std::string format(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  return s;
}

// Threads and forked ranks publish here; the main thread or the parent reads it. The ranks also
// order steps within a scenario through it ("wait until rank r has timed out"), where MPI, with
// no such side channel, can only wait long enough.
struct Ledger {
  std::atomic<int32_t> done[kMaxRanks];     // index + 1 of the last scenario this rank published
  std::atomic<int32_t> running[kMaxRanks];  // index + 1 of the scenario it runs now
  std::atomic<int32_t> step[kMaxRanks];     // the last step a rank posted, growing over the run
  Record rec[kMaxScenarios][kMaxRanks];
};

struct Ctx {
  gradsync_comm* c = nullptr;  // the main group
  Ledger* ledger = nullptr;    // nullptr on MPI
  int index = 0;               // the scenario's place in the registry
  int rank = 0, size = 1, transport = GRADSYNC_TRANSPORT_THREAD;
  std::string name;  // the main group's name; scenario groups derive theirs from it
  const char* scenario = "";
  int failures = 0;
  std::string first;
  std::vector<gradsync_comm*> groups;  // this scenario's own groups
  int serial = 0;
  std::string broken;  // why the main group cannot be recovered (a peer died): the run stops

  void fail_at(int line, const char* fmt, ...) __attribute__((format(printf, 3, 4))) {
    va_list ap;
    va_start(ap, fmt);
    const std::string msg = vformat(fmt, ap);
    va_end(ap);
    if (failures == 0) first = msg;
    if (failures < 20) std::fprintf(stderr, "  [%s] rank %d, line %d: %s\n", scenario, rank, line, msg.c_str());
    ++failures;
  }
  // Launched by mpirun (MPI and the hierarchical transport): no side channel between ranks.
  bool mpi() const { return transport == GRADSYNC_TRANSPORT_MPI || transport == GRADSYNC_TRANSPORT_HIER; }
  gradsync_comm* group(int64_t timeout_ms);
  void post(int k);
  void wait_for(int r, int k, int64_t mpi_ms);
};

#define CHECK(x, cond, ...) ((cond) ? true : ((x).fail_at(__LINE__, __VA_ARGS__), false))

// `got` must be `want`, and the message must contain every fragment. Call it right after the call
// (the message is the calling thread's last one).
inline bool expect_status(Ctx& x, int line, const char* what, int got, int want,
                          std::initializer_list<std::string> fragments) {
  if (got == GRADSYNC_OK && want == GRADSYNC_OK) return true;
  const char* last = gradsync_last_error_message();
  const std::string msg = last != nullptr ? last : "";
  if (got != want) {
    x.fail_at(line, "%s returned %d (%s), expected %d", what, got, got == GRADSYNC_OK ? "OK" : msg.c_str(), want);
    return false;
  }
  for (const std::string& f : fragments) {
    if (msg.find(f) == std::string::npos) {
      x.fail_at(line, "%s: message \"%s\" lacks \"%s\"", what, msg.c_str(), f.c_str());
      return false;
    }
  }
  return true;
}
#define EXPECT_STATUS(x, call, want, ...) expect_status((x), __LINE__, #call, (call), (want), {__VA_ARGS__})
#define EXPECT_OK(x, call) expect_status((x), __LINE__, #call, (call), GRADSYNC_OK, {})

// The scenarios' groups are subgroups of subgroups (gradsync_comm_split twice, the parents freed
// at once), so that every semantic of comm.h is checked on split communicators too.
inline bool g_split = false;
// hier/hosts2: ranks claim host "h<rank % 2>" by label, so that one machine gives the hierarchical
// transport two hosts (even with 4 ranks, uneven with 3); hier/hosts=0110: rank r claims host
// "h<digit r>" (layouts whose hosts' ranks interleave in any order). The rank comes from Open
// MPI's launcher, as the label must be set before the group exists.
inline bool g_two_hosts = false;
inline std::string g_host_digits;
// mpi/threads=T, hier/threads=T: each process holds T ranks, one per thread (comm.h, "Threads as
// ranks"); g_thread is the calling thread's index.
inline int g_threads = 1;
inline thread_local int g_thread = 0;

inline gradsync_comm* join(int transport, int rank, int size, const std::string& name, int64_t timeout_ms,
                           int* status) {
  gradsync_comm_options o;
  gradsync_comm_options_init(&o, sizeof o);
  o.transport = transport;
  o.rank = rank;
  o.size = size;
  o.timeout_ms = timeout_ms;
  o.deterministic = 1;  // MPI: rank order, as the other transports always are
  std::snprintf(o.name, sizeof o.name, "%s", name.c_str());
  if (g_threads > 1) {
    o.threads = g_threads;
    o.thread = g_thread;
  }
  if (g_two_hosts || !g_host_digits.empty()) {
    const char* world_rank = std::getenv("OMPI_COMM_WORLD_RANK");
    const int r = world_rank != nullptr ? std::atoi(world_rank) : 0;
    const int host = g_two_hosts ? r % 2 : g_host_digits[static_cast<size_t>(r) % g_host_digits.size()] - '0';
    std::snprintf(o.host, sizeof o.host, "h%d", host);
  }
  gradsync_comm* c = nullptr;
  *status = gradsync_comm_create(&c, &o);
  return c;
}

// A group of the scenario's own. Joined right after a barrier, so that a short join deadline is
// not spent waiting for a slow peer; and should a loaded machine still make one rank miss it,
// the ranks agree (through the main group) to try again under a new name.
inline gradsync_comm* Ctx::group(int64_t timeout_ms) {
  std::string last_error;
  for (int attempt = 0; attempt < 3; ++attempt) {
    EXPECT_OK(*this, gradsync_comm_barrier(c));
    int st = 0;
    gradsync_comm* g = join(transport, rank, size, name + "-" + std::to_string(++serial), timeout_ms, &st);
    for (int level = 0; g_split && st == GRADSYNC_OK && level < 2; ++level) {
      gradsync_comm* sub = nullptr;
      st = gradsync_comm_split(g, 0, rank, &sub);
      gradsync_comm_free(g);
      g = sub;
    }
    if (st != GRADSYNC_OK) last_error = gradsync_last_error_message();
    int32_t joined = st == GRADSYNC_OK ? 1 : 0, everywhere = 0;
    EXPECT_OK(*this, gradsync_comm_allreduce(c, &joined, &everywhere, 1, GRADSYNC_I32, GRADSYNC_MIN));
    if (everywhere == 1) {
      groups.push_back(g);
      return g;
    }
    gradsync_comm_free(g);
  }
  fail_at(__LINE__, "joining the scenario's group failed three times: %s", last_error.c_str());
  return nullptr;
}

// Step k of this scenario is done on this rank (thread and shm; MPI has no side channel).
inline void Ctx::post(int k) {
  if (ledger != nullptr) ledger->step[rank].store((index + 1) * 64 + k, std::memory_order_release);
}

// Waits until rank r has posted step k; on MPI, mpi_ms instead, long enough on a loaded machine.
inline void Ctx::wait_for(int r, int k, int64_t mpi_ms) {
  if (ledger == nullptr) {
    std::this_thread::sleep_for(std::chrono::milliseconds(mpi_ms));
    return;
  }
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (ledger->step[r].load(std::memory_order_acquire) < (index + 1) * 64 + k) {
    if (Clock::now() > deadline) {
      fail_at(__LINE__, "rank %d did not reach step %d within 20 s", r, k);
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// ---------------------------------------------------------------- element types and inputs

struct F32 {
  using T = float;
  static constexpr int32_t dtype = GRADSYNC_F32;
  static constexpr const char* name = "f32";
  static constexpr bool half = false;
};
struct F64 {
  using T = double;
  static constexpr int32_t dtype = GRADSYNC_F64;
  static constexpr const char* name = "f64";
  static constexpr bool half = false;
};
struct I32 {
  using T = int32_t;
  static constexpr int32_t dtype = GRADSYNC_I32;
  static constexpr const char* name = "i32";
  static constexpr bool half = false;
};
struct I64 {
  using T = int64_t;
  static constexpr int32_t dtype = GRADSYNC_I64;
  static constexpr const char* name = "i64";
  static constexpr bool half = false;
};
struct BF16 {
  using T = uint16_t;
  static constexpr int32_t dtype = GRADSYNC_BF16;
  static constexpr const char* name = "bf16";
  static constexpr bool half = true;
  static float widen(T b) { return half_reference::from_bf16(b); }
  static T narrow(float f) { return half_reference::to_bf16(f); }
};
struct F16 {
  using T = uint16_t;
  static constexpr int32_t dtype = GRADSYNC_F16;
  static constexpr const char* name = "f16";
  static constexpr bool half = true;
  static float widen(T b) { return half_reference::from_f16(b); }
  static T narrow(float f) { return half_reference::to_f16(f); }
};

constexpr int32_t kOps[] = {GRADSYNC_SUM, GRADSYNC_MEAN, GRADSYNC_MIN, GRADSYNC_MAX};
inline const char* op_name(int32_t op) {
  static const char* names[] = {"sum", "mean", "min", "max"};
  return op >= 0 && op < 4 ? names[op] : "?";
}

inline uint64_t mix(uint64_t x) {
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 32);
}

// Rank r's element i: floats of many magnitudes (so that another summation order shows in the
// bits), integers over the whole range (so that sums wrap).
template <class E>
typename E::T input(int rank, size_t i, uint64_t seed) {
  using T = typename E::T;
  const uint64_t h = mix(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(rank) * 0x94D049BB133111EBull + i);
  if constexpr (E::half || std::is_floating_point_v<T>) {
    const double unit = static_cast<double>(h >> 11) * 0x1p-53 * 2.0 - 1.0;
    const double v = std::ldexp(unit, static_cast<int>(h % 24) - 12);
    if constexpr (E::half)
      return E::narrow(static_cast<float>(v));
    else
      return static_cast<T>(v);
  } else {
    return static_cast<T>(h);
  }
}

// Bit patterns that only an exact copy keeps: a signalling NaN, -0, a NaN with a payload,
// infinity, the smallest subnormal; for integers the extremes.
template <class E>
typename E::T special(int k) {
  using T = typename E::T;
  T v{};
  if constexpr (std::is_same_v<E, F32>) {
    const uint32_t bits[] = {0x7f800001u, 0x80000000u, 0x7fc12345u, 0xff800000u, 0x00000001u};
    std::memcpy(&v, &bits[k % 5], 4);
  } else if constexpr (std::is_same_v<E, F64>) {
    const uint64_t bits[] = {0x7ff0000000000001ull, 0x8000000000000000ull, 0x7ff8000000012345ull, 0xfff0000000000000ull,
                             0x0000000000000001ull};
    std::memcpy(&v, &bits[k % 5], 8);
  } else if constexpr (std::is_same_v<E, BF16>) {
    const uint16_t bits[] = {0x7f81, 0x8000, 0x7fc5, 0xff80, 0x0001};
    v = bits[k % 5];
  } else if constexpr (std::is_same_v<E, F16>) {
    const uint16_t bits[] = {0x7c01, 0x8000, 0x7e05, 0xfc00, 0x0001};
    v = bits[k % 5];
  } else {
    const T vals[] = {std::numeric_limits<T>::min(), std::numeric_limits<T>::max(), T(-1), T(0), T(1)};
    v = vals[k % 5];
  }
  return v;
}

// Inputs of the collectives that only move data: the special patterns sprinkled among them.
template <class E>
typename E::T moved(int rank, size_t i, uint64_t seed) {
  return i % 61 == 0 ? special<E>(static_cast<int>(i / 61) + rank) : input<E>(rank, i, seed);
}

// ---------------------------------------------------------------- the reference

template <class T>
T combine(int32_t op, T acc, T v) {
  if (op == GRADSYNC_MIN) return v < acc ? v : acc;
  if (op == GRADSYNC_MAX) return acc < v ? v : acc;
  return acc + v;
}

// The one reference reduction: element i of every rank (col[0..n)) folded in rank order,
// acc = x_0, acc = op(acc, x_r), in the element type, as comm.h and common.h define it. Integer
// sums wrap (two's complement); the i32 mean sums in 64 bits and every integer mean truncates
// toward zero; bf16 and f16 fold in f32 and are rounded once.
template <class E>
typename E::T fold(int32_t op, int n, const typename E::T* col) {
  using T = typename E::T;
  if constexpr (E::half) {
    float acc = E::widen(col[0]);
    for (int r = 1; r < n; ++r) acc = combine(op, acc, E::widen(col[r]));
    if (op == GRADSYNC_MEAN) acc /= static_cast<float>(n);
    return E::narrow(acc);
  } else if constexpr (std::is_floating_point_v<T>) {
    T acc = col[0];
    for (int r = 1; r < n; ++r) acc = combine(op, acc, col[r]);
    return op == GRADSYNC_MEAN ? acc / static_cast<T>(n) : acc;
  } else {
    if (op == GRADSYNC_MIN || op == GRADSYNC_MAX) {
      T acc = col[0];
      for (int r = 1; r < n; ++r) acc = combine(op, acc, col[r]);
      return acc;
    }
    if (op == GRADSYNC_MEAN && sizeof(T) == 4) {
      int64_t acc = col[0];
      for (int r = 1; r < n; ++r) acc += col[r];
      return static_cast<T>(acc / n);
    }
    using U = std::make_unsigned_t<T>;
    U acc = static_cast<U>(col[0]);
    for (int r = 1; r < n; ++r) acc = static_cast<U>(acc + static_cast<U>(col[r]));
    return op == GRADSYNC_MEAN ? static_cast<T>(static_cast<T>(acc) / static_cast<T>(n)) : static_cast<T>(acc);
  }
}

// The hierarchical transport over two or more hosts: every rank's host (else empty). Its
// allreduce of f32 and f64 above 16 KiB runs in levels, whose order comm.h fixes by the topology:
// each host's ranks in rank order, then the hosts' sums in host order. Threads as ranks: every
// rank's process (else empty), whose ranks a reduction of floats always folds first, at any size;
// then the processes in order, host by host where g_level_hosts has hosts (the hierarchical
// transport's lanes) and the payload is above 16 KiB, else all in order.
inline thread_local std::vector<int> g_level_hosts;
inline thread_local std::vector<int> g_level_procs;

// How a reduction of floats combines the ranks: flat in rank order (kFlat), each process's ranks
// first and then the processes in order (kProcesses), or those groups host by host (kHosts).
enum Levels : int { kFlat = 0, kProcesses = 1, kHosts = 2 };

template <class E>
Levels by_levels(size_t payload_bytes) {
  if (!std::is_floating_point_v<typename E::T> || E::half) return kFlat;
  if (!g_level_hosts.empty() && payload_bytes > 16384) return kHosts;
  return g_level_procs.empty() ? kFlat : kProcesses;
}

// fold() in the levels' order (floats only: see by_levels): the innermost groups (processes where
// the ranks are threads, else hosts) fold their ranks in rank order, then (kHosts) the hosts their
// groups in order, then the hosts in order.
template <class E>
typename E::T fold_levels(Levels levels, int32_t op, int n, const typename E::T* col) {
  using T = typename E::T;
  const int32_t level_op = op == GRADSYNC_MEAN ? GRADSYNC_SUM : op;
  auto add = [&](T& acc, bool& first, T v) {
    acc = first ? v : combine(level_op, acc, v);
    first = false;
  };
  const std::vector<int>& inner = g_level_procs.empty() ? g_level_hosts : g_level_procs;
  const int groups = *std::max_element(inner.begin(), inner.end()) + 1;
  std::vector<T> partial(static_cast<size_t>(groups));
  for (int g = 0; g < groups; ++g) {
    bool first = true;
    for (int r = 0; r < n; ++r)
      if (inner[static_cast<size_t>(r)] == g) add(partial[static_cast<size_t>(g)], first, col[r]);
  }
  // Each inner group's host: where the ranks are threads, that of its ranks (else its own).
  std::vector<int> host_of(static_cast<size_t>(groups), 0);
  const bool nested = !g_level_procs.empty() && levels == kHosts;
  for (int r = 0; r < n; ++r)
    host_of[static_cast<size_t>(inner[static_cast<size_t>(r)])] =
        nested ? g_level_hosts[static_cast<size_t>(r)] : inner[static_cast<size_t>(r)];
  const int hosts = *std::max_element(host_of.begin(), host_of.end()) + 1;
  T all{};
  bool all_first = true;
  for (int h = 0; h < hosts; ++h) {
    T acc{};
    bool first = true;
    for (int g = 0; g < groups; ++g)
      if (host_of[static_cast<size_t>(g)] == h) add(acc, first, partial[static_cast<size_t>(g)]);
    if (!first) add(all, all_first, acc);
  }
  return op == GRADSYNC_MEAN ? all / static_cast<T>(n) : all;
}

// fold() of input<E>(r, offset + i, seed) over the ranks, for i in [0, count); levels: an
// allreduce whose payload the hierarchical transport reduces in levels.
template <class E>
std::vector<typename E::T> reference(int32_t op, int n, size_t count, uint64_t seed, size_t offset = 0,
                                     Levels levels = kFlat) {
  std::vector<typename E::T> out(count), col(static_cast<size_t>(n));
  for (size_t i = 0; i < count; ++i) {
    for (int r = 0; r < n; ++r) col[static_cast<size_t>(r)] = input<E>(r, offset + i, seed);
    if constexpr (std::is_floating_point_v<typename E::T>) {
      out[i] = levels != kFlat ? fold_levels<E>(levels, op, n, col.data()) : fold<E>(op, n, col.data());
    } else {
      out[i] = fold<E>(op, n, col.data());
    }
  }
  return out;
}

template <class E>
std::vector<typename E::T> inputs(int rank, size_t count, uint64_t seed, size_t offset = 0) {
  std::vector<typename E::T> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = input<E>(rank, offset + i, seed);
  return v;
}

// Part i of n elements over p ranks: the partition rule of comm.h.
struct Part {
  size_t start, len;
};
inline Part part_of(size_t n, int p, int i) {
  const size_t q = n / static_cast<size_t>(p), r = n % static_cast<size_t>(p), u = static_cast<size_t>(i);
  return {u * q + std::min(u, r), q + (u < r ? 1 : 0)};
}

template <class E>
std::string show(typename E::T v) {
  if constexpr (E::half) {
    return format("%g (0x%04x)", static_cast<double>(E::widen(v)), v);
  } else if constexpr (std::is_same_v<typename E::T, float>) {
    uint32_t b;
    std::memcpy(&b, &v, 4);
    return format("%.9g (0x%08x)", static_cast<double>(v), b);
  } else if constexpr (std::is_same_v<typename E::T, double>) {
    uint64_t b;
    std::memcpy(&b, &v, 8);
    return format("%.17g (0x%016" PRIx64 ")", v, b);
  } else {
    return format("%" PRId64, static_cast<int64_t>(v));
  }
}

// got[0..n) must be want bit for bit; reports the first difference and how many differ.
template <class E>
bool expect_bits(Ctx& x, int line, const typename E::T* want, const typename E::T* got, size_t n,
                 const std::string& what) {
  using T = typename E::T;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(&want[i], &got[i], sizeof(T)) != 0 && bad++ == 0) first = i;
  }
  if (bad == 0) return true;
  x.fail_at(line, "%s: %zu of %zu elements differ; element %zu is %s, expected %s", what.c_str(), bad, n, first,
            show<E>(got[first]).c_str(), show<E>(want[first]).c_str());
  return false;
}
#define EXPECT_BITS(E, x, want, got, n, ...) expect_bits<E>((x), __LINE__, (want), (got), (n), format(__VA_ARGS__))

constexpr uint64_t kFnvBasis = 1469598103934665603ull;
inline uint64_t fnv(const void* p, size_t bytes, uint64_t h = kFnvBasis) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

// Every rank holds the same results: their hashes compared through the group.
inline void agree(Ctx& x, gradsync_comm* c, uint64_t hash, const std::string& what) {
  std::vector<int64_t> all(static_cast<size_t>(x.size));
  const int64_t mine = static_cast<int64_t>(hash);
  if (!EXPECT_OK(x, gradsync_comm_allgather(c, &mine, all.data(), all.size(), GRADSYNC_I64))) return;
  for (int r = 0; r < x.size; ++r) {
    CHECK(x, all[static_cast<size_t>(r)] == mine, "%s: rank %d's results differ from rank %d's", what.c_str(), r,
          x.rank);
  }
}

// A buffer of the caller's heap, or of the communicator (gradsync_comm_alloc: zero copy on shm).
template <class T>
class Buf {
 public:
  Buf(Ctx& x, gradsync_comm* c, size_t n, bool from_comm) : x_(x), c_(c) {
    if (from_comm) {
      void* p = nullptr;
      if (EXPECT_OK(x, gradsync_comm_alloc(c, std::max<size_t>(n, 1) * sizeof(T), &p))) {
        CHECK(x, reinterpret_cast<uintptr_t>(p) % 4096 == 0, "gradsync_comm_alloc gave %p, not 4096-aligned", p);
        p_ = static_cast<T*>(p);
        from_comm_ = true;
      }
    }
    if (p_ == nullptr) {
      own_.resize(std::max<size_t>(n, 1));
      p_ = own_.data();
    }
    std::memset(static_cast<void*>(p_), 0xA5, std::max<size_t>(n, 1) * sizeof(T));  // never a valid result
  }
  ~Buf() {
    if (from_comm_) EXPECT_OK(x_, gradsync_comm_free_buffer(c_, p_));
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  T* data() const { return p_; }
  void fill(const std::vector<T>& v) {
    if (!v.empty()) std::memcpy(static_cast<void*>(p_), v.data(), v.size() * sizeof(T));
  }

 private:
  Ctx& x_;
  gradsync_comm* c_;
  T* p_ = nullptr;
  bool from_comm_ = false;
  std::vector<T> own_;
};

// After a failed call the group is ready for the next one: a right allreduce proves it.
inline void next_call_works(Ctx& x, gradsync_comm* c, int line) {
  float v[3] = {1.0f, static_cast<float>(x.rank), -2.0f};
  const int st = gradsync_comm_allreduce(c, v, v, 3, GRADSYNC_F32, GRADSYNC_SUM);
  if (!expect_status(x, line, "the next allreduce", st, GRADSYNC_OK, {})) return;
  const float n = static_cast<float>(x.size);
  CHECK(x, v[0] == n && v[1] == n * (n - 1) / 2 && v[2] == -2 * n, "the next allreduce gave [%g, %g, %g]",
        static_cast<double>(v[0]), static_cast<double>(v[1]), static_cast<double>(v[2]));
}
#define NEXT_CALL_WORKS(x, c) next_call_works((x), (c), __LINE__)

inline void sleep_ms(int64_t ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }
inline int64_t ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

// Whether this rank compares the case with the reference. Every rank checks that all ranks hold
// the same bits (agree), so one rank's comparison covers the group; the checker rotates, so that
// the ranks share the reference's cost (it grows with the number of ranks).
inline bool checker(const Ctx& x, uint64_t seed) {
  return static_cast<int>(seed % static_cast<uint64_t>(x.size)) == x.rank;
}

// Fewer elements than ranks (some parts empty), at least 2.
inline size_t few(const Ctx& x) { return x.size > 2 ? static_cast<size_t>(x.size - 1) : 2; }

// ---------------------------------------------------------------- the registry

struct Scenario {
  const char* name;
  void (*run)(Ctx&);
  const char* (*not_applicable)(const Ctx&);  // why not here, or nullptr
  // A library bug known to break the scenario here, or nullptr. The scenario still runs and
  // asserts comm.h; its failure is reported as XFAIL and does not fail the run, its success as
  // XPASS, which does: the entry goes with the fix.
  const char* (*known_bug)(const Ctx&);
};

// The registry (scenarios.cpp): every scenario, in the order they run.
extern const Scenario kScenarios[];
extern const int kCount;

}  // namespace conformance
