// SPDX-License-Identifier: Apache-2.0
#pragma once
// A 64-bit value no other process or earlier group is likely to have drawn: the nonces that make
// names (subgroups, a host's shared-memory level) and probe files unique. Not for secrets.
#include <cstdint>
#include <random>

namespace gradsync {

inline uint64_t random_nonce() {
  std::random_device rd;
  return (uint64_t{rd()} << 32) ^ rd();
}

}  // namespace gradsync
