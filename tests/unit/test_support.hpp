// SPDX-License-Identifier: Apache-2.0
#pragma once
// Helpers shared by the C++ unit tests.
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "gradsync/log.h"

// A scratch directory under /tmp for tests that need real files; removed with everything in it.

struct TempDir {
  std::filesystem::path dir;
  explicit TempDir(const char* prefix = "gradsync-test") {
    std::string tmpl = std::string("/tmp/") + prefix + "-XXXXXX";
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    dir = tmpl;
  }
  ~TempDir() { std::filesystem::remove_all(dir); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const char* name) const { return (dir / name).string(); }
};

// The status f ends with: GRADSYNC_OK, or the gradsync::Error's (its message into *message).
inline int status_of(const std::function<void()>& f, std::string* message = nullptr) {
  try {
    f();
  } catch (const gradsync::Error& e) {
    if (message != nullptr) *message = e.what();
    return e.status();
  }
  return GRADSYNC_OK;
}

// Runs f, which must throw gradsync::Error with `status` and a message containing `needle`.
template <class F>
void expect_error(F&& f, int status, const std::string& needle) {
  try {
    f();
    FAIL("expected status " << status << " (" << needle << ")");
  } catch (const gradsync::Error& e) {
    INFO(e.what());
    CHECK(e.status() == status);
    CHECK(std::string(e.what()).find(needle) != std::string::npos);
  }
}

// Collects the library's log lines at or above a level while it lives (the host callback).
struct LogLines {
  explicit LogLines(int level) { REQUIRE(gradsync_set_log_callback(&LogLines::capture, this, level) == GRADSYNC_OK); }
  ~LogLines() { gradsync_set_log_callback(nullptr, nullptr, GRADSYNC_LOG_WARN); }
  LogLines(const LogLines&) = delete;
  LogLines& operator=(const LogLines&) = delete;
  bool contains(const std::string& fragment) {
    std::lock_guard lock(mutex);
    for (const auto& l : all) {
      if (l.find(fragment) != std::string::npos) return true;
    }
    return false;
  }
  std::string first() {
    std::lock_guard lock(mutex);
    return all.empty() ? std::string("no lines") : all.front();
  }

 private:
  static void capture(void* user, int32_t, const char* message) {
    auto* self = static_cast<LogLines*>(user);
    std::lock_guard lock(self->mutex);
    self->all.emplace_back(message);
  }
  std::mutex mutex;
  std::vector<std::string> all;
};

// memcmp of n bytes that accepts the NULL data() of empty vectors (memcmp itself must not get NULL).
inline bool same_bytes(const void* a, const void* b, size_t n) { return n == 0 || std::memcmp(a, b, n) == 0; }

// The rank-order reference reduction of element i over srcs (one vector per rank), written
// independently of the kernels: floats fold in rank order, integer sums wrap (computed in
// unsigned), the i32 mean sums in 64 bits.
template <class T>
T reference_reduce(gradsync::ReduceOp op, const std::vector<std::vector<T>>& srcs, size_t i) {
  const size_t n = srcs.size();
  if constexpr (std::is_floating_point_v<T>) {
    T v = srcs[0][i];
    for (size_t k = 1; k < n; ++k) {
      const T x = srcs[k][i];
      if (op == gradsync::ReduceOp::Min)
        v = x < v ? x : v;
      else if (op == gradsync::ReduceOp::Max)
        v = v < x ? x : v;
      else
        v = v + x;
    }
    return op == gradsync::ReduceOp::Mean ? v / static_cast<T>(n) : v;
  } else {
    // Integers: sums wrap (computed in unsigned), the i32 mean sums in 64 bits.
    using U = std::make_unsigned_t<T>;
    if (op == gradsync::ReduceOp::Min || op == gradsync::ReduceOp::Max) {
      T v = srcs[0][i];
      for (size_t k = 1; k < n; ++k)
        v = op == gradsync::ReduceOp::Min ? std::min(v, srcs[k][i]) : std::max(v, srcs[k][i]);
      return v;
    }
    if (op == gradsync::ReduceOp::Mean && sizeof(T) == 4) {
      int64_t s = 0;
      for (size_t k = 0; k < n; ++k) s += srcs[k][i];
      return static_cast<T>(s / static_cast<int64_t>(n));
    }
    U s = 0;
    for (size_t k = 0; k < n; ++k) s = static_cast<U>(s + static_cast<U>(srcs[k][i]));
    if (op == gradsync::ReduceOp::Mean) return static_cast<T>(static_cast<T>(s) / static_cast<T>(n));
    return static_cast<T>(s);
  }
}

// The DType of an element type.
template <class T>
constexpr gradsync::DType dtype_of() {
  if constexpr (std::is_same_v<T, float>)
    return gradsync::DType::F32;
  else if constexpr (std::is_same_v<T, double>)
    return gradsync::DType::F64;
  else if constexpr (std::is_same_v<T, int32_t>)
    return gradsync::DType::I32;
  else
    return gradsync::DType::I64;
}
