// SPDX-License-Identifier: Apache-2.0
// The sharded parameter (ZeRO-1) against the unsharded baseline, and the codecs against a plain
// F16C loop, each measured in the same run.
//
//   unsharded: every rank allreduces (mean) the full gradient, then runs the full Adam step on all
//              N weights (the same kernel code as the library's, compiled here with -march=native).
//   sharded:   gradsync_shard_step: reduce-scatter (or compressed exchange), Adam on the rank's
//              1/P slice, allgather of the new weights.
// Step times are medians over several steps, taken on rank 0 between barriers, so they include
// the slowest rank. Codec throughput is in floats per nanosecond over 16M floats (median of runs),
// next to a plain _mm256_cvtps_ph / _mm256_cvtph_ps loop over the same buffers.
//   shard_bench [--quick]
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "codec/codec.hpp"
#include "comm/communicator.hpp"
#include "comm/create.hpp"
#include "shard/sharded_parameter.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using gradsync::DType;
using gradsync::ReduceOp;
using gradsync::codec::Codec;
namespace comm = gradsync::comm;
namespace shard = gradsync::shard;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The library's Adam kernel, for the unsharded baseline (decay 1, no L2: plain Adam).
__attribute__((optimize("no-math-errno"))) void adam_full(float* __restrict w, const float* __restrict g,
                                                          float* __restrict m, float* __restrict v, size_t n,
                                                          float step_size, float inv_sqrt_bc2, float eps, float b1,
                                                          float b2) {
  const float c1 = 1.0f - b1, c2 = 1.0f - b2;
  for (size_t i = 0; i < n; ++i) {
    const float grad = g[i];
    m[i] = b1 * m[i] + c1 * grad;
    v[i] = b2 * v[i] + c2 * grad * grad;
    w[i] = w[i] - step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bc2 + eps);
  }
}

struct Result {
  std::vector<double> step_seconds;
  uint64_t optimizer_bytes = 0;
  std::vector<float> weights;  // rank 0's, for the cross-check
};

constexpr int kRanks = 2;

