// SPDX-License-Identifier: Apache-2.0
// The sparse gradient accumulator: seed acceptance, modes under threads and real processes,
// apply (SGD, row-wise Adagrad), validation that writes nothing, and recovery of shared state.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "accumulator/accumulator.hpp"
#include "common/error.hpp"

using gradsync::Error;
using gradsync::accumulator::AccumSpec;
using gradsync::accumulator::Accumulator;
using gradsync::accumulator::Concurrency;
using gradsync::accumulator::OptimizerKind;
using gradsync::accumulator::OptimizerSpec;
using gradsync::table::OpenMode;
using gradsync::table::OpenSpec;
using gradsync::table::Table;
namespace fs = std::filesystem;

namespace {

AccumSpec aspec(const std::string& path, OpenMode mode, int64_t rows, int64_t dim, int32_t conc = -1,
                int64_t rows_per_lock = -1) {
  AccumSpec s;
  s.path = path;
  s.mode = mode;
  s.rows = rows;
  s.dim = dim;
  s.concurrency = conc;
  s.rows_per_lock = rows_per_lock;
  return s;
}

std::unique_ptr<Table> anon_table(int64_t rows, int64_t dim) {
  OpenSpec s;
  s.mode = OpenMode::Anonymous;
  s.rows = rows;
  s.dim = dim;
  return Table::open(s);
}

std::vector<float> row_of(Accumulator& a, int64_t r) {
  std::vector<float> out(static_cast<size_t>(a.dim()));
  a.get(r, out.data(), out.size());
  return out;
}

bool all_equal(const std::vector<float>& v, float x) {
  return std::all_of(v.begin(), v.end(), [&](float y) { return y == x; });
}

// Waits for a child at most `seconds`; kills it after that. Returns its exit status, or -1.
int wait_bounded(pid_t pid, int seconds) {
  for (int i = 0; i < seconds * 100; ++i) {
    int status = 0;
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  return -1;
}

}  // namespace

TEST_CASE("seed acceptance: dim 64, 100 rows", "[accumulator]") {
  auto mode = GENERATE(0, 1, 2);
  TempDir tmp;
  auto a = Accumulator::open(aspec(tmp.file("g.gsa"), OpenMode::Create, 100, 64, mode));
  CHECK(static_cast<int>(a->concurrency()) == mode);
  std::vector<float> ones(64, 1.0f), twos(64, 2.0f);
  a->add(0, ones.data(), 64);
  a->add(0, twos.data(), 64);
  CHECK(all_equal(row_of(*a, 0), 3.0f));
  std::vector<float> x(64, 1.5f);
  a->add(1, x.data(), 64);
  a->zero();
  CHECK(all_equal(row_of(*a, 0), 0.0f));
  CHECK(all_equal(row_of(*a, 1), 0.0f));
  CHECK(a->touched_count() == 0);

  if (mode != 2) {  // exact modes only: Hogwild may lose concurrent updates by design
    std::vector<std::thread> threads;
    for (int t = 0; t < 10; ++t) threads.emplace_back([&] { a->add(0, ones.data(), 64); });
    for (auto& t : threads) t.join();
    CHECK(all_equal(row_of(*a, 0), 10.0f));
    a->zero();
  }

  auto params = anon_table(100, 64);
  std::vector<float> ten(64, 10.0f);
  params->set(0, ten.data(), 64);
  a->add(0, ones.data(), 64);
  OptimizerSpec sgd;
  sgd.lr = 0.1f;
  a->apply(*params, sgd, nullptr);
  std::vector<float> p(64);
  params->get(0, p.data(), 64);
  for (float v : p) CHECK(std::abs(v - 9.9f) <= 1e-6f);
  CHECK(all_equal(row_of(*a, 0), 0.0f));

  std::vector<float> half(32, 1.0f);
  expect_error([&] { a->add(0, half.data(), 32); }, GRADSYNC_E_INVALID_ARG, "the gradient has 32 floats");
  expect_error([&] { a->add(100, ones.data(), 64); }, GRADSYNC_E_OUT_OF_RANGE, "row 100 out of range [0, 100)");
  a.reset();
  expect_error([&] { Accumulator::open(aspec(tmp.file("g.gsa"), OpenMode::Open, 100, 32)); }, GRADSYNC_E_MISMATCH,
               "file has 100 x 64, asked for 100 x 32");
}

TEST_CASE("add_batch sums repeated rows and tracks touched rows once", "[accumulator]") {
  auto a = Accumulator::open(aspec("", OpenMode::Anonymous, 10, 2));
  std::vector<int64_t> rows = {3, 7, 3, 3};
  std::vector<float> g = {1, 2, 10, 20, 100, 200, 1000, 2000};
  a->add_batch(rows.data(), rows.size(), g.data(), g.size());
  CHECK(row_of(*a, 3) == std::vector<float>{1101, 2202});
  CHECK(row_of(*a, 7) == std::vector<float>{10, 20});
  CHECK(a->touched_count() == 2);
  std::vector<int64_t> t(2);
  CHECK(a->touched(t.data(), 2) == 2);
  CHECK(t == std::vector<int64_t>{3, 7});
  CHECK(a->touched(nullptr, 0) == 2);  // too small: reports the size, copies nothing

  // A batch with one bad id or a wrong length writes nothing at all.
  std::vector<int64_t> bad = {1, 2, 10};
  std::vector<float> g3(6, 5.0f);
  expect_error([&] { a->add_batch(bad.data(), 3, g3.data(), 6); }, GRADSYNC_E_OUT_OF_RANGE,
               "row 10 (entry 2 of 3) out of range [0, 10)");
  expect_error([&] { a->add_batch(rows.data(), 4, g.data(), 7); }, GRADSYNC_E_INVALID_ARG,
               "has 7 floats, 4 rows x dim 2 need 8");
  CHECK(all_equal(row_of(*a, 1), 0.0f));
  CHECK(row_of(*a, 3) == std::vector<float>{1101, 2202});
  CHECK(a->touched_count() == 2);
}

TEST_CASE("exact modes lose no update under many threads", "[accumulator]") {
  auto mode = GENERATE(Concurrency::Striped, Concurrency::LockFree);
  auto rpl = GENERATE(int64_t{1}, int64_t{64});
  auto a = Accumulator::open(aspec("", OpenMode::Anonymous, 256, 8, static_cast<int32_t>(mode), rpl));
  constexpr int kThreads = 6, kBatches = 200, kBatch = 64;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<int64_t> ids(kBatch);
      std::vector<float> g(kBatch * 8, 1.0f);
      for (int b = 0; b < kBatches; ++b) {
        // Hot rows 0..7 in every batch, plus a spread of others: heavy contention on purpose.
        for (int i = 0; i < kBatch; ++i) ids[i] = i < 32 ? i % 8 : (t * 31 + b * 7 + i) % 256;
        a->add_batch(ids.data(), ids.size(), g.data(), g.size());
      }
    });
  }
  for (auto& t : threads) t.join();
  // Every row's count is known: recompute the expected number of adds per row.
  std::vector<double> expected(256, 0.0);
  for (int t = 0; t < kThreads; ++t)
    for (int b = 0; b < kBatches; ++b)
      for (int i = 0; i < kBatch; ++i) expected[i < 32 ? i % 8 : (t * 31 + b * 7 + i) % 256] += 1.0;
  for (int r = 0; r < 256; ++r) {
    INFO("row " << r);
    CHECK(all_equal(row_of(*a, r), static_cast<float>(expected[r])));
  }
  int touched = 0;
  for (double e : expected) touched += e > 0 ? 1 : 0;
  CHECK(a->touched_count() == static_cast<uint64_t>(touched));
}

