// SPDX-License-Identifier: Apache-2.0
// add_batch throughput of the sparse gradient accumulator on a 1M x 128 table (batches of 65,536
// row ids, uniform and Zipf-skewed, 1 and 2 threads) per concurrency mode, beside a plain
// single-thread loop, the no-sync (Hogwild) mode and the seed's design (one reader-writer lock per
// 64 consecutive rows, taken exclusively per row add), all measured in this run; owner mode with
// 1, 2 and 4 owner threads fed by one calling thread (the 2 threads' batches, in sequence) and
// with 2 owners fed by 2 calling threads; a memory-bandwidth probe (a streaming add over the
// table with 1, 2 and 4 threads) to put the GB/s in scale; then apply() of 64K touched rows of a
// 1M-row table beside a plain pass over the same rows.
//
// Bytes per row add: read the gradient (dim*4) + read and write the accumulator row (2*dim*4).
// Medians of several repetitions. Usage: accumulator_bench [reps (default 9)] [case name filter].
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "accumulator/accumulator.hpp"
#include "common/partition.hpp"
#include "table/table.hpp"

using gradsync::accumulator::AccumSpec;
using gradsync::accumulator::Accumulator;
using gradsync::accumulator::Concurrency;
using gradsync::accumulator::OptimizerKind;
using gradsync::accumulator::OptimizerSpec;
using gradsync::table::OpenMode;
using gradsync::table::OpenSpec;
using gradsync::table::Table;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kRows = int64_t{1} << 20;
constexpr int64_t kDim = 128;
constexpr size_t kBatch = 65536;
constexpr int kBatchesPerRep = 4;  // per thread, so one repetition moves ~100-200 MB
constexpr double kBytesPerRow = 3.0 * kDim * sizeof(float);

// Baselines run on the same kind of memory as the accumulator: an anonymous table, pre-faulted.
std::unique_ptr<Table> anon(int64_t rows, int64_t dim) {
  OpenSpec s;
  s.mode = OpenMode::Anonymous;
  s.rows = rows;
  s.dim = dim;
  auto t = Table::open(s);
  std::memset(t->data(), 0, t->data_bytes());
  return t;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Zipf(s) over ranks 1..n by inverse CDF, ranks scattered over ids by a bijection (hot ids are
// arbitrary in real embedding tables, not the first rows).
std::vector<int64_t> make_ids(size_t n, bool zipf, uint64_t seed, const std::vector<double>& cdf) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> ids(n);
  if (!zipf) {
    std::uniform_int_distribution<int64_t> u(0, kRows - 1);
    for (auto& id : ids) id = u(rng);
    return ids;
  }
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (auto& id : ids) {
    const auto rank = static_cast<uint64_t>(std::upper_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin());
    id = static_cast<int64_t>((std::min<uint64_t>(rank, kRows - 1) * 0x9E3779B1ull) & (kRows - 1));
  }
  return ids;
}

// Runs work(thread, rep) on `threads` threads together; returns the median wall time per repetition.
double time_parallel(int threads, int reps, const std::function<void(int)>& before_rep,
                     const std::function<void(int, int)>& work) {
  std::vector<double> times;
  for (int rep = 0; rep < reps; ++rep) {
    before_rep(rep);
    std::barrier sync(threads);
    std::vector<Clock::time_point> start(threads), end(threads);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        sync.arrive_and_wait();
        start[t] = Clock::now();
        work(t, rep);
        end[t] = Clock::now();
      });
    }
    for (auto& th : pool) th.join();
    const auto s = *std::min_element(start.begin(), start.end());
    const auto e = *std::max_element(end.begin(), end.end());
    times.push_back(std::chrono::duration<double>(e - s).count());
  }
  return median(times);
}

struct Row {
  std::string name;
  int threads;
  double rows_per_s;
  double min_rows_per_s;
  double max_rows_per_s;
};

