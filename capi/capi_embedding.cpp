// SPDX-License-Identifier: Apache-2.0
// C shims of the sharded embedding table (include/gradsync/embedding.h).
#include <cstddef>
#include <cstring>
#include <memory>

#include "capi/comm_handle.hpp"
#include "capi/guard.hpp"
#include "capi/options.hpp"
#include "common/log.hpp"
#include "embedding/embedding.hpp"
#include "gradsync/embedding.h"
#include "optim/optim.hpp"

// Like a shard, the table holds its communicator's link: its collective calls run inside a
// CommLink::Call, which fails with GRADSYNC_E_MISUSE once gradsync_comm_free has destroyed the
// communicator (and while another thread is in a call on it).
struct gradsync_embedding : gradsync::capi::Handle<gradsync::capi::Kind::Embedding> {
  gradsync_embedding(std::shared_ptr<gradsync::capi::CommLink> l, const gradsync::embedding::Options& options)
      : link(std::move(l)), impl(link->communicator(), options) {}
  ~gradsync_embedding() {
    // The buffers in the communicator's memory go back to it while it lives and is free;
    // otherwise they are its own to free at its end.
    try {
      link->require_this_process();
      gradsync::capi::CommLink::Call call(*link, "gradsync_embedding_free");
      impl.release_buffers();
    } catch (const std::exception& e) {
      GS_LOG_DEBUG("gradsync_embedding_free: the send buffers stay with the communicator until its end: {}", e.what());
    } catch (...) {
    }
  }
  void require_this_process() const { link->require_this_process(); }
  std::shared_ptr<gradsync::capi::CommLink> link;
  gradsync::embedding::ShardedTable impl;
};

namespace {
using gradsync::capi::check;
using gradsync::capi::CommLink;
using gradsync::capi::guard;

template <class F>
int with_comm(const char* function, gradsync_embedding* table, F&& body) noexcept {
  return guard(function, [&] {
    auto* t = check(table);
    CommLink::run_in_order(t->link, function, [&] { body(t->impl); });
  });
}

constexpr size_t kOptionsV1Size = offsetof(gradsync_embedding_options, hi) + sizeof(double);

gradsync_embedding_options default_options() {
  gradsync_embedding_options o = GRADSYNC_EMBEDDING_OPTIONS_INIT;
  return o;
}

gradsync::embedding::Options parse_options(const gradsync_embedding_options* user, const char* dir) {
  GS_REQUIRE(user != nullptr, GRADSYNC_E_INVALID_ARG, "options are NULL (rows and dim are required)");
  const gradsync_embedding_options o = gradsync::capi::read_options(user, default_options(), kOptionsV1Size, "options");
  gradsync::embedding::Options out;
  out.rows = o.rows;
  out.dim = o.dim;
  GS_REQUIRE(o.sharding == GRADSYNC_EMBEDDING_CONTIGUOUS || o.sharding == GRADSYNC_EMBEDDING_HASH,
             GRADSYNC_E_INVALID_ARG, "unknown sharding {} (0 contiguous, 1 hash)", o.sharding);
  out.sharding = static_cast<gradsync::embedding::Sharding>(o.sharding);
  GS_REQUIRE(o.optimizer == GRADSYNC_OPTIM_SGD || o.optimizer == GRADSYNC_OPTIM_ROW_ADAGRAD ||
                 o.optimizer == GRADSYNC_OPTIM_ADAM,
             GRADSYNC_E_INVALID_ARG, "optimizer {}: an embedding table takes SGD (0), ROW_ADAGRAD (1) or ADAM (2)",
             o.optimizer);
  out.optimizer = static_cast<gradsync::accumulator::OptimizerKind>(o.optimizer);
  GS_REQUIRE(gradsync::optim::finite_in_float(o.lr), GRADSYNC_E_INVALID_ARG, "learning rate must be finite, got {}",
             o.lr);
  GS_REQUIRE(gradsync::optim::finite_in_float(o.eps) && o.eps >= 0, GRADSYNC_E_INVALID_ARG,
             "eps must be finite and > 0 (or 0 for the optimizer's default), got {}", o.eps);
  out.lr = static_cast<float>(o.lr);
  out.eps = o.eps == 0 ? gradsync::optim::default_eps(out.optimizer) : static_cast<float>(o.eps);
  out.beta1 = o.beta1;
  out.beta2 = o.beta2;
  GS_REQUIRE(o.init == GRADSYNC_TABLE_INIT_ZEROS || o.init == GRADSYNC_TABLE_INIT_UNIFORM, GRADSYNC_E_INVALID_ARG,
             "unknown init {} (0 zeros, 1 uniform)", o.init);
  out.init = static_cast<gradsync::table::Init>(o.init);
  out.threads = o.threads == GRADSYNC_UNSET_I32 ? 1 : o.threads;
  out.seed = o.seed;
  GS_REQUIRE(gradsync::optim::finite_in_float(o.lo) && gradsync::optim::finite_in_float(o.hi), GRADSYNC_E_INVALID_ARG,
             "uniform bounds must be finite floats, got [{}, {}]", o.lo, o.hi);
  out.lo = static_cast<float>(o.lo);
  out.hi = static_cast<float>(o.hi);
  out.replicas = o.version >= 3 ? o.replicas : 0;
  // Checked now, so that a later version may give the field a meaning.
  GS_REQUIRE(o.version < 3 || o.reserved0 == 0, GRADSYNC_E_INVALID_ARG, "reserved0 must be 0, got {}", o.reserved0);
  if (dir != nullptr) {
    GS_REQUIRE(dir[0] != '\0', GRADSYNC_E_INVALID_ARG, "dir is empty (NULL for anonymous memory)");
    out.dir = dir;
  }
  gradsync::embedding::validate(out);
  return out;
}

// A missing directory is judged inside the collective (an empty one fails every rank alike), not
// before it, where the other ranks would wait for this one until their timeout.
std::string dir_arg(const char* dir) { return dir == nullptr ? std::string() : std::string(dir); }

}  // namespace

