// SPDX-License-Identifier: Apache-2.0
// One rank of a shared-memory communicator test, as a real process: started by shm_driver
// (fork/exec) as `shm_worker <case> <rank> <size> <group>`. Uses only the public C API.
// Exits 0 when this rank saw exactly what the case expects; otherwise prints why and exits 1.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "gradsync/comm.h"
#include "gradsync/errors.h"

namespace {

int g_rank = 0, g_size = 1;
std::string g_case, g_group;

[[noreturn]] void die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "[%s rank %d/%d pid %d] FAIL: ", g_case.c_str(), g_rank, g_size, getpid());
  std::vfprintf(stderr, fmt, ap);
  std::fprintf(stderr, "\n");
  va_end(ap);
  std::exit(1);
}

#define EXPECT(cond, ...)                                                          \
  do {                                                                             \
    if (!(cond)) die("%s:%d: %s: " __VA_ARGS__, __FILE__, __LINE__, #cond); \
  } while (0)

// Calls that must succeed.
#define OK(call)                                                                                               \
  do {                                                                                                         \
    const int st_ = (call);                                                                                    \
    if (st_ != GRADSYNC_OK) die("%s:%d: %s returned %d: %s", __FILE__, __LINE__, #call, st_, gradsync_last_error_message()); \
  } while (0)

// Calls that must fail with `status`, with a message containing each of the given fragments.
void expect_status(int got, int status, const char* what, std::initializer_list<std::string> fragments = {}) {
  if (got != status) {
    die("%s returned %d (%s), expected %d (%s)", what, got, gradsync_last_error_message(), status,
        gradsync_status_string(status));
  }
  const std::string message = gradsync_last_error_message();
  for (const auto& f : fragments) {
    if (message.find(f) == std::string::npos) die("%s: message \"%s\" lacks \"%s\"", what, message.c_str(), f.c_str());
  }
}

gradsync_comm* join(const std::string& group, int rank, int size, int64_t timeout_ms, int* status = nullptr) {
  gradsync_comm_options o;
  OK(gradsync_comm_options_init(&o, sizeof o));
  o.transport = GRADSYNC_TRANSPORT_SHM;
  o.rank = rank;
  o.size = size;
  o.timeout_ms = timeout_ms;
  std::snprintf(o.name, sizeof o.name, "%s", group.c_str());
  gradsync_comm* c = nullptr;
  const int st = gradsync_comm_create(&c, &o);
  if (status != nullptr) {
    *status = st;
    return c;
  }
  if (st != GRADSYNC_OK) die("joining %s as rank %d of %d: %s", group.c_str(), rank, size, gradsync_last_error_message());
  return c;
}

bool exists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

void touch(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "w");
  EXPECT(f != nullptr, "cannot create %s", path.c_str());
  std::fclose(f);
}

// Polls for a file another rank creates; bounded.
void await_file(const std::string& path) {
  for (int i = 0; i < 20000 && !exists(path); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT(exists(path), "%s never appeared", path.c_str());
}

std::string marker(const char* what) { return "/tmp/" + g_group + "." + what; }

// ---------------------------------------------------------------- reference reductions

// Deterministic inputs that differ per rank, element and seed; floats of mixed magnitude so the
// reduction order changes the bits.
template <class T>
T input(int rank, uint64_t i, uint64_t seed) {
  uint64_t x = (seed * 0x9E3779B97F4A7C15ull) ^ (uint64_t(rank + 1) * 0xBF58476D1CE4E5B9ull) ^ (i * 0x94D049BB133111EBull);
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 29;
  if constexpr (std::is_floating_point_v<T>) {
    const double unit = double(x >> 11) / double(uint64_t{1} << 53) * 2.0 - 1.0;
    return static_cast<T>(unit * (1 + (x & 7) * 1000.0));
  } else {
    return static_cast<T>(static_cast<int64_t>(x) >> 3);  // large: integer sums wrap
  }
}

// The documented kernel semantics: rank order; integer sums wrap; i32 mean sums in 64 bits;
// mean = sum / n, integer mean truncating toward zero.
template <class T>
T reference(int32_t op, int n, uint64_t i, uint64_t seed) {
  if constexpr (std::is_floating_point_v<T>) {
    T acc = input<T>(0, i, seed);
    for (int r = 1; r < n; ++r) {
      const T v = input<T>(r, i, seed);
      if (op == GRADSYNC_MIN) acc = v < acc ? v : acc;
      else if (op == GRADSYNC_MAX) acc = acc < v ? v : acc;
      else acc = acc + v;
    }
    return op == GRADSYNC_MEAN ? acc / static_cast<T>(n) : acc;
  } else {
    if (op == GRADSYNC_MIN || op == GRADSYNC_MAX) {
      T acc = input<T>(0, i, seed);
      for (int r = 1; r < n; ++r) {
        const T v = input<T>(r, i, seed);
        acc = op == GRADSYNC_MIN ? (v < acc ? v : acc) : (acc < v ? v : acc);
      }
      return acc;
    }
    if (op == GRADSYNC_MEAN && sizeof(T) == 4) {
      int64_t acc = 0;
      for (int r = 0; r < n; ++r) acc += input<T>(r, i, seed);
      return static_cast<T>(acc / n);
    }
    using U = std::make_unsigned_t<T>;
    U acc = 0;
    for (int r = 0; r < n; ++r) acc = static_cast<U>(acc + static_cast<U>(input<T>(r, i, seed)));
    if (op == GRADSYNC_MEAN) return static_cast<T>(static_cast<int64_t>(acc) / n);
    return static_cast<T>(acc);
  }
}

template <class T>
constexpr int32_t dtype_of() {
  if constexpr (std::is_same_v<T, float>) return GRADSYNC_F32;
  else if constexpr (std::is_same_v<T, double>) return GRADSYNC_F64;
  else if constexpr (std::is_same_v<T, int32_t>) return GRADSYNC_I32;
  else return GRADSYNC_I64;
}

// A buffer either from the caller's heap or from the group's segment (zero copy).
template <class T>
struct Buffer {
  gradsync_comm* comm;
  T* data = nullptr;
  std::vector<T> own;
  Buffer(gradsync_comm* c, size_t n, bool in_segment) : comm(c) {
    if (in_segment) {
      void* p = nullptr;
      OK(gradsync_comm_alloc(c, std::max<size_t>(n, 1) * sizeof(T), &p));
      data = static_cast<T*>(p);
    } else {
      own.resize(std::max<size_t>(n, 1));
      data = own.data();
    }
  }
  ~Buffer() {
    if (own.empty()) OK(gradsync_comm_free_buffer(comm, data));
  }
  Buffer(const Buffer&) = delete;
};

uint64_t fnv(const void* p, size_t bytes, uint64_t h = 1469598103934665603ull) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ c[i]) * 1099511628211ull;
  return h;
}

