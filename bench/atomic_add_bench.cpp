// SPDX-License-Identifier: Apache-2.0
// Atomic float add (Hogwild) against a plain racy `dst[i] += src[i]`, measured in the same run.
//
// For each size and thread count, every thread adds its own src into ONE shared dst (the Hogwild
// pattern: all workers update the same weights). Each figure is the median of several timed
// rounds; a round repeats the add enough times to last a few milliseconds. "GB/s" counts the
// bytes an add must move: read src, read dst, write dst (3 x sizeof(T) per element per thread).
// After the timed rounds, one check round verifies that the atomic methods lost no update while
// the racy loop may have (its lost-update count is printed, not asserted).
//
// Usage: atomic_add_bench [max_floats]   (default 16M; the run takes well under a minute)
#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

#include "atomics/atomic_add.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using AddFn = void (*)(float*, const float*, size_t);

void racy_add(float* dst, const float* src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] += src[i];
}
void cas_add(float* dst, const float* src, size_t n) { gradsync::atomics::add_cas(dst, src, n); }
void ref_add(float* dst, const float* src, size_t n) { gradsync::atomics::add_atomic_ref(dst, src, n); }
void striped_add(float* dst, const float* src, size_t n) { gradsync::atomics::add_striped(dst, src, n); }

struct Method {
  const char* name;
  AddFn fn;
  bool exact;
};

// Runs `reps` adds on each of `threads` threads (main thread included) and returns seconds.
double timed_round(AddFn fn, float* dst, const std::vector<std::vector<float>>& srcs, size_t n, int threads, int reps) {
  std::barrier sync(threads);
  Clock::time_point start, stop;
  auto body = [&](int t) {
    sync.arrive_and_wait();
    if (t == 0) start = Clock::now();
    sync.arrive_and_wait();
    for (int r = 0; r < reps; ++r) fn(dst, srcs[t].data(), n);
    sync.arrive_and_wait();
    if (t == 0) stop = Clock::now();
  };
  std::vector<std::thread> workers;
  for (int t = 1; t < threads; ++t) workers.emplace_back(body, t);
  body(0);
  for (auto& w : workers) w.join();
  return std::chrono::duration<double>(stop - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const size_t max_n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (size_t{16} << 20);
  const Method methods[] = {{"racy (baseline)", racy_add, false},
                            {"cas loop", cas_add, true},
                            {"atomic_ref", ref_add, true},
                            {"striped (lib)", striped_add, true}};
  const size_t sizes[] = {1024, 64 * 1024, 16 * 1024 * 1024};
  const unsigned hw = std::thread::hardware_concurrency();
  std::printf("atomic float add into one shared array; medians of 7 rounds; %u hardware threads\n", hw);
  std::printf("%-9s %-3s %-16s %11s %9s %13s %s\n", "floats", "thr", "method", "ns/elem/thr", "GB/s", "racy/method",
              "check");
  for (size_t n : sizes) {
    if (n > max_n) continue;
    for (int threads : {1, 2}) {
      std::vector<float> dst(n, 0.0f);
      std::vector<std::vector<float>> srcs(threads, std::vector<float>(n, 1.0f));
      // Repeat so that one round moves about 256 MB per thread but is at least one add.
      const int reps = static_cast<int>(std::max<size_t>(1, (size_t{64} << 20) / n));
      double racy_time = 0;
      for (const Method& m : methods) {
        timed_round(m.fn, dst.data(), srcs, n, threads, 1);  // warm-up: page faults, caches
        std::vector<double> times;
        for (int round = 0; round < 7; ++round) times.push_back(timed_round(m.fn, dst.data(), srcs, n, threads, reps));
        const double t = median(times);
        if (!m.exact) racy_time = t;
        // Check round: every thread adds 1.0 `k` times into zeros; exact methods must give k*threads.
        std::fill(dst.begin(), dst.end(), 0.0f);
        const int k = std::min(reps, 64);
        timed_round(m.fn, dst.data(), srcs, n, threads, k);
        size_t lost = 0;
        for (float v : dst) lost += static_cast<size_t>(static_cast<float>(k * threads) - v);
        char check[64];
        if (m.exact && lost != 0) {
          std::printf("FAILED: %s lost %zu updates\n", m.name, lost);
          return 1;
        }
        std::snprintf(check, sizeof check, m.exact ? "exact" : "%zu updates lost", lost);
        const double ns = t / reps / static_cast<double>(n) * 1e9;
        const double gbs = 3.0 * sizeof(float) * static_cast<double>(n) * reps * threads / t / 1e9;
        std::printf("%-9zu %-3d %-16s %11.3f %9.2f %12.2fx %s\n", n, threads, m.name, ns, gbs, racy_time / t, check);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
