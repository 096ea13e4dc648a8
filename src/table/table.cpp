// SPDX-License-Identifier: Apache-2.0
#include "table/table.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <thread>

#include <boost/interprocess/exceptions.hpp>

#include "common/bounded_wait.hpp"
#include "common/dtype.hpp"
#include "common/durable.hpp"
#include "common/error.hpp"
#include "common/fnv.hpp"
#include "common/log.hpp"

namespace gradsync::table {
namespace bip = boost::interprocess;

namespace {

// Lets Boost.Interprocess map the descriptor we opened and validated, rather than reopening the
// path (which another process could have replaced in between).
struct FdMappable {
  int fd;
  bip::mapping_handle_t get_mapping_handle() const noexcept {
    return bip::ipcdetail::mapping_handle_from_file_handle(fd);
  }
};

struct Layout {
  uint64_t data_bytes;
  uint64_t aux_offset;
  uint64_t file_bytes;
};

// Sizes of a table of rows x dim f32 plus an aux region; false on 64-bit overflow.
bool compute_layout(uint64_t rows, uint64_t dim, uint64_t aux_bytes, Layout& out) {
  uint64_t elems = 0;
  uint64_t data = 0;
  if (__builtin_mul_overflow(rows, dim, &elems) || __builtin_mul_overflow(elems, uint64_t{sizeof(float)}, &data))
    return false;
  constexpr uint64_t kMax = std::numeric_limits<int64_t>::max() / 2;  // room for rounding and offsets
  if (data > kMax || aux_bytes > kMax) return false;
  out.data_bytes = data;
  out.aux_offset = kDataOffset + round_up(data, kPageBytes);
  out.file_bytes = out.aux_offset + round_up(aux_bytes, kPageBytes);
  return out.file_bytes <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
}

const char* kind_name(uint32_t kind) {
  switch (static_cast<FileKind>(kind)) {
    case FileKind::Table: return "a table";
    case FileKind::Accumulator: return "an accumulator's gradient file";
  }
  return "an unknown kind of file";
}

// Checks one header slot. Returns GRADSYNC_OK, or a status with `why` set.
int validate_slot(const FileHeader& h, std::string& why) {
  if (h.magic == __builtin_bswap32(kMagic)) {
    why = "written on a machine of the other byte order";
    return GRADSYNC_E_VERSION_MISMATCH;
  }
  if (h.magic != kMagic) {
    why = fmt::format("bad magic 0x{:08x} (expected 0x{:08x})", h.magic, kMagic);
    return GRADSYNC_E_CORRUPT;
  }
  if (h.format_version != kFormatVersion) {
    why = fmt::format("format version {}, this library reads version {}", h.format_version, kFormatVersion);
    return GRADSYNC_E_VERSION_MISMATCH;
  }
  if (h.checksum != header_checksum(h)) {
    why = fmt::format("checksum 0x{:016x} does not match its contents (0x{:016x})", h.checksum, header_checksum(h));
    return GRADSYNC_E_CORRUPT;
  }
  Layout l{};
  if (h.header_bytes != sizeof(FileHeader) || h.page_bytes != kPageBytes || h.data_offset != kDataOffset) {
    why = fmt::format("header size {}, page size {}, data offset {} (expected {}, {}, {})", h.header_bytes,
                      h.page_bytes, h.data_offset, sizeof(FileHeader), kPageBytes, kDataOffset);
    return GRADSYNC_E_CORRUPT;
  }
  if (h.rows == 0 || h.dim == 0 || !compute_layout(h.rows, h.dim, h.aux_bytes, l)) {
    why = fmt::format("impossible shape {} x {} with {} aux bytes", h.rows, h.dim, h.aux_bytes);
    return GRADSYNC_E_CORRUPT;
  }
  if (h.dtype != GRADSYNC_F32) {
    // Element sizes are only known for f32 so far; any other dtype is an honest file we cannot use.
    why = fmt::format("dtype {}, this library reads f32 tables only", h.dtype);
    return GRADSYNC_E_VERSION_MISMATCH;
  }
  if (h.data_bytes != l.data_bytes || h.aux_offset != l.aux_offset || h.file_bytes != l.file_bytes) {
    why = fmt::format(
        "sizes disagree with the shape {} x {}: data {} (expected {}), aux offset {} (expected {}), "
        "file {} (expected {})",
        h.rows, h.dim, h.data_bytes, l.data_bytes, h.aux_offset, l.aux_offset, h.file_bytes, l.file_bytes);
    return GRADSYNC_E_CORRUPT;
  }
  for (uint8_t b : h.reserved) {
    if (b != 0) {
      why = "reserved bytes are not zero";
      return GRADSYNC_E_CORRUPT;
    }
  }
  if (h.kind != static_cast<uint32_t>(FileKind::Table) && h.kind != static_cast<uint32_t>(FileKind::Accumulator)) {
    why = fmt::format("unknown file kind {}", h.kind);
    return GRADSYNC_E_VERSION_MISMATCH;
  }
  return GRADSYNC_OK;
}

void pread_exact(int fd, void* buf, size_t n, off_t offset, const std::string& path) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, offset);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail(GRADSYNC_E_IO, "cannot read '{}': {}", path, errno_text(errno));
    if (r == 0) fail(GRADSYNC_E_CORRUPT, "'{}' ended while reading its header", path);
    p += r;
    n -= static_cast<size_t>(r);
    offset += r;
  }
}

