// SPDX-License-Identifier: Apache-2.0
#include "table_fuzz.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "accumulator/accumulator.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "table/table.hpp"

namespace {

// The statuses a damaged or foreign file may legitimately produce.
bool expected_failure(int status) {
  return status == GRADSYNC_E_CORRUPT || status == GRADSYNC_E_VERSION_MISMATCH || status == GRADSYNC_E_MISMATCH;
}

float read_all(const gradsync::table::Table& t) {
  // Touch every page: a header that lies about the size would fault here.
  float sum = 0.0f;
  const size_t n = t.data_bytes() / sizeof(float);
  for (size_t i = 0; i < n; i += 1024 / sizeof(float)) sum += t.data()[i];
  if (n > 0) sum += t.data()[n - 1];
  return sum;
}

template <class F>
int status_of(F&& f, const char* what) {
  try {
    f();
    return GRADSYNC_OK;
  } catch (const gradsync::Error& e) {
    if (!expected_failure(e.status())) {
      std::fprintf(stderr, "unexpected status %d opening %s: %s\n", e.status(), what, e.what());
      std::abort();
    }
    return e.status();
  }
}

}  // namespace

int gradsync_fuzz_open_table(const uint8_t* data, size_t size, int* accum_status) {
  static bool quiet = [] {
    gradsync::log::set_level(6);  // damaged slots are logged as warnings: not interesting here
    return true;
  }();
  (void)quiet;
  const int fd = ::memfd_create("gradsync-fuzz", MFD_CLOEXEC);
  if (fd < 0) std::abort();
  size_t off = 0;
  while (off < size) {
    const ssize_t w = ::write(fd, data + off, size - off);
    if (w <= 0) std::abort();
    off += static_cast<size_t>(w);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  volatile float sink = 0.0f;
  const int table_status = status_of(
      [&] {
        gradsync::table::OpenSpec s;
        s.path = path;
        s.mode = gradsync::table::OpenMode::Open;
        s.read_only = true;
        auto t = gradsync::table::Table::open(s);
        sink = sink + read_all(*t);
      },
      "a table");
  const int acc_status = status_of(
      [&] {
        gradsync::accumulator::AccumSpec s;
        s.path = path;
        s.mode = gradsync::table::OpenMode::Open;
        auto a = gradsync::accumulator::Accumulator::open(s);
        sink = sink + read_all(a->table());
        std::vector<int64_t> rows(static_cast<size_t>(std::min<int64_t>(a->rows(), 1 << 16)));
        const size_t n = a->touched(rows.data(), rows.size());
        if (n <= rows.size()) {
          for (size_t i = 0; i < n; ++i) {
            if (rows[i] < 0 || rows[i] >= a->rows()) std::abort();  // the rebuilt list is always valid
          }
        }
      },
      "an accumulator");
  ::close(fd);
  if (accum_status != nullptr) *accum_status = acc_status;
  return table_status;
}

#ifdef GRADSYNC_LIBFUZZER
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  gradsync_fuzz_open_table(data, size, nullptr);
  return 0;
}
#endif
