// SPDX-License-Identifier: Apache-2.0
// Files and mappings that change under the library, with real processes and real files:
//  - a table shrunk by another process after open: the next call that meets the missing part,
//    and every call after it, fails with E_IO naming the truncation; nothing dies of SIGBUS;
//  - a gradient file truncated while two threads add to it: every adder stops with E_IO;
//  - a read-only table shrunk the same way;
//  - a SIGBUS outside the library's mappings still ends the process, as it did before;
//  - a sparse copy of a table on a full file system: opening it for writing gives E_NO_SPACE
//    (its blocks are allocated at open), rather than a SIGBUS at the first write into a hole.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/accumulator.h"
#include "gradsync/errors.h"
#include "gradsync/table.h"

namespace fs = std::filesystem;

namespace {

int g_failures = 0;

#define CHECK(cond, ...)                                                     \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "%s:%d: FAILED %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                     \
      std::fprintf(stderr, "\n");                                            \
      ++g_failures;                                                          \
    }                                                                        \
  } while (0)

#define OK(call)                                                                          \
  do {                                                                                    \
    const int st_ = (call);                                                               \
    if (st_ != GRADSYNC_OK) {                                                             \
      std::fprintf(stderr, "%s:%d: %s returned %d: %s\n", __FILE__, __LINE__, #call, st_, \
                   gradsync_last_error_message());                                        \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

void expect_truncated(int status, const char* what) {
  const std::string message = gradsync_last_error_message();
  CHECK(status == GRADSYNC_E_IO, "%s returned %d (%s), expected GRADSYNC_E_IO", what, status, message.c_str());
  CHECK(message.find("shrank") != std::string::npos && message.find("truncated") != std::string::npos,
        "%s: message does not name the truncation: %s", what, message.c_str());
}

gradsync_table* open_table(const std::string& path, int32_t mode, int64_t rows, int64_t dim, int read_only = 0) {
  gradsync_table_options o = GRADSYNC_TABLE_OPTIONS_INIT;
  o.mode = mode;
  o.rows = rows;
  o.dim = dim;
  o.read_only = read_only;
  gradsync_table* t = nullptr;
  OK(gradsync_table_open(&t, path.c_str(), &o));
  return t;
}

// Another process (a real one: forked, with its own descriptor) shrinks the file to `bytes`.
void truncate_from_child(const std::string& path, off_t bytes) {
  const pid_t pid = fork();
  if (pid == 0) _exit(truncate(path.c_str(), bytes) == 0 ? 0 : 1);
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the truncating process failed");
}

void table_shrunk_by_peer(const fs::path& dir) {
  const std::string path = (dir / "t.gst").string();
  const int64_t rows = 1024, dim = 64;  // 256 KiB of data after the two header pages
  gradsync_table* t = open_table(path, GRADSYNC_TABLE_CREATE, rows, dim);
  std::vector<float> row(dim, 2.5f), out(dim);
  for (int64_t r = 0; r < rows; r += 7) OK(gradsync_table_set(t, r, row.data(), row.size()));
  // Keep the headers and the first 16 rows (4 KiB).
  truncate_from_child(path, 8192 + 4096);
  // Still inside the file: works as before, the library cannot know yet.
  OK(gradsync_table_get(t, 7, out.data(), out.size()));
  CHECK(out[0] == 2.5f, "row 7 reads %g", out[0]);
  expect_truncated(gradsync_table_get(t, rows - 1, out.data(), out.size()), "get of a row past the new end");
  // Every later call fails too, even on rows the file still has: the handle no longer maps it.
  expect_truncated(gradsync_table_get(t, 7, out.data(), out.size()), "get after the fault");
  expect_truncated(gradsync_table_set(t, 0, row.data(), row.size()), "set after the fault");
  std::vector<int64_t> ids = {1, 900};
  std::vector<float> many(2 * dim, 1.0f);
  expect_truncated(gradsync_table_scatter(t, ids.data(), 2, many.data(), many.size()), "scatter after the fault");
  expect_truncated(gradsync_table_flush(t), "flush after the fault");
  const void* view = nullptr;
  size_t bytes = 0;
  expect_truncated(gradsync_table_view(t, &view, &bytes), "view after the fault");
  gradsync_table_free(t);
  // Reopening reports the damage as what it now is: a file shorter than its header says.
  gradsync_table_options o = GRADSYNC_TABLE_OPTIONS_INIT;
  o.mode = GRADSYNC_TABLE_OPEN;
  gradsync_table* again = nullptr;
  CHECK(gradsync_table_open(&again, path.c_str(), &o) == GRADSYNC_E_CORRUPT, "reopen: %s",
        gradsync_last_error_message());
  CHECK(again == nullptr, "handle set on failure");
}

void read_only_table_shrunk(const fs::path& dir) {
  const std::string path = (dir / "r.gst").string();
  gradsync_table_free(open_table(path, GRADSYNC_TABLE_CREATE, 512, 16));
  gradsync_table* t = open_table(path, GRADSYNC_TABLE_OPEN, GRADSYNC_UNSET_I64, GRADSYNC_UNSET_I64, 1);
  truncate_from_child(path, 0);
  std::vector<int64_t> ids(512);
  for (int64_t i = 0; i < 512; ++i) ids[static_cast<size_t>(i)] = i;
  std::vector<float> out(512 * 16);
  expect_truncated(gradsync_table_gather(t, ids.data(), ids.size(), out.data(), out.size()), "read-only gather");
  gradsync_table_free(t);
}

void accumulator_truncated_while_adding(const fs::path& dir) {
  const std::string path = (dir / "g.gsa").string();
  gradsync_accum_options o = GRADSYNC_ACCUM_OPTIONS_INIT;
  o.mode = GRADSYNC_TABLE_CREATE;
  o.rows = 1 << 14;
  o.dim = 32;
  gradsync_accum* a = nullptr;
  OK(gradsync_accum_open(&a, path.c_str(), &o));
  // The truncating process is forked before any thread starts; it waits for a byte on a pipe.
  int go[2];
  CHECK(pipe(go) == 0, "pipe");
  const pid_t child = fork();
  if (child == 0) {
    char c;
    (void)!read(go[0], &c, 1);
    _exit(truncate(path.c_str(), 4096) == 0 ? 0 : 1);
  }
  std::atomic<int> adds{0};
  std::vector<int> last(2, GRADSYNC_OK);
  std::vector<std::string> messages(2);
  std::vector<std::thread> adders;
  for (int w = 0; w < 2; ++w) {
    adders.emplace_back([&, w] {
      std::vector<float> g(32, 1.0f);
      uint64_t x = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(w + 1);
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      int st = GRADSYNC_OK;
      while (st == GRADSYNC_OK && std::chrono::steady_clock::now() < until) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        st = gradsync_accum_add(a, static_cast<int64_t>(x % (1 << 14)), g.data(), g.size());
        adds.fetch_add(1);
      }
      last[static_cast<size_t>(w)] = st;
      messages[static_cast<size_t>(w)] = gradsync_last_error_message();
    });
  }
  while (adds.load() < 20000) std::this_thread::yield();
  CHECK(write(go[1], "x", 1) == 1, "pipe write");
  for (auto& t : adders) t.join();
  int status = 0;
  waitpid(child, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the truncating process failed");
  for (int w = 0; w < 2; ++w) {
    CHECK(last[static_cast<size_t>(w)] == GRADSYNC_E_IO &&
              messages[static_cast<size_t>(w)].find("shrank") != std::string::npos,
          "adder %d ended with %d: %s", w, last[static_cast<size_t>(w)], messages[static_cast<size_t>(w)].c_str());
  }
  int64_t count = 0;
  expect_truncated(gradsync_accum_touched_count(a, &count), "touched_count after the truncation");
  gradsync_table* params = nullptr;
  gradsync_table_options po = GRADSYNC_TABLE_OPTIONS_INIT;
  po.mode = GRADSYNC_TABLE_ANONYMOUS;
  po.rows = 1 << 14;
  po.dim = 32;
  OK(gradsync_table_open(&params, nullptr, &po));
  expect_truncated(gradsync_accum_apply(a, params, nullptr, nullptr), "apply after the truncation");
  gradsync_table_free(params);
  gradsync_accum_free(a);
  close(go[0]);
  close(go[1]);
}

// The handler takes only faults in the library's mappings: any other SIGBUS ends the process as
// the default disposition would.
void foreign_sigbus_still_fatal(const fs::path& dir) {
  const std::string path = (dir / "foreign").string();
  const pid_t pid = fork();
  if (pid == 0) {
    int fd = open(path.c_str(), O_RDWR | O_CREAT, 0600);
    if (fd < 0 || ftruncate(fd, 8192) != 0) _exit(2);
    auto* p = static_cast<volatile char*>(mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    if (p == MAP_FAILED || ftruncate(fd, 0) != 0) _exit(2);
    p[4096] = 1;  // past the end of the file: SIGBUS
    _exit(3);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  // Under AddressSanitizer the disposition before ours is ASan's, which reports and exits 1.
#if defined(__SANITIZE_ADDRESS__)
  const bool previous_ran = WIFEXITED(status) && WEXITSTATUS(status) == 1;
#else
  const bool previous_ran = false;
#endif
  CHECK((WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS) || previous_ran,
        "a foreign SIGBUS did not end the process (status %d)", status);
}

// Runs in a child: a tmpfs of 1 MiB (in a private mount namespace, so nothing leaks), a sparse
// 4 MiB table copied onto it. Exit 0: as expected; 1: failed; 77: no way to mount here.
int sparse_copy_on_full_fs(const fs::path& source_table, const fs::path& source_accum, const fs::path& dir) {
  g_failures = 0;  // this process's own
  if (unshare(CLONE_NEWNS) != 0 && unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) return 77;
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return 77;
  const fs::path mnt = dir / "small";
  fs::create_directories(mnt);
  if (mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=1m") != 0) return 77;
  auto sparse_copy = [&](const fs::path& from, const fs::path& to) {
    // The headers only, then the length: every data page is a hole, as cp --sparse leaves zeros.
    std::vector<char> head(8192);
    const int in = open(from.c_str(), O_RDONLY);
    const int out = open(to.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    struct stat st {};
    if (in < 0 || out < 0 || fstat(in, &st) != 0 || pread(in, head.data(), head.size(), 0) != 8192 ||
        pwrite(out, head.data(), head.size(), 0) != 8192 || ftruncate(out, st.st_size) != 0) {
      std::fprintf(stderr, "sparse copy failed: %s\n", std::strerror(errno));
      std::exit(1);
    }
    close(in);
    close(out);
  };
  const fs::path table = mnt / "t.gst", accum = mnt / "g.gsa";
  sparse_copy(source_table, table);
  sparse_copy(source_accum, accum);
  gradsync_table_options o = GRADSYNC_TABLE_OPTIONS_INIT;
  o.mode = GRADSYNC_TABLE_OPEN;
  gradsync_table* t = nullptr;
  int st = gradsync_table_open(&t, table.c_str(), &o);
  std::string message = gradsync_last_error_message();
  CHECK(st == GRADSYNC_E_NO_SPACE && t == nullptr, "writable open of a sparse table on a full fs: %d (%s)", st,
        message.c_str());
  CHECK(message.find("t.gst") != std::string::npos, "message does not name the file: %s", message.c_str());
  // Read-only needs no blocks: holes read as zeros.
  o.read_only = 1;
  OK(gradsync_table_open(&t, table.c_str(), &o));
  std::vector<float> row(1024, 1.0f);
  OK(gradsync_table_get(t, 1023, row.data(), row.size()));
  CHECK(row[0] == 0.0f && row[1023] == 0.0f, "a hole read %g", row[0]);
  gradsync_table_free(t);
  gradsync_accum_options ao = GRADSYNC_ACCUM_OPTIONS_INIT;
  ao.mode = GRADSYNC_TABLE_OPEN;
  gradsync_accum* a = nullptr;
  st = gradsync_accum_open(&a, accum.c_str(), &ao);
  CHECK(st == GRADSYNC_E_NO_SPACE && a == nullptr, "open of a sparse gradient file on a full fs: %d (%s)", st,
        gradsync_last_error_message());
  return g_failures == 0 ? 0 : 1;
}

}  // namespace

int main() {
  char tmpl[] = "/tmp/gradsync-truncate-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 1;
  const fs::path dir = tmpl;
  table_shrunk_by_peer(dir);
  read_only_table_shrunk(dir);
  accumulator_truncated_while_adding(dir);
  foreign_sigbus_still_fatal(dir);
  {
    // 4 MiB each: four times the small file system.
    const std::string big = (dir / "big.gst").string(), bigacc = (dir / "big.gsa").string();
    gradsync_table_free(open_table(big, GRADSYNC_TABLE_CREATE, 1024, 1024));
    gradsync_accum_options o = GRADSYNC_ACCUM_OPTIONS_INIT;
    o.mode = GRADSYNC_TABLE_CREATE;
    o.rows = 1024;
    o.dim = 1024;
    gradsync_accum* a = nullptr;
    OK(gradsync_accum_open(&a, bigacc.c_str(), &o));
    gradsync_accum_free(a);
    const pid_t pid = fork();
    if (pid == 0) _exit(sparse_copy_on_full_fs(big, bigacc, dir));
    int status = 0;
    waitpid(pid, &status, 0);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
      std::printf("sparse copy on a full file system: SKIPPED (cannot mount a small tmpfs here)\n");
    } else {
      CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "sparse copy on a full file system (status %d)", status);
    }
  }
  fs::remove_all(dir);
  std::printf("%s\n", g_failures == 0 ? "all passed" : "FAILED");
  return g_failures == 0 ? 0 : 1;
}
