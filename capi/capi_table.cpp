// SPDX-License-Identifier: Apache-2.0
// C shims of the memory-mapped table (include/gradsync/table.h) over gradsync::table::Table.
#include <cmath>
#include <cstring>
#include <memory>

#include "capi/capi_table.hpp"
#include "capi/guard.hpp"
#include "capi/options.hpp"
#include "gradsync/table.h"

namespace {
using gradsync::capi::check;
using gradsync::capi::guard;
namespace tbl = gradsync::table;

constexpr size_t kOptionsV1Size = offsetof(gradsync_table_options, hi) + sizeof(double);

gradsync_table_options default_options() {
  gradsync_table_options o = GRADSYNC_TABLE_OPTIONS_INIT;
  return o;
}

tbl::OpenSpec parse_options(const char* path, const gradsync_table_options* user) {
  const gradsync_table_options o =
      user == nullptr ? default_options()
                      : gradsync::capi::read_options(user, default_options(), kOptionsV1Size, "options");
  tbl::OpenSpec spec;
  GS_REQUIRE(o.mode >= GRADSYNC_TABLE_CREATE && o.mode <= GRADSYNC_TABLE_ANONYMOUS, GRADSYNC_E_INVALID_ARG,
             "unknown table mode {}", o.mode);
  spec.mode = static_cast<tbl::OpenMode>(o.mode);
  if (spec.mode == tbl::OpenMode::Anonymous) {
    GS_REQUIRE(path == nullptr, GRADSYNC_E_INVALID_ARG, "an anonymous table has no path: pass NULL");
  } else {
    GS_REQUIRE(path != nullptr, GRADSYNC_E_INVALID_ARG, "path is NULL");
    spec.path = path;
  }
  GS_REQUIRE(o.read_only == 0 || o.read_only == 1, GRADSYNC_E_INVALID_ARG, "read_only must be 0 or 1, got {}",
             o.read_only);
  spec.read_only = o.read_only == 1;
  spec.rows = o.rows == GRADSYNC_UNSET_I64 ? -1 : o.rows;
  spec.dim = o.dim == GRADSYNC_UNSET_I64 ? -1 : o.dim;
  GS_REQUIRE(o.rows == GRADSYNC_UNSET_I64 || o.rows >= 1, GRADSYNC_E_INVALID_ARG, "rows must be at least 1, got {}",
             o.rows);
  GS_REQUIRE(o.dim == GRADSYNC_UNSET_I64 || o.dim >= 1, GRADSYNC_E_INVALID_ARG, "dim must be at least 1, got {}",
             o.dim);
  GS_REQUIRE(o.dtype == GRADSYNC_F32, GRADSYNC_E_UNSUPPORTED, "tables hold f32 only, asked for dtype {}", o.dtype);
  GS_REQUIRE(o.init == GRADSYNC_TABLE_INIT_ZEROS || o.init == GRADSYNC_TABLE_INIT_UNIFORM, GRADSYNC_E_INVALID_ARG,
             "unknown init {}", o.init);
  spec.init = static_cast<tbl::Init>(o.init);
  spec.seed = o.seed;
  GS_REQUIRE(std::isfinite(o.lo) && std::isfinite(o.hi) && o.lo <= o.hi, GRADSYNC_E_INVALID_ARG,
             "uniform init needs finite lo <= hi, got [{}, {}]", o.lo, o.hi);
  spec.lo = static_cast<float>(o.lo);
  spec.hi = static_cast<float>(o.hi);
  spec.access = gradsync::capi::parse_file_access(o.file_mode, o.allow_other_owner);
  return spec;
}

gradsync_table* mut(const gradsync_table* t) { return check(const_cast<gradsync_table*>(t)); }
}  // namespace

