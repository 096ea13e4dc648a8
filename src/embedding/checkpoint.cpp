// SPDX-License-Identifier: Apache-2.0
// Saving and loading the sharded embedding (formats in embedding/checkpoint.hpp).
#include "embedding/checkpoint.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <system_error>
#include <vector>

#include "common/durable.hpp"
#include "common/error.hpp"
#include "common/fnv.hpp"
#include "optim/optim.hpp"

namespace gradsync::embedding {

namespace checkpoint {

std::string part_name(int part, int parts, uint64_t nonce) {
  return fmt::format("part-{:05d}-of-{:05d}-{:016x}.gsemb", part, parts, nonce);
}

void Checksum::update(const void* data, size_t n) noexcept {
  if (n == 0) return;  // data may then be NULL, which memcpy must not see
  const auto* p = static_cast<const unsigned char*>(data);
  length_ += n;
  auto step = [this](const unsigned char* w) {
    uint64_t word;
    std::memcpy(&word, w, 8);
    h_ = (h_ ^ word) * 0x100000001b3ull;
  };
  if (ntail_ > 0) {
    const size_t take = std::min(n, sizeof tail_ - ntail_);
    std::memcpy(tail_ + ntail_, p, take);
    ntail_ += take;
    p += take;
    n -= take;
    if (ntail_ < sizeof tail_) return;
    step(tail_);
    ntail_ = 0;
  }
  for (; n >= 8; n -= 8, p += 8) step(p);
  std::memcpy(tail_, p, n);
  ntail_ = n;
}

uint64_t Checksum::value() const noexcept {
  uint64_t h = h_;
  if (ntail_ > 0) {
    unsigned char last[8] = {};
    std::memcpy(last, tail_, ntail_);
    uint64_t word;
    std::memcpy(&word, last, 8);
    h = (h ^ word) * 0x100000001b3ull;
  }
  return (h ^ length_) * 0x100000001b3ull;
}

}  // namespace checkpoint

namespace {

using namespace checkpoint;

class Fd {
 public:
  explicit Fd(int fd) noexcept : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const noexcept { return fd_; }
  // A close that reports: on some file systems the write's error shows only here.
  void close(const std::string& path) {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail(GRADSYNC_E_IO, "cannot close '{}': {}", path, errno_text(errno));
  }