void pwrite_exact(int fd, const void* buf, size_t n, off_t offset, const std::string& path) {
  const auto* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t r = ::pwrite(fd, p, n, offset);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0)
      fail(errno == ENOSPC ? GRADSYNC_E_NO_SPACE : GRADSYNC_E_IO, "cannot write '{}': {}", path, errno_text(errno));
    p += r;
    n -= static_cast<size_t>(r);
    offset += r;
  }
}

void flock_retry(int fd, int op) {
  while (::flock(fd, op) != 0) {
    if (errno != EINTR) fail(GRADSYNC_E_IO, "flock failed: {}", errno_text(errno));
  }
}

// The shared lock of an opener while another holds the file exclusively: polled, so that a holder
// that is stopped or stuck gives E_TIMEOUT instead of a hang.
void flock_shared_within(int fd, std::chrono::milliseconds timeout, const std::string& path) {
  auto shared_lock = [&] {
    if (::flock(fd, LOCK_SH | LOCK_NB) == 0) return WaitResult::Ready;
    if (errno != EWOULDBLOCK && errno != EINTR) fail(GRADSYNC_E_IO, "cannot lock '{}': {}", path, errno_text(errno));
    return WaitResult::Timeout;
  };
  auto deadline = deadline_after(timeout);
  GS_REQUIRE(
      bounded_wait(polled(shared_lock, std::chrono::microseconds(50), std::chrono::milliseconds(20)), wait_never,
                   wait_never, wait_silent, wait_ends, deadline, std::chrono::nanoseconds::max()) == WaitEnd::Ready,
      GRADSYNC_E_TIMEOUT,
      "'{}': another process has held it exclusively for more than {} ms while opening it (a lone opener "
      "checks, repairs and allocates the file under that lock): it is stopped or stuck, or the file is very "
      "large; try again once it has opened the file",
      path, timeout.count());
}

void fsync_directory_of(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  fsync_directory(parent.empty() ? std::string(".") : parent.string());
}

uint64_t aux_bytes_of(const OpenSpec& spec, int64_t rows) {
  return spec.aux_bytes_for_rows != nullptr ? spec.aux_bytes_for_rows(rows) : 0;
}

FileHeader make_header(const OpenSpec& spec, const Layout& l) {
  FileHeader h{};
  h.magic = kMagic;
  h.format_version = kFormatVersion;
  h.header_bytes = sizeof(FileHeader);
  h.kind = static_cast<uint32_t>(spec.kind);
  h.dtype = GRADSYNC_F32;
  h.page_bytes = kPageBytes;
  h.rows = static_cast<uint64_t>(spec.rows);
  h.dim = static_cast<uint64_t>(spec.dim);
  h.generation = 0;
  h.data_offset = kDataOffset;
  h.data_bytes = l.data_bytes;
  h.aux_offset = l.aux_offset;
  h.aux_bytes = aux_bytes_of(spec, spec.rows);
  h.file_bytes = l.file_bytes;
  h.checksum = header_checksum(h);
  return h;
}

std::atomic<uint64_t> g_tmp_counter{0};

}  // namespace

uint64_t splitmix64(uint64_t x) noexcept { return mix64(x + 0x9e3779b97f4a7c15ull); }

