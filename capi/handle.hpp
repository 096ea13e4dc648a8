// SPDX-License-Identifier: Apache-2.0
#pragma once
// Every object behind a C handle starts with a magic word naming its kind. Entry points check it
// first, so a NULL handle, the wrong kind of handle, or (while its memory is not reused) a freed
// one is GRADSYNC_E_MISUSE with a message, not a crash.
#include <cstdint>
#include <cstring>

#include "common/error.hpp"

namespace gradsync::capi {

enum class Kind : uint32_t {
  Counter32 = 0x47530001u,
  Counter64 = 0x47530002u,
  Flag = 0x47530003u,
  Mutex = 0x47530004u,
  Comm = 0x47530010u,
  Request = 0x47530011u,
  Table = 0x47530020u,
  Accumulator = 0x47530021u,
  Shard = 0x47530030u,
  Embedding = 0x47530040u,
};
constexpr uint32_t kFreedMagic = 0x47DEAD00u;

constexpr const char* kind_name(uint32_t magic) noexcept {
  switch (static_cast<Kind>(magic)) {
    case Kind::Counter32: return "counter32";
    case Kind::Counter64: return "counter64";
    case Kind::Flag: return "flag";
    case Kind::Mutex: return "mutex";
    case Kind::Comm: return "comm";
    case Kind::Request: return "request";
    case Kind::Table: return "table";
    case Kind::Accumulator: return "accumulator";
    case Kind::Shard: return "shard";
    case Kind::Embedding: return "embedding";
  }
  return nullptr;
}

// Base of every handle struct: `struct gradsync_flag : Handle<Kind::Flag> { ... };`.
// The magic is the first member so it sits at offset 0 of every handle.
template <Kind K>
struct Handle {
  static constexpr Kind kKind = K;
  uint32_t magic_ = static_cast<uint32_t>(K);
  Handle() = default;
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { magic_ = kFreedMagic; }
};

// "a" or "an", for messages that name a kind.
constexpr const char* article(const char* name) noexcept {
  return name[0] == 'a' || name[0] == 'e' || name[0] == 'i' || name[0] == 'o' || name[0] == 'u' ? "an" : "a";
}

// Returns h after checking it is a live handle of its kind; throws MISUSE otherwise. Frees use
// this alone: a handle that a fork() copied into a child is still freed there (by its own rules).
template <class H>
H* check_kind(H* h) {
  constexpr const char* expected = kind_name(static_cast<uint32_t>(H::kKind));
  if (h == nullptr) fail(GRADSYNC_E_MISUSE, "NULL {} handle", expected);
  uint32_t magic;
  std::memcpy(&magic, static_cast<const void*>(h), sizeof magic);
  if (magic == static_cast<uint32_t>(H::kKind)) return h;
  if (magic == kFreedMagic) fail(GRADSYNC_E_MISUSE, "use of a freed {} handle", expected);
  const char* actual = kind_name(magic);
  if (actual != nullptr) {
    fail(GRADSYNC_E_MISUSE, "wrong kind of handle: expected {} {}, got {} {}", article(expected), expected,
         article(actual), actual);
  }
  fail(GRADSYNC_E_MISUSE, "not a gradsync {} handle (bad magic 0x{:08x})", expected, magic);
}

// check_kind, then, for a handle that belongs to the process that made it (it has
// require_this_process(), common/fork.hpp), that this is that process.
template <class H>
H* check(H* h) {
  check_kind(h);
  if constexpr (requires { h->require_this_process(); }) h->require_this_process();
  return h;
}

// Destroy a handle from its *_free function: NULL is a no-op, a wrong or stale handle is
// logged and left alone (a free function returns void, so there is no status to report).
template <class H>
void destroy(H* h) noexcept;

}  // namespace gradsync::capi