TEST_CASE("apply updates only touched rows: SGD and row-wise Adagrad", "[accumulator]") {
  auto a = Accumulator::open(aspec("", OpenMode::Anonymous, 6, 4));
  auto params = anon_table(6, 4);
  std::vector<float> init = {1, 2, 3, 4};
  for (int r = 0; r < 6; ++r) params->set(r, init.data(), 4);
  std::vector<int64_t> ids = {1, 4};
  std::vector<float> g = {1, 0, -1, 2, 0.5f, 0.5f, 0.5f, 0.5f};
  a->add_batch(ids.data(), 2, g.data(), 8);

  SECTION("SGD") {
    OptimizerSpec sgd;
    sgd.lr = 0.5f;
    a->apply(*params, sgd, nullptr);
    std::vector<float> p(4);
    params->get(1, p.data(), 4);
    CHECK(p == std::vector<float>{0.5f, 2, 3.5f, 3});
    params->get(4, p.data(), 4);
    CHECK(p == std::vector<float>{0.75f, 1.75f, 2.75f, 3.75f});
    for (int r : {0, 2, 3, 5}) {
      params->get(r, p.data(), 4);
      CHECK(p == init);
    }
    CHECK(a->touched_count() == 0);
    CHECK(all_equal(row_of(*a, 1), 0.0f));
    CHECK(all_equal(row_of(*a, 4), 0.0f));
  }
  SECTION("row-wise Adagrad as in PyTorch-BigGraph") {
    auto state = anon_table(6, 1);
    OptimizerSpec ada;
    ada.kind = OptimizerKind::RowAdagrad;
    ada.lr = 0.1f;
    ada.eps = 1e-10f;
    a->apply(*params, ada, state.get());
    float s1 = 0, s4 = 0;
    state->get(1, &s1, 1);
    state->get(4, &s4, 1);
    CHECK(s1 == Approx((1 + 0 + 1 + 4) / 4.0));
    CHECK(s4 == Approx(0.25));
    std::vector<float> p(4);
    params->get(1, p.data(), 4);
    const double std1 = std::sqrt(1.5) + 1e-10;
    CHECK(p[0] == Approx(1 - 0.1 * 1 / std1));
    CHECK(p[3] == Approx(4 - 0.1 * 2 / std1));
    params->get(4, p.data(), 4);
    CHECK(p[0] == Approx(1 - 0.1 * 0.5 / 0.5));
    float s0 = 1;
    state->get(0, &s0, 1);
    CHECK(s0 == 0.0f);
    // A second step accumulates the state.
    a->add_batch(ids.data(), 2, g.data(), 8);
    a->apply(*params, ada, state.get());
    state->get(1, &s1, 1);
    CHECK(s1 == Approx(3.0));
  }
}