float uniform_at(uint64_t seed, uint64_t index, float lo, float hi) noexcept {
  const uint64_t bits = splitmix64(splitmix64(seed) ^ index) >> 40;  // 24 random bits
  const float u = static_cast<float>(bits) * (1.0f / 16777216.0f);
  const float width = hi - lo;
  // A range wider than the largest float (-FLT_MAX to FLT_MAX) is spanned in double, so every
  // value stays finite; narrower ones keep the float formula (and its values, for old seeds).
  if (!std::isfinite(width)) return static_cast<float>(lo + (static_cast<double>(hi) - lo) * u);
  return lo + width * u;
}

Table::~Table() {
  guard_.reset();
  region_ = bip::mapped_region();
  if (anon_base_ != nullptr) ::munmap(anon_base_, anon_bytes_);
  if (fd_ >= 0) ::close(fd_);  // also drops our flock
}

void Table::adopt(const FileHeader& h) {
  header_ = h;
  rows_ = static_cast<int64_t>(h.rows);
  dim_ = static_cast<int64_t>(h.dim);
  generation_ = h.generation;
  aux_bytes_ = h.aux_bytes;
}

void Table::map_file(const std::string& path, int fd, uint64_t file_bytes) {
  try {
    region_ = bip::mapped_region(FdMappable{fd}, read_only_ ? bip::read_only : bip::read_write, 0,
                                 static_cast<size_t>(file_bytes));
  } catch (const bip::interprocess_exception& e) {
    fail(GRADSYNC_E_IO, "cannot map '{}' ({} bytes): {}", path, file_bytes, e.what());
  }
  base_ = static_cast<char*>(region_.get_address());
  mapped_bytes_ = file_bytes;
  guard_ =
      mapguard::Registration(base_, static_cast<size_t>(file_bytes), read_only_ ? PROT_READ : PROT_READ | PROT_WRITE);
  data_ = reinterpret_cast<float*>(base_ + kDataOffset);
  aux_ = header_.aux_bytes > 0 ? base_ + header_.aux_offset : nullptr;
}

void Table::write_header_slot(const FileHeader& h, int slot) {
  char page[kPageBytes] = {};
  std::memcpy(page, &h, sizeof h);
  pwrite_exact(fd_, page, sizeof page, static_cast<off_t>(slot * kPageBytes), path_);
}

namespace {
const char* file_type_name(mode_t mode) {
  if (S_ISDIR(mode)) return "directory";
  if (S_ISFIFO(mode)) return "FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "socket";
  if (S_ISCHR(mode)) return "character device";
  if (S_ISBLK(mode)) return "block device";
  return "special file";
}
}  // namespace