 private:
  int fd_;
};

int write_status(int err) {
  return err == ENOSPC || err == EDQUOT || err == EFBIG ? GRADSYNC_E_NO_SPACE : GRADSYNC_E_IO;
}

void pwrite_all(int fd, const void* data, size_t n, uint64_t offset, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, std::min<size_t>(n, size_t{1} << 30), static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0)
      fail(write_status(w < 0 ? errno : ENOSPC), "cannot write '{}': {}", path, errno_text(w < 0 ? errno : ENOSPC));
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
}

// Reads exactly n bytes; a file that ends first is a damaged one.
void pread_all(int fd, void* data, size_t n, uint64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, std::min<size_t>(n, size_t{1} << 30), static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail(GRADSYNC_E_IO, "cannot read '{}': {}", path, errno_text(errno));
    if (r == 0) fail(GRADSYNC_E_CORRUPT, "'{}' ends early (truncated?)", path);
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

// Opens a file of a checkpoint to read. Without blocking: the files may be anyone's on this host,
// and a FIFO put in a file's place would otherwise hang the open (regular_file_size refuses it).
int open_for_reading(const std::string& path) { return ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK); }

// The size of an open checkpoint file, which must be a regular file (not a FIFO, device or
// directory, whose reads could block, never end, or fail in ways a damaged file does not).
uint64_t regular_file_size(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail(GRADSYNC_E_IO, "cannot stat '{}': {}", path, errno_text(errno));
  GS_REQUIRE(S_ISREG(st.st_mode), GRADSYNC_E_CORRUPT, "'{}' is not a regular file", path);
  return static_cast<uint64_t>(st.st_size);
}

// Writes pieces at their offsets into a new temporary file beside path, syncs it, renames it over
// path and syncs the directory: path holds either its old bytes or all the new ones.
template <class WriteBody>
void write_durably(const std::string& dir, const std::string& name, WriteBody&& body) {
  const std::string path = dir + "/" + name;
  // A name of its own, created here (O_EXCL): a link another user put at a temporary name is
  // never written through, and a second save into the directory cannot take this one's file.
  std::string tmp = path + ".XXXXXX.tmp";
  Fd fd(::mkostemps(tmp.data(), 4, O_CLOEXEC));
  if (fd.get() < 0) fail(write_status(errno), "cannot create '{}': {}", tmp, errno_text(errno));
  try {
    body(fd.get(), tmp);
    if (::fsync(fd.get()) != 0) fail(write_status(errno), "cannot sync '{}': {}", tmp, errno_text(errno));
    fd.close(tmp);
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      fail(GRADSYNC_E_IO, "cannot rename '{}' to '{}': {}", tmp, path, errno_text(errno));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_directory(dir);
}

template <class Header>
uint64_t header_checksum(const Header& h) noexcept {
  return fnv1a64(&h, offsetof(Header, header_checksum));
}

// Bytes of a part of count rows, or 0 when that overflows (the caller's bounds make it fit).
uint64_t part_bytes(uint64_t count, uint64_t dim, uint64_t state_width) noexcept {
  const uint64_t row = 8 + 4 * dim + 4 * state_width;
  if (count > (UINT64_MAX - sizeof(PartHeader)) / row) return 0;
  return sizeof(PartHeader) + count * row;
}

void make_directory(const std::string& dir) {
  GS_REQUIRE(!dir.empty(), GRADSYNC_E_INVALID_ARG, "the checkpoint directory is empty");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  GS_REQUIRE(!ec, GRADSYNC_E_IO, "cannot create the directory '{}': {}", dir, ec.message());
}

// Removes what earlier checkpoints (and interrupted saves) left of their parts, keeping those of
// the nonces the manifest names.
void remove_stale_parts(const std::string& dir, const std::vector<uint64_t>& keep) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  std::vector<std::string> stale;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    const bool part =
        name.rfind("part-", 0) == 0 &&
        (name.ends_with(".gsemb") || (name.find(".gsemb.") != std::string::npos && name.ends_with(".tmp")));
    const bool kept = std::any_of(keep.begin(), keep.end(), [&](uint64_t nonce) {
      const std::string tail = fmt::format("-{:016x}.gsemb", nonce);
      return name.ends_with(tail);
    });
    if (part && !kept) stale.push_back(name);
  }
  ::closedir(d);
  for (const std::string& name : stale) ::unlink((dir + "/" + name).c_str());
}

std::string optimizer_text(int32_t kind) { return optim::optimizer_name(static_cast<optim::RowOptimizer>(kind)); }

// Reads and writes go by chunks this large: long sequential transfers, each summed while it is
// in the core's cache (the checksum reads it, then the write copies it, or the read brings it).
constexpr size_t kChunkBytes = size_t{1} << 20;

}  // namespace

