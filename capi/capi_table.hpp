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