std::unique_ptr<Table> Table::open(const OpenSpec& spec) {
  const bool creating = spec.mode != OpenMode::Open;
  GS_REQUIRE(spec.mode >= OpenMode::Create && spec.mode <= OpenMode::Anonymous, GRADSYNC_E_INVALID_ARG,
             "unknown open mode {}", static_cast<int32_t>(spec.mode));
  GS_REQUIRE(!spec.read_only || spec.mode == OpenMode::Open, GRADSYNC_E_INVALID_ARG,
             "read-only is only for opening an existing file (mode open)");
  if (creating) {
    GS_REQUIRE(spec.rows >= 1, GRADSYNC_E_INVALID_ARG, "rows must be at least 1 to create a table, got {}", spec.rows);
    GS_REQUIRE(spec.dim >= 1, GRADSYNC_E_INVALID_ARG, "dim must be at least 1 to create a table, got {}", spec.dim);
  } else {
    GS_REQUIRE(spec.rows == -1 || spec.rows >= 1, GRADSYNC_E_INVALID_ARG, "rows must be at least 1, got {}", spec.rows);
    GS_REQUIRE(spec.dim == -1 || spec.dim >= 1, GRADSYNC_E_INVALID_ARG, "dim must be at least 1, got {}", spec.dim);
  }
  GS_REQUIRE(spec.init == Init::Zeros || spec.init == Init::Uniform, GRADSYNC_E_INVALID_ARG, "unknown init {}",
             static_cast<int32_t>(spec.init));
  GS_REQUIRE(std::isfinite(spec.lo) && std::isfinite(spec.hi) && spec.lo <= spec.hi, GRADSYNC_E_INVALID_ARG,
             "uniform init needs finite lo <= hi, got [{}, {}]", spec.lo, spec.hi);
  Layout layout{};
  if (creating) {
    GS_REQUIRE(compute_layout(static_cast<uint64_t>(spec.rows), static_cast<uint64_t>(spec.dim),
                              aux_bytes_of(spec, spec.rows), layout),
               GRADSYNC_E_INVALID_ARG, "{} x {} floats do not fit in a file", spec.rows, spec.dim);
  }
  std::unique_ptr<Table> t(new Table());

  if (spec.mode == OpenMode::Anonymous) {
    FileHeader h = make_header(spec, layout);
    t->adopt(h);
    const uint64_t bytes = layout.file_bytes - kDataOffset;
    // Private anonymous memory rather than a shared segment: handles never cross fork(), and private
    // memory can use transparent huge pages, which spare random row accesses most TLB misses
    // (shared anonymous memory is shmem, where THP is usually off). 2 MB-aligned for the same reason.
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t reserve = static_cast<size_t>(bytes) + kHuge;
    void* p = ::mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      fail(GRADSYNC_E_NOMEM, "cannot map {} bytes of anonymous memory for a {} x {} table: {}", bytes, spec.rows,
           spec.dim, errno_text(errno));
    t->anon_base_ = p;
    t->anon_bytes_ = reserve;
    const auto aligned = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) / kHuge * kHuge;
    ::madvise(reinterpret_cast<void*>(aligned), static_cast<size_t>(bytes), MADV_HUGEPAGE);  // a hint only
    t->base_ = reinterpret_cast<char*>(aligned) - kDataOffset;                               // offsets as in a file
    t->mapped_bytes_ = layout.file_bytes;
    t->data_ = reinterpret_cast<float*>(t->base_ + kDataOffset);
    t->aux_ = h.aux_bytes > 0 ? t->base_ + h.aux_offset : nullptr;
    t->created_ = true;
    t->exclusive_ = true;
    if (spec.init == Init::Uniform) t->fill_uniform(spec.seed, spec.lo, spec.hi);
    if (spec.init_aux != nullptr) spec.init_aux(t->aux_, h.aux_bytes, spec.rows, spec.init_aux_user);
    return t;
  }

  GS_REQUIRE(!spec.path.empty(), GRADSYNC_E_INVALID_ARG, "path is empty");
  t->path_ = spec.path;
  t->read_only_ = spec.read_only;

  // Opens an existing file; false if it does not exist (and the mode may create it).
  auto open_existing = [&]() -> bool {
    // O_NONBLOCK: a FIFO at the path must not block the open; it is refused below.
    int fd = ::open(spec.path.c_str(), (spec.read_only ? O_RDONLY : O_RDWR) | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      struct stat link {};
      if (err == ENOENT && ::lstat(spec.path.c_str(), &link) == 0 && S_ISLNK(link.st_mode)) {
        fail(GRADSYNC_E_IO, "cannot open '{}': it is a symbolic link to a file that does not exist", spec.path);
      }
      if (err == ENOENT && spec.mode == OpenMode::CreateOrOpen) return false;
      fail(err == EACCES ? GRADSYNC_E_PERMISSION : GRADSYNC_E_IO, "cannot open '{}': {}", spec.path, errno_text(err));
    }
    t->fd_ = fd;
    {
      struct stat st {};
      if (::fstat(fd, &st) != 0) fail(GRADSYNC_E_IO, "cannot stat '{}': {}", spec.path, errno_text(errno));
      GS_REQUIRE(S_ISREG(st.st_mode), GRADSYNC_E_INVALID_ARG, "'{}' is not a regular file but a {}", spec.path,
                 file_type_name(st.st_mode));
      // Another user's file could hold anything, and change under us: trusted only when asked.
      GS_REQUIRE(spec.access.allow_other_owner || st.st_uid == ::geteuid(), GRADSYNC_E_PERMISSION,
                 "'{}' belongs to uid {}, not to this user (uid {}); refusing to use another user's file unless "
                 "allow_other_owner is set",
                 spec.path, st.st_uid, ::geteuid());
      if (::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0)
        fail(GRADSYNC_E_IO, "cannot set up '{}': {}", spec.path, errno_text(errno));
    }
    // A shared flock marks "open by someone"; whoever gets it exclusively is alone and may repair.
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {
      t->exclusive_ = true;
    } else if (errno == EWOULDBLOCK || errno == EINTR) {
      flock_shared_within(fd, spec.open_lock_timeout, spec.path);
    } else {
      fail(GRADSYNC_E_IO, "cannot lock '{}': {}", spec.path, errno_text(errno));
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) fail(GRADSYNC_E_IO, "cannot stat '{}': {}", spec.path, errno_text(errno));
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    GS_REQUIRE(size >= kDataOffset, GRADSYNC_E_CORRUPT,
               "'{}' is {} bytes, shorter than its two header pages ({} bytes): not a table file or truncated",
               spec.path, size, kDataOffset);
    FileHeader slots[2];
    pread_exact(fd, &slots[0], sizeof(FileHeader), 0, spec.path);
    pread_exact(fd, &slots[1], sizeof(FileHeader), static_cast<off_t>(kPageBytes), spec.path);
    std::string why[2];
    int status[2] = {validate_slot(slots[0], why[0]), validate_slot(slots[1], why[1])};
    int pick = -1;
    for (int s = 0; s < 2; ++s) {
      if (status[s] != GRADSYNC_OK) continue;
      if (pick < 0 || slots[s].generation > slots[pick].generation) pick = s;
    }
    if (status[0] == GRADSYNC_OK && status[1] == GRADSYNC_OK) {
      // Two valid slots describe one file: every field but the generation (and the checksum that
      // covers it) must agree, or one of them was forged or written by another program.
      FileHeader a = slots[0], b = slots[1];
      a.generation = b.generation = 0;
      a.checksum = b.checksum = 0;
      GS_REQUIRE(std::memcmp(&a, &b, sizeof a) == 0, GRADSYNC_E_CORRUPT,
                 "'{}': its two header slots disagree (rows {} and {}, dim {} and {}, file bytes {} and {}); only the "
                 "generation may differ",
                 spec.path, slots[0].rows, slots[1].rows, slots[0].dim, slots[1].dim, slots[0].file_bytes,
                 slots[1].file_bytes);
    }
    if (pick < 0) {
      const int st_out = (status[0] == GRADSYNC_E_VERSION_MISMATCH || status[1] == GRADSYNC_E_VERSION_MISMATCH)
                             ? GRADSYNC_E_VERSION_MISMATCH
                             : GRADSYNC_E_CORRUPT;
      if (why[0] == why[1]) fail(st_out, "'{}' has no valid header: both slots: {}", spec.path, why[0]);
      fail(st_out, "'{}' has no valid header: slot 0: {}; slot 1: {}", spec.path, why[0], why[1]);
    }
    if (status[1 - pick] != GRADSYNC_OK)
      GS_LOG_WARN("'{}': header slot {} is damaged ({}); using slot {} (generation {})", spec.path, 1 - pick,
                  why[1 - pick], pick, slots[pick].generation);
    const FileHeader& h = slots[pick];
    GS_REQUIRE(size == h.file_bytes, GRADSYNC_E_CORRUPT,
               "'{}' is {} bytes but its header says {} ({} x {}): truncated or extended", spec.path, size,
               h.file_bytes, h.rows, h.dim);
    GS_REQUIRE(h.kind == static_cast<uint32_t>(spec.kind), GRADSYNC_E_MISMATCH, "'{}' is {}, asked for {}", spec.path,
               kind_name(h.kind), kind_name(static_cast<uint32_t>(spec.kind)));
    const bool rows_ok = spec.rows == -1 || static_cast<uint64_t>(spec.rows) == h.rows;
    const bool dim_ok = spec.dim == -1 || static_cast<uint64_t>(spec.dim) == h.dim;
    if (!rows_ok || !dim_ok) {
      fail(GRADSYNC_E_MISMATCH, "'{}': file has {} x {}, asked for {} x {}", spec.path, h.rows, h.dim,
           spec.rows == -1 ? std::string("any") : std::to_string(spec.rows),
           spec.dim == -1 ? std::string("any") : std::to_string(spec.dim));
    }
    const uint64_t aux_expected = aux_bytes_of(spec, static_cast<int64_t>(h.rows));
    GS_REQUIRE(h.aux_bytes == aux_expected, GRADSYNC_E_CORRUPT,
               "'{}' has a state region of {} bytes; {} with {} rows needs {}", spec.path, h.aux_bytes,
               kind_name(h.kind), h.rows, aux_expected);
    if (!spec.read_only) {
      // A sparse file (a copy made with cp --sparse, say) has holes; a write through the mapping
      // into a hole on a full file system raises SIGBUS. Allocating every block now turns that
      // into this error (a no-op for blocks already there).
      const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(h.file_bytes));
      if (rc == ENOSPC || rc == EFBIG || rc == EDQUOT)
        fail(GRADSYNC_E_NO_SPACE, "cannot open '{}' for writing: allocating its {} bytes (it has holes) failed: {}",
             spec.path, h.file_bytes, errno_text(rc));
      if (rc != 0 && rc != EOPNOTSUPP)
        fail(GRADSYNC_E_IO, "cannot allocate the blocks of '{}': {}", spec.path, errno_text(rc));
    }
    t->adopt(h);
    t->map_file(spec.path, fd, h.file_bytes);
    return true;
  };

  // Builds the whole file under a private name and links it into place, so no other process
  // ever sees a half-initialised table and a crash during creation leaves no file at `path`.
  auto create_new = [&]() -> bool {
    const std::string tmp = fmt::format("{}.creating.{}.{}", spec.path, ::getpid(), g_tmp_counter.fetch_add(1));
    int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) fail(GRADSYNC_E_IO, "cannot create '{}': {}", tmp, errno_text(errno));
    t->fd_ = fd;
    if (::fchmod(fd, static_cast<mode_t>(spec.access.mode)) != 0) {
      const int err = errno;
      ::unlink(tmp.c_str());
      fail(GRADSYNC_E_IO, "cannot set mode {:04o} on '{}': {}", spec.access.mode, tmp, errno_text(err));
    }
    bool linked = false;
    try {
      flock_retry(fd, LOCK_EX);
      int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(layout.file_bytes));
      if (rc == ENOSPC || rc == EFBIG)
        fail(GRADSYNC_E_NO_SPACE, "cannot create '{}': {} x {} needs {} bytes: {}", spec.path, spec.rows, spec.dim,
             layout.file_bytes, errno_text(rc));
      if (rc != 0) {  // a file system without fallocate: size the file sparsely instead
        if (::ftruncate(fd, static_cast<off_t>(layout.file_bytes)) != 0)
          fail(errno == ENOSPC ? GRADSYNC_E_NO_SPACE : GRADSYNC_E_IO, "cannot size '{}' to {} bytes: {}", tmp,
               layout.file_bytes, errno_text(errno));
      }
      FileHeader h = make_header(spec, layout);
      t->adopt(h);
      t->path_ = tmp;
      t->write_header_slot(h, 0);
      t->write_header_slot(h, 1);
      t->map_file(tmp, fd, layout.file_bytes);
      if (spec.init == Init::Uniform) t->fill_uniform(spec.seed, spec.lo, spec.hi);
      if (spec.init_aux != nullptr) spec.init_aux(t->aux_, h.aux_bytes, spec.rows, spec.init_aux_user);
      if (::msync(t->base_, t->mapped_bytes_, MS_SYNC) != 0 || ::fsync(fd) != 0)
        fail(GRADSYNC_E_IO, "cannot sync '{}': {}", tmp, errno_text(errno));
      if (::link(tmp.c_str(), spec.path.c_str()) != 0) {
        const int err = errno;
        if (err != EEXIST) fail(GRADSYNC_E_IO, "cannot create '{}': {}", spec.path, errno_text(err));
      } else {
        linked = true;
      }
    } catch (...) {
      ::unlink(tmp.c_str());
      throw;
    }
    ::unlink(tmp.c_str());
    t->path_ = spec.path;
    if (!linked) {
      t->guard_.reset();
      t->region_ = bip::mapped_region();
      ::close(t->fd_);
      t->fd_ = -1;
      if (spec.mode == OpenMode::Create)
        fail(GRADSYNC_E_IO, "cannot create '{}': the file already exists (mode create)", spec.path);
      return false;
    }
    fsync_directory_of(spec.path);
    t->created_ = true;
    t->exclusive_ = true;
    return true;
  };

  switch (spec.mode) {
    case OpenMode::Open: open_existing(); break;
    case OpenMode::Create: create_new(); break;
    default:
      // Another process may create or remove the file between our attempts; a few rounds settle it.
      for (int attempt = 0;; ++attempt) {
        if (open_existing() || create_new()) break;
        GS_REQUIRE(attempt < 8, GRADSYNC_E_IO, "'{}' keeps appearing and disappearing", spec.path);
      }
  }
  if (!spec.keep_exclusive) t->release_exclusive();
  return t;
}