// Every rank holds the same hash: bitwise-identical results across ranks, checked through the group.
void expect_same_on_all_ranks(gradsync_comm* c, uint64_t hash, const char* what) {
  std::vector<int64_t> all(static_cast<size_t>(g_size));
  int64_t mine = static_cast<int64_t>(hash);
  OK(gradsync_comm_allgather(c, &mine, all.data(), all.size(), GRADSYNC_I64));
  for (int r = 0; r < g_size; ++r) EXPECT(all[r] == mine, "%s: rank %d's result differs from rank %d's", what, r, g_rank);
}

const char* op_str(int32_t op) {
  static const char* names[] = {"sum", "mean", "min", "max"};
  return op >= 0 && op < 4 ? names[op] : "?";
}

template <class T>
void check_allreduce(gradsync_comm* c, size_t count, int32_t op, bool in_segment, bool in_place, uint64_t seed) {
  Buffer<T> send(c, count, in_segment), recv(c, count, in_segment);
  for (size_t i = 0; i < count; ++i) send.data[i] = input<T>(g_rank, i, seed);
  T* out = in_place ? send.data : recv.data;
  OK(gradsync_comm_allreduce(c, send.data, out, count, dtype_of<T>(), op));
  for (size_t i = 0; i < count; ++i) {
    const T want = reference<T>(op, g_size, i, seed);
    if (std::memcmp(&out[i], &want, sizeof(T)) != 0) {
      die("allreduce %s of %zu (dtype %d, segment %d, in place %d): element %zu is %.17g, expected %.17g", op_str(op),
          count, dtype_of<T>(), in_segment, in_place, i, double(out[i]), double(want));
    }
  }
  expect_same_on_all_ranks(c, fnv(out, count * sizeof(T)), "allreduce");
}

