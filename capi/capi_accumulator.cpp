// SPDX-License-Identifier: Apache-2.0
// C shims of the sparse gradient accumulator (include/gradsync/accumulator.h).
#include <cmath>
#include <cstring>
#include <memory>

#include "accumulator/accumulator.hpp"
#include "capi/capi_table.hpp"
#include "capi/guard.hpp"
#include "capi/options.hpp"
#include "gradsync/accumulator.h"

struct gradsync_accum : gradsync::capi::Handle<gradsync::capi::Kind::Accumulator> {
  explicit gradsync_accum(std::unique_ptr<gradsync::accumulator::Accumulator> a) : impl(std::move(a)) {}
  std::unique_ptr<gradsync::accumulator::Accumulator> impl;
};

namespace {
using gradsync::capi::check;
using gradsync::capi::guard;
namespace acc = gradsync::accumulator;

constexpr size_t kOptionsV1Size = offsetof(gradsync_accum_options, rows_per_lock) + sizeof(int64_t);
constexpr size_t kOptimizerV1Size = offsetof(gradsync_optimizer, eps) + sizeof(double);

acc::AccumSpec parse_options(const char* path, const gradsync_accum_options* user) {
  const gradsync_accum_options defaults = GRADSYNC_ACCUM_OPTIONS_INIT;
  const gradsync_accum_options o =
      user == nullptr ? defaults : gradsync::capi::read_options(user, defaults, kOptionsV1Size, "options");
  acc::AccumSpec spec;
  GS_REQUIRE(o.mode >= GRADSYNC_TABLE_CREATE && o.mode <= GRADSYNC_TABLE_ANONYMOUS, GRADSYNC_E_INVALID_ARG,
             "unknown table mode {}", o.mode);
  spec.mode = static_cast<gradsync::table::OpenMode>(o.mode);
  if (spec.mode == gradsync::table::OpenMode::Anonymous) {
    GS_REQUIRE(path == nullptr, GRADSYNC_E_INVALID_ARG, "an anonymous accumulator has no path: pass NULL");
  } else {
    GS_REQUIRE(path != nullptr, GRADSYNC_E_INVALID_ARG, "path is NULL");
    spec.path = path;
  }
  GS_REQUIRE(o.concurrency == GRADSYNC_UNSET_I32 ||
                 (o.concurrency >= GRADSYNC_ACCUM_STRIPED && o.concurrency <= GRADSYNC_ACCUM_OWNER),
             GRADSYNC_E_INVALID_ARG, "unknown concurrency mode {}", o.concurrency);
  spec.concurrency = o.concurrency == GRADSYNC_UNSET_I32 ? -1 : o.concurrency;
  GS_REQUIRE(o.rows == GRADSYNC_UNSET_I64 || o.rows >= 1, GRADSYNC_E_INVALID_ARG, "rows must be at least 1, got {}",
             o.rows);
  GS_REQUIRE(o.dim == GRADSYNC_UNSET_I64 || o.dim >= 1, GRADSYNC_E_INVALID_ARG, "dim must be at least 1, got {}",
             o.dim);
  GS_REQUIRE(o.rows_per_lock == GRADSYNC_UNSET_I64 || o.rows_per_lock >= 1, GRADSYNC_E_INVALID_ARG,
             "rows_per_lock must be at least 1, got {}", o.rows_per_lock);
  spec.rows = o.rows == GRADSYNC_UNSET_I64 ? -1 : o.rows;
  spec.dim = o.dim == GRADSYNC_UNSET_I64 ? -1 : o.dim;
  spec.rows_per_lock = o.rows_per_lock == GRADSYNC_UNSET_I64 ? -1 : o.rows_per_lock;
  GS_REQUIRE(o.threads == GRADSYNC_UNSET_I64 || (o.threads >= 1 && o.threads <= 64), GRADSYNC_E_INVALID_ARG,
             "threads must be in [1, 64], got {}", o.threads);
  spec.threads = o.threads == GRADSYNC_UNSET_I64 ? -1 : o.threads;
  spec.access = gradsync::capi::parse_file_access(o.file_mode, o.allow_other_owner);
  return spec;
}

acc::OptimizerSpec parse_optimizer(const gradsync_optimizer* user) {
  const gradsync_optimizer defaults = GRADSYNC_OPTIMIZER_INIT;
  const gradsync_optimizer o =
      user == nullptr ? defaults : gradsync::capi::read_options(user, defaults, kOptimizerV1Size, "optimizer");
  GS_REQUIRE(o.kind >= GRADSYNC_OPTIM_SGD && o.kind <= GRADSYNC_OPTIM_MOMENTUM, GRADSYNC_E_INVALID_ARG,
             "unknown optimizer {}", o.kind);
  // AdamW and momentum are the sharded parameter's (dense): on a table's touched rows their decay
  // or velocity would stop for the rows a step leaves out.
  GS_REQUIRE(o.kind == GRADSYNC_OPTIM_SGD || o.kind == GRADSYNC_OPTIM_ROW_ADAGRAD || o.kind == GRADSYNC_OPTIM_ADAM,
             GRADSYNC_E_UNSUPPORTED, "the accumulator applies SGD, row-wise Adagrad and Adam, not optimizer {}",
             o.kind);
  GS_REQUIRE(o.reserved0 == 0, GRADSYNC_E_INVALID_ARG, "reserved0 must be 0, got {}", o.reserved0);
  GS_REQUIRE(std::isfinite(o.lr), GRADSYNC_E_INVALID_ARG, "learning rate must be finite, got {}", o.lr);
  GS_REQUIRE(std::isfinite(o.eps) && o.eps >= 0, GRADSYNC_E_INVALID_ARG,
             "eps must be finite and > 0 (or 0 for the optimizer's default), got {}", o.eps);
  GS_REQUIRE(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1, GRADSYNC_E_INVALID_ARG,
             "beta1 and beta2 must be in [0, 1), got ({}, {})", o.beta1, o.beta2);
  acc::OptimizerSpec spec;
  spec.kind = static_cast<acc::OptimizerKind>(o.kind);
  spec.lr = static_cast<float>(o.lr);
  spec.eps = o.eps == 0 ? acc::default_eps(spec.kind) : static_cast<float>(o.eps);
  spec.beta1 = o.beta1;
  spec.beta2 = o.beta2;
  return spec;
}

gradsync_accum* mut(const gradsync_accum* a) { return check(const_cast<gradsync_accum*>(a)); }

}  // namespace

