// SPDX-License-Identifier: Apache-2.0
// C shims of the sharded parameter (include/gradsync/shard.h).
#include <cstring>
#include <limits>
#include <memory>

#include "capi/comm_handle.hpp"
#include "capi/guard.hpp"
#include "capi/options.hpp"
#include "comm/communicator.hpp"
#include "gradsync/shard.h"
#include "shard/sharded_parameter.hpp"

// The shard holds its communicator's link, not the communicator: the parameter below keeps a
// reference to the communicator, used only by the collective stages, and those run inside a
// CommLink::Call, which fails with GRADSYNC_E_MISUSE once gradsync_comm_free has destroyed it
// (and while another thread is in a call on it).
struct gradsync_shard : gradsync::capi::Handle<gradsync::capi::Kind::Shard> {
  gradsync_shard(std::shared_ptr<gradsync::capi::CommLink> l, uint64_t total, const gradsync::shard::Options& options)
      : link(std::move(l)), impl(link->communicator(), total, options) {}
  // A shard is its communicator's: in a forked child it is refused as the communicator is.
  void require_this_process() const { link->require_this_process(); }
  std::shared_ptr<gradsync::capi::CommLink> link;
  gradsync::shard::ShardedParameter impl;
};

namespace {
using gradsync::capi::check;
using gradsync::capi::CommLink;
using gradsync::capi::guard;

// The body of a collective stage: it runs the communicator, so it holds the communicator's
// in-call bit like the communicator's own entry points do, and runs in order with the
// communicator's pending non-blocking calls.
template <class F>
int with_comm(const char* function, gradsync_shard* shard, F&& body) noexcept {
  return guard(function, [&] {
    auto* s = check(shard);
    CommLink::run_in_order(s->link, function, [&] { body(s->impl); });
  });
}

constexpr size_t kOptionsV1Size = offsetof(gradsync_shard_options, clip_norm) + sizeof(double);

gradsync_shard_options default_options() {
  gradsync_shard_options o = GRADSYNC_SHARD_OPTIONS_INIT;
  return o;
}

gradsync::shard::Options parse_options(const gradsync_shard_options* user) {
  const gradsync_shard_options o =
      user == nullptr ? default_options()
                      : gradsync::capi::read_options(user, default_options(), kOptionsV1Size, "options");
  gradsync::shard::Options out;
  // Version 1 had its own numbering, where 1 was momentum; since version 2 the field holds the
  // library's one optimizer enum.
  const int32_t kind = o.version == 1 && o.optimizer == 1 ? GRADSYNC_OPTIM_MOMENTUM : o.optimizer;
  GS_REQUIRE(kind != GRADSYNC_OPTIM_ROW_ADAGRAD, GRADSYNC_E_UNSUPPORTED,
             "row-wise Adagrad updates rows of a table (gradsync_accum_apply); a sharded parameter takes SGD, "
             "MOMENTUM, ADAM or ADAMW");
  GS_REQUIRE(kind >= GRADSYNC_OPTIM_SGD && kind <= GRADSYNC_OPTIM_MOMENTUM, GRADSYNC_E_INVALID_ARG,
             "unknown optimizer {} (0 sgd, 2 adam, 3 adamw, 4 momentum)", o.optimizer);
  switch (kind) {
    case GRADSYNC_OPTIM_SGD: out.optimizer = gradsync::shard::Optimizer::Sgd; break;
    case GRADSYNC_OPTIM_MOMENTUM: out.optimizer = gradsync::shard::Optimizer::Momentum; break;
    case GRADSYNC_OPTIM_ADAM: out.optimizer = gradsync::shard::Optimizer::Adam; break;
    default: out.optimizer = gradsync::shard::Optimizer::AdamW; break;
  }
  out.compress = gradsync::codec::to_codec(o.compress, true);
  GS_REQUIRE(o.error_feedback == 0 || o.error_feedback == 1, GRADSYNC_E_INVALID_ARG,
             "error_feedback must be 0 or 1, got {}", o.error_feedback);
  GS_REQUIRE(o.clamp == 0 || o.clamp == 1, GRADSYNC_E_INVALID_ARG, "clamp must be 0 or 1, got {}", o.clamp);
  out.error_feedback = o.error_feedback == 1;
  out.clamp = o.clamp == 1;
  out.lr = o.lr;
  out.momentum = o.momentum;
  out.beta1 = o.beta1;
  out.beta2 = o.beta2;
  out.eps = o.eps;
  out.weight_decay = o.weight_decay;
  out.clamp_min = o.clamp_min;
  out.clamp_max = o.clamp_max;
  out.clip_norm = o.clip_norm;
  out.replicas = o.version >= 3 ? o.replicas : 0;
  // Checked now, so that a later version may give the field a meaning.
  GS_REQUIRE(o.version < 3 || o.reserved0 == 0, GRADSYNC_E_INVALID_ARG, "reserved0 must be 0, got {}", o.reserved0);
  gradsync::shard::validate(out);
  return out;
}

}  // namespace

