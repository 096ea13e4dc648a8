// SPDX-License-Identifier: Apache-2.0
// Arbitrary bytes as a checkpoint directory of the sharded embedding (format in
// checkpoint_fuzz.hpp), read as a load reads it: a clear status or a checkpoint's rows, never a
// crash or a hang. Its seeds are real checkpoints (checkpoint_seeds writes them).
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "checkpoint_fuzz.hpp"
#include "common/error.hpp"
#include "common/fnv.hpp"
#include "embedding/checkpoint.hpp"
#include "optim/optim.hpp"

namespace {

namespace ck = gradsync::embedding::checkpoint;

void empty_dir(const std::string& dir);

// One directory per process, emptied before each input and removed at exit: in /dev/shm when
// there is one, so that the fuzzer's inputs cost no disk traffic.
const std::string& work_dir() {
  static const std::string dir = [] {
    struct stat st {};
    std::string t = (::stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) ? "/dev/shm" : "/tmp");
    t += "/gradsync-checkpoint-fuzz-XXXXXX";
    if (::mkdtemp(t.data()) == nullptr) std::abort();
    return t;
  }();
  static const bool removed_at_exit = [] {
    return std::atexit([] {
             empty_dir(work_dir());
             ::rmdir(work_dir().c_str());
           }) == 0;
  }();
  (void)removed_at_exit;
  return dir;
}

void empty_dir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) std::abort();
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.emplace_back(e->d_name);
  }
  ::closedir(d);
  for (const std::string& n : names) ::unlink((dir + "/" + n).c_str());
}

void write_file(const std::string& path, const uint8_t* data, size_t size) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) std::abort();
  for (size_t off = 0; off < size;) {
    const ssize_t w = ::write(fd, data + off, size - off);
    if (w <= 0) std::abort();
    off += static_cast<size_t>(w);
  }
  ::close(fd);
}

// The names the manifest's bytes give its parts, in file order, read as the loader would find
// them (no check: a damaged manifest still names files, so that the loader meets them).
std::vector<std::string> part_names(const std::vector<uint8_t>& manifest, size_t limit) {
  std::vector<std::string> names;
  ck::ManifestHeader h{};
  if (manifest.size() < sizeof h) return names;
  std::memcpy(&h, manifest.data(), sizeof h);
  for (int64_t l = 0; l < h.layers && names.size() < limit; ++l) {
    ck::LayerEntry le{};
    const size_t at = sizeof h + static_cast<size_t>(l) * sizeof le;
    if (at + sizeof le > manifest.size()) break;
    std::memcpy(&le, manifest.data() + at, sizeof le);
    if (le.parts < 1 || le.parts > static_cast<uint64_t>(ck::kMaxParts)) break;
    for (uint64_t p = 0; p < le.parts && names.size() < limit; ++p)
      names.push_back(ck::part_name(static_cast<int>(p), static_cast<int>(le.parts), le.nonce));
  }
  return names;
}

template <class Header>
void seal_header(std::vector<uint8_t>& file) {
  if (file.size() < sizeof(Header)) return;
  const uint64_t sum = gradsync::fnv1a64(file.data(), offsetof(Header, header_checksum));
  std::memcpy(file.data() + offsetof(Header, header_checksum), &sum, sizeof sum);
}

