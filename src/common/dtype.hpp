// SPDX-License-Identifier: Apache-2.0
#pragma once
// Element types and reduction ops as the C++ internals see them; the values equal the C enums.
#include <cstddef>
#include <cstdint>

#include "common/error.hpp"
#include "gradsync/common.h"

namespace gradsync {

enum class DType : int32_t {
  F32 = GRADSYNC_F32,
  F64 = GRADSYNC_F64,
  I32 = GRADSYNC_I32,
  I64 = GRADSYNC_I64,
  BF16 = GRADSYNC_BF16,
  F16 = GRADSYNC_F16
};
enum class ReduceOp : int32_t { Sum = GRADSYNC_SUM, Mean = GRADSYNC_MEAN, Min = GRADSYNC_MIN, Max = GRADSYNC_MAX };

constexpr size_t dtype_size(DType t) noexcept {
  switch (t) {
    case DType::F32:
    case DType::I32: return 4;
    case DType::F64:
    case DType::I64: return 8;
    case DType::BF16:
    case DType::F16: return 2;
  }
  return 0;
}

constexpr const char* dtype_name(DType t) noexcept {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F64: return "f64";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
  }
  return "unknown dtype";
}

constexpr const char* op_name(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Mean: return "mean";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
  }
  return "unknown op";
}

// Validating conversions from the int32_t values that cross the C ABI.
inline DType to_dtype(int32_t v) {
  GS_REQUIRE(v >= GRADSYNC_F32 && v <= GRADSYNC_F16, GRADSYNC_E_INVALID_ARG, "unknown dtype {}", v);
  return static_cast<DType>(v);
}
inline ReduceOp to_op(int32_t v) {
  GS_REQUIRE(v >= GRADSYNC_SUM && v <= GRADSYNC_MAX, GRADSYNC_E_INVALID_ARG, "unknown reduction op {}", v);
  return static_cast<ReduceOp>(v);
}

}  // namespace gradsync
