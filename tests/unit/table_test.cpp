// SPDX-License-Identifier: Apache-2.0
// Memory-mapped tables: modes, shape checks, header slots, corruption, durability, row access.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "table/format.hpp"
#include "table/table.hpp"

using gradsync::Error;
using gradsync::table::FileHeader;
using gradsync::table::OpenMode;
using gradsync::table::OpenSpec;
using gradsync::table::Table;
namespace fs = std::filesystem;

namespace {

OpenSpec spec(const std::string& path, OpenMode mode, int64_t rows, int64_t dim) {
  OpenSpec s;
  s.path = path;
  s.mode = mode;
  s.rows = rows;
  s.dim = dim;
  return s;
}

FileHeader read_slot(const std::string& path, int slot) {
  FileHeader h{};
  std::ifstream f(path, std::ios::binary);
  f.seekg(slot * 4096);
  f.read(reinterpret_cast<char*>(&h), sizeof h);
  return h;
}

void write_bytes(const std::string& path, size_t offset, const void* data, size_t n) {
  int fd = ::open(path.c_str(), O_WRONLY);
  REQUIRE(fd >= 0);
  REQUIRE(::pwrite(fd, data, n, static_cast<off_t>(offset)) == static_cast<ssize_t>(n));
  ::close(fd);
}

}  // namespace

TEST_CASE("create, write, flush, reopen keeps rows", "[table]") {
  TempDir tmp;
  const auto path = tmp.file("emb.gst");
  {
    auto t = Table::open(spec(path, OpenMode::Create, 100, 64));
    CHECK(t->created());
    CHECK(t->rows() == 100);
    CHECK(t->dim() == 64);
    CHECK(reinterpret_cast<uintptr_t>(t->data()) % 4096 == 0);
    std::vector<float> row(64, 1.5f);
    t->set(10, row.data(), row.size());
    t->flush();
    CHECK(t->generation() == 1);
  }
  auto t = Table::open(spec(path, OpenMode::Open, -1, -1));
  CHECK_FALSE(t->created());
  CHECK(t->rows() == 100);
  CHECK(t->dim() == 64);
  std::vector<float> out(64, 0.0f);
  t->get(10, out.data(), out.size());
  CHECK(out == std::vector<float>(64, 1.5f));
  t->get(11, out.data(), out.size());
  CHECK(out == std::vector<float>(64, 0.0f));
  CHECK(fs::file_size(path) == 8192 + 100 * 64 * 4 / 4096 * 4096 + 4096);
  // no temporary files are left beside it
  size_t files = 0;
  for (auto& e : fs::directory_iterator(tmp.dir)) files += e.is_regular_file() ? 1 : 0;
  CHECK(files == 1);
}

TEST_CASE("shape, kind and mode mismatches are errors naming both sides", "[table]") {
  TempDir tmp;
  const auto path = tmp.file("t.gst");
  Table::open(spec(path, OpenMode::Create, 100, 64));
  expect_error([&] { Table::open(spec(path, OpenMode::Open, 100, 32)); }, GRADSYNC_E_MISMATCH,
               "file has 100 x 64, asked for 100 x 32");
  expect_error([&] { Table::open(spec(path, OpenMode::CreateOrOpen, 50, 64)); }, GRADSYNC_E_MISMATCH,
               "file has 100 x 64, asked for 50 x 64");
  expect_error([&] { Table::open(spec(path, OpenMode::Create, 100, 64)); }, GRADSYNC_E_IO, "already exists");
  expect_error([&] { Table::open(spec(tmp.file("none.gst"), OpenMode::Open, -1, -1)); }, GRADSYNC_E_IO, "No such file");
  expect_error([&] { Table::open(spec(tmp.file("x.gst"), OpenMode::Create, 0, 64)); }, GRADSYNC_E_INVALID_ARG,
               "rows must be at least 1");
  expect_error([&] { Table::open(spec(tmp.file("x.gst"), OpenMode::Create, int64_t{1} << 40, int64_t{1} << 40)); },
               GRADSYNC_E_INVALID_ARG, "do not fit");
  OpenSpec acc = spec(path, OpenMode::Open, -1, -1);
  acc.kind = gradsync::table::FileKind::Accumulator;
  expect_error([&] { Table::open(acc); }, GRADSYNC_E_MISMATCH, "is a table, asked for an accumulator");
  // The failed attempts changed nothing.
  CHECK(Table::open(spec(path, OpenMode::Open, 100, 64))->rows() == 100);
}

