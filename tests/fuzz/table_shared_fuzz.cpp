// SPDX-License-Identifier: Apache-2.0
// Fuzz target: a table or gradient file that another process already holds. table_fuzz opens its
// input alone, so the opener always repairs the shared area first; here a peer (this harness's
// own descriptor, holding the shared flock as a live opener does) has the file open, so the
// library takes the files' shared state as it is: the touched count, the touched list, the flags
// and the state header, read and then used by adds, touched(), zero and apply.
//
// Input: byte 0 chooses the operations, the rest is the file.
#include <sys/file.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "accumulator/accumulator.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "table/table.hpp"

namespace {

namespace acc = gradsync::accumulator;
namespace tbl = gradsync::table;

// What a damaged or foreign file that a peer holds may legitimately produce.
bool expected_failure(int status) {
  return status == GRADSYNC_E_CORRUPT || status == GRADSYNC_E_VERSION_MISMATCH || status == GRADSYNC_E_MISMATCH;
}

template <class F>
int status_of(F&& f, const char* what) {
  try {
    f();
    return GRADSYNC_OK;
  } catch (const gradsync::Error& e) {
    if (!expected_failure(e.status())) {
      std::fprintf(stderr, "unexpected status %d from %s: %s\n", e.status(), what, e.what());
      std::abort();
    }
    return e.status();
  }
}

// Every id handed out must name a row of the table, whatever the shared list held.
void check_ids(const std::vector<int64_t>& ids, size_t n, int64_t rows) {
  for (size_t i = 0; i < std::min(n, ids.size()); ++i) {
    if (ids[i] < 0 || ids[i] >= rows) {
      std::fprintf(stderr, "touched() returned row %lld of %lld\n", static_cast<long long>(ids[i]),
                   static_cast<long long>(rows));
      std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static bool quiet = [] {
    gradsync::log::set_level(6);  // damaged state is logged as warnings: not interesting here
    return true;
  }();
  (void)quiet;
  if (size < 1) return 0;
  const uint8_t ops = data[0];
  ++data;
  --size;
  const int fd = ::memfd_create("gradsync-fuzz-shared", MFD_CLOEXEC);
  if (fd < 0) std::abort();
  for (size_t off = 0; off < size;) {
    const ssize_t w = ::write(fd, data + off, size - off);
    if (w <= 0) std::abort();
    off += static_cast<size_t>(w);
  }
  // The peer: a live opener holds the shared flock for as long as it has the file open.
  if (::flock(fd, LOCK_SH) != 0) std::abort();
  const std::string path = "/proc/self/fd/" + std::to_string(fd);

  status_of(
      [&] {
        tbl::OpenSpec s;
        s.path = path;
        s.mode = tbl::OpenMode::Open;
        auto t = tbl::Table::open(s);
        if (t->exclusive()) std::abort();  // the peer holds it: never the lone opener
        std::vector<float> row(static_cast<size_t>(t->dim()));
        t->get(t->rows() - 1, row.data(), row.size());
        t->set(0, row.data(), row.size());
      },
      "a shared table");

  status_of(
      [&] {
        acc::AccumSpec s;
        s.path = path;
        s.mode = tbl::OpenMode::Open;
        auto a = acc::Accumulator::open(s);
        const int64_t rows = a->rows();
        const size_t dim = static_cast<size_t>(a->dim());
        if (rows > (1 << 20) || dim > (1 << 16)) return;  // the input is small; a lie was refused above
        const uint64_t count = a->touched_count();
        if (count > static_cast<uint64_t>(rows)) std::abort();
        std::vector<int64_t> ids(static_cast<size_t>(count));
        check_ids(ids, a->touched(ids.data(), ids.size()), rows);
        // Adds through the shared state. In striped mode a word naming a holder whose lock is gone
        // is taken over (the file marked torn, E_CORRUPT later), but one naming a live holder (this
        // process's own slot, say) is waited for up to 5 s, then E_TIMEOUT: right for a live
        // holder, too slow to fuzz. So striped adds run only over free words.
        bool adds = (ops & 1) != 0;
        if (a->concurrency() == acc::Concurrency::Striped || a->concurrency() == acc::Concurrency::Owner) {
          const auto* words = reinterpret_cast<const uint32_t*>(static_cast<const char*>(a->table().aux()) +
                                                                acc::aux_layout(rows).locks_off);
          const uint64_t nlocks = acc::lock_count(a->concurrency(), rows, static_cast<uint64_t>(a->rows_per_lock()));
          for (uint64_t i = 0; i < nlocks && adds; ++i) adds = words[i] == 0;
        }
        if (adds) {
          const int64_t batch[3] = {0, rows - 1, rows / 2};
          std::vector<float> g(3 * dim, 1.0f);
          a->add_batch(batch, 3, g.data(), g.size());
          std::vector<int64_t> after(static_cast<size_t>(rows));
          check_ids(after, a->touched(after.data(), after.size()), rows);
        }
        if ((ops & 2) != 0) {
          tbl::OpenSpec p;
          p.mode = tbl::OpenMode::Anonymous;
          p.rows = rows;
          p.dim = static_cast<int64_t>(dim);
          auto params = tbl::Table::open(p);
          a->apply(*params, acc::OptimizerSpec{}, nullptr);
        } else if ((ops & 4) != 0) {
          a->zero();
        }
        if (a->touched_count() > static_cast<uint64_t>(rows)) std::abort();
      },
      "a shared accumulator");
  ::close(fd);
  return 0;
}
