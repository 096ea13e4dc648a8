// SPDX-License-Identifier: Apache-2.0
#pragma once
// Helpers shared by the C++ unit tests.
#include <stdlib.h>

#include <filesystem>
#include <string>

#include <catch2/catch.hpp>

#include "common/error.hpp"

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
