// SPDX-License-Identifier: Apache-2.0
// One rank of a shared-memory communicator test, as a real process: started by shm_driver
// (fork/exec) as `shm_worker <case> <rank> <size> <group>`. Uses only the public C API.
// Exits 0 when this rank saw exactly what the case expects; otherwise prints why and exits 1.
// The cases are the transport's own (a killed peer, stale segments, names, joining, the
// segment's heap, an abort named to the waiters); the collectives' semantics, mismatches,
// timeouts and resets are tested for every transport by tests/conformance.
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
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

#define EXPECT(cond, ...)                                                   \
  do {                                                                      \
    if (!(cond)) die("%s:%d: %s: " __VA_ARGS__, __FILE__, __LINE__, #cond); \
  } while (0)

// Calls that must succeed.
#define OK(call)                                                                                       \
  do {                                                                                                 \
    const int st_ = (call);                                                                            \
    if (st_ != GRADSYNC_OK)                                                                            \
      die("%s:%d: %s returned %d: %s", __FILE__, __LINE__, #call, st_, gradsync_last_error_message()); \
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
  if (st != GRADSYNC_OK)
    die("joining %s as rank %d of %d: %s", group.c_str(), rank, size, gradsync_last_error_message());
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

// Rank 1 runs out of memory in the middle of a weighted mean (the copy path's staging window, after
// the round began: its address space is capped just below it). Its peer, waiting inside the round,
// fails at once naming it, instead of waiting out its 60 s timeout; both reset and go on.
void case_oom(gradsync_comm* c) {
  const size_t n = 4 << 20;  // 16 MiB of floats, staged in windows of 4 MiB of doubles
  std::vector<float> send(n, float(g_rank + 1)), recv(n, 0.f);
  OK(gradsync_comm_barrier(c));
  uint64_t total = 0;
  if (g_rank == 1) {
    rlimit was{};
    EXPECT(getrlimit(RLIMIT_AS, &was) == 0, "getrlimit");
    long pages = 0;
    FILE* f = std::fopen("/proc/self/statm", "r");
    EXPECT(f != nullptr && std::fscanf(f, "%ld", &pages) == 1, "/proc/self/statm");
    std::fclose(f);
    rlimit capped = was;
    capped.rlim_cur = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE)) + (2u << 20);
    EXPECT(setrlimit(RLIMIT_AS, &capped) == 0, "setrlimit");
    const int st = gradsync_comm_weighted_mean(c, send.data(), recv.data(), n, GRADSYNC_F32, 1, &total);
    EXPECT(setrlimit(RLIMIT_AS, &was) == 0, "setrlimit back");
    expect_status(st, GRADSYNC_E_NOMEM, "weighted mean without the memory to stage it");
  } else {
    expect_status(gradsync_comm_weighted_mean(c, send.data(), recv.data(), n, GRADSYNC_F32, 1, &total),
                  GRADSYNC_E_ABORTED, "the peer's weighted mean", {"rank 1", "failed in the middle of a call"});
  }
  OK(gradsync_comm_reset(c));
  std::vector<float> v(1000, 1.f);
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

// A member truncates the group's segment (any process of this user could): every member's next
// collective fails with E_IO naming the truncation, within a liveness interval rather than at its
// 20 s deadline, and none dies of SIGBUS; the next call fails the same way.
void case_truncate(gradsync_comm* c) {
  const size_t n = 1 << 16;
  Buffer<float> b(c, n, true);
  std::fill(b.data, b.data + n, 1.f);
  OK(gradsync_comm_allreduce(c, b.data, b.data, n, GRADSYNC_F32, GRADSYNC_SUM));
  EXPECT(b.data[n - 1] == float(g_size), "before the truncation got %g", b.data[n - 1]);
  const auto start = std::chrono::steady_clock::now();
  // Rank 1 truncates once its barrier returned; a peer may still be inside that barrier, and
  // then it is the barrier that fails.
  int st = gradsync_comm_barrier(c);
  if (g_rank == 1) {
    OK(st);
    EXPECT(truncate(("/dev/shm/gradsync." + g_group).c_str(), 0) == 0, "truncate: %s", std::strerror(errno));
  }
  for (int i = 0; i < 100000 && st == GRADSYNC_OK; ++i) {
    st = gradsync_comm_allreduce(c, b.data, b.data, n, GRADSYNC_F32, GRADSYNC_SUM);
  }
  expect_status(st, GRADSYNC_E_IO, "collective on a truncated segment", {"shrank", "truncated"});
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT(waited < std::chrono::seconds(10), "took %lld ms to notice",
         static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(waited).count()));
  expect_status(gradsync_comm_barrier(c), GRADSYNC_E_IO, "the next call", {"shrank"});
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

void round_of_ones(gradsync_comm* c, int size);

// Allreduces of ordinary buffers past the inline size, which ranks that reach each other's
// processes run on each other's memory (process_vm_readv/writev) rather than through the segment's
// stages: the same bits as the staged path (a second group whose ranks were told not to), in place
// and out of place, fused, over several blocks per slice and odd lengths, with one rank's buffers
// in the segment; with one rank refusing (its peers then stage too); and a rank whose buffer its
// peers cannot read (pages it protected in the part they own) stops the group with E_CORRUPT on
// every rank instead of hanging or crashing. Ranks that outnumber their CPUs stage: the same bits.
void case_cross(gradsync_comm* c) {
  setenv("GRADSYNC_SHM_CROSS_PROCESS", "0", 1);
  gradsync_comm* staged = join(g_group + "-staged", g_rank, g_size, 20000);
  // Rank 1 alone refuses in the third group: its peers must stage with it.
  if (g_rank != 1) unsetenv("GRADSYNC_SHM_CROSS_PROCESS");
  gradsync_comm* one_refuses = join(g_group + "-one", g_rank, g_size, 20000);
  unsetenv("GRADSYNC_SHM_CROSS_PROCESS");
  // Values whose sums round differently in another order, so that the bits say the order.
  auto fill = [](float* p, size_t n, int salt) {
    for (size_t i = 0; i < n; ++i)
      p[i] = float((i * 2654435761u + unsigned(salt) * 40503u) % 1000003) * 1e-3f + 1e-7f * float(salt);
  };
  for (size_t n : {size_t(4097), size_t(65536 + 3), size_t(300001), size_t(1) << 20}) {
    for (bool in_place : {true, false}) {
      for (int seg = 0; seg < 2; ++seg) {
        // seg 1: rank 0's buffers in the segment, the others' ordinary.
        const bool in_segment = seg == 1 && g_rank == 0;
        Buffer<float> send(c, n, in_segment), recv(c, n, in_segment);
        std::vector<float> a(n), b(n), expect_send(n);
        fill(send.data, n, g_rank + 1);
        std::copy(send.data, send.data + n, a.data());
        std::copy(send.data, send.data + n, expect_send.data());
        float* out = in_place ? send.data : recv.data;
        OK(gradsync_comm_allreduce(c, send.data, out, n, GRADSYNC_F32, GRADSYNC_SUM));
        std::copy(send.data, send.data + n, b.data());
        float* out_a = a.data();
        std::vector<float> a_out(n);
        OK(gradsync_comm_allreduce(staged, a.data(), in_place ? out_a : a_out.data(), n, GRADSYNC_F32, GRADSYNC_SUM));
        const float* want = in_place ? a.data() : a_out.data();
        EXPECT(fnv(out, n * 4) == fnv(want, n * 4), "n=%zu in_place=%d seg=%d: not the staged path's bits (%g vs %g)",
               n, int(in_place), seg, double(out[n - 1]), double(want[n - 1]));
        if (!in_place) EXPECT(fnv(send.data, n * 4) == fnv(expect_send.data(), n * 4), "n=%zu: send changed", n);
        std::vector<float> c_in(expect_send), c_out(n);
        OK(gradsync_comm_allreduce(one_refuses, c_in.data(), c_out.data(), n, GRADSYNC_F32, GRADSYNC_SUM));
        EXPECT(fnv(c_out.data(), n * 4) == fnv(want, n * 4), "n=%zu: one rank refusing gave other bits", n);
      }
    }
  }
  // Fused: three buffers, the middle one spanning both ranks' slices.
  {
    std::vector<double> x(5000), y(200000), z(7);
    std::vector<double> x2, y2, z2;
    for (size_t i = 0; i < y.size(); ++i) y[i] = double(i % 977) * (g_rank + 1) + 0.5;
    for (size_t i = 0; i < x.size(); ++i) x[i] = double(i) - g_rank;
    for (size_t i = 0; i < z.size(); ++i) z[i] = double(i * g_rank);
    x2 = x, y2 = y, z2 = z;
    void* recvs[3] = {x.data(), y.data(), z.data()};
    void* recvs2[3] = {x2.data(), y2.data(), z2.data()};
    const size_t counts[3] = {x.size(), y.size(), z.size()};
    OK(gradsync_comm_allreduce_many(c, nullptr, recvs, counts, 3, GRADSYNC_F64, GRADSYNC_SUM));
    OK(gradsync_comm_allreduce_many(staged, nullptr, recvs2, counts, 3, GRADSYNC_F64, GRADSYNC_SUM));
    EXPECT(x == x2 && y == y2 && z == z2, "fused: not the staged path's results");
    const double s = double(g_size) * (g_size + 1) / 2;
    EXPECT(y[977 + 5] == 5 * s + 0.5 * g_size, "fused: y[982] = %g", y[977 + 5]);
  }
  gradsync_comm_free(staged);
  gradsync_comm_free(one_refuses);
  // Rank 1 protects the first quarter of its buffer, which rank 0 reduces (rank 1 itself reads
  // only its own part): rank 0 cannot read it, and every rank fails alike. Only where each rank
  // has a CPU of its own: ranks that outnumber their CPUs stage (and rank 1 would fault itself).
  cpu_set_t mask;
  EXPECT(sched_getaffinity(0, sizeof mask, &mask) == 0, "sched_getaffinity");
  if (CPU_COUNT(&mask) < g_size) {
    round_of_ones(c, g_size);
    return;
  }
  const size_t page = size_t(sysconf(_SC_PAGESIZE)), n = 64 * page / sizeof(float);
  float* p =
      static_cast<float*>(mmap(nullptr, n * sizeof(float), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  EXPECT(p != MAP_FAILED, "mmap");
  std::fill(p, p + n, 1.f);
  if (g_rank == 1) EXPECT(mprotect(p, n * sizeof(float) / 4, PROT_NONE) == 0, "mprotect");
  const int st = gradsync_comm_allreduce(c, p, p, n, GRADSYNC_F32, GRADSYNC_SUM);
  if (g_rank == 0) {
    expect_status(st, GRADSYNC_E_CORRUPT, "reading a peer's unreadable buffer", {"rank 1", "does not map"});
  } else {
    EXPECT(st == GRADSYNC_E_CORRUPT, "a peer that could not read rank 1's buffer: got %d (%s)", st,
           gradsync_last_error_message());
  }
  OK(gradsync_comm_reset(c));
  munmap(p, n * sizeof(float));
  round_of_ones(c, g_size);
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

  const int64_t timeout = k == "abort" || k == "oom" || k.rfind("kill", 0) == 0 ? 60000 : 20000;
  gradsync_comm* c = join(g_group, g_rank, g_size, timeout);
  int32_t got = -1;
  OK(gradsync_comm_transport(c, &got));
  EXPECT(got == GRADSYNC_TRANSPORT_SHM, "transport %d", got);

  if (k == "abort")
    case_abort(c);
  else if (k == "kill" || k == "kill_zero_copy")
    case_kill(c, k == "kill_zero_copy");
  else if (k == "alloc")
    case_alloc(c);
  else if (k == "oom")
    case_oom(c);
  else if (k == "truncate")
    case_truncate(c);
  else if (k == "cross")
    case_cross(c);
  else if (k == "late" || k == "stale_reuse")
    round_of_ones(c, g_size);
  else if (k == "names") {
    // Each group sums its own value: any crosstalk between the groups would change the result.
    const int64_t mine = static_cast<int64_t>(fnv(g_group.data(), g_group.size()) % 100000);
    for (int i = 0; i < 200; ++i) {
      int64_t v[4] = {mine, mine + i, 1, mine * 2};
      OK(gradsync_comm_allreduce(c, v, v, 4, GRADSYNC_I64, GRADSYNC_SUM));
      EXPECT(v[0] == mine * g_size && v[1] == (mine + i) * g_size && v[2] == g_size && v[3] == 2 * mine * g_size,
             "round %d: another group's data leaked in", i);
    }
  } else if (k == "stale_die") {
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
    for (int i = 0; i < 100000 && st == GRADSYNC_OK; ++i)
      st = gradsync_comm_allreduce(c, v.data(), v.data(), v.size(), GRADSYNC_F32, GRADSYNC_SUM);
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
