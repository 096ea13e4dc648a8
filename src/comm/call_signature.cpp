// SPDX-License-Identifier: Apache-2.0
#include "comm/call_signature.hpp"

#include <spdlog/fmt/fmt.h>

#include "common/fnv.hpp"
#include "common/partition.hpp"

namespace gradsync::comm {
namespace {

uint64_t hash_counts(std::span<const BufferRef> buffers) noexcept {
  uint64_t h = kFnvBasis;
  for (const auto& b : buffers) {
    const uint64_t c = b.count;  // the bytes of a little-endian host; every rank of a group shares one
    h = fnv1a64(&c, sizeof c, h);
  }
  return h;
}

CallSignature make(Collective c, uint64_t count, DType dtype) noexcept {
  CallSignature s;
  s.collective = c;
  s.count = count;
  s.dtype = static_cast<int32_t>(dtype);
  return s;
}

}  // namespace

CallSignature allreduce_call(std::span<const BufferRef> buffers, DType dtype, ReduceOp op) noexcept {
  uint64_t total = 0;
  for (const auto& b : buffers) total += b.count;
  CallSignature s = make(Collective::Allreduce, total, dtype);
  s.op = static_cast<int32_t>(op);
  s.nbufs = buffers.size();
  s.layout = hash_counts(buffers);
  return s;
}

CallSignature broadcast_call(uint64_t count, DType dtype, int root) noexcept {
  CallSignature s = make(Collective::Broadcast, count, dtype);
  s.root = root;
  return s;
}

namespace {

// A per-rank split of the elements: its total, and a layout that is 0 for the partition rule's
// split (so a plain call and its v-form with the same parts match) and a hash of the counts otherwise.
CallSignature parts_call(Collective c, std::span<const size_t> counts, DType dtype) noexcept {
  uint64_t total = 0, h = kFnvBasis;
  bool rule = true;
  for (size_t r = 0; r < counts.size(); ++r) total += counts[r];
  for (size_t r = 0; r < counts.size(); ++r) {
    rule &= counts[r] == partition(total, counts.size(), r).len;
    const uint64_t n = counts[r];
    h = fnv1a64(&n, sizeof n, h);
  }
  CallSignature s = make(c, total, dtype);
  s.layout = rule ? 0 : h;
  return s;
}

}  // namespace

CallSignature allgather_call(std::span<const size_t> counts, DType dtype) noexcept {
  return parts_call(Collective::Allgather, counts, dtype);
}

CallSignature reduce_scatter_call(std::span<const size_t> counts, DType dtype, ReduceOp op,
                                  std::optional<int> root) noexcept {
  CallSignature s = parts_call(Collective::ReduceScatter, counts, dtype);
  s.op = static_cast<int32_t>(op);
  if (root) {
    s.nbufs = 1;
    s.root = *root;
  }
  return s;
}

CallSignature weighted_mean_call(uint64_t count, DType dtype) noexcept {
  return make(Collective::WeightedMean, count, dtype);
}

CallSignature exchange_call(const Routes& routes, DType dtype) noexcept {
  // The count a caller passes, as rank 0's: what it sends (alltoall, gather) or receives (scatter).
  uint64_t count = 0;
  for (uint64_t r = 0; r < routes.n; ++r)
    count += routes.form == Collective::Scatter ? routes.count[routes.at(r, 0)] : routes.count[routes.at(0, r)];
  CallSignature s = make(routes.form, count, dtype);
  s.root = routes.root;
  uint64_t h = fnv1a64(routes.count.data(), routes.count.size() * sizeof(uint64_t));
  h = fnv1a64(routes.send_displ.data(), routes.send_displ.size() * sizeof(uint64_t), h);
  s.layout = fnv1a64(routes.recv_displ.data(), routes.recv_displ.size() * sizeof(uint64_t), h);
  return s;
}

CallSignature barrier_call() noexcept { return CallSignature{}; }

std::string describe(const CallSignature& call) {
  if (call.collective == Collective::Barrier) return "barrier";
  const char* dt = dtype_name(static_cast<DType>(call.dtype));
  // A rooted reduce is a reduce_scatter with every count but the root's 0.
  const bool rooted_reduce = call.collective == Collective::ReduceScatter && call.nbufs == 1;
  std::string s = rooted_reduce ? "reduce" : collective_name(call.collective);
  if (call.collective == Collective::Allreduce && call.nbufs != 1) {
    s += fmt::format(" of {} buffers ({} {} in all)", call.nbufs, call.count, dt);
  } else {
    s += fmt::format(" of {} {}", call.count, dt);
  }
  if (call.op >= 0) s += fmt::format(" ({})", op_name(static_cast<ReduceOp>(call.op)));
  switch (call.collective) {
    case Collective::Broadcast:
    case Collective::Scatter: s += fmt::format(" from root {}", call.root); break;
    case Collective::Gather: s += fmt::format(" to root {}", call.root); break;
    case Collective::ReduceScatter:
      if (rooted_reduce) s += fmt::format(" to root {}", call.root);
      break;
    default: break;
  }
  return s;
}

}  // namespace gradsync::comm