tbl::FileAccess gradsync::capi::parse_file_access(int32_t file_mode, int32_t allow_other_owner) {
  GS_REQUIRE(file_mode >= 0 && file_mode <= 0777, GRADSYNC_E_INVALID_ARG,
             "file_mode {:o} is not a set of permission bits (0 to 0777)", file_mode);
  GS_REQUIRE(allow_other_owner == 0 || allow_other_owner == 1, GRADSYNC_E_INVALID_ARG,
             "allow_other_owner must be 0 or 1, got {}", allow_other_owner);
  // 0 is the default, so that a caller's zeroed new fields mean the same to older and newer libraries.
  tbl::FileAccess access;
  access.mode = file_mode == 0 ? 0600u : static_cast<uint32_t>(file_mode);
  access.allow_other_owner = allow_other_owner == 1;
  return access;
}

extern "C" {

GRADSYNC_API int gradsync_table_options_init(gradsync_table_options* opts, size_t struct_size) {
  return guard(__func__,
               [&] { gradsync::capi::init_options(opts, struct_size, default_options(), kOptionsV1Size, "options"); });
}

GRADSYNC_API int gradsync_table_open(gradsync_table** out, const char* path, const gradsync_table_options* opts) {
  return gradsync::capi::create(__func__, out,
                                [&] { return new gradsync_table(tbl::Table::open(parse_options(path, opts))); });
}

GRADSYNC_API void gradsync_table_free(gradsync_table* table) { gradsync::capi::destroy(table); }

GRADSYNC_API int gradsync_table_shape(const gradsync_table* table, int64_t* rows, int64_t* dim) {
  return guard(__func__, [&] {
    auto* t = mut(table);
    if (rows != nullptr) *rows = t->impl->rows();
    if (dim != nullptr) *dim = t->impl->dim();
  });
}

GRADSYNC_API int gradsync_table_created(const gradsync_table* table, int32_t* created) {
  return guard(__func__, [&] {
    auto* t = mut(table);
    GS_REQUIRE(created != nullptr, GRADSYNC_E_INVALID_ARG, "created is NULL");
    *created = t->impl->created() ? 1 : 0;
  });
}

GRADSYNC_API int gradsync_table_get(const gradsync_table* table, int64_t row, float* out, size_t count) {
  return guard(__func__, [&] { mut(table)->impl->get(row, out, count); });
}

GRADSYNC_API int gradsync_table_set(gradsync_table* table, int64_t row, const float* values, size_t count) {
  return guard(__func__, [&] { check(table)->impl->set(row, values, count); });
}

GRADSYNC_API int gradsync_table_gather(const gradsync_table* table, const int64_t* rows, size_t n, float* out,
                                       size_t count) {
  return guard(__func__, [&] { mut(table)->impl->gather(rows, n, out, count); });
}

GRADSYNC_API int gradsync_table_scatter(gradsync_table* table, const int64_t* rows, size_t n, const float* values,
                                        size_t count) {
  return guard(__func__, [&] { check(table)->impl->scatter(rows, n, values, count); });
}

GRADSYNC_API int gradsync_table_fill_zero(gradsync_table* table) {
  return guard(__func__, [&] { check(table)->impl->fill_zero(); });
}

GRADSYNC_API int gradsync_table_fill_uniform(gradsync_table* table, uint64_t seed, float lo, float hi) {
  return guard(__func__, [&] { check(table)->impl->fill_uniform(seed, lo, hi); });
}

GRADSYNC_API int gradsync_table_flush(gradsync_table* table) {
  return guard(__func__, [&] { check(table)->impl->flush(); });
}

GRADSYNC_API int gradsync_table_prefetch(const gradsync_table* table, const int64_t* rows, size_t n) {
  return guard(__func__, [&] { mut(table)->impl->prefetch(rows, n); });
}

GRADSYNC_API int gradsync_table_view(const gradsync_table* table, const void** data, size_t* bytes) {
  return guard(__func__, [&] {
    auto* t = mut(table);
    GS_REQUIRE(data != nullptr && bytes != nullptr, GRADSYNC_E_INVALID_ARG, "data or bytes is NULL");
    t->impl->check_mapping();
    *data = t->impl->data();
    *bytes = t->impl->data_bytes();
  });
}

}  // extern "C"