void Table::release_exclusive() {
  if (!exclusive_) return;
  exclusive_ = false;
  if (fd_ >= 0) flock_retry(fd_, LOCK_SH);
}

void Table::check_row(int64_t row) const {
  if (row < 0 || row >= rows_) fail(GRADSYNC_E_OUT_OF_RANGE, "row {} out of range [0, {})", row, rows_);
}

void Table::check_rows(const int64_t* rows, size_t n) const {
  GS_REQUIRE(n == 0 || rows != nullptr, GRADSYNC_E_INVALID_ARG, "row ids are NULL");
  const uint64_t limit = static_cast<uint64_t>(rows_);
  for (size_t i = 0; i < n; ++i) {
    if (static_cast<uint64_t>(rows[i]) >= limit && n == 1) check_row(rows[i]);
    if (static_cast<uint64_t>(rows[i]) >= limit)
      fail(GRADSYNC_E_OUT_OF_RANGE, "row {} (entry {} of {}) out of range [0, {})", rows[i], i, n, rows_);
  }
}

void Table::check_count(size_t count, size_t rows_in_call, const char* what) const {
  size_t expected = 0;
  if (__builtin_mul_overflow(rows_in_call, static_cast<size_t>(dim_), &expected) || count != expected) {
    if (rows_in_call == 1)
      fail(GRADSYNC_E_INVALID_ARG, "{} has {} floats, the table's rows have dim {}", what, count, dim_);
    fail(GRADSYNC_E_INVALID_ARG, "{} has {} floats, {} rows x dim {} need {}", what, count, rows_in_call, dim_,
         static_cast<unsigned __int128>(rows_in_call) * static_cast<unsigned>(dim_) > SIZE_MAX ? SIZE_MAX : expected);
  }
}