// Runs `steps` training steps on kRanks threads; rank 0 times each step between barriers.
Result run(const std::string& name, size_t n, int warmup, int steps, bool sharded, Codec codec) {
  Result result;
  std::vector<double> times;
  std::vector<std::thread> threads;
  std::vector<std::string> errors(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      try {
        comm::Options o;
        o.rank = r;
        o.size = kRanks;
        o.name = name;
        o.timeout = std::chrono::milliseconds(120000);
        auto c = comm::create(o);
        std::vector<float> w(n), g(n);
        for (size_t i = 0; i < n; ++i) {
          w[i] = std::sin(static_cast<float>(i % 1000));
          g[i] = std::cos(static_cast<float>((i + static_cast<size_t>(r) * 17) % 997)) * 1e-2f;
        }
        shard::Options so;
        so.optimizer = shard::Optimizer::Adam;
        so.lr = 1e-3;
        so.compress = codec;
        std::unique_ptr<shard::ShardedParameter> p;
        std::vector<float> m, v;
        if (sharded) {
          p = std::make_unique<shard::ShardedParameter>(*c, n, so);
          p->init(w.data(), n);
        } else {
          m.assign(n, 0.0f);
          v.assign(n, 0.0f);
        }
        std::vector<float> send(n);
        for (int s = 0; s < warmup + steps; ++s) {
          c->barrier();
          const auto t0 = Clock::now();
          if (sharded) {
            p->step(g.data(), n, 1, w.data(), n);
          } else {
            const comm::BufferRef ref{g.data(), send.data(), n};
            c->allreduce(std::span<const comm::BufferRef>(&ref, 1), DType::F32, ReduceOp::Mean);
            const double t = s + 1;
            const double bc1 = 1 - std::pow(0.9, t), bc2 = 1 - std::pow(0.999, t);
            adam_full(w.data(), send.data(), m.data(), v.data(), n, static_cast<float>(1e-3 / bc1),
                      static_cast<float>(1 / std::sqrt(bc2)), 1e-8f, 0.9f, 0.999f);
          }
          c->barrier();
          if (r == 0 && s >= warmup) times.push_back(seconds_since(t0));
        }
        if (r == 0) {
          result.optimizer_bytes = sharded ? p->optimizer_bytes() : (m.size() + v.size()) * sizeof(float);
          result.weights = w;
        }
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (!e.empty()) throw std::runtime_error(e);
  result.step_seconds = times;
  return result;
}

__attribute__((target("avx,f16c"))) void plain_f16c_encode(const float* s, size_t n, uint16_t* d) {
  for (size_t i = 0; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), 0));
}
__attribute__((target("avx,f16c"))) void plain_f16c_decode(const uint16_t* s, size_t n, float* d) {
  for (size_t i = 0; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
}

// Each method is timed once per round, round after round, so a change in the machine's load
// (it is shared) hits every method alike; medians per method.
std::vector<double> floats_per_ns_interleaved(const std::vector<std::function<void()>>& fns, size_t n, int runs) {
  for (const auto& fn : fns) fn();  // fault pages in
  std::vector<std::vector<double>> t(fns.size());
  for (int i = 0; i < runs; ++i)
    for (size_t k = 0; k < fns.size(); ++k) {
      const auto t0 = Clock::now();
      fns[k]();
      t[k].push_back(seconds_since(t0));
    }
  std::vector<double> out;
  for (auto& v : t) out.push_back(static_cast<double>(n) / (median(v) * 1e9));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const size_t n = quick ? (size_t{1} << 20) : (size_t{1} << 24);
  const int warmup = 1, steps = quick ? 3 : 5, rounds = quick ? 2 : 3, codec_runs = quick ? 5 : 21;
  std::printf(
      "shard_bench: %zu parameters (%.0f MB of f32), %d ranks (threads), Adam; medians of %d steps "
      "(%d rounds of %d, modes interleaved)\n",
      n, static_cast<double>(n) * 4 / 1e6, kRanks, steps * rounds, rounds, steps);
  std::printf("hardware threads %u, F16C in the codec: %s\n\n", std::thread::hardware_concurrency(),
              gradsync::codec::fp16_uses_f16c() ? "yes" : "no (scalar path)");

  // The modes take turns, round after round, so a change in the shared machine's load hits them
  // alike; each mode's figure is the median over all its timed steps.
  struct Row {
    const char* label;
    bool sharded;
    Codec codec;
    std::vector<double> seconds;
    uint64_t optimizer_bytes = 0;
  };
  std::vector<Row> rows{{"unsharded (allreduce+Adam)", false, Codec::None, {}},
                        {"sharded, none", true, Codec::None, {}},
                        {"sharded, bf16", true, Codec::Bf16, {}},
                        {"sharded, fp16", true, Codec::Fp16, {}}};
  bool ok = true;
  for (int round = 0; round < rounds; ++round) {
    std::vector<float> base_weights;
    for (Row& row : rows) {
      std::string name = "shard_bench_";
      name += row.sharded ? gradsync::codec::codec_name(row.codec) : "unsharded";
      const Result r = run(name, n, warmup, steps, row.sharded, row.codec);
      row.seconds.insert(row.seconds.end(), r.step_seconds.begin(), r.step_seconds.end());
      row.optimizer_bytes = r.optimizer_bytes;
      if (!row.sharded) base_weights = r.weights;
      if (row.sharded && row.codec == Codec::None) {
        // Same Adam, same gradients: uncompressed sharding must reproduce the baseline's weights.
        size_t far = 0;
        for (size_t i = 0; i < n; ++i) far += std::abs(r.weights[i] - base_weights[i]) > 1e-6f;
        if (far != 0) {
          std::printf("CHECK FAILED: %zu weights differ from the unsharded baseline\n", far);
          ok = false;
        }
      }
    }
  }
  const double base_ms = median(rows[0].seconds) * 1e3;
  std::printf("%-28s %10s %10s %22s\n", "mode", "step ms", "vs base", "optimizer MB per rank");
  for (const Row& row : rows) {
    const double ms = median(row.seconds) * 1e3;
    std::printf("%-28s %10.2f %9.2fx %22.1f\n", row.label, ms, ms / base_ms,
                static_cast<double>(row.optimizer_bytes) / 1e6);
  }
  const double sharded_none_ms = median(rows[1].seconds) * 1e3;
  std::printf("target: sharded none <= unsharded: %s (%.2fx)\n\n", sharded_none_ms <= base_ms ? "met" : "MISSED",
              sharded_none_ms / base_ms);

  // ---- codecs
  std::vector<float> src(n), dst(n);
  std::vector<uint16_t> enc(n);
  for (size_t i = 0; i < n; ++i) src[i] = std::sin(static_cast<float>(i)) * 100.0f;
  const Codec codecs[] = {Codec::Fp16, Codec::Bf16, Codec::BigdlFp16};
  std::vector<std::function<void()>> encoders{[&] { plain_f16c_encode(src.data(), n, enc.data()); }};
  std::vector<std::function<void()>> decoders{[&] { plain_f16c_decode(enc.data(), n, dst.data()); }};
  for (Codec c : codecs) {
    encoders.push_back([&, c] { gradsync::codec::encode(c, src.data(), n, enc.data()); });
    decoders.push_back([&, c] { gradsync::codec::decode(c, enc.data(), n, dst.data()); });
  }
  const auto e = floats_per_ns_interleaved(encoders, n, codec_runs);
  const auto d = floats_per_ns_interleaved(decoders, n, codec_runs);
  std::printf("%-22s %14s %14s %12s %12s\n", quick ? "codec (1M floats)" : "codec (16M floats)", "encode f/ns",
              "decode f/ns", "enc vs F16C", "dec vs F16C");
  std::printf("%-22s %14.2f %14.2f %12s %12s\n", "plain F16C loop", e[0], d[0], "1.00x", "1.00x");
  double worst = 1e9;
  for (size_t k = 0; k < 3; ++k) {
    worst = std::min({worst, e[k + 1] / e[0], d[k + 1] / d[0]});
    std::printf("%-22s %14.2f %14.2f %11.2fx %11.2fx\n", gradsync::codec::codec_name(codecs[k]), e[k + 1], d[k + 1],
                e[k + 1] / e[0], d[k + 1] / d[0]);
  }
  std::printf("target: every codec >= 0.8x the plain F16C loop: %s (worst %.2fx)\n", worst >= 0.8 ? "met" : "MISSED",
              worst);
  return ok ? 0 : 1;
}
