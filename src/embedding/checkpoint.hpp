// SPDX-License-Identifier: Apache-2.0
#pragma once
// Checkpoint files of the sharded embedding, keyed by global row id (docs/file-format.md has the
// bytes). A checkpoint is a directory holding a manifest and the parts of one or more layers:
//   checkpoint.gsemb               ManifestHeader, then `layers` LayerEntry, then every layer's
//                                  PartEntry (layer after layer)
//   part-<p>-of-<P>-<nonce>.gsemb  PartHeader, then count ids (int64, strictly ascending), then
//                                  count x dim values (f32), then count x state_width state (f32)
// Layer 0 is a full save (every row exactly once); each later layer is an incremental save that
// holds the rows pushed since the layer before it and overrides them. Each layer's parts bear its
// nonce, one part per rank of the world that wrote it.
// The manifest is the commit point: it is written (temporary name, fsync, rename, fsync of the
// directory) only after every part of the new layer is durable, so the parts of a save in progress
// never replace those the committed manifest names. Every field is checked on load before it sizes
// a read; the payload checksum covers ids, values and state in that order.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace gradsync::embedding::checkpoint {

constexpr char kPartMagic[8] = {'G', 'S', 'E', 'M', 'B', 'P', 'R', 'T'};
constexpr char kManifestMagic[8] = {'G', 'S', 'E', 'M', 'B', 'M', 'A', 'N'};
constexpr uint32_t kFormatVersion = 1;
// Written as the machine's uint32: another byte order reads it as 0x04030201.
constexpr uint32_t kByteOrder = 0x01020304u;
constexpr const char* kManifestName = "checkpoint.gsemb";
constexpr int64_t kMaxParts = 1 << 16;   // in one layer
constexpr int64_t kMaxLayers = 1 << 12;  // incremental saves on top of a full one, plus it

struct PartHeader {
  char magic[8];
  uint32_t format_version;
  uint32_t byte_order;
  int64_t rows;  // of the whole table
  int64_t dim;
  int32_t state_width;  // floats of optimizer state per row (0 SGD, 1 row-wise Adagrad)
  int32_t part;
  int32_t parts;
  int32_t reserved0;
  uint64_t nonce;  // the checkpoint's: a part of another checkpoint is refused
  uint64_t count;  // rows in this part
  uint64_t payload_checksum;
  uint64_t reserved[6];
  uint64_t header_checksum;  // fnv1a64 of the bytes before it
};
static_assert(sizeof(PartHeader) == 128);

struct ManifestHeader {
  char magic[8];
  uint32_t format_version;
  uint32_t byte_order;
  int64_t rows;
  int64_t dim;
  int32_t optimizer;  // gradsync_optimizer_kind of the saver
  int32_t state_width;
  int32_t sharding;  // the last saver's rule (informative: a load may use any)
  int32_t layers;    // LayerEntry records that follow
  uint64_t parts;    // PartEntry records after them, every layer's
  int64_t steps;     // the table's scalar state
  double lr;         // the last saver's (informative: a load keeps its own)
  double eps;
  uint64_t reserved[4];
  uint64_t entries_checksum;  // fnv1a64 of the LayerEntry and PartEntry arrays, in file order
  uint64_t header_checksum;   // fnv1a64 of the bytes before it
};
static_assert(sizeof(ManifestHeader) == 128);

struct LayerEntry {
  uint64_t nonce;
  uint64_t parts;  // in [1, kMaxParts]
};

struct PartEntry {
  uint64_t count;
  uint64_t payload_checksum;
};

std::string part_name(int part, int parts, uint64_t nonce);

// A manifest as read and checked: its header, its layers, and each layer's parts.
struct Manifest {
  ManifestHeader header{};
  std::vector<LayerEntry> layers;
  std::vector<std::vector<PartEntry>> parts;  // per layer
};

// Reads and checks dir's manifest (every field before it sizes a read).
Manifest read_manifest(const std::string& dir);

// Writes a part durably under its name in dir (created if need be). `header` gives the fields
// that describe it (shape, part, parts, nonce, count); the checksums are filled here. ids, rows
// and state hold count, count x dim and count x state_width elements. `verify` runs once the
// payload is written, before the header that makes it a part: a throw there leaves no part.
// Returns the payload checksum.
uint64_t write_part(const std::string& dir, PartHeader header, const int64_t* ids, const float* rows,
                    const float* state, const std::function<void()>& verify);

// Commits m (its entries and checksums computed here) as dir's manifest, then removes the parts
// of nonces that none of its layers names.
void commit(const std::string& dir, const Manifest& m);

// What a loader expects of a checkpoint: its table's shape and optimizer.
struct Shape {
  int64_t rows = 0;
  int64_t dim = 0;
  int32_t state_width = 0;
  int32_t optimizer = 0;
};

// A checkpoint's rows for one rank, staged (nothing of the caller's is touched by a read).
struct Staged {
  Manifest manifest;
  std::unique_ptr<float[]> values;  // owned.size() x dim (at least one float)
  std::vector<float> state;         // owned.size() x state_width
};

// Reads every layer of the checkpoint in dir into the rows `owned` (global ids, ascending:
// staged row l is owned[l]), later layers overriding earlier ones. Every part's header and ids
// are checked whichever of its rows are owned here; its payload checksum only where it has such
// rows (the readers of one load own every row between them, so a damaged payload fails the load). Throws E_CORRUPT
// (damaged, truncated, not a checkpoint), E_VERSION_MISMATCH, E_MISMATCH (another shape or optimizer), E_IO (cannot
// read) or E_INVALID_ARG (an empty dir).
Staged read_rows(const std::string& dir, const Shape& shape, const std::vector<int64_t>& owned);

// A checksum of a byte stream fed in pieces of any size: fnv1a64's step over 64-bit words
// (eight times fewer multiplies than over bytes, so it keeps up with the disk), the last partial
// word zero-padded, then the length folded in.
class Checksum {
 public:
  void update(const void* data, size_t n) noexcept;
  uint64_t value() const noexcept;

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
  uint64_t length_ = 0;
  unsigned char tail_[8] = {};
  size_t ntail_ = 0;
};

}  // namespace gradsync::embedding::checkpoint