void Table::check_writable() const { GS_REQUIRE(!read_only_, GRADSYNC_E_MISUSE, "'{}' was opened read-only", path_); }

void Table::check_mapping() const {
  if (!guard_.faulted()) return;
  struct stat st {};
  const long long now = ::fstat(fd_, &st) == 0 ? static_cast<long long>(st.st_size) : -1;
  fail(GRADSYNC_E_IO,
       "'{}' shrank under its mapping (now {} bytes, {} expected): another process truncated it; "
       "this handle no longer reads or writes the file: free it and reopen",
       path_, now, mapped_bytes_);
}

void Table::get(int64_t row, float* out, size_t count) const {
  check_mapping();
  GS_REQUIRE(out != nullptr, GRADSYNC_E_INVALID_ARG, "output buffer is NULL");
  check_row(row);
  check_count(count, 1, "the output buffer");
  std::memcpy(out, row_ptr(row), count * sizeof(float));
  check_mapping();
}

void Table::set(int64_t row, const float* values, size_t count) {
  check_mapping();
  check_writable();
  GS_REQUIRE(values != nullptr, GRADSYNC_E_INVALID_ARG, "values are NULL");
  check_row(row);
  check_count(count, 1, "the row");
  // memmove: values may be read from this table's own view (gradsync_table_view), even overlapping the row.
  std::memmove(row_ptr(row), values, count * sizeof(float));
  check_mapping();
}

