// SPDX-License-Identifier: Apache-2.0
#pragma once
// Helpers shared by the C++ unit tests.
#include <stdlib.h>

#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

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
