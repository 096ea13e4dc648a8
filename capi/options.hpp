#pragma once
// Options structs carry their size first, so callers compiled against an older or newer header
// keep working. These two helpers are the one place that rule is implemented.
#include <algorithm>
#include <cstddef>
#include <cstring>

#include "common/error.hpp"

namespace gradsync::capi {

// The caller's options as this library knows them: the fields the caller's version has, and
// `defaults` for any field it predates. `user` must not be NULL (callers decide what NULL means).
template <class T>
T read_options(const T* user, T defaults, size_t v1_size, const char* what) {
  GS_REQUIRE(user->struct_size >= v1_size, GRADSYNC_E_INVALID_ARG,
             "{} struct_size {} is smaller than version 1's {} (not initialised?)", what, user->struct_size, v1_size);
  std::memcpy(static_cast<void*>(&defaults), user, std::min<size_t>(user->struct_size, sizeof(T)));
  return defaults;
}

// The *_init() of an options struct: zero the caller's struct_size bytes (so no garbage reaches a
// newer library), write the defaults this library knows, and record how many bytes that was.
template <class T>
void init_options(T* out, size_t struct_size, T defaults, size_t v1_size, const char* what) {
  GS_REQUIRE(out != nullptr, GRADSYNC_E_INVALID_ARG, "{} pointer is NULL", what);
  GS_REQUIRE(struct_size >= v1_size, GRADSYNC_E_INVALID_ARG, "{} struct_size {} is smaller than version 1's {}", what,
             struct_size, v1_size);
  defaults.struct_size = static_cast<uint32_t>(std::min(struct_size, sizeof(T)));
  std::memset(static_cast<void*>(out), 0, struct_size);
  std::memcpy(static_cast<void*>(out), &defaults, std::min(struct_size, sizeof(T)));
}

}  // namespace gradsync::capi
