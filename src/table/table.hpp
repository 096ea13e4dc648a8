// SPDX-License-Identifier: Apache-2.0
#pragma once
// A table of rows x dim f32 in a memory-mapped file (or anonymous memory): the embedding and
// gradient storage of the accumulator. Format and crash rules: src/table/format.hpp.
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include <boost/interprocess/mapped_region.hpp>

#include "common/mapguard.hpp"
#include "table/format.hpp"

namespace gradsync::table {

enum class OpenMode : int32_t { Create = 1, Open = 2, CreateOrOpen = 3, Anonymous = 4 };
enum class Init : int32_t { Zeros = 0, Uniform = 1 };

// Who may use a file: the mode a new file gets, exactly (whatever the umask), private unless the
// caller shares it; and whether an existing file owned by another user is trusted.
struct FileAccess {
  uint32_t mode = 0600;
  bool allow_other_owner = false;
};

struct OpenSpec {
  std::string path;  // ignored for Anonymous
  OpenMode mode = OpenMode::CreateOrOpen;
  bool read_only = false;  // Open only
  int64_t rows = -1;       // -1: take it from the existing file (Open); required to create
  int64_t dim = -1;
  FileKind kind = FileKind::Table;
  // Size of the kind-specific region for a given row count (nullptr: none); an existing file's
  // region must have exactly this size.
  uint64_t (*aux_bytes_for_rows)(int64_t rows) = nullptr;
  Init init = Init::Zeros;  // how a newly created table is filled
  uint64_t seed = 0;
  float lo = -0.5f, hi = 0.5f;
  // Called on a newly created file's aux region before the file becomes visible under its name.
  void (*init_aux)(void* aux, uint64_t bytes, int64_t rows, void* user) = nullptr;
  void* init_aux_user = nullptr;
  // Keep the exclusive file lock of a lone opener until release_exclusive(), to repair the aux
  // region first; otherwise open() downgrades it to shared before returning.
  bool keep_exclusive = false;
  FileAccess access;
  // How long to wait for the shared lock while another opener holds the file exclusively (a lone
  // opener checks, repairs and allocates it under that lock: seconds for a large file) before
  // E_TIMEOUT: that holder may be stopped or stuck, and waiting forever would hang this opener.
  std::chrono::milliseconds open_lock_timeout{30000};
};

class Table {
 public:
  // Opens or creates per spec; throws gradsync::Error (E_MISMATCH, E_CORRUPT, E_VERSION_MISMATCH,
  // E_IO, E_NO_SPACE, E_INVALID_ARG) naming the exact problem.
  static std::unique_ptr<Table> open(const OpenSpec& spec);
  ~Table();
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  int64_t rows() const noexcept { return rows_; }
  int64_t dim() const noexcept { return dim_; }
  bool read_only() const noexcept { return read_only_; }
  bool anonymous() const noexcept { return fd_ < 0; }
  // The open file (-1 when anonymous): its open file description carries the OFD locks of users
  // that share the file (the accumulator's row-lock holders).
  int fd() const noexcept { return fd_; }
  bool created() const noexcept { return created_; }
  // True when no other process had the file open as this one opened it (always for anonymous and
  // new files): the opener may then repair shared state in the aux region before release_exclusive().
  bool exclusive() const noexcept { return exclusive_; }
  void release_exclusive();
  uint64_t generation() const noexcept { return generation_.load(); }
  const std::string& path() const noexcept { return path_; }
  // Its owner renamed the file (the descriptor and mapping stay valid): messages name `path` now.
  void renamed(std::string path) { path_ = std::move(path); }

  float* data() noexcept { return data_; }
  const float* data() const noexcept { return data_; }
  size_t data_bytes() const noexcept { return static_cast<size_t>(rows_) * static_cast<size_t>(dim_) * sizeof(float); }
  float* row_ptr(int64_t row) noexcept { return data_ + static_cast<size_t>(row) * static_cast<size_t>(dim_); }
  const float* row_ptr(int64_t row) const noexcept {
    return data_ + static_cast<size_t>(row) * static_cast<size_t>(dim_);
  }
  void* aux() noexcept { return aux_; }
  uint64_t aux_bytes() const noexcept { return aux_bytes_; }

  // Argument checks shared with the accumulator: they throw before anything is written.
  void check_row(int64_t row) const;
  void check_rows(const int64_t* rows, size_t n) const;
  void check_count(size_t count, size_t rows_in_call, const char* what) const;
  void check_writable() const;
  // Throws E_IO once the file shrank under the mapping (another process truncated it): from then
  // on the handle sees anonymous memory, not the file (common/mapguard.hpp). Every operation
  // checks before and after it touches the mapping, so the call that met the fault fails too.
  void check_mapping() const;

  void get(int64_t row, float* out, size_t count) const;
  void set(int64_t row, const float* values, size_t count);
  void gather(const int64_t* rows, size_t n, float* out, size_t count) const;
  void scatter(const int64_t* rows, size_t n, const float* values, size_t count);
  void fill_zero();
  void fill_uniform(uint64_t seed, float lo, float hi);
  // Durable on return: data and aux region written back and fsync'ed, then the next header slot.
  void flush();
  void prefetch(const int64_t* rows, size_t n) const;

 private:
  Table() = default;
  void map_file(const std::string& path, int fd, uint64_t file_bytes);
  void adopt(const FileHeader& h);
  void write_header_slot(const FileHeader& h, int slot);

  std::string path_;
  int fd_ = -1;
  bool read_only_ = false;
  bool created_ = false;
  bool exclusive_ = false;
  bool fatal_ = false;  // a header write failed: flush refuses to go on (guarded by flush_mutex_)
  int64_t rows_ = 0;
  int64_t dim_ = 0;
  FileHeader header_{};
  std::atomic<uint64_t> generation_{0};
  std::mutex flush_mutex_;
  boost::interprocess::mapped_region region_;
  mapguard::Registration guard_;  // reset before region_ is unmapped
  char* base_ = nullptr;
  float* data_ = nullptr;
  void* aux_ = nullptr;
  uint64_t aux_bytes_ = 0;
  uint64_t mapped_bytes_ = 0;
  void* anon_base_ = nullptr;  // anonymous tables: our own private mapping
  size_t anon_bytes_ = 0;
};

// Deterministic uniform value of element `index` of a table filled from `seed`: the same for
// any thread count and any platform.
float uniform_at(uint64_t seed, uint64_t index, float lo, float hi) noexcept;

// The mixer behind uniform_at; also the sharded embedding's hash sharding rule (a public contract
// there), so it never changes.
uint64_t splitmix64(uint64_t x) noexcept;

}  // namespace gradsync::table
