// SPDX-License-Identifier: Apache-2.0
// SIGKILL a process in the middle of table writes, accumulator adds, applies, flushes and table
// creation, at random moments, N times; after every kill reopen and check:
//  - every file opens (never a torn header, never a half-created file under its name);
//  - everything flushed before the kill is intact. The child reports phase k on a pipe only after
//    the flushes of phase k returned, so with K the last report:
//      table T: every element is K or K+1 (phase K+1 may have been in progress), never older: an
//        element the kill caught being copied may hold some bytes of K+1 and the rest of K (a
//        kill can land inside one copy, in `rep movsb` or a sanitizer's byte loop), never another;
//      params P: every element is base-K or base-K-1 (the K flushed SGD steps are all there);
//      gradients G: 0 or 1, and every row with a non-zero gradient is in the touched set, so the
//      next apply sees it; each header generation is at least its value before the run plus K;
//  - a table being created is either absent or complete and identical to its seeded contents.
// "Flushed" means: gradsync flush returned. SIGKILL keeps the page cache, so this test checks the
// process-crash contract (and the header/generation machinery); power loss is fsync's business.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "accumulator/accumulator.hpp"
#include "common/error.hpp"
#include "table/table.hpp"

namespace fs = std::filesystem;
using gradsync::accumulator::AccumSpec;
using gradsync::accumulator::Accumulator;
using gradsync::accumulator::OptimizerKind;
using gradsync::accumulator::OptimizerSpec;
using gradsync::table::OpenMode;
using gradsync::table::OpenSpec;
using gradsync::table::Table;

namespace {

constexpr int64_t kRows = 4096, kDim = 64;
constexpr float kBase = 100000.0f;
int failures = 0;

#define EXPECT(cond, ...)                                                    \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                     \
      std::fprintf(stderr, "\n");                                            \
      ++failures;                                                            \
    }                                                                        \
  } while (0)

// Whether every byte of x is the same byte of a or of b: a or b, or a copy from one to the other
// cut part way (0.5 is 0x3F000000: the top byte of 1.0 written over 0.0, the next not yet).
bool bytes_of_either(float x, float a, float b) {
  unsigned char cx[sizeof x], ca[sizeof a], cb[sizeof b];
  std::memcpy(cx, &x, sizeof x);
  std::memcpy(ca, &a, sizeof a);
  std::memcpy(cb, &b, sizeof b);
  for (size_t i = 0; i < sizeof x; ++i)
    if (cx[i] != ca[i] && cx[i] != cb[i]) return false;
  return true;
}

OpenSpec tspec(const std::string& path, OpenMode mode, int64_t rows = kRows, int64_t dim = kDim) {
  OpenSpec s;
  s.path = path;
  s.mode = mode;
  s.rows = rows;
  s.dim = dim;
  return s;
}

AccumSpec aspec(const std::string& path, OpenMode mode) {
  AccumSpec s;
  s.path = path;
  s.mode = mode;
  s.rows = kRows;
  s.dim = kDim;
  return s;
}

OpenSpec new_table_spec(const std::string& path, int iteration) {
  OpenSpec s = tspec(path, OpenMode::Create, 1024, 64);
  s.init = gradsync::table::Init::Uniform;
  s.seed = static_cast<uint64_t>(iteration);
  return s;
}

[[noreturn]] void child(const fs::path& dir, int iteration, int report_fd) {
  try {
    // Creation under a kill: the new table must be absent or complete afterwards.
    Table::open(new_table_spec((dir / ("new-" + std::to_string(iteration) + ".gst")).string(), iteration));
    auto t = Table::open(tspec((dir / "t.gst").string(), OpenMode::Open));
    auto p = Table::open(tspec((dir / "p.gst").string(), OpenMode::Open));
    auto g = Accumulator::open(aspec((dir / "g.gsa").string(), OpenMode::Open));
    std::vector<int64_t> ids(kRows);
    for (int64_t r = 0; r < kRows; ++r) ids[r] = (r * 37) % kRows;  // scattered order
    std::vector<float> ones(kRows * kDim, 1.0f), value(kRows * kDim);
    OptimizerSpec sgd{OptimizerKind::Sgd, 1.0f, 1e-10f};
    for (int64_t k = 1;; ++k) {
      std::fill(value.begin(), value.end(), static_cast<float>(k));
      for (int64_t b = 0; b < kRows; b += 256) t->scatter(ids.data() + b, 256, value.data(), 256 * kDim);
      for (int64_t b = 0; b < kRows; b += 256) g->add_batch(ids.data() + b, 256, ones.data(), 256 * kDim);
      g->apply(*p, sgd, nullptr);
      t->flush();
      p->flush();
      g->flush();
      if (::write(report_fd, &k, sizeof k) != sizeof k) ::_exit(3);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "child: %s\n", e.what());
    ::_exit(2);
  }
}

// Puts the files into the known starting state (parent only, never killed).
void reset(const fs::path& dir, uint64_t gens[3]) {
  auto t = Table::open(tspec((dir / "t.gst").string(), OpenMode::CreateOrOpen));
  auto p = Table::open(tspec((dir / "p.gst").string(), OpenMode::CreateOrOpen));
  auto g = Accumulator::open(aspec((dir / "g.gsa").string(), OpenMode::CreateOrOpen));
  t->fill_zero();
  std::vector<float> base(kDim, kBase);
  for (int64_t r = 0; r < kRows; ++r) p->set(r, base.data(), kDim);
  g->zero();
  g->table().fill_zero();
  t->flush();
  p->flush();
  g->flush();
  gens[0] = t->generation();
  gens[1] = p->generation();
  gens[2] = g->table().generation();
}