void Table::gather(const int64_t* rows, size_t n, float* out, size_t count) const {
  check_mapping();
  GS_REQUIRE(n == 0 || out != nullptr, GRADSYNC_E_INVALID_ARG, "output buffer is NULL");
  check_count(count, n, "the output buffer");  // first: a bad n must not walk the ids
  check_rows(rows, n);
  const size_t d = static_cast<size_t>(dim_);
  for (size_t i = 0; i < n; ++i) std::memcpy(out + i * d, row_ptr(rows[i]), d * sizeof(float));
  check_mapping();
}

void Table::scatter(const int64_t* rows, size_t n, const float* values, size_t count) {
  check_mapping();
  check_writable();
  GS_REQUIRE(n == 0 || values != nullptr, GRADSYNC_E_INVALID_ARG, "values are NULL");
  check_count(count, n, "the values");  // first: a bad n must not walk the ids
  check_rows(rows, n);
  const size_t d = static_cast<size_t>(dim_);
  for (size_t i = 0; i < n; ++i) std::memmove(row_ptr(rows[i]), values + i * d, d * sizeof(float));  // as in set()
  check_mapping();
}

void Table::fill_zero() {
  check_mapping();
  check_writable();
  std::memset(data_, 0, data_bytes());
  check_mapping();
}

