// SPDX-License-Identifier: Apache-2.0
// The communicator's semantics, once, for every transport: the one place where what comm.h
// promises "on every transport alike" is tested. The same scenarios run over threads of one
// process, over processes sharing memory (fork), and over MPI (under a real mpirun), through the
// public C API, against one reference reduction written here in plain rank order.
//
//   conformance thread|shm <ranks> [filter]     starts the ranks itself
//   mpirun -np <ranks> conformance mpi <ranks> [filter]
//
// Every rank runs every scenario; failures are printed by the rank that saw them and counted over
// the group through the communicator itself, so rank 0 can print one line per scenario and the
// summary. A watchdog turns a hang into a failure.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/gradsync.h"
#include "../half_reference.hpp"

namespace {

constexpr int64_t kTimeoutMs = 3000;  // short, so the timeout scenario is quick
constexpr unsigned kWatchdogSeconds = 280;

struct Ctx {
  gradsync_comm* c = nullptr;
  int rank = 0, size = 1, transport = GRADSYNC_TRANSPORT_THREAD;
  int failures = 0;
  const char* scenario = "";

  void fail(const char* file, int line, const char* fmt, ...) __attribute__((format(printf, 4, 5))) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    std::fprintf(stderr, "  [%s rank %d] %s:%d: %s\n", scenario, rank, file, line, msg);
    ++failures;
  }
  bool mpi() const { return transport == GRADSYNC_TRANSPORT_MPI; }
};

