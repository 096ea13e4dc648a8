// SPDX-License-Identifier: Apache-2.0
#include "shard/sharded_parameter.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include <sys/mman.h>

#include "comm/call_signature.hpp"
#include "common/error.hpp"
#include "common/fnv.hpp"
#include "gradsync/errors.h"
#include "optim/optim.hpp"

namespace gradsync::shard {
namespace {

constexpr uint64_t kMaxSamples = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

const char* stage_name(int64_t stage) noexcept {
  switch (stage) {
    case 1: return "aggregate";
    case 2: return "gather";
    case 3: return "step";
  }
  return "an unknown stage";
}

// Collects the first local problem of a collective stage instead of throwing, so that the rank
// still joins the header exchange and the problem reaches every rank.
struct Problem {
  int status = GRADSYNC_OK;
  std::string message;
  template <class... Args>
  void require(bool cond, int s, fmt::format_string<Args...> format, Args&&... args) {
    if (!cond && status == GRADSYNC_OK) {
      status = s;
      message = fmt::format(format, std::forward<Args>(args)...);
    }
  }
};

// Sum of squares in double with a fixed association (8 running sums), so it vectorises and is
// still the same on every run.
double sum_of_squares(const float* x, size_t n) noexcept {
  double acc[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (size_t k = 0; k < 8; ++k) acc[k] += static_cast<double>(x[i + k]) * static_cast<double>(x[i + k]);
  for (size_t k = 0; i < n; ++i, ++k) acc[k] += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

constexpr size_t kHugePage = size_t{2} << 20;
}  // namespace

void* allocate_slice(size_t bytes) {
  if (bytes < 2 * kHugePage) {
    void* p = std::malloc(bytes == 0 ? 1 : bytes);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = std::aligned_alloc(kHugePage, rounded);
  if (p == nullptr) throw std::bad_alloc();
  madvise(p, rounded, MADV_HUGEPAGE);  // a hint: without huge pages the memory works the same
  return p;
}

void free_slice(void* p, size_t) noexcept { std::free(p); }

const char* optimizer_name(Optimizer o) noexcept {
  switch (o) {
    case Optimizer::Sgd: return "sgd";
    case Optimizer::Momentum: return "momentum";
    case Optimizer::Adam: return "adam";
    case Optimizer::AdamW: return "adamw";
  }
  return "unknown optimizer";
}

void validate(const Options& o) {
  auto finite = [](double x) { return optim::finite_in_float(x); };
  GS_REQUIRE(static_cast<int32_t>(o.optimizer) >= 0 && static_cast<int32_t>(o.optimizer) <= 3, GRADSYNC_E_INVALID_ARG,
             "unknown optimizer {} (0 sgd, 1 momentum, 2 adam, 3 adamw)", static_cast<int32_t>(o.optimizer));
  GS_REQUIRE(finite(o.lr) && o.lr >= 0, GRADSYNC_E_INVALID_ARG, "lr must be finite and >= 0, got {}", o.lr);
  GS_REQUIRE(finite(o.momentum) && o.momentum >= 0 && o.momentum < 1, GRADSYNC_E_INVALID_ARG,
             "momentum must be in [0, 1), got {}", o.momentum);
  GS_REQUIRE(finite(o.beta1) && o.beta1 >= 0 && o.beta1 < 1, GRADSYNC_E_INVALID_ARG, "beta1 must be in [0, 1), got {}",
             o.beta1);
  GS_REQUIRE(finite(o.beta2) && o.beta2 >= 0 && o.beta2 < 1, GRADSYNC_E_INVALID_ARG, "beta2 must be in [0, 1), got {}",
             o.beta2);
  GS_REQUIRE(finite(o.eps) && o.eps > 0, GRADSYNC_E_INVALID_ARG, "eps must be finite and > 0, got {}", o.eps);
  GS_REQUIRE(finite(o.weight_decay) && o.weight_decay >= 0, GRADSYNC_E_INVALID_ARG,
             "weight_decay must be finite and >= 0, got {}", o.weight_decay);
  if (o.clamp) {
    GS_REQUIRE(!std::isnan(o.clamp_min) && !std::isnan(o.clamp_max) && o.clamp_min <= o.clamp_max,
               GRADSYNC_E_INVALID_ARG, "clamp range [{}, {}] is empty", o.clamp_min, o.clamp_max);
  }
  GS_REQUIRE(finite(o.clip_norm) && o.clip_norm >= 0, GRADSYNC_E_INVALID_ARG,
             "clip_norm must be finite and >= 0 (0: off), got {}", o.clip_norm);
  GS_REQUIRE(o.replicas >= 0 && o.replicas <= 64, GRADSYNC_E_INVALID_ARG, "replicas must be in [0, 64], got {}",
             o.replicas);
}

ShardedParameter::ShardedParameter(comm::Communicator& comm, uint64_t total, const Options& options)
    : comm_(&comm),
      total_(total),
      options_(options),
      rank_(comm.rank()),
      size_(comm.size()),
      ring_(comm.topology(), comm.size()) {
  GS_REQUIRE(total > 0, GRADSYNC_E_INVALID_ARG, "total parameter count is 0");
  GS_REQUIRE(total <= (uint64_t{1} << 60) / static_cast<uint64_t>(size_), GRADSYNC_E_INVALID_ARG,
             "total parameter count {} is too large", total);
  validate(options_);
  part_ = part_of(rank_);
  const size_t len = part_.len;
  weights_.assign(len, 0.0f);
  if (options_.optimizer == Optimizer::Momentum) state1_.assign(len, 0.0f);
  if (options_.optimizer == Optimizer::Adam || options_.optimizer == Optimizer::AdamW) {
    state1_.assign(len, 0.0f);
    state2_.assign(len, 0.0f);
  }
  if (options_.compress != codec::Codec::None && options_.error_feedback) residual_.assign(total, 0.0f);
  replicas_.resize(static_cast<size_t>(replica_count()));
  for (int j = 1; j <= replica_count(); ++j) {
    const size_t n = part_of(ring_.behind(rank_, j)).len;
    Replica& r = replicas_[static_cast<size_t>(j - 1)];
    r.weights.assign(n, 0.0f);
    r.grad.assign(n, 0.0f);
    if (!state1_.empty()) r.state1.assign(n, 0.0f);
    if (!state2_.empty()) r.state2.assign(n, 0.0f);
  }
  size_buffers();
}

// Every buffer a step needs is allocated here, so nothing between two collectives can fail on
// one rank alone.
void ShardedParameter::size_buffers() {
  const size_t len = part_.len;
  grad_.assign(len, 0.0f);
  own_.clear();
  wire_out_.clear();
  wire_in_.clear();
  if (options_.compress == codec::Codec::None) {
    // Every use writes the whole gradient copy before reading it: one the size of the parameter
    // (after a reshard) is kept as it is rather than refilled.
    if (staging_.size() != total_) staging_.assign(total_, 0.0f);
  } else {
    staging_.clear();
    own_.assign(len, 0.0f);
    wire_out_.assign(total_, 0u);
    wire_in_.assign(len * static_cast<size_t>(size_), 0u);
  }
  size_t incoming = 0;
  for (const Replica& r : replicas_) incoming += r.weights.size();
  replica_recv_.assign(incoming, 0.0f);
  headers_.assign(static_cast<size_t>(size_), Header{});
  weights_of_ranks_.assign(static_cast<size_t>(size_), 0);
}

Part ShardedParameter::part_of(int rank) const noexcept {
  return partition(total_, static_cast<uint64_t>(size_), static_cast<uint64_t>(rank));
}

uint64_t ShardedParameter::optimizer_bytes() const noexcept {
  return (state1_.size() + state2_.size()) * sizeof(float);
}

uint64_t ShardedParameter::buffer_bytes() const noexcept {
  return (staging_.size() + own_.size() + residual_.size() + grad_.size()) * sizeof(float) +
         (wire_out_.size() + wire_in_.size()) * sizeof(uint16_t);
}

void ShardedParameter::set_lr(double lr) {
  GS_REQUIRE(optim::finite_in_float(lr) && lr >= 0, GRADSYNC_E_INVALID_ARG, "lr must be finite and >= 0, got {}", lr);
  options_.lr = lr;
}

void ShardedParameter::remember_failure(int status, std::string message) noexcept {
  if (pending_status_ != GRADSYNC_OK) return;  // the first failure is the cause
  pending_status_ = status;
  try {
    pending_message_ = std::move(message);
  } catch (...) {
  }
}

std::pair<int, std::string> ShardedParameter::take_failure() noexcept {
  std::pair<int, std::string> out{pending_status_, std::move(pending_message_)};
  pending_status_ = GRADSYNC_OK;
  pending_message_.clear();
  return out;
}

int64_t ShardedParameter::config_word() const noexcept {
  // Ranks must agree on everything that shapes the update, the learning rate included (set_lr is
  // local): the low bits name the discrete choices, the high bits hash the numbers (FNV-1a).
  const double numbers[] = {options_.lr,
                            options_.momentum,
                            options_.beta1,
                            options_.beta2,
                            options_.eps,
                            options_.weight_decay,
                            options_.clamp ? options_.clamp_min : 0.0,
                            options_.clamp ? options_.clamp_max : 0.0,
                            options_.clip_norm};
  const uint64_t hash = fnv1a64(numbers, sizeof numbers);
  const uint64_t choices = static_cast<uint64_t>(options_.compress) | (static_cast<uint64_t>(options_.optimizer) << 4) |
                           (static_cast<uint64_t>(options_.clamp) << 8) |
                           (static_cast<uint64_t>(options_.error_feedback) << 9) |
                           (static_cast<uint64_t>(options_.replicas & 0x7f) << 10);  // [0, 64]: 7 bits
  return static_cast<int64_t>(choices | (hash >> 25 << 17));
}

void ShardedParameter::init(const float* weights, size_t count) {
  try {
    GS_REQUIRE(weights != nullptr, GRADSYNC_E_INVALID_ARG, "weights buffer is NULL");
    GS_REQUIRE(count == total_, GRADSYNC_E_INVALID_ARG, "weights hold {} floats, the parameter has {}", count, total_);
  } catch (const Error& e) {
    remember_failure(e.status(), fmt::format("init failed: {}", e.what()));
    throw;
  }
  adopt(weights, nullptr, nullptr, 0);
}

void ShardedParameter::restore(const float* weights, const float* state1, const float* state2, size_t count,
                               int64_t updates) {
  try {
    const int states = optimizer_states();  // 0 SGD, 1 momentum, 2 Adam
    const char* name = optimizer_name(options_.optimizer);
    GS_REQUIRE(weights != nullptr, GRADSYNC_E_INVALID_ARG, "weights buffer is NULL");
    GS_REQUIRE(count == total_, GRADSYNC_E_INVALID_ARG, "weights hold {} floats, the parameter has {}", count, total_);
    GS_REQUIRE(updates >= 0, GRADSYNC_E_INVALID_ARG, "update count {} is negative", updates);
    GS_REQUIRE((state1 != nullptr) == (states >= 1), GRADSYNC_E_INVALID_ARG, "the optimizer ({}) {}", name,
               state1 == nullptr ? "keeps a first state, and it is NULL" : "keeps no first state, but one was given");
    GS_REQUIRE((state2 != nullptr) == (states >= 2), GRADSYNC_E_INVALID_ARG, "the optimizer ({}) {}", name,
               state2 == nullptr ? "keeps a second state, and it is NULL" : "keeps no second state, but one was given");
  } catch (const Error& e) {
    remember_failure(e.status(), fmt::format("restore failed: {}", e.what()));
    throw;
  }
  adopt(weights, state1, state2, updates);
}

int ShardedParameter::optimizer_states() const noexcept {
  switch (options_.optimizer) {
    case Optimizer::Sgd: return 0;
    case Optimizer::Momentum: return 1;
    case Optimizer::Adam:
    case Optimizer::AdamW: return 2;
  }
  return 0;
}

void ShardedParameter::adopt(const float* weights, const float* state1, const float* state2, int64_t updates) {
  // Each slice is its part of the full array, or zeros where no array was given.
  auto take = [](const float* full, const Part& at, SliceVector& into) {
    if (full == nullptr)
      std::fill(into.begin(), into.end(), 0.0f);
    else
      std::copy_n(full + at.start, into.size(), into.begin());
  };
  take(weights, part_, weights_);
  take(state1, part_, state1_);
  take(state2, part_, state2_);
  for (int j = 1; j <= replica_count(); ++j) {
    Replica& r = replicas_[static_cast<size_t>(j - 1)];
    const Part owner = part_of(ring_.behind(rank_, j));
    take(weights, owner, r.weights);
    take(state1, owner, r.state1);
    take(state2, owner, r.state2);
  }
  std::fill(residual_.begin(), residual_.end(), 0.0f);
  updates_ = updates;
  fresh_gradient_ = aggregated_ = false;
  // A fresh start: earlier local failures concerned the state this call replaces.
  take_failure();
  initialised_ = true;
}

void ShardedParameter::stage_gradient(const float* gradient) {
  if (options_.compress == codec::Codec::None) {
    std::copy_n(gradient, total_, staging_.begin());
    return;
  }
  // The parts that travel, encoded in place; this rank's own part stays in f32 and never travels.
  uint16_t* wire = wire_out_.data();
  const uint64_t start = part_.start, end = part_.start + part_.len;
  const codec::Codec c = options_.compress;
  if (options_.error_feedback) {
    codec::encode_with_feedback(c, gradient, start, residual_.data(), wire);
    codec::encode_with_feedback(c, gradient + end, total_ - end, residual_.data() + end, wire + end);
  } else {
    codec::encode(c, gradient, start, wire);
    codec::encode(c, gradient + end, total_ - end, wire + end);
  }
  std::copy_n(gradient + start, part_.len, own_.begin());
}

void ShardedParameter::put(const float* gradient, size_t count, uint64_t samples) {
  // A failed put must never leave the previous round's gradient looking fresh.
  fresh_gradient_ = false;
  try {
    GS_REQUIRE(initialised_, GRADSYNC_E_MISUSE, "put before init(): the parameter has no weights yet");
    GS_REQUIRE(gradient != nullptr, GRADSYNC_E_INVALID_ARG, "gradient buffer is NULL");
    GS_REQUIRE(count == total_, GRADSYNC_E_INVALID_ARG, "gradient holds {} floats, the parameter has {}", count,
               total_);
    GS_REQUIRE(samples <= kMaxSamples, GRADSYNC_E_INVALID_ARG, "sample count {} exceeds 2^63-1", samples);
    stage_gradient(gradient);
  } catch (const Error& e) {
    remember_failure(e.status(), fmt::format("rank {}: put failed: {}", rank_, e.what()));
    throw;
  }
  samples_ = samples;
  fresh_gradient_ = true;
}

void ShardedParameter::exchange(Stage stage, int status, const std::string& message, uint64_t samples) {
  const Header mine{static_cast<int64_t>(stage), status, static_cast<int64_t>(samples), static_cast<int64_t>(total_),
                    config_word()};
  // A group of one needs no exchange (and a transport may leave recv alone for size 1).
  if (size_ == 1)
    headers_[0] = mine;
  else
    comm_->allgather(&mine, headers_.data(), headers_.size() * kHeaderWords, DType::I64);
  if (status != GRADSYNC_OK) throw Error(status, message);
  for (int j = 0; j < size_; ++j) {
    const Header& h = headers_[static_cast<size_t>(j)];
    if (h.status != GRADSYNC_OK)
      fail(GRADSYNC_E_REMOTE, "rank {} failed before {}: {}", j, stage_name(h.stage),
           gradsync_status_string(static_cast<int>(h.status)));
  }
  for (int j = 0; j < size_; ++j) {
    const Header& h = headers_[static_cast<size_t>(j)];
    if (h.stage != mine.stage)
      fail(GRADSYNC_E_MISMATCH, "rank {} called {} while rank {} called {}", rank_, stage_name(mine.stage), j,
           stage_name(h.stage));
    if (h.total != mine.total)
      fail(GRADSYNC_E_MISMATCH, "rank {} has {} parameters, rank {} has {}", rank_, mine.total, j, h.total);
    if (h.config != mine.config)
      fail(GRADSYNC_E_MISMATCH,
           "rank {} and rank {} disagree on the options (codec, optimizer, error feedback, clamping, clipping, "
           "learning rate or another optimizer parameter)",
           rank_, j);
    weights_of_ranks_[static_cast<size_t>(j)] = static_cast<uint64_t>(h.samples);
  }
}

void ShardedParameter::reduce(const float* gradient) {
  // Weights are identical on every rank (they came from the same exchange), so every rank takes
  // the same branch and joins the same collectives.
  uint64_t total_samples = 0;
  bool equal = true;
  for (uint64_t w : weights_of_ranks_) {
    GS_REQUIRE(total_samples <= kMaxSamples - w, GRADSYNC_E_INVALID_ARG, "sample counts overflow 2^63-1 in total");
    total_samples += w;
    equal = equal && w == weights_of_ranks_[0];
  }
  GS_REQUIRE(total_samples > 0, GRADSYNC_E_ZERO_WEIGHT, "total sample count over {} ranks is 0: nothing to average",
             size_);
  auto share = [&](int j) {
    return static_cast<float>(static_cast<double>(weights_of_ranks_[static_cast<size_t>(j)]) /
                              static_cast<double>(total_samples));
  };
  const size_t len = part_.len;
  float* out = grad_.data();
  const float ranks = static_cast<float>(size_);

  if (options_.compress == codec::Codec::None) {
    const float* send = gradient;
    if (!equal) {
      const float s = share(rank_);
      for (size_t i = 0; i < total_; ++i) staging_[i] = s * gradient[i];
      send = staging_.data();
    }
    if (size_ == 1)
      std::copy_n(send, total_, out);
    else
      comm_->reduce_scatter(send, out, total_, DType::F32, ReduceOp::Sum);
  } else {
    // Each rank receives only its own part from every peer: (P-1)/P of N halves, half the bytes
    // of the uncompressed reduce-scatter.
    if (size_ > 1) comm_->alltoall(wire_out_.data(), wire_in_.data(), total_, DType::BF16);
    // Decode and sum in rank order, in f32, rounding once per add and never to 16 bits.
    std::fill(grad_.begin(), grad_.end(), 0.0f);
    for (int j = 0; j < size_; ++j) {
      const float s = equal ? 1.0f : share(j);
      if (!equal && weights_of_ranks_[static_cast<size_t>(j)] == 0) continue;
      if (j == rank_) {
        for (size_t i = 0; i < len; ++i) out[i] += s * own_[i];
        continue;
      }
      const uint16_t* block = wire_in_.data() + static_cast<size_t>(j) * len;
      if (equal)
        codec::accumulate(options_.compress, block, len, out);
      else
        codec::accumulate_scaled(options_.compress, block, len, s, out);
    }
  }
  if (equal)
    for (size_t i = 0; i < len; ++i) out[i] /= ranks;
}

void ShardedParameter::process_gradient() {
  float* g = grad_.data();
  const size_t len = part_.len;
  if (options_.clamp) {
    const float lo = static_cast<float>(options_.clamp_min), hi = static_cast<float>(options_.clamp_max);
    for (size_t i = 0; i < len; ++i) g[i] = std::min(std::max(g[i], lo), hi);
  }
  if (options_.clip_norm > 0) {
    // The norm needs every part: an allreduce of the parts' sums of squares, in rank order.
    double sum = sum_of_squares(g, len);
    const comm::BufferRef ref{&sum, &sum, 1};
    if (size_ > 1) comm_->allreduce(std::span<const comm::BufferRef>(&ref, 1), DType::F64, ReduceOp::Sum);
    const double norm = std::sqrt(sum);
    if (norm > options_.clip_norm) {
      const double scale = options_.clip_norm / norm;
      for (size_t i = 0; i < len; ++i) g[i] = static_cast<float>(static_cast<double>(g[i]) * scale);
    }
  }
}

namespace {
void run_optimizer(const Options& o, int64_t updates, float* w, const float* g, float* s1, float* s2, size_t len) {
  const float lr = static_cast<float>(o.lr), wd = static_cast<float>(o.weight_decay);
  switch (o.optimizer) {
    case Optimizer::Sgd: optim::sgd(w, g, len, lr, wd); break;
    case Optimizer::Momentum: optim::momentum_sgd(w, g, s1, len, lr, wd, static_cast<float>(o.momentum)); break;
    case Optimizer::Adam:
    case Optimizer::AdamW: {
      const double t = static_cast<double>(updates + 1);
      const double bc1 = 1.0 - std::pow(o.beta1, t), bc2 = 1.0 - std::pow(o.beta2, t);
      const bool decoupled = o.optimizer == Optimizer::AdamW;
      optim::adam(w, g, s1, s2, len, static_cast<float>(o.lr / bc1), static_cast<float>(1.0 / std::sqrt(bc2)),
                  static_cast<float>(o.eps), static_cast<float>(o.beta1), static_cast<float>(o.beta2),
                  decoupled ? 0.0f : wd, decoupled ? static_cast<float>(1.0 - o.lr * o.weight_decay) : 1.0f);
      break;
    }
  }
}
}  // namespace

void ShardedParameter::apply_optimizer() {
  run_optimizer(options_, updates_, weights_.data(), grad_.data(), state1_.data(), state2_.data(), part_.len);
  // The replicas take the same update from the gradient their owners sent (replicate_gradient):
  // the same operations on the same values, so the same bits as the owners' slices.
  for (Replica& r : replicas_) {
    run_optimizer(options_, updates_, r.weights.data(), r.grad.data(), r.state1.data(), r.state2.data(),
                  r.weights.size());
  }
  ++updates_;
}

void ShardedParameter::replicate_gradient() {
  const int k = replica_count();
  if (k == 0) return;
  const auto n = static_cast<uint64_t>(size_);
  // Every rank knows every rank's routes (rank s sends its slice to the k ranks ahead of it on the
  // ring, each keeping them in that order): the exchange needs no round to agree on them (its own
  // round checks they match).
  comm::Routes routes(comm::Collective::Alltoall, -1, n);
  for (int d = 0; d < size_; ++d) {
    uint64_t at = 0;
    for (int j = 1; j <= k; ++j) {
      const int s = ring_.behind(d, j);
      const size_t route = routes.at(static_cast<uint64_t>(s), static_cast<uint64_t>(d));
      routes.count[route] = part_of(s).len;
      routes.recv_displ[route] = at;
      at += part_of(s).len;
    }
  }
  comm_->exchange(grad_.data(), replica_recv_.data(), routes, DType::F32);
  // Taken only once the exchange succeeded on every rank (the round is decided for all): a failed
  // one leaves every replica as it was, at the owners' last completed step.
  for (int j = 1; j <= k; ++j) {
    const int from = ring_.behind(rank_, j);
    const size_t route = routes.at(static_cast<uint64_t>(from), static_cast<uint64_t>(rank_));
    std::copy_n(replica_recv_.begin() + static_cast<std::ptrdiff_t>(routes.recv_displ[route]), routes.count[route],
                replicas_[static_cast<size_t>(j - 1)].grad.begin());
  }
}

void ShardedParameter::aggregate() {
  Problem p;
  auto [pending, pending_message] = take_failure();
  p.require(pending == GRADSYNC_OK, pending, "{}", pending_message);
  p.require(initialised_, GRADSYNC_E_MISUSE, "rank {}: aggregate before init()", rank_);
  p.require(fresh_gradient_, GRADSYNC_E_MISUSE,
            "rank {}: no fresh gradient: put() was not called (or failed) since the last aggregate", rank_);
  p.require(!aggregated_, GRADSYNC_E_MISUSE,
            "rank {}: the previous aggregated gradient was not applied (call update() or write_weights())", rank_);
  // The staged gradient is consumed whatever happens next: it can never be reused by a later round.
  fresh_gradient_ = false;
  exchange(Stage::Aggregate, p.status, p.message, samples_);
  reduce(staging_.empty() ? nullptr : staging_.data());
  process_gradient();
  replicate_gradient();
  aggregated_ = true;
}

void ShardedParameter::update() {
  if (!aggregated_) {
    const std::string message =
        fmt::format("rank {}: update without an aggregated gradient (call put() and aggregate() first)", rank_);
    remember_failure(GRADSYNC_E_MISUSE, message);
    throw Error(GRADSYNC_E_MISUSE, message);
  }
  apply_optimizer();
  aggregated_ = false;
}

void ShardedParameter::write_weights(const float* slice, size_t count) {
  try {
    GS_REQUIRE(initialised_, GRADSYNC_E_MISUSE, "write_weights before init()");
    GS_REQUIRE(replica_count() == 0, GRADSYNC_E_UNSUPPORTED,
               "write_weights with replicas: the replicas follow the library's optimizer; use update()");
    GS_REQUIRE(slice != nullptr || count == 0, GRADSYNC_E_INVALID_ARG, "weight slice buffer is NULL");
    GS_REQUIRE(count == part_.len, GRADSYNC_E_INVALID_ARG, "weight slice holds {} floats, rank {} owns {}", count,
               rank_, part_.len);
  } catch (const Error& e) {
    remember_failure(e.status(), fmt::format("rank {}: write_weights failed: {}", rank_, e.what()));
    throw;
  }
  std::copy_n(slice, count, weights_.begin());
  if (aggregated_) ++updates_;
  aggregated_ = false;
}

void ShardedParameter::read_slice(Slice which, float* out, size_t count) const {
  const int index = which == Slice::State1 ? 1 : which == Slice::State2 ? 2 : 0;
  GS_REQUIRE(index <= optimizer_states(), GRADSYNC_E_INVALID_ARG, "the optimizer ({}) keeps no {} state",
             optimizer_name(options_.optimizer), index == 1 ? "first" : "second");
  GS_REQUIRE(out != nullptr || count == 0, GRADSYNC_E_INVALID_ARG, "output buffer is NULL");
  GS_REQUIRE(count == part_.len, GRADSYNC_E_INVALID_ARG, "output holds {} floats, rank {} owns {}", count, rank_,
             part_.len);
  const SliceVector& slice = which == Slice::Weights ? weights_ : index == 1 ? state1_ : state2_;
  std::copy_n(which == Slice::Gradient ? grad_.data() : slice.data(), count, out);
}

void ShardedParameter::publish(float* weights) {
  if (size_ == 1)
    std::copy(weights_.begin(), weights_.end(), weights);
  else
    comm_->allgather(weights_.data(), weights, total_, DType::F32);
}

void ShardedParameter::gather(float* weights, size_t count) {
  Problem p;
  auto [pending, pending_message] = take_failure();
  p.require(pending == GRADSYNC_OK, pending, "{}", pending_message);
  p.require(initialised_, GRADSYNC_E_MISUSE, "rank {}: gather before init()", rank_);
  p.require(weights != nullptr, GRADSYNC_E_INVALID_ARG, "rank {}: weights buffer is NULL", rank_);
  p.require(count == total_, GRADSYNC_E_INVALID_ARG, "rank {}: weights hold {} floats, the parameter has {}", rank_,
            count, total_);
  p.require(!aggregated_, GRADSYNC_E_MISUSE,
            "rank {}: the aggregated gradient was not applied: call update() or write_weights() before gather()",
            rank_);
  exchange(Stage::Gather, p.status, p.message, 0);
  publish(weights);
}

void ShardedParameter::step(const float* gradient, size_t gradient_count, uint64_t samples, float* weights,
                            size_t weights_count) {
  Problem p;
  auto [pending, pending_message] = take_failure();
  p.require(pending == GRADSYNC_OK, pending, "{}", pending_message);
  p.require(initialised_, GRADSYNC_E_MISUSE, "rank {}: step before init()", rank_);
  p.require(gradient != nullptr, GRADSYNC_E_INVALID_ARG, "rank {}: gradient buffer is NULL", rank_);
  p.require(gradient_count == total_, GRADSYNC_E_INVALID_ARG, "rank {}: gradient holds {} floats, the parameter has {}",
            rank_, gradient_count, total_);
  p.require(weights != nullptr, GRADSYNC_E_INVALID_ARG, "rank {}: weights buffer is NULL", rank_);
  p.require(weights_count == total_, GRADSYNC_E_INVALID_ARG, "rank {}: weights hold {} floats, the parameter has {}",
            rank_, weights_count, total_);
  p.require(samples <= kMaxSamples, GRADSYNC_E_INVALID_ARG, "rank {}: sample count {} exceeds 2^63-1", rank_, samples);
  p.require(!aggregated_, GRADSYNC_E_MISUSE,
            "rank {}: the aggregated gradient was not applied (call update() or write_weights())", rank_);
  // step brings its own gradient: an earlier put is superseded, never used later.
  fresh_gradient_ = false;
  if (p.status == GRADSYNC_OK && options_.compress != codec::Codec::None) stage_gradient(gradient);
  exchange(Stage::Step, p.status, p.message, samples);
  reduce(gradient);
  process_gradient();
  replicate_gradient();
  apply_optimizer();
  publish(weights);
}

namespace {
// One stretch of elements that moves in a reshard: [start, start + len) of the flat parameter,
// from old slice `slice` (held by member src) to member dst, into the range dst keeps as its
// `range`-th (0: its new slice, j: its replica of the new ring's behind(dst, j)).
struct Piece {
  int src, dst, range, slice;
  uint64_t start, len;
};
}  // namespace

ShardedParameter::ReshardReport ShardedParameter::reshard(comm::Communicator& next) {
  enum : size_t { kOldRank, kOldSize, kTotal, kConfig, kUpdates, kReady, kOnNext, kRing, kWords };
  const int np = next.size(), me = next.rank();
  const auto n = static_cast<size_t>(np);
  // A joiner of a grown group: made on next and never initialised. It holds no old rank, and
  // takes the old group's size and step from the members.
  const bool joiner = comm_ == &next && !initialised_;
  const int64_t mine[kWords] = {joiner ? -1 : rank_,          joiner ? 0 : size_,
                                static_cast<int64_t>(total_), config_word(),
                                joiner ? -1 : updates_,       initialised_ ? 1 : 0,
                                comm_ == &next ? 1 : 0,       static_cast<int64_t>(ring_.fingerprint())};
  std::vector<int64_t> all(kWords * n);
  if (np == 1)
    std::copy_n(mine, kWords, all.begin());
  else
    next.allgather(mine, all.data(), all.size(), DType::I64);
  auto word = [&](int r, size_t w) { return all[static_cast<size_t>(r) * kWords + w]; };
  auto is_joiner = [&](int r) { return word(r, kOldRank) == -1 && word(r, kReady) == 0; };
  // The members' old size and step, from the first that held the parameter (every member sees the
  // same table, so every member reaches the same verdict).
  int held_by = 0;
  while (held_by < np && is_joiner(held_by)) ++held_by;
  GS_REQUIRE(held_by < np, GRADSYNC_E_MISUSE,
             "reshard: no member of the new group holds the parameter (every one is a joiner with a shard never "
             "initialised)");
  // A joiner computes the old parts as the members do; if the reshard fails it is as it was.
  struct Restore {
    ShardedParameter& p;
    int size;
    int64_t updates;
    bool armed;
    ~Restore() {
      if (armed) {
        p.size_ = size;
        p.updates_ = updates;
      }
    }
  } restore{*this, size_, updates_, joiner};
  if (joiner) {
    size_ = static_cast<int>(word(held_by, kOldSize));
    updates_ = word(held_by, kUpdates);
  }
  // A member that brings the parameter from the old group: then one that made and initialised its
  // shard on the new group is a joiner that initialised too early, not a member of the old group.
  bool from_old = false;
  for (int r = 0; r < np; ++r) from_old = from_old || (word(r, kReady) == 1 && word(r, kOnNext) == 0);
  for (int r = 0; r < np; ++r) {
    GS_REQUIRE(!from_old || word(r, kOnNext) == 0 || word(r, kReady) == 0, GRADSYNC_E_MISUSE,
               "reshard: member {} of the new group initialised its shard (gradsync_shard_init) on the new group "
               "before this reshard: a joiner must not initialise its shard before the reshard, which brings it "
               "the members' weights and step",
               r);
  }
  for (int r = 0; r < np; ++r) {
    GS_REQUIRE(word(r, kTotal) == static_cast<int64_t>(total_) && word(r, kConfig) == config_word(),
               GRADSYNC_E_MISMATCH,
               "reshard: member {} of the new group holds another parameter ({} parameters, or other options) than "
               "member {} ({} parameters)",
               r, word(r, kTotal), me, total_);
    if (is_joiner(r)) continue;
    GS_REQUIRE(word(r, kOldSize) == size_, GRADSYNC_E_MISMATCH,
               "reshard: member {} of the new group was in a group of {}, member {} in one of {}", r, word(r, kOldSize),
               joiner ? held_by : me, size_);
    GS_REQUIRE(word(r, kReady) == 1, GRADSYNC_E_MISUSE, "reshard: member {} of the new group has no weights (init)", r);
    GS_REQUIRE(word(r, kUpdates) == updates_, GRADSYNC_E_MISMATCH,
               "reshard: member {} has applied {} updates, member {} {}: they are at different steps", r,
               word(r, kUpdates), joiner ? held_by : me, updates_);
    GS_REQUIRE(word(r, kOldRank) >= 0 && word(r, kOldRank) < size_, GRADSYNC_E_MISMATCH,
               "reshard: member {} was rank {} of a group of {}", r, word(r, kOldRank), size_);
    GS_REQUIRE(word(r, kRing) == word(held_by, kRing), GRADSYNC_E_MISMATCH,
               "reshard: members {} and {} placed their replicas on different rings (different old groups)", r,
               held_by);
    for (int q = 0; q < r; ++q) {
      GS_REQUIRE(is_joiner(q) || word(q, kOldRank) != word(r, kOldRank), GRADSYNC_E_MISMATCH,
                 "reshard: members {} and {} both held old rank {}", q, r, word(r, kOldRank));
    }
  }
  // Who holds each old slice: its owner if it survived, else the first member (in new rank order)
  // with a replica of it.
  const int old_k = replica_count();
  auto old_rank_of = [&](int r) { return static_cast<int>(word(r, kOldRank)); };
  std::vector<int> source(static_cast<size_t>(size_), -1);
  for (int r = 0; r < np; ++r) {
    if (!is_joiner(r)) source[static_cast<size_t>(old_rank_of(r))] = r;
  }
  ReshardReport report;
  // Where the lost slices' replicas are: on the old group's ring, which only members hold; joiners
  // get it from the first member when they need it (every rank sees the same words, so all or none
  // take part in the broadcast).
  bool joiners = false, gaps = false;
  for (int r = 0; r < np; ++r) joiners = joiners || is_joiner(r);
  for (int j = 0; j < size_; ++j) gaps = gaps || source[static_cast<size_t>(j)] < 0;
  const auto from_first_member = [&](int64_t* words, size_t count) {
    next.broadcast(words, count, DType::I64, held_by);
  };
  const comm::ReplicaRing old_ring =
      joiners && gaps ? comm::ReplicaRing::broadcast(from_first_member, ring_, size_, me == held_by) : ring_;
  for (int j = 0; j < size_; ++j) {
    if (source[static_cast<size_t>(j)] >= 0) continue;
    report.lost_old_ranks.push_back(j);
    for (int r = 0; r < np && source[static_cast<size_t>(j)] < 0; ++r) {
      if (is_joiner(r)) continue;
      const int behind = old_ring.distance(old_rank_of(r), j);
      if (behind >= 1 && behind <= old_k) source[static_cast<size_t>(j)] = r;
    }
  }
  std::vector<std::string> lost;
  for (int j : report.lost_old_ranks) {
    if (source[static_cast<size_t>(j)] >= 0) continue;
    const Part p = part_of(j);
    lost.push_back(fmt::format("old rank {}'s [{}, {})", j, p.start, p.start + p.len));
  }
  if (!lost.empty()) {
    fail(GRADSYNC_E_LOST,
         "reshard: the state of {} lived only on lost ranks (replicas = {}); nothing was changed: restore it from a "
         "checkpoint (gradsync_shard_init with saved weights) or keep replicas",
         fmt::join(lost, ", "), options_.replicas);
  }

  // What every member keeps in the new group, and where each stretch of it comes from.
  const int new_k = std::min(options_.replicas, np - 1);
  auto new_part = [&](int r) { return partition(total_, n, static_cast<uint64_t>(r)); };
  const comm::ReplicaRing next_ring(next.topology(), np);
  auto kept = [&](int d, int range) { return new_part(next_ring.behind(d, range)); };
  std::vector<Piece> pieces;
  for (int d = 0; d < np; ++d) {
    for (int range = 0; range <= new_k; ++range) {
      const Part want = kept(d, range);
      for (int j = 0; j < size_; ++j) {
        const Part have = part_of(j);
        const uint64_t lo = std::max(want.start, have.start),
                       hi = std::min(want.start + want.len, have.start + have.len);
        if (lo < hi) pieces.push_back({source[static_cast<size_t>(j)], d, range, j, lo, hi - lo});
      }
    }
  }
  const size_t f = state_arrays();
  // The arrays this member keeps: g = range * f + a (a: weights, state1, state2).
  const size_t arrays = static_cast<size_t>(new_k + 1) * f;
  std::vector<SliceVector> fresh(arrays);
  for (int range = 0; range <= new_k; ++range) {
    for (size_t a = 0; a < f; ++a) fresh[static_cast<size_t>(range) * f + a].resize(kept(me, range).len);
  }
  // What stays with its holder is copied in place; the rest travels in one exchange per kept
  // array, so that it lands straight in its fresh array: a transfer touches its destination once,
  // and the reshard needs no memory beyond the fresh arrays. Every member derives every member's routes from the table
  // all of them hold, so the exchanges need no round to agree on them (the round still checks that they match). A
  // member's pieces of one range from one source arrive in piece order, the order of the flat parameter: they land in
  // place when each source's pieces tile one stretch of the range (always, unless a source holds two old slices that
  // are not neighbours and the range spans both); otherwise that range goes through a receive buffer. A source's send
  // buffer is in the group's own memory, so that on shared memory the peers read it directly (one copy) instead of
  // through the staging chunks: packed by array, then destination, then piece order.
  const auto ranges = static_cast<size_t>(new_k + 1);
  auto pair = [&](size_t range, int s, int d) {
    return (range * n + static_cast<size_t>(s)) * n + static_cast<size_t>(d);
  };
  // For every range and pair (s, d): the floats s sends d, and where they begin in d's range.
  std::vector<uint64_t> count(ranges * n * n, 0), first(ranges * n * n, ~uint64_t{0});
  std::vector<char> in_place(ranges * n, 1);  // [range * n + d]
  {
    std::vector<uint64_t> next_at(ranges * n * n, ~uint64_t{0});
    for (const Piece& p : pieces) {
      if (p.src == p.dst) continue;
      const auto range = static_cast<size_t>(p.range);
      const size_t k = pair(range, p.src, p.dst);
      const uint64_t off = p.start - kept(p.dst, p.range).start;
      if (next_at[k] == ~uint64_t{0}) {
        first[k] = off;
      } else if (next_at[k] != off) {
        in_place[range * n + static_cast<size_t>(p.dst)] = 0;
      }
      next_at[k] = off + p.len;
      count[k] += p.len;
    }
  }
  // Where (g, d)'s floats begin in member s's send buffer, and the buffer's length.
  std::vector<uint64_t> send_at(n * arrays * n, 0), send_len(n, 0);
  for (int s = 0; s < np; ++s) {
    uint64_t at = 0;
    for (size_t g = 0; g < arrays; ++g) {
      for (int d = 0; d < np; ++d) {
        send_at[(static_cast<size_t>(s) * arrays + g) * n + static_cast<size_t>(d)] = at;
        at += count[pair(g / f, s, d)];
      }
    }
    send_len[static_cast<size_t>(s)] = at;
  }
  const size_t send_total = send_len[static_cast<size_t>(me)];
  // The arrays of old slice j here: this rank's own, or its replica of j.
  auto held = [&](int j, size_t a) -> const float* {
    const int behind = ring_.distance(rank_, j);
    if (behind == 0) return a == 0 ? weights_.data() : a == 1 ? state1_.data() : state2_.data();
    const Replica& r = replicas_[static_cast<size_t>(behind - 1)];
    return a == 0 ? r.weights.data() : a == 1 ? r.state1.data() : r.state2.data();
  };
  struct GroupMemory {
    comm::Communicator& c;
    float* p;
    ~GroupMemory() {
      try {
        if (p != nullptr) c.dealloc(p);
      } catch (...) {
      }
    }
  } send{next, send_total > 0 ? static_cast<float*>(next.alloc(send_total * sizeof(float))) : nullptr};
  {
    std::vector<uint64_t> at(send_at.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(me) * arrays * n),
                             send_at.begin() + static_cast<std::ptrdiff_t>((static_cast<size_t>(me) + 1) * arrays * n));
    for (const Piece& p : pieces) {
      if (p.src != me) continue;
      const uint64_t off = p.start - part_of(p.slice).start;
      for (size_t a = 0; a < f; ++a) {
        const size_t g = static_cast<size_t>(p.range) * f + a;
        if (p.dst == me) {
          std::copy_n(held(p.slice, a) + off, p.len,
                      fresh[g].begin() + static_cast<std::ptrdiff_t>(p.start - kept(me, p.range).start));
          continue;
        }
        uint64_t& to = at[g * n + static_cast<size_t>(p.dst)];
        std::copy_n(held(p.slice, a) + off, p.len, send.p + to);
        to += p.len;
      }
    }
  }
  for (size_t g = 0; np > 1 && g < arrays; ++g) {
    const size_t range = g / f;
    comm::Routes routes(comm::Collective::Alltoall, -1, n);
    for (int s = 0; s < np; ++s) {
      for (int d = 0; d < np; ++d) {
        const size_t k = routes.at(static_cast<uint64_t>(s), static_cast<uint64_t>(d));
        routes.count[k] = count[pair(range, s, d)];
        routes.send_displ[k] = send_at[(static_cast<size_t>(s) * arrays + g) * n + static_cast<size_t>(d)];
        if (in_place[range * n + static_cast<size_t>(d)]) {
          routes.recv_displ[k] = routes.count[k] > 0 ? first[pair(range, s, d)] : 0;
        } else {
          uint64_t before = 0;
          for (int q = 0; q < s; ++q) before += count[pair(range, q, d)];
          routes.recv_displ[k] = before;
        }
      }
    }
    if (in_place[range * n + static_cast<size_t>(me)]) {
      next.exchange(send.p, fresh[g].data(), routes, DType::F32);
      continue;
    }
    uint64_t total = 0;
    for (int s = 0; s < np; ++s) total += count[pair(range, s, me)];
    SliceVector recv(total);
    next.exchange(send.p, recv.data(), routes, DType::F32);
    std::vector<uint64_t> at(n, 0);
    for (int s = 0; s < np; ++s)
      at[static_cast<size_t>(s)] = routes.recv_displ[routes.at(static_cast<uint64_t>(s), static_cast<uint64_t>(me))];
    for (const Piece& p : pieces) {
      if (p.dst != me || p.src == me || static_cast<size_t>(p.range) != range) continue;
      uint64_t& from = at[static_cast<size_t>(p.src)];
      std::copy_n(recv.begin() + static_cast<std::ptrdiff_t>(from), p.len,
                  fresh[g].begin() + static_cast<std::ptrdiff_t>(p.start - kept(me, p.range).start));
      from += p.len;
    }
  }
  for (const Piece& p : pieces) {
    if (p.dst == me && p.src != me) report.moved_floats += p.len * f;
  }
  // Everything arrived on every member: switch to the new group.
  restore.armed = false;
  initialised_ = true;
  comm_ = &next;
  rank_ = me;
  size_ = np;
  ring_ = next_ring;
  part_ = part_of(rank_);
  auto take = [&](int range, size_t a) { return std::move(fresh[static_cast<size_t>(range) * f + a]); };
  weights_ = take(0, 0);
  if (f > 1) state1_ = take(0, 1);
  if (f > 2) state2_ = take(0, 2);
  replicas_.assign(static_cast<size_t>(new_k), Replica{});
  for (int range = 1; range <= new_k; ++range) {
    Replica& r = replicas_[static_cast<size_t>(range - 1)];
    r.weights = take(range, 0);
    if (f > 1) r.state1 = take(range, 1);
    if (f > 2) r.state2 = take(range, 2);
    r.grad.assign(r.weights.size(), 0.0f);
  }
  size_buffers();
  fresh_gradient_ = aggregated_ = false;
  take_failure();
  return report;
}

}  // namespace gradsync::shard