void print_row(const char* dist, const Row& r, double nosync_same_threads, double seed_same_threads, double probe_gbs) {
  const double gbs = r.rows_per_s * kBytesPerRow / 1e9;
  std::printf(
      "%-8s %-40s %2d  %6.1f [%5.1f..%5.1f] M rows/s  %6.2f GB/s (%3.0f%% probe)  %5.2fx no-sync  %5.2fx seed\n", dist,
      r.name.c_str(), r.threads, r.rows_per_s / 1e6, r.min_rows_per_s / 1e6, r.max_rows_per_s / 1e6, gbs,
      100.0 * gbs / probe_gbs, r.rows_per_s / nosync_same_threads, r.rows_per_s / seed_same_threads);
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::max(1, std::atoi(argv[1])) : 9;
  // Optional: only cases whose name contains this (the seed and no-sync baselines always run).
  const std::string filter = argc > 2 ? argv[2] : "";
  {
    std::ifstream load("/proc/loadavg");
    std::string l1;
    load >> l1;
    std::printf(
        "accumulator_bench: %lld x %lld f32 table, batches of %zu ids, %d batches per thread per rep, "
        "median of %d reps; %u hardware threads, load average %s\n",
        static_cast<long long>(kRows), static_cast<long long>(kDim), kBatch, kBatchesPerRep, reps,
        std::thread::hardware_concurrency(), l1.c_str());
  }
  std::vector<double> cdf(kRows);
  {
    const double s = 1.1;
    double sum = 0;
    for (int64_t k = 0; k < kRows; ++k) sum += 1.0 / std::pow(static_cast<double>(k + 1), s);
    double acc = 0;
    for (int64_t k = 0; k < kRows; ++k) cdf[k] = (acc += 1.0 / std::pow(static_cast<double>(k + 1), s) / sum);
  }
  std::vector<float> grads(kBatch * kDim);
  {
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (auto& g : grads) g = u(rng);
  }

  // Memory-bandwidth probe: the same bytes per row as an add (read the gradient, read and write
  // the row), streamed over the whole table, so the random-row cases can be read against it.
  std::vector<double> probe_gbs(5, 1.0);
  {
    auto t = anon(kRows, kDim);
    float* dst = t->data();
    for (int threads : {1, 2, 4}) {
      const double secs = time_parallel(
          threads, std::max(3, reps / 3), [](int) {},
          [&](int th, int) {
            const gradsync::Part part = gradsync::partition(static_cast<uint64_t>(kRows),
                                                            static_cast<uint64_t>(threads), static_cast<uint64_t>(th));
            for (uint64_t r = part.start; r < part.start + part.len; ++r) {
              float* d = dst + r * kDim;
              const float* g = grads.data() + (r % kBatch) * kDim;
              for (int64_t j = 0; j < kDim; ++j) d[j] += g[j];
            }
          });
      probe_gbs[threads] = static_cast<double>(kRows) * kBytesPerRow / secs / 1e9;
      std::printf("bandwidth probe (streaming add over the table), %d threads: %6.2f GB/s\n", threads,
                  probe_gbs[threads]);
    }
  }

  for (bool zipf : {false, true}) {
    const char* dist = zipf ? "zipf1.1" : "uniform";
    // ids[thread][batch]
    std::vector<std::vector<std::vector<int64_t>>> ids(2);
    for (int t = 0; t < 2; ++t)
      for (int b = 0; b < kBatchesPerRep; ++b)
        ids[t].push_back(make_ids(kBatch, zipf, 100 * t + b + (zipf ? 7 : 0), cdf));
    const double per_rep_rows = static_cast<double>(kBatch) * kBatchesPerRep;
    // Every case runs once per repetition, round-robin, so that load from other processes on a
    // shared machine falls on all of them alike; the medians are then compared.
    struct Case {
      std::string name;
      int threads;
      std::function<void(int)> before;
      std::function<void(int, int)> work;
      std::vector<double> times;
      int callers = 0;          // threads calling work(); 0: `threads`
      double rows_per_rep = 0;  // 0: threads x per_rep_rows
    };
    std::vector<Case> cases;
    auto raw_table = anon(kRows, kDim);
    float* raw = raw_table->data();
    std::vector<std::shared_mutex> locks(static_cast<size_t>(kRows / 64));
    cases.push_back({"plain loop (no tracking, no sync)",
                     1,
                     [](int) {},
                     [&](int t, int) {
                       for (int b = 0; b < kBatchesPerRep; ++b) {
                         const auto& batch = ids[t][b];
                         for (size_t i = 0; i < kBatch; ++i) {
                           float* dst = raw + batch[i] * kDim;
                           const float* src = grads.data() + i * kDim;
                           for (int64_t j = 0; j < kDim; ++j) dst[j] += src[j];
                         }
                       }
                     },
                     {}});
    for (int threads : {1, 2}) {
      cases.push_back({"seed: rwlock per 64 rows, exclusive",
                       threads,
                       [](int) {},
                       [&](int t, int) {
                         for (int b = 0; b < kBatchesPerRep; ++b) {
                           const auto& batch = ids[t][b];
                           for (size_t i = 0; i < kBatch; ++i) {
                             std::unique_lock lock(locks[static_cast<size_t>(batch[i] / 64)]);
                             float* dst = raw + batch[i] * kDim;
                             const float* src = grads.data() + i * kDim;
                             for (int64_t j = 0; j < kDim; ++j) dst[j] += src[j];
                           }
                         }
                       },
                       {}});
    }
    struct ModeCase {
      const char* name;
      Concurrency mode;
      int64_t rows_per_lock;
    };
    const ModeCase modes[] = {{"none (Hogwild, racy)", Concurrency::None, 16},
                              {"striped, default (16 rows/lock)", Concurrency::Striped, -1},
                              {"striped, 64 rows/lock", Concurrency::Striped, 64},
                              {"lock-free (CAS per float)", Concurrency::LockFree, 16}};
    std::vector<std::unique_ptr<Accumulator>> accs;
    for (const auto& m : modes) {
      AccumSpec s;
      s.mode = OpenMode::Anonymous;
      s.rows = kRows;
      s.dim = kDim;
      s.concurrency = static_cast<int32_t>(m.mode);
      s.rows_per_lock = m.rows_per_lock;
      accs.push_back(Accumulator::open(s));
      Accumulator* acc = accs.back().get();
      std::memset(acc->table().data(), 0, acc->table().data_bytes());  // fault the pages in, untimed
      for (int threads : {1, 2}) {
        cases.push_back({std::string("accumulator ") + m.name,
                         threads,
                         [acc](int) { acc->zero(); },
                         [&, acc](int th, int) {
                           for (int b = 0; b < kBatchesPerRep; ++b)
                             acc->add_batch(ids[th][b].data(), kBatch, grads.data(), grads.size());
                         },
                         {}});
      }
    }
    // Owner mode: T owner threads apply the batches one calling thread hands over (the 2 threads'
    // batches in turn: the same rows as the 2-thread cases), and 2 owners fed by 2 calling threads.
    for (int owners : {1, 2, 4}) {
      AccumSpec s;
      s.mode = OpenMode::Anonymous;
      s.rows = kRows;
      s.dim = kDim;
      s.concurrency = static_cast<int32_t>(Concurrency::Owner);
      s.threads = owners;
      accs.push_back(Accumulator::open(s));
      Accumulator* acc = accs.back().get();
      std::memset(acc->table().data(), 0, acc->table().data_bytes());
      cases.push_back({"accumulator owner, 1 caller",
                       owners,
                       [acc](int) { acc->zero(); },
                       [&, acc](int, int) {
                         for (int b = 0; b < kBatchesPerRep; ++b)
                           for (int th = 0; th < 2; ++th)
                             acc->add_batch(ids[th][b].data(), kBatch, grads.data(), grads.size());
                       },
                       {},
                       1,
                       2 * per_rep_rows});
      if (owners == 2) {
        cases.push_back({"accumulator owner, 2 callers",
                         owners,
                         [acc](int) { acc->zero(); },
                         [&, acc](int th, int) {
                           for (int b = 0; b < kBatchesPerRep; ++b)
                             acc->add_batch(ids[th][b].data(), kBatch, grads.data(), grads.size());
                         },
                         {},
                         2,
                         2 * per_rep_rows});
      }
    }
    for (int rep = 0; rep < reps; ++rep)
      for (auto& c : cases)
        if (filter.empty() || c.name.find(filter) != std::string::npos || c.name.rfind("seed", 0) == 0 ||
            c.name.find("none") != std::string::npos)
          c.times.push_back(time_parallel(c.callers > 0 ? c.callers : c.threads, 1, c.before, c.work));
    std::erase_if(cases, [](const Case& c) { return c.times.empty(); });
    std::vector<Row> rows;
    for (auto& c : cases) {
      const double n = c.rows_per_rep > 0 ? c.rows_per_rep : c.threads * per_rep_rows;
      const auto [lo, hi] = std::minmax_element(c.times.begin(), c.times.end());
      rows.push_back({c.name, c.threads, n / median(c.times), n / *hi, n / *lo});
    }
    accs.clear();
    // Baselines run with 1 and 2 threads (the machine's cores here); 4 owners are read against 2.
    auto find = [&](const std::string& prefix, int threads) {
      for (const auto& r : rows)
        if (r.name.rfind(prefix, 0) == 0 && r.threads == std::min(threads, 2)) return r.rows_per_s;
      return 1.0;
    };
    std::printf("\n%-8s %-40s %2s  %29s  %21s  %14s  %10s\n", "ids", "add_batch", "T", "rows/s median [min..max]",
                "GB/s", "vs no-sync(T)", "vs seed(T)");
    for (const auto& r : rows)
      print_row(dist, r, find("accumulator none", r.threads), find("seed", r.threads), probe_gbs[r.threads]);
    double best_exact2 = 0;
    std::string best_name;
    for (const auto& r : rows) {
      if (r.threads == 2 &&
          (r.name.find("striped") != std::string::npos || r.name.find("lock-free") != std::string::npos ||
           r.name.find("owner") != std::string::npos) &&
          r.rows_per_s > best_exact2) {
        best_exact2 = r.rows_per_s;
        best_name = r.name;
      }
    }
    std::printf(
        "%-8s fastest exact mode with 2 threads: %s: %.2fx no-sync (target >= 0.9), %.2fx seed (target >= 1.8)\n", dist,
        best_name.c_str(), best_exact2 / find("accumulator none", 2), best_exact2 / find("seed", 2));
  }

  // Two processes adding to one gradient file (tmpfs), striped against owner mode (1 owner per
  // process, so 2 processes = 2 cores, and 2 owners per process). Each child opens the file and
  // faults the mapping in before the clock starts.
  {
    char dir[] = "/dev/shm/gradsync-accbench-XXXXXX";
    if (::mkdtemp(dir) == nullptr) {
      std::perror("mkdtemp");
      return 1;
    }
    std::vector<std::vector<int64_t>> pids_ids;
    for (int t = 0; t < 2; ++t)
      for (int b = 0; b < kBatchesPerRep; ++b) pids_ids.push_back(make_ids(kBatch, false, 100 * t + b, cdf));
    struct ProcCase {
      const char* name;
      Concurrency mode;
      int64_t threads;
    };
    const ProcCase proc_cases[] = {{"striped, default (16 rows/lock)", Concurrency::Striped, -1},
                                   {"owner, 1 owner per process", Concurrency::Owner, 1},
                                   {"owner, 2 owners per process", Concurrency::Owner, 2}};
    std::printf("\n2 processes on one gradient file in /dev/shm, uniform ids, %d batches of %zu each:\n",
                kBatchesPerRep, kBatch);
    double striped_median = 0;
    for (const auto& pc : proc_cases) {
      const std::string path = std::string(dir) + "/g.gsa";
      std::vector<double> times;
      {
        AccumSpec s;
        s.path = path;
        s.mode = OpenMode::Create;
        s.rows = kRows;
        s.dim = kDim;
        s.concurrency = static_cast<int32_t>(pc.mode);
        s.threads = 1;
        auto holder = Accumulator::open(s);
        for (int rep = 0; rep < reps; ++rep) {
          holder->zero();
          int ready[2], go[2], done[2];
          if (::pipe(ready) != 0 || ::pipe(go) != 0 || ::pipe(done) != 0) return 1;
          std::vector<pid_t> kids;
          for (int p = 0; p < 2; ++p) {
            const pid_t pid = ::fork();
            if (pid == 0) {
              AccumSpec cs;
              cs.path = path;
              cs.mode = OpenMode::Open;
              cs.threads = pc.threads;
              auto a = Accumulator::open(cs);
              volatile float sink = 0;
              const float* data = a->table().data();
              for (size_t i = 0; i < a->table().data_bytes() / sizeof(float); i += 1024) sink = sink + data[i];
              char c = 1;
              if (::write(ready[1], &c, 1) != 1 || ::read(go[0], &c, 1) != 1) ::_exit(2);
              for (int b = 0; b < kBatchesPerRep; ++b)
                a->add_batch(pids_ids[p * kBatchesPerRep + b].data(), kBatch, grads.data(), grads.size());
              if (::write(done[1], &c, 1) != 1) ::_exit(2);
              ::_exit(0);
            }
            kids.push_back(pid);
          }
          char c = 0;
          for (int p = 0; p < 2; ++p)
            if (::read(ready[0], &c, 1) != 1) return 1;
          const auto t0 = Clock::now();
          for (int p = 0; p < 2; ++p)
            if (::write(go[1], &c, 1) != 1) return 1;
          for (int p = 0; p < 2; ++p)
            if (::read(done[0], &c, 1) != 1) return 1;
          times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
          for (pid_t k : kids) ::waitpid(k, nullptr, 0);
          for (int fd : {ready[0], ready[1], go[0], go[1], done[0], done[1]}) ::close(fd);
        }
        // Exactness: every add landed (the sum of all gradient elements, in double, against the inputs).
        double got = 0, want = 0;
        const float* data = holder->table().data();
        for (size_t i = 0; i < holder->table().data_bytes() / sizeof(float); ++i) got += data[i];
        for (int p = 0; p < 2; ++p)
          for (int b = 0; b < kBatchesPerRep; ++b)
            for (float g : grads) want += g;
        std::printf("  %-34s sum of the table %.6g, of the inputs %.6g\n", pc.name, got, want);
      }
      std::filesystem::remove(path);
      const double n = 2.0 * kBatchesPerRep * kBatch;
      const auto [lo, hi] = std::minmax_element(times.begin(), times.end());
      const double med = n / median(times);
      if (striped_median == 0) striped_median = med;
      std::printf("  %-34s %6.1f [%5.1f..%5.1f] M rows/s  %6.2f GB/s  %5.2fx striped\n", pc.name, med / 1e6,
                  n / *hi / 1e6, n / *lo / 1e6, med * kBytesPerRow / 1e9, med / striped_median);
    }
    ::rmdir(dir);
  }

  // apply() of 64K touched rows of a 1M-row table, beside a plain pass over the same rows.
  {
    constexpr size_t kTouched = 65536;
    std::vector<int64_t> all(static_cast<size_t>(kRows));
    for (int64_t i = 0; i < kRows; ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), std::mt19937_64(5));
    std::vector<int64_t> touched(all.begin(), all.begin() + kTouched);
    AccumSpec s;
    s.mode = OpenMode::Anonymous;
    s.rows = kRows;
    s.dim = kDim;
    auto acc = Accumulator::open(s);
    OpenSpec ps;
    ps.mode = OpenMode::Anonymous;
    ps.rows = kRows;
    ps.dim = kDim;
    auto params = Table::open(ps);
    ps.dim = 1;
    auto state = Table::open(ps);
    std::memset(acc->table().data(), 0, acc->table().data_bytes());
    std::memset(params->data(), 0, params->data_bytes());
    auto raw_p_table = anon(kRows, kDim), raw_g_table = anon(kRows, kDim);
    float* raw_p = raw_p_table->data();
    float* raw_g = raw_g_table->data();
    const size_t raw_n = static_cast<size_t>(kRows * kDim);
    const float lr = 0.01f;
    auto fill = [&](int) { acc->add_batch(touched.data(), kTouched, grads.data(), grads.size()); };
    const double t_sgd = time_parallel(1, reps, fill, [&](int, int) {
      acc->apply(*params, OptimizerSpec{OptimizerKind::Sgd, lr, 1e-10f}, nullptr);
    });
    const double t_ada = time_parallel(1, reps, fill, [&](int, int) {
      acc->apply(*params, OptimizerSpec{OptimizerKind::RowAdagrad, lr, 1e-10f}, state.get());
    });
    // Owner mode: the owners split the touched list.
    s.concurrency = static_cast<int32_t>(Concurrency::Owner);
    s.threads = 2;
    auto owner = Accumulator::open(s);
    std::memset(owner->table().data(), 0, owner->table().data_bytes());
    auto owner_fill = [&](int) { owner->add_batch(touched.data(), kTouched, grads.data(), grads.size()); };
    const double t_sgd_owner = time_parallel(1, reps, owner_fill, [&](int, int) {
      owner->apply(*params, OptimizerSpec{OptimizerKind::Sgd, lr, 1e-10f}, nullptr);
    });
    const double t_ada_owner = time_parallel(1, reps, owner_fill, [&](int, int) {
      owner->apply(*params, OptimizerSpec{OptimizerKind::RowAdagrad, lr, 1e-10f}, state.get());
    });
    auto refill = [&](int) {
      for (size_t i = 0; i < kTouched; ++i)
        std::memcpy(raw_g + touched[i] * kDim, grads.data() + i * kDim, kDim * sizeof(float));
    };
    const double t_plain = time_parallel(1, reps, refill, [&](int, int) {
      for (size_t i = 0; i < kTouched; ++i) {
        float* p = raw_p + touched[i] * kDim;
        float* g = raw_g + touched[i] * kDim;
        for (int64_t j = 0; j < kDim; ++j) {
          p[j] -= lr * g[j];
          g[j] = 0.0f;
        }
      }
    });
    // A full pass over all rows, as the seed's apply did, for scale.
    const double t_full = time_parallel(
        1, std::min(reps, 3), [](int) {},
        [&](int, int) {
          for (size_t i = 0; i < raw_n; ++i) {
            raw_p[i] -= lr * raw_g[i];
            raw_g[i] = 0.0f;
          }
        });
    std::printf("\napply, %zu touched rows of %lld x %lld:\n", kTouched, static_cast<long long>(kRows),
                static_cast<long long>(kDim));
    std::printf("  plain pass over the touched rows (p -= lr*g; g = 0) %8.2f ms\n", t_plain * 1e3);
    std::printf("  accumulator apply, SGD                              %8.2f ms  %5.2fx plain (target <= 2)\n",
                t_sgd * 1e3, t_sgd / t_plain);
    std::printf("  accumulator apply, row-wise Adagrad                 %8.2f ms  %5.2fx plain\n", t_ada * 1e3,
                t_ada / t_plain);
    std::printf("  owner mode (2 owners) apply, SGD                    %8.2f ms  %5.2fx plain\n", t_sgd_owner * 1e3,
                t_sgd_owner / t_plain);
    std::printf("  owner mode (2 owners) apply, row-wise Adagrad       %8.2f ms  %5.2fx plain\n", t_ada_owner * 1e3,
                t_ada_owner / t_plain);
    std::printf("  seed-style pass over all %lld rows                 %8.2f ms  %5.2fx plain\n",
                static_cast<long long>(kRows), t_full * 1e3, t_full / t_plain);
  }
  return 0;
}
