// SPDX-License-Identifier: Apache-2.0
// Replays hand-made damaged files through the fuzz entry point and checks each gives its clear
// error (or opens, where a good slot remains). `--write-corpus DIR` writes them as a seed corpus.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "accumulator/accumulator.hpp"
#include "gradsync/errors.h"
#include "table/format.hpp"
#include "table/table.hpp"
#include "table_fuzz.hpp"

namespace fs = std::filesystem;
using gradsync::table::FileHeader;
using Bytes = std::vector<uint8_t>;

namespace {

Bytes read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

FileHeader header_at(const Bytes& b, int slot) {
  FileHeader h{};
  std::memcpy(&h, b.data() + slot * 4096, sizeof h);
  return h;
}

void put_header(Bytes& b, int slot, FileHeader h, bool fix_checksum) {
  if (fix_checksum) h.checksum = gradsync::table::header_checksum(h);
  std::memcpy(b.data() + slot * 4096, &h, sizeof h);
}

// Edits both header slots (so that no good slot remains) and re-checksums them.
Bytes both(Bytes b, const std::function<void(FileHeader&)>& edit, bool fix_checksum = true) {
  for (int s = 0; s < 2; ++s) {
    FileHeader h = header_at(b, s);
    edit(h);
    put_header(b, s, h, fix_checksum);
  }
  return b;
}

struct Case {
  std::string name;
  Bytes bytes;
  int table_status;
  int accum_status;
};

}  // namespace

int main(int argc, char** argv) {
  char tmpl[] = "/tmp/gradsync-fuzz-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return 1;
  const fs::path dir = tmpl;
  Bytes table, accum;
  {
    gradsync::table::OpenSpec s;
    s.path = (dir / "t.gst").string();
    s.mode = gradsync::table::OpenMode::Create;
    s.rows = 7;
    s.dim = 5;
    s.init = gradsync::table::Init::Uniform;
    auto t = gradsync::table::Table::open(s);
    t->flush();  // generation 1 in slot 1, generation 0 in slot 0
    gradsync::accumulator::AccumSpec a;
    a.path = (dir / "g.gsa").string();
    a.mode = gradsync::table::OpenMode::Create;
    a.rows = 9;
    a.dim = 3;
    auto acc = gradsync::accumulator::Accumulator::open(a);
    std::vector<float> g(3, 1.0f);
    acc->add(4, g.data(), 3);
    acc->flush();
  }
  table = read_file(dir / "t.gst");
  accum = read_file(dir / "g.gsa");
  fs::remove_all(dir);

  constexpr int OK = GRADSYNC_OK, CORRUPT = GRADSYNC_E_CORRUPT, VERSION = GRADSYNC_E_VERSION_MISMATCH,
                MISMATCH = GRADSYNC_E_MISMATCH;
  std::vector<Case> cases;
  cases.push_back({"valid-table", table, OK, MISMATCH});
  cases.push_back({"valid-accumulator", accum, MISMATCH, OK});
  cases.push_back({"empty", Bytes{}, CORRUPT, CORRUPT});
  cases.push_back({"truncated-100", Bytes(table.begin(), table.begin() + 100), CORRUPT, CORRUPT});
  cases.push_back({"truncated-page", Bytes(table.begin(), table.end() - 4096), CORRUPT, CORRUPT});
  {
    Bytes b = table;
    b.resize(b.size() + 4096, 0);
    cases.push_back({"extended-page", b, CORRUPT, CORRUPT});
  }
  cases.push_back({"bad-magic", both(table, [](FileHeader& h) { h.magic = 0x12345678; }), CORRUPT, CORRUPT});
  cases.push_back(
      {"byte-swapped", both(table, [](FileHeader& h) { h.magic = __builtin_bswap32(h.magic); }), VERSION, VERSION});
  cases.push_back({"flipped-checksum",
                   both(
                       table, [](FileHeader& h) { h.checksum ^= 1; }, false),
                   CORRUPT, CORRUPT});
  {
    Bytes b = table;  // only the newer slot damaged: the older one still opens the file
    FileHeader h = header_at(b, 1);
    h.checksum ^= 0x100;
    put_header(b, 1, h, false);
    cases.push_back({"one-slot-torn", b, OK, MISMATCH});
  }
  cases.push_back({"huge-shape-overflow",
                   both(table,
                        [](FileHeader& h) {
                          h.rows = uint64_t{1} << 62;
                          h.dim = uint64_t{1} << 40;
                        }),
                   CORRUPT, CORRUPT});
  cases.push_back({"shape-size-mismatch", both(table, [](FileHeader& h) { h.rows = 1000; }), CORRUPT, CORRUPT});
  cases.push_back({"file-size-lie",
                   both(table,
                        [](FileHeader& h) {
                          h.rows = 1000;
                          h.data_bytes = 1000 * 5 * 4;
                          h.aux_offset = 8192 + 20480;
                          h.file_bytes = 8192 + 20480;
                        }),
                   CORRUPT, CORRUPT});
  cases.push_back({"version-2", both(table, [](FileHeader& h) { h.format_version = 2; }), VERSION, VERSION});
  cases.push_back({"dtype-f64", both(table, [](FileHeader& h) { h.dtype = 1; }), VERSION, VERSION});
  cases.push_back({"zero-rows", both(table, [](FileHeader& h) { h.rows = 0; }), CORRUPT, CORRUPT});
  cases.push_back({"accumulator-aux-size", both(accum, [](FileHeader& h) { h.aux_bytes -= 8; }), MISMATCH, CORRUPT});
  {
    Bytes b = accum;  // garbage in the accumulator's state region: repaired when opened alone
    const FileHeader h = header_at(b, 0);
    for (size_t i = h.aux_offset; i < b.size(); ++i) b[i] = static_cast<uint8_t>(i * 131 + 7);
    cases.push_back({"accumulator-garbage-state", b, MISMATCH, OK});
  }
  {
    Bytes b(12288);
    for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
    cases.push_back({"random-bytes", b, CORRUPT, CORRUPT});
  }

  if (argc == 3 && std::strcmp(argv[1], "--write-corpus") == 0) {
    fs::create_directories(argv[2]);
    for (const auto& c : cases) {
      std::ofstream f(fs::path(argv[2]) / c.name, std::ios::binary);
      f.write(reinterpret_cast<const char*>(c.bytes.data()), static_cast<std::streamsize>(c.bytes.size()));
    }
    std::printf("wrote %zu seed files to %s\n", cases.size(), argv[2]);
    return 0;
  }
  int failures = 0;
  for (const auto& c : cases) {
    int acc = 0;
    const int t = gradsync_fuzz_open_table(c.bytes.data(), c.bytes.size(), &acc);
    const bool ok = t == c.table_status && acc == c.accum_status;
    std::printf("%-28s table %4d (expected %4d)  accumulator %4d (expected %4d)  %s\n", c.name.c_str(), t,
                c.table_status, acc, c.accum_status, ok ? "ok" : "FAILED");
    failures += ok ? 0 : 1;
  }
  return failures == 0 ? 0 : 1;
}