TEST_CASE("create-or-open creates once, then opens", "[table]") {
  TempDir tmp;
  const auto path = tmp.file("t.gst");
  OpenSpec s = spec(path, OpenMode::CreateOrOpen, 8, 4);
  s.init = gradsync::table::Init::Uniform;
  s.seed = 7;
  auto a = Table::open(s);
  CHECK(a->created());
  auto b = Table::open(s);  // a second handle on the same file, while the first is open
  CHECK_FALSE(b->created());
  CHECK(std::memcmp(a->data(), b->data(), a->data_bytes()) == 0);
  float v[4] = {9, 9, 9, 9};
  a->set(3, v, 4);
  float w[4];
  b->get(3, w, 4);  // the same mapping: visible at once
  CHECK(std::memcmp(v, w, sizeof v) == 0);
}

TEST_CASE("an opener waits for a file held exclusively, never past the lock deadline", "[table]") {
  // A lone opener holds the file exclusively while it repairs shared state; one stopped there
  // (or any process holding the flock) must cost the next opener an E_TIMEOUT, not a hang.
  TempDir tmp;
  const auto path = tmp.file("held.gst");
  Table::open(spec(path, OpenMode::Create, 8, 4));
  const int fd = ::open(path.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  REQUIRE(::flock(fd, LOCK_EX) == 0);
  OpenSpec waiting = spec(path, OpenMode::Open, -1, -1);
  waiting.open_lock_timeout = std::chrono::milliseconds(300);
  expect_error([&] { Table::open(waiting); }, GRADSYNC_E_TIMEOUT, "held it exclusively for more than 300 ms");
  // Released while an opener waits: the open goes through.
  std::thread release([fd] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ::flock(fd, LOCK_UN);
  });
  waiting.open_lock_timeout = std::chrono::milliseconds(60000);
  auto t = Table::open(waiting);
  release.join();
  CHECK(t->rows() == 8);
  ::close(fd);
}

TEST_CASE("uniform init is deterministic and within bounds, anonymous or file", "[table]") {
  TempDir tmp;
  OpenSpec s = spec(tmp.file("u.gst"), OpenMode::Create, 50, 10);
  s.init = gradsync::table::Init::Uniform;
  s.seed = 42;
  s.lo = -0.25f;
  s.hi = 0.75f;
  auto f = Table::open(s);
  s.mode = OpenMode::Anonymous;
  auto a = Table::open(s);
  CHECK(a->anonymous());
  CHECK(std::memcmp(f->data(), a->data(), f->data_bytes()) == 0);
  double sum = 0;
  for (size_t i = 0; i < 500; ++i) {
    CHECK(a->data()[i] >= -0.25f);
    CHECK(a->data()[i] <= 0.75f);
    sum += a->data()[i];
  }
  CHECK(sum / 500 == Approx(0.25).margin(0.05));
  s.seed = 43;
  auto other = Table::open(s);
  CHECK(std::memcmp(other->data(), a->data(), a->data_bytes()) != 0);
  a->fill_zero();
  CHECK(a->data()[0] == 0.0f);
  a->fill_uniform(42, -0.25f, 0.75f);
  CHECK(std::memcmp(f->data(), a->data(), f->data_bytes()) == 0);
  // The widest range there is: hi - lo overflows float, yet every value is finite and in range.
  a->fill_uniform(7, -std::numeric_limits<float>::max(), std::numeric_limits<float>::max());
  bool signs[2] = {false, false};
  for (size_t i = 0; i < a->data_bytes() / sizeof(float); ++i) {
    REQUIRE(std::isfinite(a->data()[i]));
    signs[a->data()[i] < 0] = true;
  }
  CHECK((signs[0] && signs[1]));
  a->flush();  // a no-op without a file
}