TEST_CASE("apply validates everything before writing", "[accumulator]") {
  auto a = Accumulator::open(aspec("", OpenMode::Anonymous, 6, 4));
  std::vector<float> g(4, 1.0f);
  a->add(2, g.data(), 4);
  auto wrong_dim = anon_table(6, 3);
  auto wrong_rows = anon_table(7, 4);
  auto params = anon_table(6, 4);
  OptimizerSpec sgd;
  expect_error([&] { a->apply(*wrong_dim, sgd, nullptr); }, GRADSYNC_E_MISMATCH,
               "parameter table has 6 x 3, the accumulator 6 x 4");
  expect_error([&] { a->apply(*wrong_rows, sgd, nullptr); }, GRADSYNC_E_MISMATCH, "7 x 4");
  expect_error([&] { a->apply(*params, sgd, params.get()); }, GRADSYNC_E_INVALID_ARG, "SGD keeps no state");
  OptimizerSpec ada;
  ada.kind = OptimizerKind::RowAdagrad;
  expect_error([&] { a->apply(*params, ada, nullptr); }, GRADSYNC_E_INVALID_ARG, "needs a state table of 6 x 1");
  auto bad_state = anon_table(6, 2);
  expect_error([&] { a->apply(*params, ada, bad_state.get()); }, GRADSYNC_E_MISMATCH, "state table has 6 x 2");
  OptimizerSpec nan_lr;
  nan_lr.lr = NAN;
  expect_error([&] { a->apply(*params, nan_lr, nullptr); }, GRADSYNC_E_INVALID_ARG, "learning rate");
  expect_error([&] { a->apply(a->table(), sgd, nullptr); }, GRADSYNC_E_INVALID_ARG, "gradient table itself");
  CHECK(all_equal(row_of(*a, 2), 1.0f));
  CHECK(a->touched_count() == 1);
  std::vector<float> p(4);
  params->get(2, p.data(), 4);
  CHECK(all_equal(p, 0.0f));
}

TEST_CASE("two processes adding to one gradient file lose no update", "[accumulator][process]") {
  auto mode = GENERATE(Concurrency::Striped, Concurrency::LockFree, Concurrency::Owner);
  // Owner mode: 2 owners per process, or 1 (which, on a file other processes have open, adds
  // partition by partition).
  const int64_t child_threads = GENERATE(1, 2);
  TempDir tmp;
  const auto path = tmp.file("shared.gsa");
  // Owner mode hands batches of 256 rows and more to the owner threads of each process.
  constexpr int kProcs = 3, kBatches = 300, kBatch = 320, kDim = 16, kRows = 64;
  {
    // The parent keeps the file open too, so the children are never alone with it. Without owner
    // threads of its own: a fork while another thread holds an allocator lock (a sanitizer's
    // allocator has no fork handler) leaves the child's copy of it locked forever.
    AccumSpec spec = aspec(path, OpenMode::Create, kRows, kDim, static_cast<int32_t>(mode));
    spec.threads = 1;
    auto holder = Accumulator::open(spec);
    std::vector<pid_t> kids;
    for (int p = 0; p < kProcs; ++p) {
      pid_t pid = ::fork();
      REQUIRE(pid >= 0);
      if (pid == 0) {
        int code = 0;
        try {
          AccumSpec cs = aspec(path, OpenMode::Open, kRows, kDim);  // adopts the file's mode
          cs.threads = child_threads;
          auto a = Accumulator::open(cs);
          if (a->concurrency() != mode) code = 3;
          std::vector<int64_t> ids(kBatch);
          std::vector<float> g(kBatch * kDim, 1.0f);
          for (int b = 0; b < kBatches; ++b) {
            for (int i = 0; i < kBatch; ++i) ids[i] = (i * 5 + b + p) % 8;  // 8 hot rows, heavy contention
            a->add_batch(ids.data(), ids.size(), g.data(), g.size());
          }
        } catch (...) {
          code = 2;
        }
        ::_exit(code);
      }
      kids.push_back(pid);
    }
    for (pid_t k : kids) CHECK(wait_bounded(k, 60) == 0);
    // Another mode while the file is open elsewhere is refused.
    const int32_t other = mode == Concurrency::Striped ? 1 : 0;
    expect_error([&] { Accumulator::open(aspec(path, OpenMode::Open, kRows, kDim, other)); }, GRADSYNC_E_MISMATCH,
                 "every process must use the same mode");
  }
  auto a = Accumulator::open(aspec(path, OpenMode::Open, -1, -1));
  double total = 0;
  for (int r = 0; r < kRows; ++r) {
    auto v = row_of(*a, r);
    CHECK(all_equal(v, v[0]));
    total += v[0];
  }
  CHECK(total == static_cast<double>(kProcs) * kBatches * kBatch);
  CHECK(a->touched_count() == 8);
}