namespace checkpoint {

Manifest read_manifest(const std::string& dir) {
  GS_REQUIRE(!dir.empty(), GRADSYNC_E_INVALID_ARG, "the checkpoint directory is empty");
  const std::string mpath = dir + "/" + kManifestName;
  Fd fd(open_for_reading(mpath));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ENOENT) fail(GRADSYNC_E_IO, "no checkpoint in '{}' ({} is missing)", dir, kManifestName);
    fail(GRADSYNC_E_IO, "cannot open '{}': {}", mpath, errno_text(err));
  }
  const uint64_t size = regular_file_size(fd.get(), mpath);
  Manifest out;
  ManifestHeader& m = out.header;
  GS_REQUIRE(size >= sizeof m, GRADSYNC_E_CORRUPT, "'{}' has {} bytes, less than its header's {}", mpath, size,
             sizeof m);
  pread_all(fd.get(), &m, sizeof m, 0, mpath);
  GS_REQUIRE(std::memcmp(m.magic, kManifestMagic, sizeof m.magic) == 0, GRADSYNC_E_CORRUPT,
             "'{}' is not a checkpoint manifest (bad magic)", mpath);
  GS_REQUIRE(m.byte_order == kByteOrder, GRADSYNC_E_VERSION_MISMATCH, "'{}' was written with another byte order",
             mpath);
  GS_REQUIRE(m.format_version == kFormatVersion, GRADSYNC_E_VERSION_MISMATCH,
             "'{}' has format version {}, this library reads {}", mpath, m.format_version, kFormatVersion);
  GS_REQUIRE(m.header_checksum == header_checksum(m), GRADSYNC_E_CORRUPT, "'{}': header checksum mismatch", mpath);
  GS_REQUIRE(m.layers >= 1 && m.layers <= kMaxLayers, GRADSYNC_E_CORRUPT, "'{}' names {} layers", mpath, m.layers);
  GS_REQUIRE(m.parts >= 1 && m.parts <= static_cast<uint64_t>(kMaxLayers * kMaxParts), GRADSYNC_E_CORRUPT,
             "'{}' names {} parts", mpath, m.parts);
  const uint64_t expected =
      sizeof m + static_cast<uint64_t>(m.layers) * sizeof(LayerEntry) + m.parts * sizeof(PartEntry);
  GS_REQUIRE(size == expected, GRADSYNC_E_CORRUPT, "'{}' has {} bytes, its {} layers of {} parts need {}", mpath, size,
             m.layers, m.parts, expected);
  std::vector<char> tail(size - sizeof m);
  pread_all(fd.get(), tail.data(), tail.size(), sizeof m, mpath);
  GS_REQUIRE(m.entries_checksum == fnv1a64(tail.data(), tail.size()), GRADSYNC_E_CORRUPT,
             "'{}': layer and part list checksum mismatch", mpath);
  out.layers.resize(static_cast<size_t>(m.layers));
  std::memcpy(out.layers.data(), tail.data(), out.layers.size() * sizeof(LayerEntry));
  const char* at = tail.data() + out.layers.size() * sizeof(LayerEntry);
  uint64_t listed = 0;
  for (const LayerEntry& l : out.layers) {
    GS_REQUIRE(l.parts >= 1 && l.parts <= static_cast<uint64_t>(kMaxParts) && l.parts <= m.parts - listed,
               GRADSYNC_E_CORRUPT, "'{}': a layer of {} parts", mpath, l.parts);
    std::vector<PartEntry> entries(l.parts);
    std::memcpy(entries.data(), at + listed * sizeof(PartEntry), entries.size() * sizeof(PartEntry));
    listed += l.parts;
    uint64_t total = 0;
    for (const PartEntry& e : entries) {
      GS_REQUIRE(e.count <= static_cast<uint64_t>(m.rows) && m.rows >= 0, GRADSYNC_E_CORRUPT, "'{}': a part of {} rows",
                 mpath, e.count);
      total += e.count;
    }
    // The first layer is a full save: every row exactly once; later ones at most once each.
    GS_REQUIRE(out.parts.empty() ? total == static_cast<uint64_t>(m.rows) : total <= static_cast<uint64_t>(m.rows),
               GRADSYNC_E_CORRUPT, "'{}': layer {} holds {} rows of {}", mpath, out.parts.size(), total, m.rows);
    out.parts.push_back(std::move(entries));
  }
  GS_REQUIRE(listed == m.parts, GRADSYNC_E_CORRUPT, "'{}': its layers list {} parts, its header {}", mpath, listed,
             m.parts);
  return out;
}

void commit(const std::string& dir, const Manifest& m) {
  std::vector<char> tail;
  auto put = [&](const void* p, size_t n) {
    tail.insert(tail.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n);
  };
  put(m.layers.data(), m.layers.size() * sizeof(LayerEntry));
  for (const auto& entries : m.parts) put(entries.data(), entries.size() * sizeof(PartEntry));
  ManifestHeader h = m.header;
  h.entries_checksum = fnv1a64(tail.data(), tail.size());
  h.header_checksum = header_checksum(h);
  write_durably(dir, kManifestName, [&](int fd, const std::string& path) {
    pwrite_all(fd, &h, sizeof h, 0, path);
    pwrite_all(fd, tail.data(), tail.size(), sizeof h, path);
  });
  std::vector<uint64_t> keep;
  for (const LayerEntry& l : m.layers) keep.push_back(l.nonce);
  remove_stale_parts(dir, keep);
}

