// SPDX-License-Identifier: Apache-2.0
#include "comm/verdict.hpp"

#include <spdlog/fmt/fmt.h>

#include "comm/reduce.hpp"
#include "common/dtype.hpp"
#include "common/error.hpp"

namespace gradsync::comm {

void fail_mismatch(std::string_view group, uint64_t call, int rank, const CallSignature& theirs,
                   const CallSignature& rank0) {
  std::string a = describe(theirs);
  const std::string b = describe(rank0);
  // Same words, different calls: fused lists of the same total, split differently.
  if (a == b) a += " with other buffer sizes";
  fail(GRADSYNC_E_MISMATCH, "{} call {}: rank {} called {} but rank 0 called {}", group, call, rank, a, b);
}

void verify_round(const std::function<std::string()>& name_group, uint64_t call, int size, int entries, bool compare,
                  const std::function<const CallSignature&(int)>& signature_of,
                  const std::function<uint64_t(int)>& weight_of) {
  if (compare && entries > 1) require_same_calls(name_group, call, entries, signature_of);
  for (int r = 0; r < entries; ++r) {
    const CallSignature& c = signature_of(r);
    const auto dtype = static_cast<DType>(c.dtype);
    const bool rooted = c.collective == Collective::Broadcast || c.collective == Collective::Gather ||
                        c.collective == Collective::Scatter ||
                        (c.collective == Collective::ReduceScatter && c.nbufs == 1);
    if (rooted && (c.root < 0 || c.root >= size)) {
      fail(GRADSYNC_E_OUT_OF_RANGE, "{} call {}: rank {} passed root {} out of range [0, {}) ({})", name_group(), call,
           r, c.root, size, describe(c));
    }
    if ((c.collective == Collective::Allreduce || c.collective == Collective::ReduceScatter) && !reducible(dtype)) {
      fail(GRADSYNC_E_UNSUPPORTED, "{} call {}: {} of {} is not supported", name_group(), call,
           collective_name(c.collective), dtype_name(dtype));
    }
    if (c.collective == Collective::WeightedMean) {
      if (dtype != DType::F32 && dtype != DType::F64) {
        fail(GRADSYNC_E_INVALID_ARG, "{} call {}: weighted mean needs f32 or f64, got {}", name_group(), call,
             dtype_name(dtype));
      }
      const uint64_t w = weight_of(r);
      if (w > (uint64_t{1} << 53)) {
        fail(GRADSYNC_E_INVALID_ARG, "{} call {}: rank {} passed weight {}, which exceeds 2^53", name_group(), call, r,
             w);
      }
    }
  }
}

}  // namespace gradsync::comm