TEST_CASE("a lock of a holder slot nobody holds is taken over and the file marked torn; alone, it is rebuilt",
          "[accumulator][process]") {
  TempDir tmp;
  const auto path = tmp.file("dead.gsa");
  auto holder = Accumulator::open(aspec(path, OpenMode::Create, 32, 4, 0, 1));
  auto a = Accumulator::open(aspec(path, OpenMode::Open, -1, -1));
  const auto layout = gradsync::accumulator::aux_layout(32);
  auto* aux = static_cast<char*>(a->table().aux());
  auto* locks = reinterpret_cast<uint32_t*>(aux + layout.locks_off);
  REQUIRE(gradsync::accumulator::lock_count(32, 1) == 32);
  auto lock_of = [&](uint64_t row) { return &locks[(row * 0x9E3779B97F4A7C15ull) >> (64 - 5)]; };
  *lock_of(5) = 1000;  // as if the process of slot 999 had died holding row 5's lock
  std::vector<float> g(4, 2.0f);
  a->add(5, g.data(), 4);  // must not hang
  CHECK(*lock_of(5) == 0);
  // Row 5 may hold part of the dead process's add: reading sums fails, on every handle, until zero().
  CHECK(status_of([&] { row_of(*a, 5); }) == GRADSYNC_E_CORRUPT);
  CHECK(status_of([&] { row_of(*holder, 6); }) == GRADSYNC_E_CORRUPT);
  a->zero();
  CHECK(all_equal(row_of(*a, 5), 0.0f));
  a->add(5, g.data(), 4);
  CHECK(all_equal(row_of(*a, 5), 2.0f));

  // A process that died between raising a touched flag and appending to the list: simulate it,
  // then reopen alone; the row is in the touched set again.
  auto* flags = reinterpret_cast<uint8_t*>(aux + layout.flags_off);
  flags[9] = 1;
  *lock_of(7) = 12345678;  // and a stale lock
  a.reset();
  holder.reset();
  auto b = Accumulator::open(aspec(path, OpenMode::Open, -1, -1));
  std::vector<int64_t> t(4);
  REQUIRE(b->touched(t.data(), 4) == 2);
  std::sort(t.begin(), t.begin() + 2);
  CHECK(t[0] == 5);
  CHECK(t[1] == 9);
  b->add(7, g.data(), 4);  // the stale lock was reset
  CHECK(all_equal(row_of(*b, 7), 2.0f));
}

namespace {
// A child process that adds to row 1 of `path` in a loop, with rows large enough that it almost
// always holds the row's lock; returned once it has the file open. The parent catches it holding
// the lock by stopping it until `held` says so.
pid_t start_adder(const std::string& path, int64_t dim) {
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(ready[0]);
    auto a = Accumulator::open(aspec(path, OpenMode::Open, -1, -1));
    std::vector<float> g(static_cast<size_t>(dim), 1.0f);
    const char c = 1;
    if (::write(ready[1], &c, 1) != 1) ::_exit(2);
    for (;;) a->add(1, g.data(), g.size());
  }
  ::close(ready[1]);
  char c = 0;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  ::close(ready[0]);
  return pid;
}

// Stops `pid` at a moment it holds a row lock (as `a` sees the shared lock words).
void stop_holding(pid_t pid, const Accumulator& a) {
  for (int attempt = 0; attempt < 10000; ++attempt) {
    ::kill(pid, SIGSTOP);
    siginfo_t info{};
    REQUIRE(::waitid(P_PID, static_cast<id_t>(pid), &info, WSTOPPED) == 0);
    if (a.held_row_locks() > 0) return;
    ::kill(pid, SIGCONT);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  FAIL("the adder was never caught holding a row lock");
}

char process_state(pid_t pid) {
  FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return '?';
  char state = '?';
  if (std::fscanf(f, "%*d %*s %c", &state) != 1) state = '?';
  std::fclose(f);
  return state;
}
}  // namespace