extern "C" {

GRADSYNC_API int gradsync_embedding_options_init(gradsync_embedding_options* opts, size_t struct_size) {
  return guard(__func__,
               [&] { gradsync::capi::init_options(opts, struct_size, default_options(), kOptionsV1Size, "options"); });
}

GRADSYNC_API int gradsync_embedding_create(gradsync_embedding** out, gradsync_comm* comm, const char* dir,
                                           const gradsync_embedding_options* opts) {
  return gradsync::capi::create(__func__, out, [&] {
    auto* c = check(comm);
    const auto options = parse_options(opts, dir);
    return new gradsync_embedding(c->link, options);
  });
}

GRADSYNC_API void gradsync_embedding_free(gradsync_embedding* table) { gradsync::capi::destroy(table); }

GRADSYNC_API int gradsync_embedding_shape(const gradsync_embedding* table, int64_t* rows, int64_t* dim,
                                          int64_t* local_rows) {
  return guard(__func__, [&] {
    const auto* t = check(table);
    if (rows != nullptr) *rows = t->impl.rows();
    if (dim != nullptr) *dim = t->impl.dim();
    if (local_rows != nullptr) *local_rows = t->impl.local_rows();
  });
}

GRADSYNC_API int gradsync_embedding_owner(const gradsync_embedding* table, const int64_t* ids, size_t n,
                                          int32_t* owners) {
  return guard(__func__, [&] {
    const auto* t = check(table);
    GS_REQUIRE(n == 0 || (ids != nullptr && owners != nullptr), GRADSYNC_E_INVALID_ARG, "ids or owners is NULL");
    for (size_t i = 0; i < n; ++i)
      GS_REQUIRE(ids[i] >= 0 && ids[i] < t->impl.rows(), GRADSYNC_E_OUT_OF_RANGE,
                 "id {} at position {} is outside [0, {})", ids[i], i, t->impl.rows());
    for (size_t i = 0; i < n; ++i) owners[i] = t->impl.layout().owner(ids[i]);
  });
}

GRADSYNC_API int gradsync_embedding_steps(const gradsync_embedding* table, int64_t* steps) {
  return guard(__func__, [&] {
    const auto* t = check(table);
    GS_REQUIRE(steps != nullptr, GRADSYNC_E_INVALID_ARG, "steps out-parameter is NULL");
    *steps = t->impl.steps();
  });
}

GRADSYNC_API int gradsync_embedding_set_lr(gradsync_embedding* table, double lr) {
  return guard(__func__, [&] { check(table)->impl.set_lr(lr); });
}

GRADSYNC_API int gradsync_embedding_lookup(gradsync_embedding* table, const int64_t* ids, size_t n, float* out,
                                           size_t count) {
  return with_comm(__func__, table, [&](gradsync::embedding::ShardedTable& t) { t.lookup(ids, n, out, count); });
}

GRADSYNC_API int gradsync_embedding_push(gradsync_embedding* table, const int64_t* ids, size_t n, const float* grads,
                                         size_t count) {
  return with_comm(__func__, table, [&](gradsync::embedding::ShardedTable& t) { t.push(ids, n, grads, count); });
}

GRADSYNC_API int gradsync_embedding_save(gradsync_embedding* table, const char* dir) {
  return with_comm(__func__, table, [&](gradsync::embedding::ShardedTable& t) { t.save(dir_arg(dir), false); });
}

GRADSYNC_API int gradsync_embedding_save_incremental(gradsync_embedding* table, const char* dir) {
  return with_comm(__func__, table, [&](gradsync::embedding::ShardedTable& t) { t.save(dir_arg(dir), true); });
}

GRADSYNC_API int gradsync_embedding_load(gradsync_embedding* table, const char* dir) {
  return with_comm(__func__, table, [&](gradsync::embedding::ShardedTable& t) { t.load(dir_arg(dir)); });
}

GRADSYNC_API int gradsync_embedding_reshard(gradsync_embedding* table, gradsync_comm* new_comm, int32_t sharding,
                                            const char* checkpoint_dir, uint64_t* moved_rows, int32_t* restored) {
  return guard(__func__, [&] {
    auto* t = check(table);
    const std::shared_ptr<CommLink>& next = check(new_comm)->link;
    // An unknown rule is judged inside the collective, so that every rank fails alike.
    std::optional<gradsync::embedding::Sharding> rule;
    if (sharding == GRADSYNC_EMBEDDING_KEEP_SHARDING) rule = t->impl.options().sharding;
    if (sharding == GRADSYNC_EMBEDDING_CONTIGUOUS || sharding == GRADSYNC_EMBEDDING_HASH) {
      rule = static_cast<gradsync::embedding::Sharding>(sharding);
    }
    const bool on_next = t->link == next;
    if (!on_next) {
      // The lookup and push buffers in the old group's memory go back to it while it lives and is
      // free (its end frees them otherwise).
      try {
        CommLink::Call call(*t->link, __func__);
        t->impl.release_buffers();
      } catch (const std::exception& e) {
        GS_LOG_DEBUG("gradsync_embedding_reshard: the send buffers stay with the old communicator: {}", e.what());
      }
    }
    gradsync::embedding::ShardedTable::ReshardReport report;
    CommLink::run_in_order(next, __func__, [&] {
      report = t->impl.reshard(next->communicator(), on_next, rule, dir_arg(checkpoint_dir));
    });
    t->link = next;
    if (moved_rows != nullptr) *moved_rows = report.moved_rows;
    if (restored != nullptr) *restored = report.from_checkpoint ? 1 : 0;
  });
}

GRADSYNC_API int gradsync_embedding_local_rows(const gradsync_embedding* table, int64_t* ids, float* values,
                                               float* state, size_t capacity) {
  return guard(__func__, [&] {
    const auto* t = check(table);
    const auto local = static_cast<size_t>(t->impl.local_rows());
    GS_REQUIRE(capacity >= local, GRADSYNC_E_BUFS, "this rank owns {} rows, capacity is {}", local, capacity);
    t->impl.local_rows(ids, values, state);
  });
}

}  // extern "C"
