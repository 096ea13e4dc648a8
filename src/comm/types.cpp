// SPDX-License-Identifier: Apache-2.0
#include "comm/types.hpp"

#include <algorithm>

namespace gradsync::comm {

const char* transport_name(Transport t) noexcept {
  switch (t) {
    case Transport::Thread: return "thread";
    case Transport::Shm: return "shm";
    case Transport::Mpi: return "mpi";
    case Transport::Hier: return "hier";
  }
  return "unknown";
}

const char* collective_name(Collective c) noexcept {
  switch (c) {
    case Collective::Allreduce: return "allreduce";
    case Collective::Broadcast: return "broadcast";
    case Collective::Allgather: return "allgather";
    case Collective::ReduceScatter: return "reduce_scatter";
    case Collective::Barrier: return "barrier";
    case Collective::WeightedMean: return "weighted_mean";
    case Collective::Alltoall: return "alltoall";
    case Collective::Gather: return "gather";
    case Collective::Scatter: return "scatter";
  }
  return "unknown collective";
}

uint64_t Routes::send_extent(uint64_t s) const noexcept {
  uint64_t end = 0;
  for (uint64_t d = 0; d < n; ++d)
    if (count[at(s, d)] > 0) end = std::max(end, send_displ[at(s, d)] + count[at(s, d)]);
  return end;
}

uint64_t Routes::recv_extent(uint64_t d) const noexcept {
  uint64_t end = 0;
  for (uint64_t s = 0; s < n; ++s)
    if (count[at(s, d)] > 0) end = std::max(end, recv_displ[at(s, d)] + count[at(s, d)]);
  return end;
}

uint64_t Routes::longest() const noexcept {
  uint64_t m = 0;
  for (uint64_t c : count) m = std::max(m, c);
  return m;
}

}  // namespace gradsync::comm