void Table::fill_uniform(uint64_t seed, float lo, float hi) {
  check_mapping();
  check_writable();
  GS_REQUIRE(std::isfinite(lo) && std::isfinite(hi) && lo <= hi, GRADSYNC_E_INVALID_ARG,
             "uniform init needs finite lo <= hi, got [{}, {}]", lo, hi);
  const size_t n = data_bytes() / sizeof(float);
  for (size_t i = 0; i < n; ++i) data_[i] = uniform_at(seed, i, lo, hi);
  check_mapping();
}

void Table::flush() {
  if (fd_ < 0 || read_only_) return;  // nothing of ours to make durable
  std::lock_guard lock(flush_mutex_);
  check_mapping();  // msync of what is anonymous memory now would report a durable write
  GS_REQUIRE(!fatal_, GRADSYNC_E_IO,
             "'{}': an earlier flush failed while writing its header; the handle is unusable, reopen the file", path_);
  // 1. data and aux region, then 2. the next header slot: a crash between the two leaves the
  // previous header, which describes the same shape, so the file always opens.
  if (::msync(base_ + kDataOffset, mapped_bytes_ - kDataOffset, MS_SYNC) != 0)
    fail(GRADSYNC_E_IO, "cannot write back '{}': {}", path_, errno_text(errno));
  if (::fdatasync(fd_) != 0) fail(GRADSYNC_E_IO, "cannot sync '{}': {}", path_, errno_text(errno));
  // Another process may have flushed the same file: continue from the highest generation on disk.
  uint64_t g = generation_.load();
  for (int s = 0; s < 2; ++s) {
    FileHeader h{};
    pread_exact(fd_, &h, sizeof h, static_cast<off_t>(s * kPageBytes), path_);
    std::string why;
    if (validate_slot(h, why) == GRADSYNC_OK) g = std::max(g, h.generation);
  }
  FileHeader next = header_;
  next.generation = g + 1;
  next.checksum = header_checksum(next);
  // A header write that failed half-way leaves the on-disk slots in an unknown state: as LMDB
  // does, refuse further flushes through this handle (a reopen picks the valid slot).
  try {
    write_header_slot(next, static_cast<int>(next.generation & 1));
    if (::fdatasync(fd_) != 0) fail(GRADSYNC_E_IO, "cannot sync the header of '{}': {}", path_, errno_text(errno));
  } catch (...) {
    fatal_ = true;
    throw;
  }
  generation_ = next.generation;
}

void Table::prefetch(const int64_t* rows, size_t n) const {
  check_rows(rows, n);
  if (fd_ < 0) return;  // anonymous memory is never paged in from a file
  const size_t row_bytes = static_cast<size_t>(dim_) * sizeof(float);
  const uintptr_t page = kPageBytes;
  uintptr_t run_begin = 0, run_end = 0;
  auto advise = [&] {
    if (run_end > run_begin) ::madvise(reinterpret_cast<void*>(run_begin), run_end - run_begin, MADV_WILLNEED);
  };
  // Coalesces runs of neighbouring pages so that sorted or clustered ids cost few system calls.
  for (size_t i = 0; i < n; ++i) {
    const auto b = reinterpret_cast<uintptr_t>(row_ptr(rows[i]));
    const uintptr_t lo = b / page * page;
    const uintptr_t hi = (b + row_bytes + page - 1) / page * page;
    if (lo <= run_end && hi >= run_begin && run_end > run_begin) {
      run_begin = std::min(run_begin, lo);
      run_end = std::max(run_end, hi);
    } else {
      advise();
      run_begin = lo;
      run_end = hi;
    }
  }
  advise();
}

}  // namespace gradsync::table