extern "C" {

GRADSYNC_API int gradsync_accum_options_init(gradsync_accum_options* opts, size_t struct_size) {
  const gradsync_accum_options defaults = GRADSYNC_ACCUM_OPTIONS_INIT;
  return guard(__func__, [&] { gradsync::capi::init_options(opts, struct_size, defaults, kOptionsV1Size, "options"); });
}

GRADSYNC_API int gradsync_optimizer_init(gradsync_optimizer* opt, size_t struct_size) {
  const gradsync_optimizer defaults = GRADSYNC_OPTIMIZER_INIT;
  return guard(__func__,
               [&] { gradsync::capi::init_options(opt, struct_size, defaults, kOptimizerV1Size, "optimizer"); });
}

GRADSYNC_API int gradsync_accum_open(gradsync_accum** out, const char* path, const gradsync_accum_options* opts) {
  return gradsync::capi::create(__func__, out,
                                [&] { return new gradsync_accum(acc::Accumulator::open(parse_options(path, opts))); });
}

GRADSYNC_API void gradsync_accum_free(gradsync_accum* accum) { gradsync::capi::destroy(accum); }

GRADSYNC_API int gradsync_accum_shape(const gradsync_accum* accum, int64_t* rows, int64_t* dim) {
  return guard(__func__, [&] {
    auto* a = mut(accum);
    if (rows != nullptr) *rows = a->impl->rows();
    if (dim != nullptr) *dim = a->impl->dim();
  });
}

GRADSYNC_API int gradsync_accum_get_concurrency(const gradsync_accum* accum, int32_t* concurrency,
                                                int64_t* rows_per_lock) {
  return guard(__func__, [&] {
    auto* a = mut(accum);
    if (concurrency != nullptr) *concurrency = static_cast<int32_t>(a->impl->concurrency());
    if (rows_per_lock != nullptr) *rows_per_lock = a->impl->rows_per_lock();
  });
}

GRADSYNC_API int gradsync_accum_add(gradsync_accum* accum, int64_t row, const float* grad, size_t count) {
  return guard(__func__, [&] { check(accum)->impl->add(row, grad, count); });
}

GRADSYNC_API int gradsync_accum_add_batch(gradsync_accum* accum, const int64_t* rows, size_t n, const float* grads,
                                          size_t count) {
  return guard(__func__, [&] { check(accum)->impl->add_batch(rows, n, grads, count); });
}

GRADSYNC_API int gradsync_accum_get(gradsync_accum* accum, int64_t row, float* out, size_t count) {
  return guard(__func__, [&] { check(accum)->impl->get(row, out, count); });
}

GRADSYNC_API int gradsync_accum_zero(gradsync_accum* accum) {
  return guard(__func__, [&] { check(accum)->impl->zero(); });
}

GRADSYNC_API int gradsync_accum_touched_count(gradsync_accum* accum, int64_t* count) {
  return guard(__func__, [&] {
    auto* a = check(accum);
    GS_REQUIRE(count != nullptr, GRADSYNC_E_INVALID_ARG, "count is NULL");
    *count = static_cast<int64_t>(a->impl->touched_count());
  });
}

GRADSYNC_API int gradsync_accum_touched(gradsync_accum* accum, int64_t* out, size_t capacity, size_t* needed) {
  return guard(__func__, [&] {
    auto* a = check(accum);
    GS_REQUIRE(needed != nullptr, GRADSYNC_E_INVALID_ARG, "needed is NULL");
    GS_REQUIRE(out != nullptr || capacity == 0, GRADSYNC_E_INVALID_ARG, "out is NULL with capacity {}", capacity);
    const size_t n = a->impl->touched(out, capacity);
    *needed = n;
    if (capacity < n) gradsync::fail(GRADSYNC_E_BUFS, "{} rows are touched, the buffer holds {}", n, capacity);
  });
}

GRADSYNC_API int gradsync_accum_apply(gradsync_accum* accum, gradsync_table* params, const gradsync_optimizer* opt,
                                      gradsync_table* state) {
  return guard(__func__, [&] {
    auto* a = check(accum);
    auto* p = check(params);
    gradsync::table::Table* s = state != nullptr ? check(state)->impl.get() : nullptr;
    a->impl->apply(*p->impl, parse_optimizer(opt), s);
  });
}

GRADSYNC_API int gradsync_accum_flush(gradsync_accum* accum) {
  return guard(__func__, [&] { check(accum)->impl->flush(); });
}

GRADSYNC_API int gradsync_accum_view(const gradsync_accum* accum, const void** data, size_t* bytes) {
  return guard(__func__, [&] {
    auto* a = mut(accum);
    GS_REQUIRE(data != nullptr && bytes != nullptr, GRADSYNC_E_INVALID_ARG, "data or bytes is NULL");
    a->impl->table().check_mapping();
    *data = a->impl->table().data();
    *bytes = a->impl->table().data_bytes();
  });
}

}  // extern "C"