template <class T>
void check_all_ops(gradsync_comm* c, const std::vector<size_t>& counts) {
  uint64_t seed = 1;
  for (size_t count : counts) {
    for (int32_t op : {GRADSYNC_SUM, GRADSYNC_MEAN, GRADSYNC_MIN, GRADSYNC_MAX}) {
      for (int path = 0; path < 4; ++path) check_allreduce<T>(c, count, op, path >= 2, path % 2 == 1, ++seed);
    }
  }
}

// Sizes: empty, one element, fewer than ranks, not divisible by the ranks, over the small-payload
// limit, and several pipeline chunks with a ragged end.
std::vector<size_t> sizes() {
  return {0, 1, size_t(g_size > 1 ? g_size - 1 : 1), 1001, 5003, 300007};
}

void case_ops(gradsync_comm* c) {
  check_all_ops<float>(c, sizes());
  check_all_ops<double>(c, sizes());
  check_all_ops<int32_t>(c, sizes());
  check_all_ops<int64_t>(c, sizes());
}

void case_fused(gradsync_comm* c) {
  for (int segment = 0; segment < 2; ++segment) {
    const std::vector<size_t> counts = {3, 0, 7000, 1, 100003, 17};
    std::vector<Buffer<float>*> bufs;
    std::vector<void*> recvs;
    for (size_t k = 0; k < counts.size(); ++k) {
      bufs.push_back(new Buffer<float>(c, counts[k], segment == 1));
      for (size_t i = 0; i < counts[k]; ++i) bufs[k]->data[i] = input<float>(g_rank, i, 100 + k);
      recvs.push_back(bufs[k]->data);
    }
    OK(gradsync_comm_allreduce_many(c, nullptr, recvs.data(), counts.data(), counts.size(), GRADSYNC_F32, GRADSYNC_SUM));
    for (size_t k = 0; k < counts.size(); ++k) {
      for (size_t i = 0; i < counts[k]; ++i) {
        const float want = reference<float>(GRADSYNC_SUM, g_size, i, 100 + k);
        EXPECT(std::memcmp(&bufs[k]->data[i], &want, 4) == 0, "fused buffer %zu element %zu", k, i);
      }
      delete bufs[k];
    }
  }
}

template <class T>
void check_broadcast(gradsync_comm* c, size_t count, int root, bool in_segment) {
  Buffer<T> buf(c, count, in_segment);
  for (size_t i = 0; i < count; ++i) buf.data[i] = input<T>(g_rank, i, 7);
  OK(gradsync_comm_broadcast(c, buf.data, count, dtype_of<T>(), root));
  for (size_t i = 0; i < count; ++i) {
    const T want = input<T>(root, i, 7);
    EXPECT(std::memcmp(&buf.data[i], &want, sizeof(T)) == 0, "broadcast of %zu from %d: element %zu", count, root, i);
  }
}