uint64_t write_part(const std::string& dir, PartHeader h, const int64_t* ids, const float* rows, const float* state,
                    const std::function<void()>& verify) {
  const uint64_t count = h.count, d = static_cast<uint64_t>(h.dim), sw = static_cast<uint64_t>(h.state_width);
  make_directory(dir);
  write_durably(dir, part_name(h.part, h.parts, h.nonce), [&](int fd, const std::string& path) {
    Checksum sum;
    uint64_t at = sizeof(PartHeader);
    auto put = [&](const void* data, size_t bytes) {
      const auto* p = static_cast<const char*>(data);
      for (size_t off = 0; off < bytes; off += kChunkBytes) {
        const size_t n = std::min(kChunkBytes, bytes - off);
        sum.update(p + off, n);
        pwrite_all(fd, p + off, n, at, path);
        at += n;
      }
    };
    put(ids, count * 8);
    put(rows, count * d * 4);
    if (sw != 0) put(state, count * sw * 4);
    verify();
    std::memcpy(h.magic, kPartMagic, sizeof h.magic);
    h.format_version = kFormatVersion;
    h.byte_order = kByteOrder;
    h.payload_checksum = sum.value();
    h.header_checksum = header_checksum(h);
    pwrite_all(fd, &h, sizeof h, 0, path);
  });
  return h.payload_checksum;
}