// Writes the checksums of the files as the writer would: each part's payload checksum into its
// header and into its manifest entry (the i-th part in file order is the i-th entry), then every
// header's checksum and the manifest's entries checksum.
void seal(std::vector<std::vector<uint8_t>>& files) {
  std::vector<uint8_t>& manifest = files[0];
  constexpr size_t kHead = sizeof(ck::ManifestHeader);
  int32_t layers = 0;
  if (manifest.size() >= kHead) std::memcpy(&layers, manifest.data() + offsetof(ck::ManifestHeader, layers), 4);
  const size_t entries_at = kHead + static_cast<size_t>(std::max(layers, 0)) * sizeof(ck::LayerEntry);
  for (size_t i = 1; i < files.size(); ++i) {
    std::vector<uint8_t>& part = files[i];
    if (part.size() < sizeof(ck::PartHeader)) continue;
    ck::Checksum payload;
    payload.update(part.data() + sizeof(ck::PartHeader), part.size() - sizeof(ck::PartHeader));
    const uint64_t sum = payload.value();
    std::memcpy(part.data() + offsetof(ck::PartHeader, payload_checksum), &sum, sizeof sum);
    seal_header<ck::PartHeader>(part);
    const size_t entry = entries_at + (i - 1) * sizeof(ck::PartEntry) + offsetof(ck::PartEntry, payload_checksum);
    if (layers >= 0 && entry + sizeof sum <= manifest.size()) std::memcpy(manifest.data() + entry, &sum, sizeof sum);
  }
  if (manifest.size() < kHead) return;
  const uint64_t entries = gradsync::fnv1a64(manifest.data() + kHead, manifest.size() - kHead);
  std::memcpy(manifest.data() + offsetof(ck::ManifestHeader, entries_checksum), &entries, sizeof entries);
  seal_header<ck::ManifestHeader>(manifest);
}

bool expected_failure(int status) {
  return status == GRADSYNC_E_CORRUPT || status == GRADSYNC_E_VERSION_MISMATCH || status == GRADSYNC_E_MISMATCH;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using gradsync_fuzz::kCheckpointPrefix;
  if (size < kCheckpointPrefix) return 0;
  ck::Shape shape;
  shape.rows = int64_t{data[0]} + 1;
  shape.dim = int64_t{data[1] % 16} + 1;
  shape.optimizer = data[2] % 3;
  shape.state_width = static_cast<int32_t>(
      gradsync::optim::state_width(static_cast<gradsync::optim::RowOptimizer>(shape.optimizer), shape.dim));
  std::vector<int64_t> owned;
  const int64_t half = (shape.rows + 1) / 2;
  for (int64_t id = 0; id < shape.rows; ++id) {
    const int which = data[3] & 3;
    if (which == 0 || (which == 1 && id < half) || (which == 2 && id >= half) || (which == 3 && id % 2 == 1))
      owned.push_back(id);
  }
  std::vector<std::vector<uint8_t>> files;
  for (size_t at = kCheckpointPrefix; at < size;) {
    uint32_t len = 0;
    const size_t head = std::min<size_t>(sizeof len, size - at);
    std::memcpy(&len, data + at, head);
    at += head;
    const size_t n = std::min<size_t>(len, size - at);
    files.emplace_back(data + at, data + at + n);
    at += n;
  }
  if (!files.empty() && (data[3] & 4) != 0) seal(files);
  const std::string& dir = work_dir();
  empty_dir(dir);
  if (!files.empty()) {
    write_file(dir + "/" + ck::kManifestName, files[0].data(), files[0].size());
    const std::vector<std::string> names = part_names(files[0], files.size() - 1);
    for (size_t i = 1; i < files.size(); ++i) {
      const std::string name = i - 1 < names.size() ? names[i - 1] : "stray-" + std::to_string(i);
      write_file(dir + "/" + name, files[i].data(), files[i].size());
    }
  }
  try {
    const ck::Staged staged = ck::read_rows(dir, shape, owned);
    // A load that succeeds gives every owned row and its state, from a manifest that checks.
    const ck::ManifestHeader& m = staged.manifest.header;
    if (m.rows != shape.rows || m.dim != shape.dim || staged.manifest.layers.empty() ||
        staged.state.size() != owned.size() * static_cast<size_t>(shape.state_width))
      std::abort();
    volatile float sink = 0.0f;
    for (size_t i = 0; i < owned.size() * static_cast<size_t>(shape.dim); ++i) sink = sink + staged.values[i];
  } catch (const gradsync::Error& e) {
    // No files at all: the missing manifest is an I/O error, as for any directory without one.
    const bool missing = files.empty() && e.status() == GRADSYNC_E_IO;
    if (!(expected_failure(e.status()) || missing) || std::strlen(e.what()) == 0) {
      std::fprintf(stderr, "unexpected status %d reading a checkpoint: %s\n", e.status(), e.what());
      std::abort();
    }
  }
  return 0;
}