void verify(const fs::path& dir, int iteration, int64_t k, const uint64_t gens[3]) {
  try {
    auto t = Table::open(tspec((dir / "t.gst").string(), OpenMode::Open));
    auto p = Table::open(tspec((dir / "p.gst").string(), OpenMode::Open));
    auto g = Accumulator::open(aspec((dir / "g.gsa").string(), OpenMode::Open));
    EXPECT(t->generation() >= gens[0] + static_cast<uint64_t>(k), "table generation %llu < %llu + %lld",
           (unsigned long long)t->generation(), (unsigned long long)gens[0], (long long)k);
    EXPECT(p->generation() >= gens[1] + static_cast<uint64_t>(k), "params generation");
    EXPECT(g->table().generation() >= gens[2] + static_cast<uint64_t>(k), "gradient generation");
    const float* tv = t->data();
    const float* pv = p->data();
    const float* gv = g->table().data();
    std::vector<int64_t> touched(kRows);
    const size_t n = g->touched(touched.data(), touched.size());
    std::vector<char> is_touched(kRows, 0);
    for (size_t i = 0; i < n; ++i) is_touched[touched[i]] = 1;
    int bad_t = 0, bad_p = 0, bad_g = 0, hidden = 0;
    for (int64_t r = 0; r < kRows; ++r) {
      bool nonzero = false;
      for (int64_t j = 0; j < kDim; ++j) {
        const size_t i = static_cast<size_t>(r * kDim + j);
        bad_t += !bytes_of_either(tv[i], static_cast<float>(k), static_cast<float>(k + 1));
        bad_p += !(pv[i] == kBase - static_cast<float>(k) || pv[i] == kBase - static_cast<float>(k + 1));
        bad_g += !(gv[i] == 0.0f || gv[i] == 1.0f);
        nonzero |= gv[i] != 0.0f;
      }
      hidden += nonzero && !is_touched[r];
    }
    EXPECT(bad_t == 0, "iteration %d, flushed phase %lld: %d table elements older than flushed", iteration,
           (long long)k, bad_t);
    EXPECT(bad_p == 0, "iteration %d, flushed phase %lld: %d parameter elements lost a flushed step", iteration,
           (long long)k, bad_p);
    EXPECT(bad_g == 0, "iteration %d: %d gradient elements not 0 or 1", iteration, bad_g);
    EXPECT(hidden == 0, "iteration %d: %d rows hold a gradient but are not in the touched set", iteration, hidden);
    // The recovered accumulator works: apply consumes every pending gradient.
    g->apply(*p, OptimizerSpec{OptimizerKind::Sgd, 1.0f, 1e-10f}, nullptr);
    EXPECT(g->touched_count() == 0, "touched set not empty after apply");
    int left = 0;
    for (int64_t i = 0; i < kRows * kDim; ++i) left += gv[i] != 0.0f;
    EXPECT(left == 0, "%d gradient elements left after apply", left);
  } catch (const std::exception& e) {
    EXPECT(false, "iteration %d: reopening failed: %s", iteration, e.what());
  }
  // The table being created: absent, or complete.
  const fs::path created = dir / ("new-" + std::to_string(iteration) + ".gst");
  if (fs::exists(created)) {
    try {
      auto t = Table::open(tspec(created.string(), OpenMode::Open, 1024, 64));
      OpenSpec ref = new_table_spec("", iteration);
      ref.mode = OpenMode::Anonymous;
      auto expected = Table::open(ref);
      EXPECT(std::memcmp(t->data(), expected->data(), t->data_bytes()) == 0, "iteration %d: created table differs",
             iteration);
    } catch (const std::exception& e) {
      EXPECT(false, "iteration %d: a created table does not open: %s", iteration, e.what());
    }
    fs::remove(created);
  }
  // Left-over private files of an interrupted creation are never under the real name; clean them.
  for (auto& entry : fs::directory_iterator(dir))
    if (entry.path().filename().string().find(".creating.") != std::string::npos) fs::remove(entry.path());
}

}  // namespace

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 40;
  char tmpl[] = "/tmp/gradsync-crash-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return 1;
  const fs::path dir = tmpl;
  std::mt19937 rng(12345);
  std::uniform_int_distribution<int> delay_us(0, 300000);
  int max_phase = 0, killed_mid_create = 0;
  for (int it = 0; it < iterations && failures == 0; ++it) {
    uint64_t gens[3];
    reset(dir, gens);
    int fds[2];
    if (::pipe(fds) != 0) return 1;
    const pid_t pid = ::fork();
    if (pid < 0) return 1;
    if (pid == 0) {
      ::close(fds[0]);
      child(dir, it, fds[1]);
    }
    ::close(fds[1]);
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us(rng)));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "child ended on its own (status %d)", status);
    int64_t k = 0, v = 0;
    while (::read(fds[0], &v, sizeof v) == sizeof v) k = v;
    ::close(fds[0]);
    max_phase = std::max<int>(max_phase, static_cast<int>(k));
    killed_mid_create += k == 0 ? 1 : 0;
    verify(dir, it, k, gens);
  }
  fs::remove_all(dir);
  std::printf("%d kills, up to %d flushed phases before a kill, %d kills before the first flush: %s\n", iterations,
              max_phase, killed_mid_create, failures == 0 ? "all files intact" : "FAILURES");
  return failures == 0 ? 0 : 1;
}
