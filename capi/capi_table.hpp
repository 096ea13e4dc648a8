// SPDX-License-Identifier: Apache-2.0
#pragma once
// The table handle, shared with the accumulator's shims (apply takes tables).
#include <memory>

#include "capi/handle.hpp"
#include "table/table.hpp"

struct gradsync_table : gradsync::capi::Handle<gradsync::capi::Kind::Table> {
  explicit gradsync_table(std::unique_ptr<gradsync::table::Table> t) : impl(std::move(t)) {}
  std::unique_ptr<gradsync::table::Table> impl;
};

namespace gradsync::capi {

// The options that say who may use a file (tables' and gradient files' alike), checked.
table::FileAccess parse_file_access(int32_t file_mode, int32_t allow_other_owner);

}  // namespace gradsync::capi
