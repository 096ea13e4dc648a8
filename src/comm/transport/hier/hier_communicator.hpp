// SPDX-License-Identifier: Apache-2.0
#pragma once
// The hierarchical transport: one group of MPI processes over any number of hosts, whose ranks of
// one host meet through shared memory (the shm transport, on the round engine) and whose hosts
// talk through MPI. Which ranks share a host is the MPI group's topology (comm/topology.hpp).
//
// An allreduce has no leader where every host has the same number of ranks: each host
// reduce-scatters the buffer over its ranks through shared memory, each local rank all-reduces its
// own slice across hosts through an MPI group of the ranks with its local rank, and each host
// all-gathers the slices. With hosts of different sizes, local rank 0 of each host carries its
// host's sum across hosts and broadcasts the result. Between 2 hosts the slices cross in one
// exchange and each side folds them in host order; between more, by a rank-order allreduce over
// MPI. Either way a reduction combines in a fixed order for a given topology (within a host in
// local rank order, then across hosts in host order), so every rank gets the same bits on every
// run; topology_independent trades the hierarchy for the flat rank-order reduction's bits. A
// broadcast, a reduce-scatter (in the allreduce's order, so each part is its slice of that
// allreduce) and an all-gather run in levels too. Small payloads, half-precision types and the
// integer mean (whose accumulator is wider than its type), the rooted reduce and every other
// collective go flat over MPI.
#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "comm/communicator.hpp"

namespace gradsync::comm {

// world: the group's MPI communicator, its topology detected. Collective over world.
std::unique_ptr<Communicator> make_hierarchical_communicator(std::unique_ptr<Communicator> world,
                                                             const Options& options);

// The cross-host level of an allreduce, in place: data (count elements, the same count on every
// rank) reduced over cross, whose rank r is host r's member, combined in host order. scratch: the
// caller's, kept between calls. Exposed for the benchmark that times the levels one by one.
void hier_cross_allreduce(Communicator& cross, void* data, size_t count, DType dtype, ReduceOp op,
                          std::vector<std::byte>& scratch);

// The cross-host level of a reduce-scatter: data holds cross.size() consecutive parts, part h
// (counts[h] elements) member h's; out (counts[cross.rank()] elements, which may be this member's
// part in data) receives this member's part reduced over cross in host order: the bits that
// hier_cross_allreduce gives those elements.
void hier_cross_reduce_scatter(Communicator& cross, const void* data, std::span<const size_t> counts, void* out,
                               DType dtype, ReduceOp op, std::vector<std::byte>& scratch);

}  // namespace gradsync::comm
