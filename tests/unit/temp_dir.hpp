#pragma once
// A scratch directory under /tmp for tests that need real files; removed with everything in it.
#include <stdlib.h>

#include <filesystem>
#include <string>

#include <catch2/catch.hpp>

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
