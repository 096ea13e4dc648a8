// SPDX-License-Identifier: Apache-2.0
// The sharded parameter over the thread transport: BigDL's acceptance cases, weighting, the
// gradient processors, compression, optimizers against a reference, and error propagation.
#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/create.hpp"
#include "common/error.hpp"
#include "shard/sharded_parameter.hpp"

using gradsync::Error;
using gradsync::codec::Codec;
using gradsync::shard::Optimizer;
using gradsync::shard::Options;
using gradsync::shard::ShardedParameter;
namespace comm = gradsync::comm;

namespace {

std::string unique_name(const char* what) {
  static std::atomic<int> counter{0};
  return std::string("shard_test_") + what + "_" + std::to_string(counter++);
}

// Runs body(comm, rank) on `ranks` threads of one group. Catch2 assertions are not thread-safe,
// so bodies record results and the test checks them afterwards; an exception escaping a body
// fails the test. Every wait is bounded by the communicator's timeout.
void run_ranks(int ranks, const std::function<void(comm::Communicator&, int)>& body) {
  const std::string name = unique_name("group");
  std::vector<std::exception_ptr> errors(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        comm::Options o;
        o.rank = r;
        o.size = ranks;
        o.name = name;
        o.timeout = std::chrono::milliseconds(20000);
        auto c = comm::create(o);
        body(*c, r);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// The status a call throws, or 0.
Options sgd(double lr) {
  Options o;
  o.optimizer = Optimizer::Sgd;
  o.lr = lr;
  return o;
}

}  // namespace

TEST_CASE("parts follow BigDL's partition rule, N < P included", "[shard]") {
  struct Case {
    uint64_t n;
    int p;
    std::vector<std::pair<uint64_t, uint64_t>> parts;
  };
  for (const Case& c : {Case{10, 3, {{0, 4}, {4, 3}, {7, 3}}}, Case{5, 3, {{0, 2}, {2, 2}, {4, 1}}},
                        Case{2, 3, {{0, 1}, {1, 1}, {2, 0}}}}) {
    std::vector<std::pair<uint64_t, uint64_t>> mine(static_cast<size_t>(c.p)), of_zero(static_cast<size_t>(c.p));
    run_ranks(c.p, [&](comm::Communicator& cm, int r) {
      ShardedParameter s(cm, c.n, sgd(1));
      mine[static_cast<size_t>(r)] = {s.part().start, s.part().len};
      if (r == 0)
        for (int j = 0; j < c.p; ++j) of_zero[static_cast<size_t>(j)] = {s.part_of(j).start, s.part_of(j).len};
    });
    CHECK(mine == c.parts);
    CHECK(of_zero == c.parts);
  }
}

TEST_CASE("BigDL acceptance: two ranks, weight 100, lr 1 -> 82 on both, in every codec and both APIs", "[shard]") {
  for (Codec codec : {Codec::None, Codec::BigdlFp16, Codec::Bf16, Codec::Fp16}) {
    for (bool staged : {false, true}) {
      INFO("codec " << gradsync::codec::codec_name(codec) << (staged ? " staged" : " step"));
      std::vector<float> after1(2), after2(2);
      run_ranks(2, [&](comm::Communicator& cm, int r) {
        Options o = sgd(1.0);
        o.compress = codec;
        ShardedParameter s(cm, 1, o);
        float w = 100.0f;
        s.init(&w, 1);
        const float g1 = r == 0 ? 2.0f : 4.0f, g2 = r == 0 ? 10.0f : 20.0f;
        auto one_step = [&](float g) {
          if (staged) {
            s.put(&g, 1, 1);
            s.aggregate();
            s.update();  // rank 1's part is empty (N < P): a no-op, but still a stage
            s.gather(&w, 1);
          } else {
            s.step(&g, 1, 1, &w, 1);
          }
        };
        one_step(g1);
        after1[static_cast<size_t>(r)] = w;
        one_step(g2);
        after2[static_cast<size_t>(r)] = w;
      });
      CHECK(after1 == std::vector<float>{97.0f, 97.0f});
      CHECK(after2 == std::vector<float>{82.0f, 82.0f});
    }
  }
}

TEST_CASE("weighted mean by sample counts, and a total count of 0 is an error on every rank", "[shard]") {
  std::vector<float> result(3);
  run_ranks(3, [&](comm::Communicator& cm, int r) {
    ShardedParameter s(cm, 4, sgd(1.0));
    std::vector<float> w(4, 0.0f);
    s.init(w.data(), 4);
    // Counts 1, 3, 0: gradient = (1*4 + 3*0 + 0*100) / 4 = 1.
    const float g_value = r == 0 ? 4.0f : r == 1 ? 0.0f : 100.0f;
    std::vector<float> g(4, g_value);
    const uint64_t samples = r == 0 ? 1 : r == 1 ? 3 : 0;
    s.step(g.data(), 4, samples, w.data(), 4);
    result[static_cast<size_t>(r)] = w[3];
  });
  CHECK(result == std::vector<float>{-1.0f, -1.0f, -1.0f});

  std::vector<int> statuses(2), staged(2);
  std::vector<float> untouched(2);
  run_ranks(2, [&](comm::Communicator& cm, int r) {
    ShardedParameter s(cm, 3, sgd(1.0));
    std::vector<float> w(3, 5.0f), g(3, 1.0f);
    s.init(w.data(), 3);
    statuses[static_cast<size_t>(r)] = status_of([&] { s.step(g.data(), 3, 0, w.data(), 3); });
    untouched[static_cast<size_t>(r)] = w[0];
    s.put(g.data(), 3, 0);
    staged[static_cast<size_t>(r)] = status_of([&] { s.aggregate(); });
  });
  CHECK(statuses == std::vector<int>{GRADSYNC_E_ZERO_WEIGHT, GRADSYNC_E_ZERO_WEIGHT});
  CHECK(staged == std::vector<int>{GRADSYNC_E_ZERO_WEIGHT, GRADSYNC_E_ZERO_WEIGHT});
  CHECK(untouched == std::vector<float>{5.0f, 5.0f});
}

TEST_CASE("gradient processors: clamp to [0,0] zeroes, L2 clipping scales by clip/norm", "[shard]") {
  std::vector<std::vector<float>> clamped(2), clipped(2), unclipped(2);
  const std::vector<float> g{0.3f, -0.4f, 1.2f, 0.0f, 5.0f};  // same on both ranks, so the mean is g
  double norm = 0;
  for (float x : g) norm += double(x) * x;
  norm = std::sqrt(norm);
  run_ranks(2, [&](comm::Communicator& cm, int r) {
    Options clamp = sgd(1.0);
    clamp.clamp = true;
    ShardedParameter a(cm, 5, clamp);
    std::vector<float> w(5, 1.0f);
    a.init(w.data(), 5);
    a.step(g.data(), 5, 1, w.data(), 5);
    clamped[static_cast<size_t>(r)] = w;

    Options clip = sgd(1.0);
    clip.clip_norm = 0.03;
    ShardedParameter b(cm, 5, clip);
    std::vector<float> w2(5, 0.0f);
    b.init(w2.data(), 5);
    b.step(g.data(), 5, 1, w2.data(), 5);
    clipped[static_cast<size_t>(r)] = w2;

    Options loose = sgd(1.0);
    loose.clip_norm = 100.0;  // norm below the threshold: unchanged
    ShardedParameter c(cm, 5, loose);
    std::vector<float> w3(5, 0.0f);
    c.init(w3.data(), 5);
    c.step(g.data(), 5, 1, w3.data(), 5);
    unclipped[static_cast<size_t>(r)] = w3;
  });
  CHECK(clamped[0] == std::vector<float>(5, 1.0f));
  CHECK(clamped[1] == clamped[0]);
  CHECK(clipped[1] == clipped[0]);
  for (size_t i = 0; i < 5; ++i) {
    CHECK(clipped[0][i] == Approx(-g[i] * 0.03 / norm).margin(1e-9));
    CHECK(unclipped[0][i] == -g[i]);
  }
}

TEST_CASE("compressed steps sum in f32 in rank order: same bits on every rank and every run", "[shard]") {
  const uint64_t n = 1001;
  const int ranks = 3;
  std::vector<std::vector<float>> grads(ranks, std::vector<float>(n));
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto& g : grads)
    for (auto& x : g) x = dist(rng);
  std::vector<float> exact_mean(n);
  for (size_t i = 0; i < n; ++i) exact_mean[i] = (grads[0][i] + grads[1][i] + grads[2][i]) / 3.0f;

  for (Codec codec : {Codec::None, Codec::Bf16, Codec::Fp16, Codec::BigdlFp16}) {
    for (bool feedback : {false, true}) {
      if (codec == Codec::None && feedback) continue;
      INFO("codec " << gradsync::codec::codec_name(codec) << " feedback " << feedback);
      std::vector<std::vector<float>> first(ranks), second(ranks);
      for (auto* out : {&first, &second}) {
        run_ranks(ranks, [&](comm::Communicator& cm, int r) {
          Options o = sgd(1.0);
          o.compress = codec;
          o.error_feedback = feedback;
          ShardedParameter s(cm, n, o);
          std::vector<float> w(n, 0.0f);
          s.init(w.data(), n);
          s.step(grads[static_cast<size_t>(r)].data(), n, 1, w.data(), n);
          (*out)[static_cast<size_t>(r)] = w;
        });
      }
      CHECK(first[1] == first[0]);
      CHECK(first[2] == first[0]);
      CHECK(second == first);
      // bf16 keeps 8 significant bits, half 11: the error of a mean of 3 is below one quantum.
      const double tol = codec == Codec::None ? 0.0 : codec == Codec::Fp16 ? 2e-3 : 1.6e-2;
      size_t far = 0;
      for (size_t i = 0; i < n; ++i)
        far += std::abs(first[0][i] + exact_mean[i]) > tol * std::max(1.0f, std::abs(exact_mean[i]));
      CHECK(far == 0);
    }
  }
}

TEST_CASE("error feedback makes compressed SGD track uncompressed SGD over many steps", "[shard]") {
  // A gradient of 0.001 + 1/3 per step: bf16 cannot represent it; with feedback the sum over
  // 200 steps is right to within one quantum, without it the rounding error accumulates.
  const float g = 1.0f / 3.0f + 0.001f;
  std::vector<float> with(2), without(2);
  for (bool feedback : {false, true}) {
    run_ranks(2, [&](comm::Communicator& cm, int r) {
      Options o = sgd(1.0);
      o.compress = Codec::Bf16;
      o.error_feedback = feedback;
      ShardedParameter s(cm, 2, o);
      std::vector<float> w(2, 0.0f), grad(2, g);
      s.init(w.data(), 2);
      for (int step = 0; step < 200; ++step) s.step(grad.data(), 2, 1, w.data(), 2);
      // Element 1 belongs to rank 1: its value came through rank 0's compressed gradient too.
      (feedback ? with : without)[static_cast<size_t>(r)] = w[1];
    });
  }
  const double exact = -200.0 * g;
  CHECK(std::abs(with[0] - exact) < 2e-3);
  CHECK(std::abs(without[0] - exact) > std::abs(with[0] - exact));
  CHECK(with[0] == with[1]);
}

TEST_CASE("optimizers match a single-process reference on the mean gradient", "[shard]") {
  const uint64_t n = 37;
  const int ranks = 3, steps = 5;
  std::vector<float> init(n);
  for (size_t i = 0; i < n; ++i) init[i] = std::sin(static_cast<float>(i));
  auto gradient = [&](int rank, int step, size_t i) {
    return std::cos(static_cast<float>(i * 7 + static_cast<size_t>(rank) * 3 + static_cast<size_t>(step)));
  };
  for (Optimizer opt : {Optimizer::Sgd, Optimizer::Momentum, Optimizer::Adam, Optimizer::AdamW}) {
    INFO("optimizer " << gradsync::shard::optimizer_name(opt));
    Options o;
    o.optimizer = opt;
    o.lr = 0.05;
    o.weight_decay = 0.01;
    std::vector<std::vector<float>> result(ranks);
    std::vector<uint64_t> optimizer_bytes(ranks);
    run_ranks(ranks, [&](comm::Communicator& cm, int r) {
      ShardedParameter s(cm, n, o);
      std::vector<float> w = init, g(n);
      s.init(w.data(), n);
      for (int t = 0; t < steps; ++t) {
        for (size_t i = 0; i < n; ++i) g[i] = gradient(r, t, i);
        s.step(g.data(), n, 1, w.data(), n);
      }
      result[static_cast<size_t>(r)] = w;
      optimizer_bytes[static_cast<size_t>(r)] = s.optimizer_bytes();
    });
    // Reference in double.
    std::vector<double> w(init.begin(), init.end()), m(n, 0.0), v(n, 0.0);
    for (int t = 0; t < steps; ++t) {
      for (size_t i = 0; i < n; ++i) {
        double g = 0;
        for (int r = 0; r < ranks; ++r) g += gradient(r, t, i);
        g /= ranks;
        switch (opt) {
          case Optimizer::Sgd: w[i] -= o.lr * (g + o.weight_decay * w[i]); break;
          case Optimizer::Momentum:
            m[i] = o.momentum * m[i] + g + o.weight_decay * w[i];
            w[i] -= o.lr * m[i];
            break;
          case Optimizer::Adam:
          case Optimizer::AdamW: {
            if (opt == Optimizer::Adam)
              g += o.weight_decay * w[i];
            else
              w[i] *= 1.0 - o.lr * o.weight_decay;
            m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
            v[i] = o.beta2 * v[i] + (1 - o.beta2) * g * g;
            const double mhat = m[i] / (1 - std::pow(o.beta1, t + 1)), vhat = v[i] / (1 - std::pow(o.beta2, t + 1));
            w[i] -= o.lr * mhat / (std::sqrt(vhat) + o.eps);
            break;
          }
        }
      }
    }
    CHECK(result[1] == result[0]);
    CHECK(result[2] == result[0]);
    for (size_t i = 0; i < n; ++i) CHECK(result[0][i] == Approx(w[i]).margin(1e-5));
    // ZeRO-1: each rank holds state for its 13 or 12 elements only.
    const uint64_t per_element = opt == Optimizer::Sgd ? 0 : opt == Optimizer::Momentum ? 4 : 8;
    CHECK(optimizer_bytes == std::vector<uint64_t>{13 * per_element, 12 * per_element, 12 * per_element});
  }
}

TEST_CASE("a local failure on one rank is an error on every rank, never a hang or a stale gradient", "[shard]") {
  SECTION("bad input to step on one rank") {
    std::vector<int> statuses(3);
    run_ranks(3, [&](comm::Communicator& cm, int r) {
      ShardedParameter s(cm, 6, sgd(1.0));
      std::vector<float> w(6, 1.0f), g(6, 1.0f);
      s.init(w.data(), 6);
      statuses[static_cast<size_t>(r)] = status_of([&] { s.step(r == 1 ? nullptr : g.data(), 6, 1, w.data(), 6); });
      // The group still works afterwards.
      s.step(g.data(), 6, 1, w.data(), 6);
    });
    CHECK(statuses == std::vector<int>{GRADSYNC_E_REMOTE, GRADSYNC_E_INVALID_ARG, GRADSYNC_E_REMOTE});
  }
  SECTION("a failed put is never replaced by the previous round's gradient") {
    std::vector<int> statuses(2), put_status(2);
    std::vector<float> weights(2);
    run_ranks(2, [&](comm::Communicator& cm, int r) {
      ShardedParameter s(cm, 2, sgd(1.0));
      std::vector<float> w(2, 0.0f), g(2, 1.0f);
      s.init(w.data(), 2);
      s.put(g.data(), 2, 1);
      s.aggregate();
      s.update();
      s.gather(w.data(), 2);
      // Round 2: rank 0's put fails (wrong length); its round-1 gradient must not be reused.
      put_status[static_cast<size_t>(r)] = status_of([&] { s.put(g.data(), r == 0 ? 1 : 2, 1); });
      statuses[static_cast<size_t>(r)] = status_of([&] { s.aggregate(); });
      // Round 3 works again, from fresh puts.
      s.put(g.data(), 2, 1);
      s.aggregate();
      s.update();
      s.gather(w.data(), 2);
      weights[static_cast<size_t>(r)] = w[r];
    });
    CHECK(put_status == std::vector<int>{GRADSYNC_E_INVALID_ARG, 0});
    CHECK(statuses == std::vector<int>{GRADSYNC_E_INVALID_ARG, GRADSYNC_E_REMOTE});
    CHECK(weights == std::vector<float>{-2.0f, -2.0f});
  }
  SECTION("aggregate without a fresh put, and update without aggregate") {
    std::vector<int> first(2), second(2), update_status(2), gather_status(2);
    run_ranks(2, [&](comm::Communicator& cm, int r) {
      ShardedParameter s(cm, 4, sgd(1.0));
      std::vector<float> w(4, 0.0f), g(4, 1.0f);
      s.init(w.data(), 4);
      if (r == 0) s.put(g.data(), 4, 1);
      first[static_cast<size_t>(r)] = status_of([&] { s.aggregate(); });
      s.put(g.data(), 4, 1);
      s.aggregate();
      s.update();
      second[static_cast<size_t>(r)] = status_of([&] { s.aggregate(); });  // consumed: no reuse
      update_status[static_cast<size_t>(r)] = status_of([&] {
        if (r == 1) s.update();
      });
      gather_status[static_cast<size_t>(r)] = status_of([&] { s.gather(w.data(), 4); });
    });
    CHECK(first == std::vector<int>{GRADSYNC_E_REMOTE, GRADSYNC_E_MISUSE});
    CHECK(second == std::vector<int>{GRADSYNC_E_MISUSE, GRADSYNC_E_MISUSE});
    CHECK(update_status == std::vector<int>{0, GRADSYNC_E_MISUSE});
    CHECK(gather_status == std::vector<int>{GRADSYNC_E_REMOTE, GRADSYNC_E_MISUSE});
  }
  SECTION("ranks in different stages or with different options disagree, and say so") {
    std::vector<int> stage(2), config(2), lr(2), lr_again(2);
    run_ranks(2, [&](comm::Communicator& cm, int r) {
      ShardedParameter s(cm, 4, sgd(1.0));
      std::vector<float> w(4, 0.0f), g(4, 1.0f);
      s.init(w.data(), 4);
      stage[static_cast<size_t>(r)] = status_of([&] {
        if (r == 0)
          s.step(g.data(), 4, 1, w.data(), 4);
        else
          s.gather(w.data(), 4);
      });
      Options o = sgd(1.0);
      o.compress = r == 0 ? Codec::Bf16 : Codec::None;
      ShardedParameter t(cm, 4, o);
      t.init(w.data(), 4);
      config[static_cast<size_t>(r)] = status_of([&] { t.step(g.data(), 4, 1, w.data(), 4); });
      // A learning rate changed on one rank only.
      ShardedParameter u(cm, 4, sgd(1.0));
      u.init(w.data(), 4);
      if (r == 1) u.set_lr(0.5);
      lr[static_cast<size_t>(r)] = status_of([&] { u.step(g.data(), 4, 1, w.data(), 4); });
      u.set_lr(0.5);
      lr_again[static_cast<size_t>(r)] = status_of([&] { u.step(g.data(), 4, 1, w.data(), 4); });
    });
    CHECK(stage == std::vector<int>{GRADSYNC_E_MISMATCH, GRADSYNC_E_MISMATCH});
    CHECK(config == std::vector<int>{GRADSYNC_E_MISMATCH, GRADSYNC_E_MISMATCH});
    CHECK(lr == std::vector<int>{GRADSYNC_E_MISMATCH, GRADSYNC_E_MISMATCH});
    CHECK(lr_again == std::vector<int>{0, 0});
  }
}

TEST_CASE("one rank needs no communication, options are validated", "[shard]") {
  run_ranks(1, [&](comm::Communicator& cm, int) {
    Options o;
    o.optimizer = Optimizer::Adam;
    o.compress = Codec::Fp16;
    ShardedParameter s(cm, 3, o);
    std::vector<float> w{1, 2, 3}, g{1, 1, 1};
    s.init(w.data(), 3);
    s.step(g.data(), 3, 1, w.data(), 3);
    if (std::abs(w[0] - (1 - 0.01f)) > 1e-6f) throw std::runtime_error("adam step on one rank is wrong");
  });
  run_ranks(1, [&](comm::Communicator& cm, int) {
    auto status = [&](Options o, uint64_t n = 3) { return status_of([&] { ShardedParameter s(cm, n, o); }); };
    Options o;
    if (status(o, 0) != GRADSYNC_E_INVALID_ARG) throw std::runtime_error("total 0 accepted");
    o.lr = -1;
    if (status(o) != GRADSYNC_E_INVALID_ARG) throw std::runtime_error("negative lr accepted");
    o.lr = 1e300;  // finite as a double, infinite as the kernels' float
    if (status(o) != GRADSYNC_E_INVALID_ARG) throw std::runtime_error("lr 1e300 accepted");
    o = Options{};
    o.clamp = true;
    o.clamp_min = 1;
    o.clamp_max = 0;
    if (status(o) != GRADSYNC_E_INVALID_ARG) throw std::runtime_error("empty clamp range accepted");
    o = Options{};
    o.beta2 = 1.0;
    if (status(o) != GRADSYNC_E_INVALID_ARG) throw std::runtime_error("beta2 1 accepted");
  });
}