TEST_CASE("a holder killed mid-add and left a zombie: its lock is taken over, the file marked torn",
          "[accumulator][process]") {
  TempDir tmp;
  const auto path = tmp.file("zombie.gsa");
  const int64_t dim = 1 << 16;
  auto a = Accumulator::open(aspec(path, OpenMode::Create, 4, dim, 0, 1));
  const pid_t adder = start_adder(path, dim);
  stop_holding(adder, *a);
  ::kill(adder, SIGKILL);  // not reaped: a zombie, whose pid still exists
  for (int i = 0; i < 500 && process_state(adder) != 'Z'; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  CHECK(process_state(adder) == 'Z');
  std::vector<float> g(static_cast<size_t>(dim), 1.0f);
  a->add(1, g.data(), g.size());                                   // does not hang
  CHECK(status_of([&] { row_of(*a, 1); }) == GRADSYNC_E_CORRUPT);  // never a torn row read as whole
  a->zero();
  a->add(1, g.data(), g.size());
  CHECK(all_equal(row_of(*a, 1), 1.0f));
  ::waitpid(adder, nullptr, 0);
}

TEST_CASE("a stopped holder makes a waiting add fail with E_TIMEOUT, not hang", "[accumulator][process]") {
  // Owner mode: the wait is in an owner thread, and its error reaches the caller of the batch.
  auto mode = GENERATE(Concurrency::Striped, Concurrency::Owner);
  TempDir tmp;
  const auto path = tmp.file("stopped.gsa");
  const int64_t dim = 1 << 16;
  auto a = Accumulator::open(aspec(path, OpenMode::Create, 4, dim, static_cast<int32_t>(mode), 1));
  std::vector<float> g(static_cast<size_t>(dim), 1.0f);
  if (mode == Concurrency::Owner) {
    // A batch first, so that the owner threads have started and wait idle: a fork while a thread
    // is still starting can copy a lock it holds (a sanitizer's allocator or thread registry)
    // into the child, whose own open then waits for it forever.
    const std::vector<int64_t> ids(gradsync::accumulator::kHandOffRows, 3);
    std::vector<float> batch(ids.size() * g.size(), 1.0f);
    a->add_batch(ids.data(), ids.size(), batch.data(), batch.size());
  }
  const pid_t adder = start_adder(path, dim);
  stop_holding(adder, *a);
  std::string message;
  const auto start = std::chrono::steady_clock::now();
  if (mode == Concurrency::Owner) {
    const std::vector<int64_t> ids(gradsync::accumulator::kHandOffRows, 1);
    std::vector<float> batch(ids.size() * g.size(), 1.0f);
    CHECK(status_of([&] { a->add_batch(ids.data(), ids.size(), batch.data(), batch.size()); }, &message) ==
          GRADSYNC_E_TIMEOUT);
  } else {
    CHECK(status_of([&] { a->add(1, g.data(), g.size()); }, &message) == GRADSYNC_E_TIMEOUT);
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(60));
  CHECK(message.find("held for more than") != std::string::npos);
  ::kill(adder, SIGKILL);
  ::waitpid(adder, nullptr, 0);
  a->add(1, g.data(), g.size());  // the holder is gone now: taken over
  CHECK(status_of([&] { row_of(*a, 1); }) == GRADSYNC_E_CORRUPT);
}

TEST_CASE("gradients and touched set survive flush, close and reopen", "[accumulator]") {
  TempDir tmp;
  const auto path = tmp.file("persist.gsa");
  {
    auto a = Accumulator::open(aspec(path, OpenMode::CreateOrOpen, 20, 3));
    std::vector<float> g = {1, 2, 3};
    a->add(11, g.data(), 3);
    a->flush();
  }
  auto a = Accumulator::open(aspec(path, OpenMode::CreateOrOpen, 20, 3));
  CHECK(row_of(*a, 11) == std::vector<float>{1, 2, 3});
  CHECK(a->touched_count() == 1);
  auto params = anon_table(20, 3);
  a->apply(*params, OptimizerSpec{OptimizerKind::Sgd, 1.0f, 1e-10f}, nullptr);
  std::vector<float> p(3);
  params->get(11, p.data(), 3);
  CHECK(p == std::vector<float>{-1, -2, -3});
  // A plain table cannot be opened as an accumulator and vice versa.
  OpenSpec ts;
  ts.path = path;
  ts.mode = OpenMode::Open;
  expect_error([&] { Table::open(ts); }, GRADSYNC_E_MISMATCH, "accumulator's gradient file, asked for a table");
}

// A file another process holds is used as it is: its touched list and count may hold what a
// process that died mid-append (or a member gone bad) left there.
TEST_CASE("a shared file's damaged touched list gives valid ids and a damaged count an error", "[accumulator]") {
  TempDir tmp;
  const std::string path = (tmp.dir / "g.gsa").string();
  const int64_t rows = 64, dim = 4;
  auto holder = Accumulator::open(aspec(path, OpenMode::Create, rows, dim, 1));
  std::vector<float> g(dim, 1.0f);
  holder->add(3, g.data(), g.size());
  holder->add(9, g.data(), g.size());
  // Damage the shared list the way a dead appender leaves it: an id out of range, and one whose
  // flag is down.
  auto* aux = static_cast<char*>(holder->table().aux());
  const auto layout = gradsync::accumulator::aux_layout(rows);
  auto* count = reinterpret_cast<uint64_t*>(aux + layout.count_off);
  auto* list = reinterpret_cast<int64_t*>(aux + layout.list_off);
  list[2] = 1000;
  list[3] = 17;
  *count = 4;
  auto peer = Accumulator::open(aspec(path, OpenMode::Open, -1, -1));  // not alone: no rebuild
  std::vector<int64_t> ids(static_cast<size_t>(rows), -1);
  const size_t n = peer->touched(ids.data(), ids.size());
  REQUIRE(n == 2);
  CHECK(ids[0] == 3);
  CHECK(ids[1] == 9);
  // A count past the list: the add lands and raises its flag, but is refused a place in the list.
  *count = static_cast<uint64_t>(rows);
  try {
    peer->add(20, g.data(), g.size());
    FAIL("an add past a full list succeeded");
  } catch (const Error& e) {
    CHECK(e.status() == GRADSYNC_E_CORRUPT);
    CHECK(std::string(e.what()).find("touched count") != std::string::npos);
  }
  for (int64_t i = 0; i < rows; ++i) CHECK(list[i] != 20);  // the list was not written
  std::vector<float> out(dim);
  peer->get(20, out.data(), out.size());
  CHECK(out[0] == 1.0f);
  // Alone again, the next opener rebuilds the list from the flags: row 20 is back in it.
  holder.reset();
  peer.reset();
  auto alone = Accumulator::open(aspec(path, OpenMode::Open, -1, -1));
  const size_t m = alone->touched(ids.data(), ids.size());
  CHECK(std::find(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(m), 20) !=
        ids.begin() + static_cast<std::ptrdiff_t>(m));
}

// ---------------------------------------------------------------- owner mode

namespace {
AccumSpec owner_spec(int64_t rows, int64_t dim, int64_t threads) {
  AccumSpec s = aspec("", OpenMode::Anonymous, rows, dim, static_cast<int32_t>(Concurrency::Owner));
  s.threads = threads;
  return s;
}

// A fixed sequence of batches: skewed ids (a few hot rows repeated within and across batches, so
// the order of a row's contributions matters) and gradients of mixed magnitudes (so that float
// addition in another order gives other bits). Mixes batches handed to the owners (>= 256 rows)
// with small ones the caller adds.
struct Workload {
  std::vector<std::vector<int64_t>> ids;
  std::vector<std::vector<float>> grads;
};
Workload make_workload(int64_t rows, int64_t dim, uint64_t seed) {
  Workload w;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> mag(-8.0f, 8.0f);
  for (int b = 0; b < 12; ++b) {
    const size_t n = b % 4 == 3 ? 37 : 700 + static_cast<size_t>(b) * 50;
    std::vector<int64_t> ids(n);
    // Even batches: a quarter of the ids on 8 hot rows (the owners split such a batch by
    // partition). Odd ones: one in 64 (they split it by position, and the rows in more than one
    // chunk are added in a second phase).
    const uint64_t hot_one_in = b % 2 == 0 ? 4 : 64;
    for (auto& id : ids)
      id = rng() % hot_one_in == 0 ? static_cast<int64_t>(rng() % 8) : static_cast<int64_t>(rng() % rows);
    std::vector<float> g(n * static_cast<size_t>(dim));
    for (auto& x : g) x = std::ldexp(mag(rng), static_cast<int>(rng() % 40) - 20);
    w.ids.push_back(std::move(ids));
    w.grads.push_back(std::move(g));
  }
  return w;
}

std::vector<float> run_owner(const Workload& w, int64_t rows, int64_t dim, int64_t threads) {
  auto a = Accumulator::open(owner_spec(rows, dim, threads));
  REQUIRE(a->threads() == threads);
  for (size_t b = 0; b < w.ids.size(); ++b)
    a->add_batch(w.ids[b].data(), w.ids[b].size(), w.grads[b].data(), w.grads[b].size());
  const auto* data = a->table().data();
  return std::vector<float>(data, data + rows * dim);
}
}  // namespace

TEST_CASE("owner mode: the table is bitwise the sequential sum in batch then position order, for 1, 2, 4 owners",
          "[accumulator][owner]") {
  constexpr int64_t kRows = 4096, kDim = 12;
  const Workload w = make_workload(kRows, kDim, 42);
  // The reference: one thread, plain float adds in batch order, then position order.
  std::vector<float> ref(static_cast<size_t>(kRows * kDim), 0.0f);
  for (size_t b = 0; b < w.ids.size(); ++b)
    for (size_t i = 0; i < w.ids[b].size(); ++i)
      for (int64_t j = 0; j < kDim; ++j) ref[w.ids[b][i] * kDim + j] += w.grads[b][i * kDim + j];
  // The same sums in reverse batch order give other bits: the comparison below can fail.
  std::vector<float> reversed(ref.size(), 0.0f);
  for (size_t b = w.ids.size(); b-- > 0;)
    for (size_t i = 0; i < w.ids[b].size(); ++i)
      for (int64_t j = 0; j < kDim; ++j) reversed[w.ids[b][i] * kDim + j] += w.grads[b][i * kDim + j];
  REQUIRE(std::memcmp(ref.data(), reversed.data(), ref.size() * sizeof(float)) != 0);
  for (int64_t threads : {1, 2, 4}) {
    for (int run = 0; run < 3; ++run) {
      INFO("owners " << threads << ", run " << run);
      const auto got = run_owner(w, kRows, kDim, threads);
      CHECK(std::memcmp(got.data(), ref.data(), ref.size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("owner mode on a file another handle has open (partition by partition): the same bits, for 1, 2, 3 owners",
          "[accumulator][owner]") {
  constexpr int64_t kDim = 12;
  // 4096 rows: 64 partitions; 40 rows: 2, fewer than the owners.
  for (int64_t rows : {4096, 40}) {
    const Workload w = make_workload(rows, kDim, 42);
    const auto ref = run_owner(w, rows, kDim, 2);  // alone with its table: the barrier path
    for (int64_t threads : {1, 2, 3}) {
      INFO("rows " << rows << ", owners " << threads);
      TempDir tmp;
      const auto path = tmp.file("contended.gsa");
      AccumSpec first = aspec(path, OpenMode::Create, rows, kDim, static_cast<int32_t>(Concurrency::Owner));
      first.threads = 1;
      auto other = Accumulator::open(first);
      // Opened while `other` has the file: its first kContendedBatches batches go partition by
      // partition (the workload has fewer), each owner on its own partitions, without barriers.
      AccumSpec second = aspec(path, OpenMode::Open, rows, kDim);
      second.threads = threads;
      auto a = Accumulator::open(second);
      static_assert(gradsync::accumulator::kContendedBatches >= 12);
      REQUIRE(w.ids.size() <= 12);
      unsigned jobs = 0;  // batches handed to the owners; the caller adds the small ones
      for (size_t b = 0; b < w.ids.size(); ++b) {
        a->add_batch(w.ids[b].data(), w.ids[b].size(), w.grads[b].data(), w.grads[b].size());
        jobs += w.ids[b].size() >= gradsync::accumulator::kHandOffRows ? 1 : 0;
      }
      REQUIRE(jobs > 0);
      CHECK(a->contended_batches() == gradsync::accumulator::kContendedBatches - jobs);  // each went that way
      CHECK(std::memcmp(a->table().data(), ref.data(), ref.size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("owner mode: many calling threads lose no update, and the touched set is exact", "[accumulator][owner]") {
  auto a = Accumulator::open(owner_spec(1024, 8, 3));
  constexpr int kThreads = 4, kBatches = 60;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int b = 0; b < kBatches; ++b) {
        // Handed-off batches and small ones the caller adds itself, on the same hot rows.
        const size_t n = b % 3 == 0 ? 40 : 600;
        std::vector<int64_t> ids(n);
        for (size_t i = 0; i < n; ++i)
          ids[i] = i < n / 2 ? static_cast<int64_t>(i % 16) : (t * 131 + b * 17 + static_cast<int64_t>(i)) % 1024;
        std::vector<float> g(n * 8, 1.0f);
        a->add_batch(ids.data(), n, g.data(), g.size());
      }
    });
  }
  for (auto& t : threads) t.join();
  std::vector<double> expected(1024, 0.0);
  for (int t = 0; t < kThreads; ++t)
    for (int b = 0; b < kBatches; ++b) {
      const size_t n = b % 3 == 0 ? 40 : 600;
      for (size_t i = 0; i < n; ++i)
        expected[i < n / 2 ? i % 16 : (t * 131 + b * 17 + static_cast<int64_t>(i)) % 1024] += 1.0;
    }
  int touched = 0;
  for (int r = 0; r < 1024; ++r) {
    INFO("row " << r);
    CHECK(all_equal(row_of(*a, r), static_cast<float>(expected[r])));
    touched += expected[r] > 0 ? 1 : 0;
  }
  CHECK(a->touched_count() == static_cast<uint64_t>(touched));
}

TEST_CASE("owner mode: apply, split over the owners, equals the striped mode's apply bitwise", "[accumulator][owner]") {
  constexpr int64_t kRows = 8192, kDim = 6;
  const Workload w = make_workload(kRows, kDim, 7);
  auto kind = GENERATE(OptimizerKind::Sgd, OptimizerKind::RowAdagrad);
  auto run = [&](AccumSpec spec) {
    auto a = Accumulator::open(spec);
    auto params = anon_table(kRows, kDim);
    auto state = anon_table(kRows, 1);
    std::vector<float> init(kDim, 0.25f);
    for (int64_t r = 0; r < kRows; ++r) params->set(r, init.data(), init.size());
    for (int step = 0; step < 2; ++step) {
      for (size_t b = 0; b < w.ids.size(); ++b)
        a->add_batch(w.ids[b].data(), w.ids[b].size(), w.grads[b].data(), w.grads[b].size());
      REQUIRE(a->touched_count() > 1024);  // enough for the owners to split the list
      a->apply(*params, OptimizerSpec{kind, 0.01f, 1e-6f}, kind == OptimizerKind::Sgd ? nullptr : state.get());
      CHECK(a->touched_count() == 0);
    }
    for (int64_t r = 0; r < kRows; ++r) REQUIRE(all_equal(row_of(*a, r), 0.0f));
    std::vector<float> out(params->data(), params->data() + kRows * kDim);
    out.insert(out.end(), state->data(), state->data() + kRows);
    return out;
  };
  const auto striped = run(aspec("", OpenMode::Anonymous, kRows, kDim, 0));
  const auto owner = run(owner_spec(kRows, kDim, 2));
  CHECK(std::memcmp(striped.data(), owner.data(), striped.size() * sizeof(float)) == 0);
}

TEST_CASE("owner mode: a forked child using its parent's handle gets E_MISUSE, not a hang",
          "[accumulator][owner][process]") {
  auto a = Accumulator::open(owner_spec(1024, 4, 2));
  // One batch first, so that the owner thread is up and idle when the fork copies the process (a
  // thread caught starting may hold a sanitizer allocator's lock, which the child then never gets).
  {
    std::vector<int64_t> ids(512, 5);
    std::vector<float> g(512 * 4, 1.0f);
    a->add_batch(ids.data(), ids.size(), g.data(), g.size());
  }
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    std::vector<int64_t> ids(512, 3);
    std::vector<float> g(512 * 4, 1.0f);
    std::string message;
    const int status = status_of([&] { a->add_batch(ids.data(), ids.size(), g.data(), g.size()); }, &message);
    a.reset();  // must not hang either
    ::_exit(status == GRADSYNC_E_MISUSE && message.find("open the file again in the child") != std::string::npos ? 0
                                                                                                                 : 1);
  }
  CHECK(wait_bounded(pid, 30) == 0);
  std::vector<int64_t> ids(512, 3);
  std::vector<float> g(512 * 4, 1.0f);
  a->add_batch(ids.data(), ids.size(), g.data(), g.size());
  CHECK(all_equal(row_of(*a, 3), 512.0f));
}

TEST_CASE("owner mode: more owners than partitions (a 4-row table has one)", "[accumulator][owner]") {
  auto a = Accumulator::open(owner_spec(4, 3, 4));
  std::vector<int64_t> ids(1000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i % 4);
  std::vector<float> g(ids.size() * 3, 0.5f);
  a->add_batch(ids.data(), ids.size(), g.data(), g.size());
  for (int r = 0; r < 4; ++r) CHECK(all_equal(row_of(*a, r), 125.0f));
  CHECK(a->touched_count() == 4);
}

TEST_CASE("owner mode: options are checked", "[accumulator][owner]") {
  expect_error([] { Accumulator::open(owner_spec(16, 4, 0)); }, GRADSYNC_E_INVALID_ARG, "threads must be in [1, 64]");
  expect_error([] { Accumulator::open(owner_spec(16, 4, 65)); }, GRADSYNC_E_INVALID_ARG, "threads must be in [1, 64]");
  auto a = Accumulator::open(aspec("", OpenMode::Anonymous, 16, 4, static_cast<int32_t>(Concurrency::Owner)));
  CHECK(a->threads() >= 1);
  CHECK(Accumulator::open(aspec("", OpenMode::Anonymous, 16, 4, 0))->threads() == 0);
}
