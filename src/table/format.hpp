// SPDX-License-Identifier: Apache-2.0
#pragma once
// On-disk format of a table file (docs/file-format.md is the reference for users).
//
//   offset 0            header slot 0 (one 4096-byte page, FileHeader at its start, rest zero)
//   offset 4096         header slot 1
//   offset 8192         data: rows x dim elements, row-major, page-aligned
//   aux_offset          kind-specific region (an accumulator's touched set and lock words), page-aligned
//   file_bytes          end of file; the file is exactly this long
//
// Invariants (LMDB's meta-page scheme plus a checksum):
// - Both slots are written at creation with generation 0. Flush number g (g = 1, 2, ...) first makes
//   the data durable (msync + fsync), then writes slot g & 1 with generation g and syncs again, so a
//   torn header write damages only the slot being written and the other one still describes the file.
// - Open reads both slots, validates each (magic, version, checksum, internal consistency) and uses
//   the valid one with the higher generation. Every field except `generation` is the same in both.
// - The magic reads 0x4C545347 ("GSTL" in memory on a little-endian machine); a reader of the other
//   byte order sees its byte swap and reports that, instead of a vague "bad magic".
// - The file is never truncated or extended after creation: a size other than file_bytes is corruption.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/fnv.hpp"

namespace gradsync::table {

constexpr uint32_t kMagic = 0x4C545347u;
constexpr uint32_t kFormatVersion = 1;
constexpr uint64_t kPageBytes = 4096;
constexpr uint64_t kDataOffset = 2 * kPageBytes;

enum class FileKind : uint32_t { Table = 1, Accumulator = 2 };

struct FileHeader {
  uint32_t magic;           // kMagic
  uint32_t format_version;  // kFormatVersion
  uint32_t header_bytes;    // sizeof(FileHeader) = 128
  uint32_t kind;            // FileKind
  uint32_t dtype;           // GRADSYNC_F32 (the only dtype so far)
  uint32_t page_bytes;      // kPageBytes: slot size and alignment of every region
  uint64_t rows;
  uint64_t dim;
  uint64_t generation;   // number of completed flushes
  uint64_t data_offset;  // kDataOffset
  uint64_t data_bytes;   // rows * dim * element size
  uint64_t aux_offset;   // data_offset + round_up(data_bytes, page_bytes)
  uint64_t aux_bytes;    // size of the kind-specific region (0 for a plain table)
  uint64_t file_bytes;   // aux_offset + round_up(aux_bytes, page_bytes)
  uint8_t reserved[32];  // zero
  uint64_t checksum;     // FNV-1a 64 of the 120 bytes before it
};
static_assert(sizeof(FileHeader) == 128, "the header layout is part of the file format");
static_assert(offsetof(FileHeader, checksum) == 120, "the header layout is part of the file format");

inline uint64_t header_checksum(const FileHeader& h) noexcept { return fnv1a64(&h, offsetof(FileHeader, checksum)); }

constexpr uint64_t round_up(uint64_t n, uint64_t a) noexcept { return (n + a - 1) / a * a; }

}  // namespace gradsync::table
