// SPDX-License-Identifier: Apache-2.0
#pragma once
// Options structs carry their size and version first, so callers compiled against an older or
// newer header keep working. These two helpers are the one place that rule is implemented.
//
// What a caller's struct may say (`known` is the version of this library's header, sizeof(T) its size):
// - version 1..known, struct_size from version 1's size up to sizeof(T): an older or the same
//   header; the fields it predates keep their defaults.
// - version > known, struct_size above sizeof(T): a newer header (fields are only appended). It
//   works as long as every byte this library does not know is 0, i.e. the newer fields are left
//   at a zero default; a non-zero one is refused rather than silently ignored.
// Anything else (version 0, sizes that fit no version, garbage) is GRADSYNC_E_INVALID_ARG naming
// the field and what it accepts: it is an uninitialised or corrupted struct, and reading it on
// would take garbage for options.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/error.hpp"

namespace gradsync::capi {

// The largest struct_size taken from a newer header. Only a guard against garbage (an
// uninitialised struct would otherwise have us read kilobytes past it); far above any real one.
constexpr size_t kMaxOptionsStructSize = 4096;

namespace options_detail {
inline std::string accepted_sizes(size_t v1_size, size_t known_size, uint32_t known) {
  const std::string own = v1_size == known_size
                              ? fmt::format("{} (version 1)", v1_size)
                              : fmt::format("{} (version 1) to {} (version {})", v1_size, known_size, known);
  return fmt::format("{}, or up to {} from a newer header whose fields past byte {} are 0", own, kMaxOptionsStructSize,
                     known_size);
}
}  // namespace options_detail

// The caller's options as this library knows them: the fields the caller's version has, and
// `defaults` for any field it predates. `user` must not be NULL (callers decide what NULL means).
// defaults.version is the newest version this library knows.
template <class T>
T read_options(const T* user, T defaults, size_t v1_size, const char* what) {
  const size_t size = user->struct_size;
  const uint32_t version = user->version;
  const uint32_t known = defaults.version;
  GS_REQUIRE(size >= v1_size && size <= kMaxOptionsStructSize, GRADSYNC_E_INVALID_ARG,
             "{}.struct_size {} is not the size of any version of the struct (accepted: {}); not initialised?", what,
             size, options_detail::accepted_sizes(v1_size, sizeof(T), known));
  GS_REQUIRE(version >= 1, GRADSYNC_E_INVALID_ARG,
             "{}.version 0 is not a version of the struct (accepted: {}, or later from a newer header); not "
             "initialised?",
             what, known == 1 ? std::string("1") : fmt::format("1 to {}", known));
  if (version <= known) {
    GS_REQUIRE(size <= sizeof(T), GRADSYNC_E_INVALID_ARG,
               "{}.struct_size {} is larger than version {} of the struct can be (accepted with version {}: {} to {})",
               what, size, version, version, v1_size, sizeof(T));
  } else {
    GS_REQUIRE(size > sizeof(T), GRADSYNC_E_INVALID_ARG,
               "{}.version {} is newer than this library's {}, but struct_size {} is not larger than this library's "
               "{} (a newer version only appends fields); not initialised?",
               what, version, known, size, sizeof(T));
    const auto* bytes = reinterpret_cast<const unsigned char*>(user);
    const auto* set = std::find_if(bytes + sizeof(T), bytes + size, [](unsigned char b) { return b != 0; });
    GS_REQUIRE(set == bytes + size, GRADSYNC_E_INVALID_ARG,
               "{} of version {} set a field this library (version {}, {} bytes) does not know: byte {} of {} is "
               "not 0; refusing rather than ignoring it (leave newer fields at 0, or use a newer libgradsync)",
               what, version, known, sizeof(T), set - bytes, size);
  }
  std::memcpy(static_cast<void*>(&defaults), user, std::min<size_t>(size, sizeof(T)));
  return defaults;
}

// The *_init() of an options struct: zero the caller's struct_size bytes (so no garbage reaches a
// newer library), write the defaults this library knows, and record how many bytes that was.
template <class T>
void init_options(T* out, size_t struct_size, T defaults, size_t v1_size, const char* what) {
  GS_REQUIRE(out != nullptr, GRADSYNC_E_INVALID_ARG, "{} pointer is NULL", what);
  GS_REQUIRE(struct_size >= v1_size, GRADSYNC_E_INVALID_ARG, "{} struct_size {} is smaller than version 1's {}", what,
             struct_size, v1_size);
  // A larger struct comes from a newer header (its tail is zeroed); beyond the bound it is a bad
  // size, not a struct: zeroing it would write past the caller's object.
  GS_REQUIRE(struct_size <= kMaxOptionsStructSize, GRADSYNC_E_INVALID_ARG,
             "{} struct_size {} exceeds the largest options struct any version can have ({})", what, struct_size,
             kMaxOptionsStructSize);
  defaults.struct_size = static_cast<uint32_t>(std::min(struct_size, sizeof(T)));
  std::memset(static_cast<void*>(out), 0, struct_size);
  std::memcpy(static_cast<void*>(out), &defaults, std::min(struct_size, sizeof(T)));
}

}  // namespace gradsync::capi