#define CHECK(ctx, cond, fmt, ...)                                                            \
  do {                                                                                        \
    if (!(cond)) (ctx).fail(__FILE__, __LINE__, "%s: " fmt, #cond __VA_OPT__(, ) __VA_ARGS__); \
  } while (0)

// A call that must succeed.
#define OK(ctx, call)                                                                                       \
  do {                                                                                                      \
    const int st_ = (call);                                                                                 \
    if (st_ != GRADSYNC_OK) (ctx).fail(__FILE__, __LINE__, "%s returned %d: %s", #call, st_,                \
                                       gradsync_last_error_message());                                      \
  } while (0)

// A call that must fail with `status` and a message containing `fragment` ("" for any).
#define FAILS(ctx, call, status, fragment) expect_failure((ctx), __LINE__, #call, (call), (status), (fragment))

void expect_failure(Ctx& x, int line, const char* what, int got, int status, const char* fragment) {
  const char* last = gradsync_last_error_message();
  const std::string m = last != nullptr ? last : "";
  if (got != status) {
    x.fail(__FILE__, line, "%s returned %d (%s), expected %d", what, got, m.c_str(), status);
  } else if (m.find(fragment) == std::string::npos) {
    x.fail(__FILE__, line, "%s: message \"%s\" lacks \"%s\"", what, m.c_str(), fragment);
  }
}

// ---- the reference: every element folded in rank order, in the library's arithmetic ----

template <class T>
T input(int rank, size_t i) {
  // Values whose float sums round differently in another order, so the order is tested too.
  if constexpr (std::is_floating_point_v<T>) {
    return static_cast<T>((static_cast<double>(rank) + 1.0) * 0.1 * static_cast<double>(i % 7 + 1) +
                          static_cast<double>(i % 3) * 1e-3 - 0.25 * static_cast<double>(rank % 2));
  } else {
    return static_cast<T>((static_cast<int64_t>(i % 11) - 5) * (rank + 1) + rank * 3);
  }
}

template <class T>
std::vector<T> reference(int32_t op, int size, size_t count) {
  std::vector<T> out(count);
  for (size_t i = 0; i < count; ++i) {
    if constexpr (std::is_floating_point_v<T>) {
      T acc = input<T>(0, i);
      for (int r = 1; r < size; ++r) {
        const T v = input<T>(r, i);
        acc = op == GRADSYNC_MIN ? (v < acc ? v : acc) : op == GRADSYNC_MAX ? (acc < v ? v : acc) : acc + v;
      }
      out[i] = op == GRADSYNC_MEAN ? acc / static_cast<T>(size) : acc;
    } else {
      int64_t acc = input<T>(0, i);
      for (int r = 1; r < size; ++r) {
        const int64_t v = input<T>(r, i);
        acc = op == GRADSYNC_MIN ? std::min(acc, v) : op == GRADSYNC_MAX ? std::max(acc, v) : acc + v;
      }
      out[i] = static_cast<T>(op == GRADSYNC_MEAN ? acc / size : acc);  // truncation toward zero
    }
  }
  return out;
}

template <class T>
std::vector<T> inputs(int rank, size_t count, size_t offset = 0) {
  std::vector<T> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = input<T>(rank, offset + i);
  return v;
}

template <class T>
constexpr int32_t dtype_of() {
  if constexpr (std::is_same_v<T, float>) return GRADSYNC_F32;
  if constexpr (std::is_same_v<T, double>) return GRADSYNC_F64;
  if constexpr (std::is_same_v<T, int32_t>) return GRADSYNC_I32;
  return GRADSYNC_I64;
}

// Part i of n elements over p ranks: the partition rule of comm.h.
struct Part {
  size_t start, len;
};
Part part_of(size_t n, int p, int i) {
  const size_t q = n / static_cast<size_t>(p), r = n % static_cast<size_t>(p), u = static_cast<size_t>(i);
  return {u * q + std::min(u, r), q + (u < r ? 1 : 0)};
}

template <class T>
bool same_bits(const std::vector<T>& a, const T* b) {
  return a.empty() || std::memcmp(a.data(), b, a.size() * sizeof(T)) == 0;  // an empty vector's data() may be NULL
}

// ---- scenarios ----

template <class T>
void allreduce_case(Ctx& x, int32_t op, size_t count, bool in_place) {
  const auto send = inputs<T>(x.rank, count);
  std::vector<T> recv(count);
  std::vector<T> buf = send;
  const int st = in_place ? gradsync_comm_allreduce(x.c, buf.data(), buf.data(), count, dtype_of<T>(), op)
                          : gradsync_comm_allreduce(x.c, send.data(), recv.data(), count, dtype_of<T>(), op);
  if (st != GRADSYNC_OK) {
    x.fail(__FILE__, __LINE__, "allreduce dtype %d op %d count %zu: %d %s", dtype_of<T>(), op, count, st,
           gradsync_last_error_message());
    return;
  }
  const T* got = in_place ? buf.data() : recv.data();
  CHECK(x, same_bits(reference<T>(op, x.size, count), got), "allreduce dtype %d op %d count %zu in_place %d",
        dtype_of<T>(), op, count, in_place);
  if (!in_place) CHECK(x, same_bits(inputs<T>(x.rank, count), send.data()), "send buffer changed");
}

void s_allreduce(Ctx& x) {
  const int32_t ops[] = {GRADSYNC_SUM, GRADSYNC_MEAN, GRADSYNC_MIN, GRADSYNC_MAX};
  // Empty, fewer elements than ranks, not divisible by them, around the inline limit.
  const size_t fewer = static_cast<size_t>(x.size > 1 ? x.size - 1 : 1);
  for (const size_t count : {size_t{0}, size_t{1}, fewer, size_t{7}, size_t{1025}, size_t{4099}}) {
    for (const int32_t op : ops) {
      const bool in_place = (count + static_cast<size_t>(op)) % 2 == 0;
      allreduce_case<float>(x, op, count, in_place);
      allreduce_case<double>(x, op, count, !in_place);
      allreduce_case<int32_t>(x, op, count, in_place);
      allreduce_case<int64_t>(x, op, count, !in_place);
    }
  }
  // Large: the copy pipeline (shm), MPI's tuned path.
  allreduce_case<float>(x, GRADSYNC_SUM, 300000, true);
  allreduce_case<float>(x, GRADSYNC_MEAN, 300001, false);
  allreduce_case<double>(x, GRADSYNC_MAX, 100000, true);
}

void s_allreduce_alloc(Ctx& x) {
  // Buffers from the communicator (zero copy on shm; plain memory elsewhere) give the same bits.
  const size_t count = 70000;
  void* p = nullptr;
  OK(x, gradsync_comm_alloc(x.c, count * sizeof(float), &p));
  if (p == nullptr) return;
  auto* f = static_cast<float*>(p);
  const auto in = inputs<float>(x.rank, count);
  std::memcpy(f, in.data(), count * sizeof(float));
  OK(x, gradsync_comm_allreduce(x.c, f, f, count, GRADSYNC_F32, GRADSYNC_SUM));
  CHECK(x, same_bits(reference<float>(GRADSYNC_SUM, x.size, count), f), "zero-copy allreduce");
  OK(x, gradsync_comm_barrier(x.c));
  OK(x, gradsync_comm_free_buffer(x.c, p));
}

void s_allreduce_many(Ctx& x) {
  // A fused call gives the same bits as one call per buffer.
  const size_t counts[] = {5, 5000, 70000};
  std::vector<std::vector<float>> bufs;
  for (size_t count : counts) bufs.push_back(inputs<float>(x.rank, count));
  void* recvs[3] = {bufs[0].data(), bufs[1].data(), bufs[2].data()};
  OK(x, gradsync_comm_allreduce_many(x.c, nullptr, recvs, counts, 3, GRADSYNC_F32, GRADSYNC_MEAN));
  for (int i = 0; i < 3; ++i) {
    CHECK(x, same_bits(reference<float>(GRADSYNC_MEAN, x.size, counts[i]), bufs[static_cast<size_t>(i)].data()),
          "fused buffer %d", i);
  }
}

template <class T>
void weighted_case(Ctx& x, size_t count) {
  // Weights r + 1, except the last rank of a group of several, which has weight 0 and holds NaN
  // and inf: it contributes nothing.
  const bool empty = x.size > 1 && x.rank == x.size - 1;
  std::vector<T> send = inputs<T>(x.rank, count);
  if (empty) {
    for (size_t i = 0; i < count; ++i) send[i] = i % 2 ? std::numeric_limits<T>::infinity() : std::nan("");
  }
  std::vector<T> recv(count);
  uint64_t total = 0;
  OK(x, gradsync_comm_weighted_mean(x.c, send.data(), recv.data(), count, dtype_of<T>(),
                                    empty ? 0 : static_cast<uint64_t>(x.rank + 1), &total));
  uint64_t expect_total = 0;
  std::vector<T> expect(count);
  for (int r = 0; r < x.size; ++r) expect_total += x.size > 1 && r == x.size - 1 ? 0 : static_cast<uint64_t>(r + 1);
  if (x.size == 1) {
    expect = send;  // a group of one leaves the bits as they are
  } else {
    for (size_t i = 0; i < count; ++i) {
      double acc = 0;
      for (int r = 0; r < x.size; ++r) {
        const double w = r == x.size - 1 ? 0 : r + 1;
        acc = r == 0 ? w * static_cast<double>(input<T>(r, i)) : w != 0 ? acc + w * static_cast<double>(input<T>(r, i))
                                                                          : acc + 0.0;
      }
      expect[i] = static_cast<T>(acc / static_cast<double>(expect_total));
    }
  }
  CHECK(x, total == expect_total, "total weight %" PRIu64 ", expected %" PRIu64, total, expect_total);
  CHECK(x, same_bits(expect, recv.data()), "weighted mean of %zu (dtype %d)", count, dtype_of<T>());
}

void s_weighted_mean(Ctx& x) {
  weighted_case<float>(x, 10);
  weighted_case<double>(x, 10);
  weighted_case<float>(x, 70000);
  // A total weight of 0 (every shard empty) is an error on every rank, and recv is untouched.
  std::vector<float> send(6, 1.0f), recv(6, -2.0f);
  FAILS(x, gradsync_comm_weighted_mean(x.c, send.data(), recv.data(), 6, GRADSYNC_F32, 0, nullptr),
        GRADSYNC_E_ZERO_WEIGHT, "");
  CHECK(x, recv == std::vector<float>(6, -2.0f), "recv written on a zero total weight");
}

void next_call_works(Ctx& x);

void s_seed(Ctx& x) {
  // The library's first acceptance case: 2 ranks [2,4] and [4,8], mean gives [3,6] on both; with
  // 3 ranks, lengths 4, 7, 4 give every rank the mismatch error, then the next round works.
  if (x.size == 2) {
    float v[2] = {2.0f * static_cast<float>(x.rank + 1), 4.0f * static_cast<float>(x.rank + 1)};
    OK(x, gradsync_comm_allreduce(x.c, v, v, 2, GRADSYNC_F32, GRADSYNC_MEAN));
    CHECK(x, v[0] == 3.0f && v[1] == 6.0f, "got [%g, %g]", static_cast<double>(v[0]), static_cast<double>(v[1]));
  } else {
    std::vector<float> v(7, 1.0f);
    const size_t count = x.rank == 1 ? 7 : 4;
    FAILS(x, gradsync_comm_allreduce(x.c, v.data(), v.data(), count, GRADSYNC_F32, GRADSYNC_MEAN),
          GRADSYNC_E_MISMATCH, "rank 1 called allreduce of 7 f32 (mean) but rank 0 called allreduce of 4 f32 (mean)");
    CHECK(x, v == std::vector<float>(7, 1.0f), "a buffer was written on a mismatch");
    next_call_works(x);
  }
}

void s_broadcast(Ctx& x) {
  for (const size_t count : {size_t{5}, size_t{70000}}) {
    for (int root = 0; root < x.size; ++root) {
      std::vector<float> buf = inputs<float>(x.rank, count);
      OK(x, gradsync_comm_broadcast(x.c, buf.data(), count, GRADSYNC_F32, root));
      CHECK(x, same_bits(inputs<float>(root, count), buf.data()), "broadcast of %zu from root %d", count, root);
    }
  }
}

void s_allgather_reduce_scatter_alltoall(Ctx& x) {
  for (const size_t total : {static_cast<size_t>(3 * x.size + 1), size_t{70001}}) {
    const Part mine = part_of(total, x.size, x.rank);
    // allgather: every rank's part lands at its offset.
    std::vector<float> all(total);
    const auto own = inputs<float>(x.rank, mine.len, mine.start);
    OK(x, gradsync_comm_allgather(x.c, own.data(), all.data(), total, GRADSYNC_F32));
    std::vector<float> expect(total);
    for (int r = 0; r < x.size; ++r) {
      const Part p = part_of(total, x.size, r);
      const auto v = inputs<float>(r, p.len, p.start);
      std::copy(v.begin(), v.end(), expect.begin() + static_cast<long>(p.start));
    }
    CHECK(x, same_bits(expect, all.data()), "allgather of %zu", total);
    // reduce_scatter: this rank's part of the reduction.
    const auto send = inputs<float>(x.rank, total);
    std::vector<float> part(mine.len);
    OK(x, gradsync_comm_reduce_scatter(x.c, send.data(), part.data(), total, GRADSYNC_F32, GRADSYNC_SUM));
    const auto full = reference<float>(GRADSYNC_SUM, x.size, total);
    CHECK(x, mine.len == 0 || std::memcmp(part.data(), full.data() + mine.start, mine.len * sizeof(float)) == 0,
          "reduce_scatter of %zu", total);
    // alltoall: rank i's part j lands in rank j's block i.
    std::vector<int32_t> out(mine.len * static_cast<size_t>(x.size));
    const auto ints = inputs<int32_t>(x.rank, total);
    OK(x, gradsync_comm_alltoall(x.c, ints.data(), out.data(), total, GRADSYNC_I32));
    for (int r = 0; r < x.size; ++r) {
      const auto theirs = inputs<int32_t>(r, total);
      CHECK(x, mine.len == 0 || std::memcmp(out.data() + static_cast<size_t>(r) * mine.len, theirs.data() + mine.start,
                                            mine.len * sizeof(int32_t)) == 0,
            "alltoall of %zu: block from rank %d", total, r);
    }
  }
  OK(x, gradsync_comm_barrier(x.c));
}

// After a failed call every rank is ready for the next one: a right allreduce proves it.
void next_call_works(Ctx& x) {
  allreduce_case<float>(x, GRADSYNC_SUM, 4, false);
}

void s_mismatch(Ctx& x) {
  // One rank passes another count: every rank gets the mismatch, in that same call, and the
  // group goes on.
  std::vector<float> v(5, 1.0f);
  const size_t count = x.rank == x.size - 1 ? 5 : 4;
  FAILS(x, gradsync_comm_allreduce(x.c, v.data(), v.data(), count, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_MISMATCH,
        "rank");
  next_call_works(x);
}

void s_bad_root(Ctx& x) {
  // Only the last rank passes a root out of range: a disagreement like any other, reported to
  // every rank in that call, naming the rank and its root; the group goes on.
  std::vector<float> v(4, 1.0f);
  char who[64];
  std::snprintf(who, sizeof who, "rank %d called broadcast of 4 f32 from root %d", x.size - 1, x.size);
  FAILS(x, gradsync_comm_broadcast(x.c, v.data(), 4, GRADSYNC_F32, x.rank == x.size - 1 ? x.size : 0),
        GRADSYNC_E_MISMATCH, who);
  next_call_works(x);
  // Every rank passes the same root out of range: E_OUT_OF_RANGE on every rank.
  FAILS(x, gradsync_comm_broadcast(x.c, v.data(), 4, GRADSYNC_F32, x.size), GRADSYNC_E_OUT_OF_RANGE, "root");
  next_call_works(x);
}

using half_reference::from_bf16;
using half_reference::from_f16;
using half_reference::to_bf16;
using half_reference::to_f16;

void s_half_precision(Ctx& x) {
  // bf16 and f16: accumulated in f32 in rank order, rounded once, the same bits on every rank.
  struct Half {
    int32_t dtype;
    uint16_t (*to)(float);
    float (*from)(uint16_t);
  };
  for (const Half h : {Half{GRADSYNC_BF16, to_bf16, from_bf16}, Half{GRADSYNC_F16, to_f16, from_f16}}) {
    for (const int32_t op : {GRADSYNC_SUM, GRADSYNC_MEAN, GRADSYNC_MIN, GRADSYNC_MAX}) {
      for (const size_t count : {size_t{5}, size_t{100003}}) {
        auto half_of = [&](int r, size_t i) { return h.to(input<float>(r, i)); };
        std::vector<uint16_t> v(count);
        for (size_t i = 0; i < count; ++i) v[i] = half_of(x.rank, i);
        OK(x, gradsync_comm_allreduce(x.c, v.data(), v.data(), count, h.dtype, op));
        size_t wrong = 0;
        for (size_t i = 0; i < count; ++i) {
          float acc = h.from(half_of(0, i));
          for (int r = 1; r < x.size; ++r) {
            const float b = h.from(half_of(r, i));
            acc = op == GRADSYNC_MIN ? (b < acc ? b : acc) : op == GRADSYNC_MAX ? (acc < b ? b : acc) : acc + b;
          }
          if (op == GRADSYNC_MEAN) acc /= static_cast<float>(x.size);
          wrong += v[i] != h.to(acc);
        }
        CHECK(x, wrong == 0, "dtype %d op %d count %zu: %zu elements differ", h.dtype, op, count, wrong);
      }
    }
  }
}

void s_unsupported_dtype(Ctx& x) {
  // A weighted mean of integers has no meaning here: every rank refuses it in that same call.
  std::vector<int32_t> v(8, 1);
  FAILS(x, gradsync_comm_weighted_mean(x.c, v.data(), v.data(), 8, GRADSYNC_I32, 1, nullptr), GRADSYNC_E_INVALID_ARG,
        "weighted mean needs f32 or f64");
  next_call_works(x);
}

void s_abort(Ctx& x) {
  // Rank 0 aborts while the others wait in a collective; every rank's call fails, later calls
  // fail fast, and a reset on every rank recovers the group.
  std::vector<float> v(4, 1.0f);
  if (x.rank == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    OK(x, gradsync_comm_abort(x.c));
  }
  const int st = gradsync_comm_allreduce(x.c, v.data(), v.data(), 4, GRADSYNC_F32, GRADSYNC_SUM);
  // MPI: an abort is local; the others' exchange in flight ends at their deadline (comm.h).
  CHECK(x, st == GRADSYNC_E_ABORTED || (x.mpi() && x.rank != 0 && st == GRADSYNC_E_TIMEOUT), "aborted call gave %d: %s",
        st, gradsync_last_error_message());
  FAILS(x, gradsync_comm_barrier(x.c), GRADSYNC_E_ABORTED, "");
  OK(x, gradsync_comm_reset(x.c));
  next_call_works(x);
}

void s_timeout(Ctx& x) {
  // The last rank arrives after the deadline: the waiters time out naming it; its own late call
  // finds the group stopped; a reset on every rank recovers it.
  std::vector<float> v(4, 1.0f);
  const bool late = x.rank == x.size - 1;
  if (late) std::this_thread::sleep_for(std::chrono::milliseconds(kTimeoutMs + 700));
  const int st = gradsync_comm_allreduce(x.c, v.data(), v.data(), 4, GRADSYNC_F32, GRADSYNC_SUM);
  if (late) {
    CHECK(x, st == GRADSYNC_E_ABORTED || st == GRADSYNC_E_TIMEOUT, "late call gave %d: %s", st,
          gradsync_last_error_message());
  } else {
    CHECK(x, st == GRADSYNC_E_TIMEOUT, "waiter gave %d: %s", st, gradsync_last_error_message());
  }
  OK(x, gradsync_comm_reset(x.c));
  next_call_works(x);
}

void s_group_of_one_keeps_bits(Ctx& x) {
  // recv = send bit for bit: a signalling NaN stays signalling, -0 stays -0.
  uint32_t bits[4] = {0x7f800001u, 0x80000000u, 0x7fc00000u, 0x3f800000u};
  float send[4], recv[4];
  std::memcpy(send, bits, sizeof send);
  OK(x, gradsync_comm_allreduce(x.c, send, recv, 4, GRADSYNC_F32, GRADSYNC_MEAN));
  CHECK(x, std::memcmp(send, recv, sizeof send) == 0, "allreduce changed the bits");
  uint64_t total = 0;
  OK(x, gradsync_comm_weighted_mean(x.c, send, recv, 4, GRADSYNC_F32, 3, &total));
  CHECK(x, std::memcmp(send, recv, sizeof send) == 0 && total == 3, "weighted mean changed the bits");
}

struct Scenario {
  const char* name;
  void (*run)(Ctx&);
  // Why the scenario does not apply here, or nullptr.
  const char* (*not_applicable)(const Ctx&);
};

const char* needs_peers(const Ctx& x) { return x.size < 2 ? "needs 2 or more ranks" : nullptr; }
const char* needs_one(const Ctx& x) { return x.size != 1 ? "a group of one only" : nullptr; }
const char* always(const Ctx&) { return nullptr; }
const char* seed_sizes(const Ctx& x) { return x.size == 2 || x.size == 3 ? nullptr : "the seed cases have 2 or 3 ranks"; }

const Scenario kScenarios[] = {
    {"the seed: [2,4] and [4,8] mean to [3,6]; lengths 4, 7, 4 mismatch on every rank", s_seed, seed_sizes},
    {"allreduce: every dtype and op, sizes 1 to 300001, bitwise equal to the rank-order reference", s_allreduce, always},
    {"allreduce on the communicator's own buffers", s_allreduce_alloc, always},
    {"allreduce_many equals one allreduce per buffer", s_allreduce_many, always},
    {"weighted mean: double accumulation in rank order; weight 0 with NaN and inf contributes nothing", s_weighted_mean,
     always},
    {"broadcast from every root", s_broadcast, always},
    {"allgather, reduce_scatter, alltoall by the partition rule", s_allgather_reduce_scatter_alltoall, always},
    {"a count that one rank disagrees on: E_MISMATCH on every rank, then the next call works", s_mismatch, needs_peers},
    {"a root out of range on one rank (E_MISMATCH naming it) or on all (E_OUT_OF_RANGE), on every rank", s_bad_root,
     needs_peers},
    {"bf16 and f16 reductions: f32 accumulation in rank order, one rounding", s_half_precision, always},
    {"a dtype the operation lacks (weighted mean of i32): E_INVALID_ARG on every rank", s_unsupported_dtype, always},
    {"abort from one rank while the others wait, fail fast, reset", s_abort, needs_peers},
    {"a rank late past the deadline: E_TIMEOUT for the waiters, reset", s_timeout, needs_peers},
    {"a group of one leaves the bits as they are", s_group_of_one_keeps_bits, needs_one},
};

const char* transport_name(int t) {
  return t == GRADSYNC_TRANSPORT_THREAD ? "thread" : t == GRADSYNC_TRANSPORT_SHM ? "shm" : "mpi";
}

// One rank: join, run every scenario, count failures over the group; rank 0 reports.
int run_rank(int transport, int rank, int size, const std::string& name, const char* filter) {
  gradsync_comm_options o;
  gradsync_comm_options_init(&o, sizeof o);
  o.transport = transport;
  o.rank = rank;
  o.size = size;
  o.timeout_ms = kTimeoutMs;
  o.deterministic = 1;  // MPI: rank order, like the other transports
  std::snprintf(o.name, sizeof o.name, "%s", name.c_str());
  Ctx x;
  x.transport = transport;
  if (gradsync_comm_create(&x.c, &o) != GRADSYNC_OK) {
    std::fprintf(stderr, "rank %d: cannot join: %s\n", rank, gradsync_last_error_message());
    return 2;
  }
  gradsync_comm_rank(x.c, &x.rank);
  gradsync_comm_size(x.c, &x.size);
  int passed = 0, failed = 0, skipped = 0;
  for (const Scenario& s : kScenarios) {
    if (filter != nullptr && std::strstr(s.name, filter) == nullptr) continue;
    x.scenario = s.name;
    if (const char* why = s.not_applicable(x)) {
      if (x.rank == 0) std::printf("n/a  %s: %s\n", s.name, why);
      ++skipped;
      continue;
    }
    x.failures = 0;
    s.run(x);
    // The verdict travels through the communicator under test; a broken group is a failure too.
    int32_t mine = x.failures, total = 0;
    if (gradsync_comm_allreduce(x.c, &mine, &total, 1, GRADSYNC_I32, GRADSYNC_SUM) != GRADSYNC_OK) {
      std::fprintf(stderr, "rank %d: the group is unusable after \"%s\": %s\n", x.rank, s.name,
                   gradsync_last_error_message());
      gradsync_comm_reset(x.c);
      total = mine + 1;
    }
    if (x.rank == 0) std::printf("%s %s\n", total == 0 ? "ok  " : "FAIL", s.name);
    std::fflush(stdout);
    (total == 0 ? passed : failed)++;
  }
  if (x.rank == 0) {
    std::printf("conformance %s x%d: %d passed, %d failed, %d not applicable\n", transport_name(transport), x.size,
                passed, failed, skipped);
  }
  std::fflush(stdout);
  gradsync_comm_free(x.c);
  return failed == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s thread|shm|mpi <ranks> [scenario filter]\n", argv[0]);
    return 2;
  }
  const std::string kind = argv[1];
  const int size = std::atoi(argv[2]);
  const char* filter = argc > 3 ? argv[3] : nullptr;
  alarm(kWatchdogSeconds);  // a hang ends the process: the test fails instead of hanging
  const std::string name = "conformance-" + std::to_string(getpid());
  if (kind == "mpi") return run_rank(GRADSYNC_TRANSPORT_MPI, 0, size, name, filter);
  if (kind == "thread") {
    std::vector<int> codes(static_cast<size_t>(size));
    std::vector<std::thread> ranks;
    for (int r = 0; r < size; ++r) {
      ranks.emplace_back([&, r] { codes[static_cast<size_t>(r)] = run_rank(GRADSYNC_TRANSPORT_THREAD, r, size, name, filter); });
    }
    for (auto& t : ranks) t.join();
    for (int c : codes) {
      if (c != 0) return 1;
    }
    return 0;
  }
  if (kind == "shm") {
    std::fflush(stdout);
    std::vector<pid_t> pids;
    for (int r = 0; r < size; ++r) {
      const pid_t pid = fork();
      if (pid == 0) {
        std::fflush(stdout);
        _exit(run_rank(GRADSYNC_TRANSPORT_SHM, r, size, name, filter));
      }
      pids.push_back(pid);
    }
    int worst = 0;
    for (pid_t pid : pids) {
      int status = 0;
      waitpid(pid, &status, 0);
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0) {
        std::fprintf(stderr, "rank process %d ended with %d\n", static_cast<int>(pid), code);
        worst = 1;
      }
    }
    return worst;
  }
  std::fprintf(stderr, "unknown transport '%s'\n", kind.c_str());
  return 2;
}