template <class T>
void check_allgather(gradsync_comm* c, size_t total, bool in_segment, bool in_place) {
  Buffer<T> recv(c, total, in_segment), send(c, total, in_segment);
  const size_t base = total / g_size, extra = total % g_size;
  auto start = [&](int r) { return r * base + std::min<size_t>(r, extra); };
  const size_t my_len = base + (size_t(g_rank) < extra ? 1 : 0);
  for (size_t i = 0; i < total; ++i) recv.data[i] = T(-1);
  T* part = in_place ? recv.data + start(g_rank) : send.data;
  for (size_t i = 0; i < my_len; ++i) part[i] = input<T>(g_rank, start(g_rank) + i, 9);
  OK(gradsync_comm_allgather(c, in_place ? nullptr : send.data, recv.data, total, dtype_of<T>()));
  for (int r = 0; r < g_size; ++r) {
    const size_t len = base + (size_t(r) < extra ? 1 : 0);
    for (size_t i = 0; i < len; ++i) {
      const T want = input<T>(r, start(r) + i, 9);
      EXPECT(std::memcmp(&recv.data[start(r) + i], &want, sizeof(T)) == 0, "allgather of %zu: rank %d's element %zu",
             total, r, i);
    }
  }
}

template <class T>
void check_reduce_scatter(gradsync_comm* c, size_t total, int32_t op, bool in_segment, bool in_place) {
  Buffer<T> send(c, total, in_segment), recv(c, total, in_segment);
  for (size_t i = 0; i < total; ++i) send.data[i] = input<T>(g_rank, i, 11);
  const size_t base = total / g_size, extra = total % g_size;
  const size_t start = g_rank * base + std::min<size_t>(g_rank, extra);
  const size_t len = base + (size_t(g_rank) < extra ? 1 : 0);
  T* out = in_place ? send.data + start : recv.data;
  OK(gradsync_comm_reduce_scatter(c, send.data, out, total, dtype_of<T>(), op));
  for (size_t i = 0; i < len; ++i) {
    const T want = reference<T>(op, g_size, start + i, 11);
    EXPECT(std::memcmp(&out[i], &want, sizeof(T)) == 0, "reduce_scatter %s of %zu: element %zu", op_str(op), total, i);
  }
}

// Rank i's part for this rank lands in block i; both data paths (segment or ordinary memory).
template <class T>
void check_alltoall(gradsync_comm* c, size_t total, bool in_segment) {
  const size_t base = total / g_size, extra = total % g_size;
  const size_t start = g_rank * base + std::min<size_t>(g_rank, extra);
  const size_t len = base + (size_t(g_rank) < extra ? 1 : 0);
  Buffer<T> send(c, total, in_segment), recv(c, len * g_size, in_segment);
  for (size_t i = 0; i < total; ++i) send.data[i] = input<T>(g_rank, i, 13);
  for (size_t i = 0; i < len * g_size; ++i) recv.data[i] = T(-1);
  OK(gradsync_comm_alltoall(c, send.data, recv.data, total, dtype_of<T>()));
  for (int r = 0; r < g_size; ++r) {
    for (size_t i = 0; i < len; ++i) {
      const T want = input<T>(r, start + i, 13);
      EXPECT(std::memcmp(&recv.data[r * len + i], &want, sizeof(T)) == 0, "alltoall of %zu: rank %d's element %zu",
             total, r, i);
    }
  }
}