TEST_CASE("gather and scatter check every id before touching any row", "[table]") {
  auto t = Table::open(spec("", OpenMode::Anonymous, 10, 3));
  std::vector<int64_t> ids = {1, 4, 4, 9};
  std::vector<float> vals = {1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4};
  t->scatter(ids.data(), ids.size(), vals.data(), vals.size());
  std::vector<float> out(12);
  t->gather(ids.data(), ids.size(), out.data(), out.size());
  CHECK(out == std::vector<float>{1, 1, 1, 3, 3, 3, 3, 3, 3, 4, 4, 4});  // last write of row 4 wins

  std::vector<int64_t> bad = {0, 2, 10};
  expect_error([&] { t->scatter(bad.data(), 3, vals.data(), 9); }, GRADSYNC_E_OUT_OF_RANGE,
               "row 10 (entry 2 of 3) out of range [0, 10)");
  float r0[3];
  t->get(0, r0, 3);
  CHECK(r0[0] == 0.0f);  // nothing written
  expect_error([&] { t->scatter(ids.data(), 4, vals.data(), 11); }, GRADSYNC_E_INVALID_ARG,
               "the values has 11 floats, 4 rows x dim 3 need 12");
  expect_error([&] { t->get(-1, r0, 3); }, GRADSYNC_E_OUT_OF_RANGE, "row -1 out of range [0, 10)");
  expect_error([&] { t->set(0, r0, 2); }, GRADSYNC_E_INVALID_ARG, "has 2 floats, the table's rows have dim 3");
  expect_error([&] { t->prefetch(bad.data(), 3); }, GRADSYNC_E_OUT_OF_RANGE, "row 10");
  t->prefetch(ids.data(), ids.size());
  t->gather(nullptr, 0, nullptr, 0);  // an empty batch is fine
  // A row count whose n x dim overflows is refused before a single id is read (ASan sees the ids
  // array of 4 walked past otherwise).
  const size_t huge = SIZE_MAX / 3 + 1;
  expect_error([&] { t->gather(ids.data(), huge, out.data(), out.size()); }, GRADSYNC_E_INVALID_ARG, "rows x dim 3");
  expect_error([&] { t->scatter(ids.data(), huge, vals.data(), vals.size()); }, GRADSYNC_E_INVALID_ARG, "rows x dim 3");
}

TEST_CASE("read-only open reads and refuses writes", "[table]") {
  TempDir tmp;
  const auto path = tmp.file("ro.gst");
  {
    auto t = Table::open(spec(path, OpenMode::Create, 4, 2));
    float v[2] = {3, 4};
    t->set(1, v, 2);
    t->flush();
  }
  OpenSpec s = spec(path, OpenMode::Open, -1, -1);
  s.read_only = true;
  auto t = Table::open(s);
  float out[2];
  t->get(1, out, 2);
  CHECK(out[1] == 4.0f);
  expect_error([&] { t->set(1, out, 2); }, GRADSYNC_E_MISUSE, "read-only");
  expect_error([&] { t->fill_zero(); }, GRADSYNC_E_MISUSE, "read-only");
  t->flush();  // nothing to make durable
  OpenSpec bad = spec(path, OpenMode::CreateOrOpen, 4, 2);
  bad.read_only = true;
  expect_error([&] { Table::open(bad); }, GRADSYNC_E_INVALID_ARG, "read-only is only for");
}

