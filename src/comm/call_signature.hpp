// SPDX-License-Identifier: Apache-2.0
#pragma once
// What a rank called in one round of collectives, in one form for every transport.
//
// Before any data moves, each transport compares every rank's signature with rank 0's, from a table
// that every rank sees alike (the thread transport's slots, the shared segment's descriptors, the
// MPI fingerprint exchange), so every rank reaches the same verdict and throws the same
// E_MISMATCH, naming both sides in the same words whatever the transport (comm/verdict.hpp).
//
// Plain old data with a fixed layout: it lives in process memory, in a shared-memory segment that
// processes of different builds may map, and on the wire as raw bytes.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>

#include "comm/types.hpp"
#include "common/dtype.hpp"

namespace gradsync::comm {

struct CallSignature {
  uint64_t count = 0;   // elements; for a fused allreduce, all buffers together
  uint64_t nbufs = 0;   // allreduce: buffers in the list (1 when not fused); 1 for a rooted reduce; 0 otherwise
  uint64_t layout = 0;  // allreduce, allgather: FNV-1a of the per-buffer / per-rank counts; 0 otherwise
  Collective collective = Collective::Barrier;
  int32_t dtype = -1;  // a DType, or -1 (barrier)
  int32_t op = -1;     // a ReduceOp, or -1 when the collective has none
  int32_t root = -1;   // broadcast's, gather's, scatter's or a rooted reduce's root, or -1

  friend bool operator==(const CallSignature&, const CallSignature&) = default;
};
static_assert(std::is_trivially_copyable_v<CallSignature> && sizeof(CallSignature) == 40,
              "the signature is shared between processes and sent as raw bytes: keep its layout");

CallSignature allreduce_call(std::span<const BufferRef> buffers, DType dtype, ReduceOp op) noexcept;
CallSignature broadcast_call(uint64_t count, DType dtype, int root) noexcept;
// counts: every rank's part; the signature's layout hashes them unless they are the partition rule's.
CallSignature allgather_call(std::span<const size_t> counts, DType dtype) noexcept;
// root: a rooted reduce's (its counts are 0 but root's), as the caller passed it.
CallSignature reduce_scatter_call(std::span<const size_t> counts, DType dtype, ReduceOp op,
                                  std::optional<int> root) noexcept;
CallSignature weighted_mean_call(uint64_t count, DType dtype) noexcept;
CallSignature exchange_call(const Routes& routes, DType dtype) noexcept;
CallSignature barrier_call() noexcept;

// "allreduce of 7 f32 (sum)", "allreduce of 2 buffers (7 f32 in all) (sum)",
// "broadcast of 10 f32 from root 1", "barrier".
std::string describe(const CallSignature& call);

}  // namespace gradsync::comm
