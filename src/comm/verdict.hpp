// SPDX-License-Identifier: Apache-2.0
#pragma once
// The verdict on one round's calls, written once for every transport. Each judges a table of every
// rank's call that every rank sees alike (the shared descriptors of the round engine, the MPI
// fingerprint exchange, the hierarchical group's table of calls), so every rank throws the same
// error, in the same words, or none does.
#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "comm/call_signature.hpp"
#include "common/fnv.hpp"

namespace gradsync::comm {

// Throws E_MISMATCH "<group> call <n>: rank r called <theirs> but rank 0 called <rank 0's>".
[[noreturn]] void fail_mismatch(std::string_view group, uint64_t call, int rank, const CallSignature& theirs,
                                const CallSignature& rank0);

// Compares every rank's signature with rank 0's: signature_of(r) for r in [0, size). name_group()
// names the group for the message; it is called only on a mismatch (this check runs on every call).
template <class NameGroup, class SignatureOf>
void require_same_calls(NameGroup&& name_group, uint64_t call, int size, SignatureOf&& signature_of) {
  const CallSignature& first = signature_of(0);
  for (int r = 1; r < size; ++r) {
    const CallSignature& other = signature_of(r);
    if (!(other == first)) fail_mismatch(name_group(), call, r, other, first);
  }
}

// A group built of levels (hier, threads as ranks) compares its ranks' calls in two steps: first a
// max-allreduce of (w, -w) for w = signature_word(call), which finds whether any two differ in one
// small round; only then every signature, gathered by gather(mine, all, words per rank), to name
// both sides as require_same_calls does.
inline int64_t signature_word(const CallSignature& call) noexcept {
  return static_cast<int64_t>(fnv1a64(&call, sizeof call) >> 1);
}
template <class NameGroup, class Gather>
void require_same_gathered_calls(NameGroup&& name_group, uint64_t call, const CallSignature& mine, int size,
                                 Gather&& gather) {
  constexpr size_t kWords = sizeof(CallSignature) / sizeof(int64_t);
  std::array<int64_t, kWords> word{};
  std::memcpy(word.data(), &mine, sizeof mine);
  std::vector<int64_t> all(kWords * static_cast<size_t>(size));
  gather(word.data(), all.data(), kWords);
  std::vector<CallSignature> calls(static_cast<size_t>(size));
  std::memcpy(static_cast<void*>(calls.data()), all.data(), calls.size() * sizeof(CallSignature));
  require_same_calls(name_group, call, size,
                     [&](int r) -> const CallSignature& { return calls[static_cast<size_t>(r)]; });
}

// Judges one round's calls: the signatures must agree (when `compare`), then arguments that only
// the group can judge (a root, a dtype the kernels do not reduce, a weight) are checked, naming the
// rank that passed them. name_group() names the group ("thread group 'train'"); messages add the
// call number. signature_of(r) and weight_of(r) for r in [0, entries): entries is the group's
// size, or 1 when one call stands for all (a transport that skips the exchange judges this rank's
// own; the round engine, rank 0's when every rank's is alike).
void verify_round(const std::function<std::string()>& name_group, uint64_t call, int size, int entries, bool compare,
                  const std::function<const CallSignature&(int)>& signature_of,
                  const std::function<uint64_t(int)>& weight_of);

}  // namespace gradsync::comm