void case_collectives(gradsync_comm* c) {
  for (size_t count : sizes()) {
    for (bool in_segment : {false, true}) {
      check_alltoall<float>(c, count, in_segment);
      check_alltoall<int64_t>(c, count, in_segment);
    }
    for (int root = 0; root < g_size; ++root) {
      check_broadcast<float>(c, count, root, false);
      check_broadcast<double>(c, count, root, true);
    }
    for (int path = 0; path < 4; ++path) {
      check_allgather<float>(c, count, path >= 2, path % 2 == 1);
      check_allgather<int64_t>(c, count, path >= 2, path % 2 == 1);
      for (int32_t op : {GRADSYNC_SUM, GRADSYNC_MEAN, GRADSYNC_MAX}) {
        check_reduce_scatter<float>(c, count, op, path >= 2, path % 2 == 1);
        check_reduce_scatter<int32_t>(c, count, op, path >= 2, path % 2 == 1);
      }
    }
  }
  for (int i = 0; i < 50; ++i) OK(gradsync_comm_barrier(c));
  // Weighted mean: rank r sends [r+1, 2(r+1)] with weight r+1.
  double send[2] = {double(g_rank + 1), 2.0 * (g_rank + 1)}, recv[2];
  uint64_t total = 0;
  OK(gradsync_comm_weighted_mean(c, send, recv, 2, GRADSYNC_F64, uint64_t(g_rank + 1), &total));
  double num = 0, den = 0;
  for (int r = 0; r < g_size; ++r) num += double(r + 1) * (r + 1), den += r + 1;
  EXPECT(total == uint64_t(den), "total weight %" PRIu64, total);
  EXPECT(std::fabs(recv[0] - num / den) < 1e-12 && std::fabs(recv[1] - 2 * num / den) < 1e-12, "weighted mean");
  uint64_t zero_total = 7;
  expect_status(gradsync_comm_weighted_mean(c, send, recv, 2, GRADSYNC_F64, 0, &zero_total), GRADSYNC_E_ZERO_WEIGHT,
                "weighted mean of zero weights");
  EXPECT(zero_total == 0, "total of zero weights");
}

// Every kind of disagreement gives E_MISMATCH on every rank, naming both sides; the next round works.
void case_mismatch(gradsync_comm* c) {
  const bool odd = g_rank == g_size - 1;
  const std::string other = "rank " + std::to_string(g_size - 1);
  std::vector<float> big(100000, 1.f);
  expect_status(gradsync_comm_allreduce(c, big.data(), big.data(), odd ? 99999 : 100000, GRADSYNC_F32, GRADSYNC_SUM),
                GRADSYNC_E_MISMATCH, "count", {"rank 0", other, "100000", "99999"});
  expect_status(gradsync_comm_allreduce(c, big.data(), big.data(), 10, odd ? GRADSYNC_I32 : GRADSYNC_F32, GRADSYNC_SUM),
                GRADSYNC_E_MISMATCH, "dtype", {"f32", "i32"});
  expect_status(gradsync_comm_allreduce(c, big.data(), big.data(), 10, GRADSYNC_F32, odd ? GRADSYNC_MAX : GRADSYNC_SUM),
                GRADSYNC_E_MISMATCH, "op", {"(sum)", "(max)"});
  expect_status(gradsync_comm_broadcast(c, big.data(), 10, GRADSYNC_F32, odd ? 1 : 0), GRADSYNC_E_MISMATCH, "root",
                {"root 0", "root 1"});
  expect_status(odd ? gradsync_comm_barrier(c) : gradsync_comm_allreduce(c, big.data(), big.data(), 10, GRADSYNC_F32, GRADSYNC_SUM),
                GRADSYNC_E_MISMATCH, "collective", {"barrier", "allreduce"});
  const size_t counts_a[2] = {5, 5}, counts_b[2] = {4, 6};
  void* recvs[2] = {big.data(), big.data() + 10};
  expect_status(gradsync_comm_allreduce_many(c, nullptr, recvs, odd ? counts_b : counts_a, 2, GRADSYNC_F32, GRADSYNC_SUM),
                GRADSYNC_E_MISMATCH, "fused counts", {"2 buffers"});
  std::vector<float> v(10, 1.f);
  OK(gradsync_comm_allreduce(c, v.data(), v.data(), 10, GRADSYNC_F32, GRADSYNC_SUM));
  for (float x : v) EXPECT(x == float(g_size), "after mismatches got %g", x);
}