extern "C" {

GRADSYNC_API int gradsync_shard_options_init(gradsync_shard_options* opts, size_t struct_size) {
  return guard(__func__,
               [&] { gradsync::capi::init_options(opts, struct_size, default_options(), kOptionsV1Size, "options"); });
}

GRADSYNC_API int gradsync_shard_create(gradsync_shard** out, gradsync_comm* comm, uint64_t total,
                                       const gradsync_shard_options* opts) {
  return gradsync::capi::create(__func__, out, [&] {
    auto* c = check(comm);
    const auto options = parse_options(opts);
    return new gradsync_shard(c->link, total, options);
  });
}

GRADSYNC_API void gradsync_shard_free(gradsync_shard* shard) { gradsync::capi::destroy(shard); }

GRADSYNC_API int gradsync_shard_reshard(gradsync_shard* shard, gradsync_comm* new_comm, uint64_t* moved_floats) {
  return guard(__func__, [&] {
    auto* s = check(shard);
    const std::shared_ptr<CommLink>& next = check(new_comm)->link;
    gradsync::shard::ShardedParameter::ReshardReport report;
    CommLink::run_in_order(next, __func__, [&] { report = s->impl.reshard(next->communicator()); });
    s->link = next;
    if (moved_floats != nullptr) *moved_floats = report.moved_floats;
  });
}

GRADSYNC_API int gradsync_shard_part(const gradsync_shard* shard, int32_t rank, uint64_t base, uint64_t* offset,
                                     uint64_t* length) {
  return guard(__func__, [&] {
    const auto* s = check(shard);
    const int size = s->impl.size();
    GS_REQUIRE(rank == -1 || (rank >= 0 && rank < size), GRADSYNC_E_OUT_OF_RANGE,
               "rank {} out of range [0, {}) (or -1 for this rank)", rank, size);
    const gradsync::Part p = rank == -1 ? s->impl.part() : s->impl.part_of(rank);
    GS_REQUIRE(base <= std::numeric_limits<uint64_t>::max() - p.start, GRADSYNC_E_INVALID_ARG,
               "base {} overflows the offset", base);
    if (offset != nullptr) *offset = base + p.start;
    if (length != nullptr) *length = p.len;
  });
}

GRADSYNC_API int gradsync_shard_ranges(const gradsync_shard* shard, uint64_t base, uint64_t* out, size_t capacity,
                                       size_t* needed) {
  return guard(__func__, [&] {
    const auto* s = check(shard);
    const size_t size = static_cast<size_t>(s->impl.size());
    if (needed != nullptr) *needed = 2 * size;
    GS_REQUIRE(capacity >= 2 * size, GRADSYNC_E_BUFS, "{} ranks need {} values, capacity is {}", size, 2 * size,
               capacity);
    GS_REQUIRE(out != nullptr, GRADSYNC_E_INVALID_ARG, "out buffer is NULL");
    GS_REQUIRE(base <= std::numeric_limits<uint64_t>::max() - s->impl.total(), GRADSYNC_E_INVALID_ARG,
               "base {} overflows the offsets", base);
    for (size_t r = 0; r < size; ++r) {
      const gradsync::Part p = s->impl.part_of(static_cast<int>(r));
      out[2 * r] = base + p.start;
      out[2 * r + 1] = p.len;
    }
  });
}

GRADSYNC_API int gradsync_shard_memory(const gradsync_shard* shard, uint64_t* weight_bytes, uint64_t* optimizer_bytes,
                                       uint64_t* buffer_bytes) {
  return guard(__func__, [&] {
    const auto* s = check(shard);
    if (weight_bytes != nullptr) *weight_bytes = s->impl.weight_bytes();
    if (optimizer_bytes != nullptr) *optimizer_bytes = s->impl.optimizer_bytes();
    if (buffer_bytes != nullptr) *buffer_bytes = s->impl.buffer_bytes();
  });
}

GRADSYNC_API int gradsync_shard_updates(const gradsync_shard* shard, int64_t* updates) {
  return guard(__func__, [&] {
    const auto* s = check(shard);
    GS_REQUIRE(updates != nullptr, GRADSYNC_E_INVALID_ARG, "updates out-parameter is NULL");
    *updates = s->impl.updates();
  });
}

GRADSYNC_API int gradsync_shard_set_lr(gradsync_shard* shard, double lr) {
  return guard(__func__, [&] { check(shard)->impl.set_lr(lr); });
}

GRADSYNC_API int gradsync_shard_init(gradsync_shard* shard, const float* weights, size_t count) {
  return guard(__func__, [&] { check(shard)->impl.init(weights, count); });
}

GRADSYNC_API int gradsync_shard_restore(gradsync_shard* shard, const float* weights, const float* state1,
                                        const float* state2, size_t count, int64_t updates) {
  return guard(__func__, [&] { check(shard)->impl.restore(weights, state1, state2, count, updates); });
}

GRADSYNC_API int gradsync_shard_step(gradsync_shard* shard, const float* gradient, float* weights, size_t count,
                                     uint64_t samples) {
  return with_comm(__func__, shard,
                   [&](gradsync::shard::ShardedParameter& s) { s.step(gradient, count, samples, weights, count); });
}

GRADSYNC_API int gradsync_shard_put(gradsync_shard* shard, const float* gradient, size_t count, uint64_t samples) {
  return guard(__func__, [&] { check(shard)->impl.put(gradient, count, samples); });
}

GRADSYNC_API int gradsync_shard_aggregate(gradsync_shard* shard) {
  return with_comm(__func__, shard, [&](gradsync::shard::ShardedParameter& s) { s.aggregate(); });
}

GRADSYNC_API int gradsync_shard_update(gradsync_shard* shard) {
  return guard(__func__, [&] { check(shard)->impl.update(); });
}

GRADSYNC_API int gradsync_shard_read_slice(const gradsync_shard* shard, int32_t which, float* out, size_t count) {
  return guard(__func__, [&] {
    const auto* s = check(shard);
    GS_REQUIRE(which >= GRADSYNC_SHARD_WEIGHTS && which <= GRADSYNC_SHARD_STATE2, GRADSYNC_E_INVALID_ARG,
               "unknown slice {} (0 weights, 1 gradient, 2 first optimizer state, 3 second)", which);
    s->impl.read_slice(static_cast<gradsync::shard::Slice>(which), out, count);
  });
}

GRADSYNC_API int gradsync_shard_write_weights(gradsync_shard* shard, const float* slice, size_t count) {
  return guard(__func__, [&] { check(shard)->impl.write_weights(slice, count); });
}

GRADSYNC_API int gradsync_shard_gather(gradsync_shard* shard, float* weights, size_t count) {
  return with_comm(__func__, shard, [&](gradsync::shard::ShardedParameter& s) { s.gather(weights, count); });
}

}  // extern "C"