Staged read_rows(const std::string& dir, const Shape& shape, const std::vector<int64_t>& owned) {
  const auto d = static_cast<uint64_t>(shape.dim);
  const auto sw = static_cast<uint64_t>(shape.state_width);
  const uint64_t local = owned.size();
  Staged out;
  // Every row of the staged values is written before it is used (the full layer must give each),
  // so they are not cleared first: that would be a pass over the whole shard for nothing.
  out.manifest = read_manifest(dir);
  const Manifest& manifest = out.manifest;
  const ManifestHeader& m = manifest.header;
  GS_REQUIRE(m.rows == shape.rows && m.dim == shape.dim, GRADSYNC_E_MISMATCH,
             "checkpoint '{}' has {} x {}, the table {} x {}", dir, m.rows, m.dim, shape.rows, shape.dim);
  GS_REQUIRE(m.state_width == shape.state_width && m.optimizer == shape.optimizer, GRADSYNC_E_MISMATCH,
             "checkpoint '{}' holds the state of optimizer {} ({}, {} floats per row), the table uses {} ({})", dir,
             m.optimizer, optimizer_text(m.optimizer), m.state_width, shape.optimizer, optimizer_text(shape.optimizer));
  out.values = std::make_unique_for_overwrite<float[]>(std::max<uint64_t>(local * d, 1));
  float* values = out.values.get();
  std::vector<float>& state = out.state;
  state.resize(local * sw);
  std::vector<uint16_t> found(local, 0);
  const uint64_t row_bytes = d * 4;
  std::vector<int64_t> ids;
  std::vector<char> chunk;
  std::vector<std::pair<uint64_t, uint64_t>> mine;  // (index in part, local row)
  for (size_t layer = 0; layer < manifest.layers.size(); ++layer) {
    const LayerEntry& le = manifest.layers[layer];
    const auto nparts = static_cast<int>(le.parts);
    // found[l] == layer + 1: row l was read in this layer (a second time is a damaged layer).
    const auto mark = static_cast<uint16_t>(layer + 1);  // kMaxLayers < 2^16
    for (int p = 0; p < nparts; ++p) {
      const PartEntry& e = manifest.parts[layer][static_cast<size_t>(p)];
      const std::string path = dir + "/" + part_name(p, nparts, le.nonce);
      Fd fd(open_for_reading(path));
      if (fd.get() < 0) fail(GRADSYNC_E_CORRUPT, "cannot open the checkpoint's part '{}': {}", path, errno_text(errno));
      const uint64_t size = regular_file_size(fd.get(), path);
      const uint64_t expected = part_bytes(e.count, d, sw);
      GS_REQUIRE(size == expected, GRADSYNC_E_CORRUPT, "'{}' has {} bytes, its {} rows need {} (truncated?)", path,
                 size, e.count, expected);
      PartHeader h{};
      pread_all(fd.get(), &h, sizeof h, 0, path);
      GS_REQUIRE(std::memcmp(h.magic, kPartMagic, sizeof h.magic) == 0 && h.header_checksum == header_checksum(h),
                 GRADSYNC_E_CORRUPT, "'{}' is not a checkpoint part (bad magic or header checksum)", path);
      GS_REQUIRE(h.format_version == kFormatVersion && h.byte_order == kByteOrder, GRADSYNC_E_VERSION_MISMATCH,
                 "'{}' has format version {}, this library reads {}", path, h.format_version, kFormatVersion);
      GS_REQUIRE(h.rows == m.rows && h.dim == m.dim && h.state_width == m.state_width && h.part == p &&
                     h.parts == nparts && h.nonce == le.nonce && h.count == e.count &&
                     h.payload_checksum == e.payload_checksum,
                 GRADSYNC_E_CORRUPT, "'{}' does not belong to the checkpoint its manifest describes", path);
      ids.resize(e.count);
      pread_all(fd.get(), ids.data(), e.count * 8, sizeof h, path);
      // Which of the part's rows are owned here, and where they go: a walk of both ascending
      // lists. The ids themselves are checked whole, so a bad part fails every reader however
      // the rows fall.
      mine.clear();
      auto at = owned.begin();
      for (uint64_t i = 0; i < e.count; ++i) {
        const int64_t id = ids[i];
        GS_REQUIRE(id >= 0 && id < m.rows && (i == 0 || id > ids[i - 1]), GRADSYNC_E_CORRUPT,
                   "'{}': id {} at {} is out of range or out of order", path, id, i);
        if (i == 0) at = std::lower_bound(owned.begin(), owned.end(), id);
        while (at != owned.end() && *at < id) ++at;
        if (at != owned.end() && *at == id) mine.emplace_back(i, static_cast<uint64_t>(at - owned.begin()));
      }
      if (mine.empty()) continue;
      // The rows are copied out as the checksum streams over the whole payload. A part whose
      // rows are all owned here, and consecutive here (one written under this layout), is read
      // straight into place.
      Checksum sum;
      sum.update(ids.data(), e.count * 8);
      const bool in_place = mine.size() == e.count && mine.back().second - mine.front().second == e.count - 1;
      const uint64_t per_chunk = std::max<uint64_t>(1, kChunkBytes / row_bytes);
      if (!in_place) chunk.resize(per_chunk * row_bytes);
      size_t next = 0;
      for (uint64_t first = 0; first < e.count; first += per_chunk) {
        const uint64_t n = std::min(per_chunk, e.count - first);
        char* to = in_place ? reinterpret_cast<char*>(values + (mine.front().second + first) * d) : chunk.data();
        pread_all(fd.get(), to, n * row_bytes, sizeof h + e.count * 8 + first * row_bytes, path);
        sum.update(to, n * row_bytes);
        for (; next < mine.size() && mine[next].first < first + n; ++next) {
          const auto [i, l] = mine[next];
          GS_REQUIRE(found[l] != mark, GRADSYNC_E_CORRUPT, "'{}': row {} is in two parts of one layer", path, ids[i]);
          found[l] = mark;
          if (!in_place) std::memcpy(values + l * d, chunk.data() + (i - first) * row_bytes, row_bytes);
        }
      }
      if (sw != 0) {
        std::vector<float> s(e.count * sw);
        pread_all(fd.get(), s.data(), s.size() * 4, sizeof h + e.count * (8 + row_bytes), path);
        sum.update(s.data(), s.size() * 4);
        for (const auto& [i, l] : mine) std::copy(&s[i * sw], &s[(i + 1) * sw], &state[l * sw]);
      }
      GS_REQUIRE(sum.value() == e.payload_checksum, GRADSYNC_E_CORRUPT, "'{}': payload checksum mismatch", path);
    }
    // The full layer must have given every owned row.
    if (layer == 0) {
      for (uint64_t l = 0; l < local; ++l)
        GS_REQUIRE(found[l] == 1, GRADSYNC_E_CORRUPT, "checkpoint '{}' lacks row {}", dir, owned[l]);
    }
  }
  return out;
}

}  // namespace checkpoint

}  // namespace gradsync::embedding