// The last rank joins but does not arrive: the others time out, then fail fast until reset.
void case_timeout(gradsync_comm* c) {
  float v = 1.f;
  const std::string arrived = marker("late-in-reset");
  if (g_rank == g_size - 1) {
    // Wait until every other rank has timed out, then find the group stopped too.
    await_file(marker("timed-out"));
    expect_status(gradsync_comm_allreduce(c, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_ABORTED, "after timeout",
                  {"timeout"});
    touch(arrived);
  } else {
    expect_status(gradsync_comm_allreduce(c, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM), GRADSYNC_E_TIMEOUT, "late rank",
                  {"timed out"});
    expect_status(gradsync_comm_barrier(c), GRADSYNC_E_ABORTED, "fail fast after timeout");
    if (g_rank == 0) {
      // Rank 0 signals once the others have seen it too (they fail fast before touching anything).
      touch(marker("timed-out"));
    }
    await_file(arrived);
  }
  OK(gradsync_comm_reset(c));
  v = 1.f;
  OK(gradsync_comm_allreduce(c, &v, &v, 1, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(v == float(g_size), "after reset got %g", v);
}

// abort from another thread unblocks every waiter; reset makes the group usable again.
void case_abort(gradsync_comm* c) {
  std::vector<float> v(1000, 1.f);
  const std::string aborted = marker("aborted");
  if (g_rank == g_size - 1) {
    await_file(aborted);
    expect_status(gradsync_comm_allreduce(c, v.data(), v.data(), v.size(), GRADSYNC_F32, GRADSYNC_SUM),
                  GRADSYNC_E_ABORTED, "after abort", {"aborted"});
  } else {
    std::thread aborter;
    if (g_rank == 0) {
      aborter = std::thread([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        OK(gradsync_comm_abort(c));
        touch(aborted);
      });
    }
    expect_status(gradsync_comm_allreduce(c, v.data(), v.data(), v.size(), GRADSYNC_F32, GRADSYNC_SUM),
                  GRADSYNC_E_ABORTED, "blocked allreduce", {"aborted", "rank 0"});
    if (aborter.joinable()) aborter.join();
  }
  OK(gradsync_comm_reset(c));
  std::fill(v.begin(), v.end(), 1.f);
  OK(gradsync_comm_allreduce(c, v.data(), v.data(), v.size(), GRADSYNC_F32, GRADSYNC_SUM));
  for (float x : v) EXPECT(x == float(g_size), "after reset got %g", x);
}

// Rank 1 is SIGKILLed in the middle of collectives: the others get E_REMOTE naming it (not a
// timeout: their timeout is 60 s), free the group and form a new one under the same name.
void case_kill(gradsync_comm* c, bool in_segment) {
  const size_t n = 4 << 20;
  Buffer<float> b(c, n, in_segment);
  OK(gradsync_comm_barrier(c));  // every rank is past joining before the victim dies
  if (g_rank == 1) {
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      raise(SIGKILL);
    }).detach();
  }
  int st = GRADSYNC_OK;
  for (int i = 0; i < 100000 && st == GRADSYNC_OK; ++i) {
    st = gradsync_comm_allreduce(c, b.data, b.data, n, GRADSYNC_F32, GRADSYNC_SUM);
  }
  EXPECT(g_rank != 1, "the victim outlived its SIGKILL");
  expect_status(st, GRADSYNC_E_REMOTE, "collective with a killed peer", {"rank 1", "died"});
  expect_status(gradsync_comm_barrier(c), GRADSYNC_E_REMOTE, "fail fast with a dead peer", {"rank 1"});
}

void case_kill_survivors(int survivor_rank, int survivors) {
  gradsync_comm* c = join(g_group, survivor_rank, survivors, 20000);
  float v[3] = {1.f, 2.f, 3.f};
  OK(gradsync_comm_allreduce(c, v, v, 3, GRADSYNC_F32, GRADSYNC_SUM));
  const float m = float(survivors);
  EXPECT(v[0] == m && v[1] == 2 * m && v[2] == 3 * m, "new group got [%g, %g, %g]", v[0], v[1], v[2]);
  gradsync_comm_free(c);
}

void case_alloc(gradsync_comm* c) {
  void* p = nullptr;
  expect_status(gradsync_comm_alloc(c, 0, &p), GRADSYNC_E_INVALID_ARG, "alloc 0", {"bytes is 0"});
  EXPECT(p == nullptr, "ptr set on failure");
  expect_status(gradsync_comm_alloc(c, 16, nullptr), GRADSYNC_E_INVALID_ARG, "alloc NULL out");
  expect_status(gradsync_comm_alloc(nullptr, 16, &p), GRADSYNC_E_MISUSE, "alloc NULL comm");
  expect_status(gradsync_comm_alloc(c, size_t(1) << 50, &p), GRADSYNC_E_NO_SPACE, "alloc 1 PiB", {"bytes"});
  int local = 0;
  expect_status(gradsync_comm_free_buffer(c, &local), GRADSYNC_E_INVALID_ARG, "free a foreign pointer",
                {"not allocated by this communicator"});
  OK(gradsync_comm_free_buffer(c, nullptr));
  // Many allocations, freed out of order, then one as large as all of them: the heap coalesces.
  std::vector<void*> ps;
  for (int i = 0; i < 64; ++i) {
    OK(gradsync_comm_alloc(c, 100000 + i, &p));
    EXPECT(reinterpret_cast<uintptr_t>(p) % 4096 == 0, "alignment");
    std::memset(p, i, 100000 + i);
    ps.push_back(p);
  }
  for (int i = 0; i < 64; i += 2) OK(gradsync_comm_free_buffer(c, ps[i]));
  for (int i = 1; i < 64; i += 2) EXPECT(static_cast<unsigned char*>(ps[i])[99999] == i, "buffer %d clobbered", i);
  for (int i = 1; i < 64; i += 2) OK(gradsync_comm_free_buffer(c, ps[i]));
  expect_status(gradsync_comm_free_buffer(c, ps[1]), GRADSYNC_E_INVALID_ARG, "double free");
  OK(gradsync_comm_alloc(c, 64 * 102400, &p));
  EXPECT(p == ps[0], "the freed heap did not coalesce");
  OK(gradsync_comm_free_buffer(c, p));
}

void round_of_ones(gradsync_comm* c, int size) {
  std::vector<double> v(20000, 1.0);
  OK(gradsync_comm_allreduce(c, v.data(), v.data(), v.size(), GRADSYNC_F64, GRADSYNC_SUM));
  for (double x : v) EXPECT(x == double(size), "got %g", x);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s <case> <rank> <size> <group>\n", argv[0]);
    return 2;
  }
  g_case = argv[1];
  g_rank = std::atoi(argv[2]);
  g_size = std::atoi(argv[3]);
  g_group = argv[4];
  const std::string& k = g_case;

  if (k == "size_mismatch") {
    // Rank 0 creates the group with size 2; rank 1 then claims size 3: both fail, rank 0 at once.
    // (Rank 1 may win the set-up lock and build the segment first: then the sides swap, and both
    // still fail at once, each message naming both sizes.)
    int st = 0;
    if (g_rank == 0) {
      // Told at once, not at its deadline: a timeout here would be the old behaviour.
      gradsync_comm* c = join(g_group, 0, 2, 60000, &st);
      expect_status(st, GRADSYNC_E_MISMATCH, "rank 0 told of the refused joiner", {"size 2", "size 3"});
      EXPECT(c == nullptr, "handle set on failure");
    } else {
      await_file("/dev/shm/gradsync." + g_group);
      gradsync_comm* c = join(g_group, 1, 3, 1500, &st);
      expect_status(st, GRADSYNC_E_MISMATCH, "size 3 against 2", {"size 3", "size 2"});
      EXPECT(c == nullptr, "handle set on failure");
    }
    return 0;
  }
  if (k == "dup_forming") {
    // Rank 0 waits for its peer; a second process then claims rank 0 as well: both fail, the
    // waiting one at once. (The second may win the set-up lock and claim first: then the sides
    // swap, so each side accepts either message.)
    int st = 0;
    if (g_rank != 0) await_file("/dev/shm/gradsync." + g_group);
    gradsync_comm* c = join(g_group, 0, 2, g_rank == 0 ? 60000 : 1500, &st);
    expect_status(st, GRADSYNC_E_MISUSE, "two processes claiming rank 0", {"rank 0"});
    const std::string message = gradsync_last_error_message();
    EXPECT(message.find("claimed a second time") != std::string::npos ||
               message.find("already joined") != std::string::npos,
           "message: %s", message.c_str());
    EXPECT(c == nullptr, "handle set on failure");
    return 0;
  }
  if (k == "late" && g_rank == g_size - 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));

  const int64_t timeout = k == "timeout" ? 1000 : k == "abort" || k.rfind("kill", 0) == 0 ? 60000 : 20000;
  gradsync_comm* c = join(g_group, g_rank, g_size, timeout);
  int32_t got = -1;
  OK(gradsync_comm_transport(c, &got));
  EXPECT(got == GRADSYNC_TRANSPORT_SHM, "transport %d", got);

  if (k == "ops") case_ops(c);
  else if (k == "fused") case_fused(c);
  else if (k == "collectives") case_collectives(c);
  else if (k == "mismatch") case_mismatch(c);
  else if (k == "timeout") case_timeout(c);
  else if (k == "abort") case_abort(c);
  else if (k == "kill" || k == "kill_zero_copy") case_kill(c, k == "kill_zero_copy");
  else if (k == "alloc") case_alloc(c);
  else if (k == "late" || k == "stale_reuse") round_of_ones(c, g_size);
  else if (k == "names") {
    // Each group sums its own value: any crosstalk between the groups would change the result.
    const int64_t mine = static_cast<int64_t>(fnv(g_group.data(), g_group.size()) % 100000);
    for (int i = 0; i < 200; ++i) {
      int64_t v[4] = {mine, mine + i, 1, mine * 2};
      OK(gradsync_comm_allreduce(c, v, v, 4, GRADSYNC_I64, GRADSYNC_SUM));
      EXPECT(v[0] == mine * g_size && v[1] == (mine + i) * g_size && v[2] == g_size && v[3] == 2 * mine * g_size,
             "round %d: another group's data leaked in", i);
    }
  }
  else if (k == "stale_die") {
    round_of_ones(c, g_size);
    OK(gradsync_comm_barrier(c));
    raise(SIGKILL);  // leaves the segment behind, as a crash would
  } else if (k == "replace") {
    // Rank 1 dies right after the group forms; the driver starts a replacement for it, which must
    // not slip into the half-dead group: rank 0 sees the death, leaves, and both form a new group.
    OK(gradsync_comm_barrier(c));
    if (g_rank == 1) raise(SIGKILL);
    std::vector<float> v(100000, 1.f);
    int st = GRADSYNC_OK;
    for (int i = 0; i < 100000 && st == GRADSYNC_OK; ++i) st = gradsync_comm_allreduce(c, v.data(), v.data(), v.size(), GRADSYNC_F32, GRADSYNC_SUM);
    expect_status(st, GRADSYNC_E_REMOTE, "allreduce with a dead peer", {"rank 1", "died"});
    gradsync_comm_free(c);
    c = join(g_group, 0, 2, 20000);
    round_of_ones(c, 2);
  } else if (k == "replacement") {
    round_of_ones(c, g_size);
  } else if (k == "dup") {
    int st = 0;
    gradsync_comm* again = join(g_group, g_rank, g_size, 2000, &st);
    expect_status(st, GRADSYNC_E_MISUSE, "joining the same rank twice", {"already joined", "alive"});
    EXPECT(again == nullptr, "handle set on failure");
    gradsync_comm* other = join(g_group, (g_rank + 1) % g_size, g_size, 2000, &st);
    expect_status(st, GRADSYNC_E_MISUSE, "joining a peer's live rank", {"already joined"});
    EXPECT(other == nullptr, "handle set on failure");
    round_of_ones(c, g_size);
  } else {
    die("unknown case");
  }
  gradsync_comm_free(c);
  if (k == "kill" || k == "kill_zero_copy") {
    // Survivors renumber (ranks above the victim move down) and form a new group of that name.
    case_kill_survivors(g_rank > 1 ? g_rank - 1 : g_rank, g_size - 1);
  }
  return 0;
}