TEST_CASE("header slots alternate; a damaged slot falls back to the other", "[table]") {
  TempDir tmp;
  const auto path = tmp.file("h.gst");
  {
    auto t = Table::open(spec(path, OpenMode::Create, 16, 4));
    CHECK(read_slot(path, 0).generation == 0);
    CHECK(read_slot(path, 1).generation == 0);
    t->flush();
    CHECK(read_slot(path, 1).generation == 1);
    CHECK(read_slot(path, 0).generation == 0);
    t->flush();
    CHECK(read_slot(path, 0).generation == 2);
    t->flush();
    CHECK(read_slot(path, 1).generation == 3);
  }
  // Tear the newest slot (1): the file opens from slot 0.
  const uint32_t junk = 0xdeadbeef;
  write_bytes(path, 4096 + 40, &junk, sizeof junk);
  CHECK(Table::open(spec(path, OpenMode::Open, 16, 4))->generation() == 2);
  // A flush rewrites the damaged slot's successor and carries on from the highest generation.
  {
    auto t = Table::open(spec(path, OpenMode::Open, 16, 4));
    t->flush();
    CHECK(t->generation() == 3);
    CHECK(read_slot(path, 1).generation == 3);
  }
  // Both slots damaged: corrupt, naming both.
  write_bytes(path, 40, &junk, sizeof junk);
  write_bytes(path, 4096 + 40, &junk, sizeof junk);
  expect_error([&] { Table::open(spec(path, OpenMode::Open, -1, -1)); }, GRADSYNC_E_CORRUPT, "checksum");

  // A newer slot that is valid on its own but describes another shape (8 x 8 for 16 x 4, the
  // same bytes) is a forgery, not a newer header: the slots must agree on all but the generation.
  const auto forged = tmp.file("forged.gst");
  Table::open(spec(forged, OpenMode::Create, 16, 4));
  FileHeader h = read_slot(forged, 1);
  h.rows = 8;
  h.dim = 8;
  h.generation = 7;
  h.checksum = gradsync::fnv1a64(&h, offsetof(FileHeader, checksum));
  write_bytes(forged, 4096, &h, sizeof h);
  expect_error([&] { Table::open(spec(forged, OpenMode::Open, -1, -1)); }, GRADSYNC_E_CORRUPT, "disagree");
}

TEST_CASE("bad files: magic, byte order, version, sizes", "[table]") {
  TempDir tmp;
  const auto path = tmp.file("b.gst");
  Table::open(spec(path, OpenMode::Create, 16, 4));
  const auto pristine = [&] {
    std::ifstream f(path, std::ios::binary);
    return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  }();
  auto restore = [&] {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(pristine.data(), static_cast<std::streamsize>(pristine.size()));
  };
  auto both_slots = [&](size_t offset, const void* data, size_t n) {
    write_bytes(path, offset, data, n);
    write_bytes(path, 4096 + offset, data, n);
  };
  auto open_any = [&] { Table::open(spec(path, OpenMode::Open, -1, -1)); };

  const uint32_t swapped = __builtin_bswap32(gradsync::table::kMagic);
  both_slots(0, &swapped, 4);
  expect_error(open_any, GRADSYNC_E_VERSION_MISMATCH, "other byte order");
  restore();

  const uint32_t zero = 0;
  both_slots(0, &zero, 4);
  expect_error(open_any, GRADSYNC_E_CORRUPT, "bad magic 0x00000000");
  restore();

  // A well-formed header of a future version.
  for (int slot = 0; slot < 2; ++slot) {
    FileHeader h = read_slot(path, slot);
    h.format_version = 2;
    h.checksum = gradsync::table::header_checksum(h);
    write_bytes(path, static_cast<size_t>(slot) * 4096, &h, sizeof h);
  }
  expect_error(open_any, GRADSYNC_E_VERSION_MISMATCH, "format version 2, this library reads version 1");
  restore();

  // Huge rows x dim with a valid checksum: rejected without mapping anything.
  for (int slot = 0; slot < 2; ++slot) {
    FileHeader h = read_slot(path, slot);
    h.rows = uint64_t{1} << 62;
    h.dim = 1u << 20;
    h.checksum = gradsync::table::header_checksum(h);
    write_bytes(path, static_cast<size_t>(slot) * 4096, &h, sizeof h);
  }
  expect_error(open_any, GRADSYNC_E_CORRUPT, "impossible shape");
  restore();

  // Truncated and extended files: never silently accepted.
  fs::resize_file(path, pristine.size() - 4096);
  expect_error(open_any, GRADSYNC_E_CORRUPT, "truncated or extended");
  fs::resize_file(path, pristine.size() + 1);
  expect_error(open_any, GRADSYNC_E_CORRUPT, "truncated or extended");
  fs::resize_file(path, 100);
  expect_error(open_any, GRADSYNC_E_CORRUPT, "shorter than its two header pages");
  CHECK(fs::file_size(path) == 100);  // and never "repaired" by extending it
  restore();
  CHECK(Table::open(spec(path, OpenMode::Open, 16, 4))->rows() == 16);
}
