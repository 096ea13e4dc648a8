// SPDX-License-Identifier: Apache-2.0
#pragma once
// The checks of the communicator's arguments that the entry points make on the caller's thread
// before anything runs (capi_comm.cpp), so a bad argument is reported at once, in this rank's own
// words: the buffers and counts of the collectives. What only the group can judge (a root, the
// ranks' agreement) is judged inside the round instead.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "capi/comm_handle.hpp"
#include "comm/types.hpp"
#include "common/dtype.hpp"
#include "common/partition.hpp"

namespace gradsync::capi {

// This rank's part of total elements by the partition rule.
Part part_of(const CommLink& link, size_t total);

// A buffer of count elements must exist and its byte size must fit in size_t (huge counts are errors).
void require_buffer(const void* p, size_t count, DType dtype, const char* what);
// The collectives that reduce read and write elements as their type, so a buffer must be aligned
// as an array of that type is (a misaligned one would be undefined behaviour in the kernels).
void require_aligned(const void* p, DType dtype, const char* what);
// Buffer a (a_count elements) and buffer b must not overlap, except in place: a exactly at
// `in_place` (a position inside b). Peers read the send buffer while recv is written, so any other
// overlap races them (and copying it is undefined behaviour). Counts have passed require_buffer, so
// the byte sizes do not overflow.
void require_disjoint(const void* a, size_t a_count, const char* a_name, const void* b, size_t b_count,
                      const char* b_name, DType dtype, const void* in_place);
// One buffer of a reduction: present, aligned, and send either recv or apart from it.
comm::BufferRef reducible(const void* send, void* recv, size_t count, DType t);

// The parts of an allgather or a reduce_scatter: every rank's count, their sum, this rank's part.
struct RankParts {
  std::vector<size_t> counts;
  size_t total = 0;
  Part mine{};
};
// By the partition rule.
RankParts rule_parts(const CommLink& link, size_t total);
// As the caller gives them (copied: a non-blocking call outlives the caller's array).
RankParts given_parts(const CommLink& link, const size_t* counts);

// An exchange's buffers: send (send_extent elements) and recv (recv_extent) must not overlap.
void require_exchange_buffers(const void* send, size_t send_extent, const void* recv, size_t recv_extent, DType t);
// size entries, copied (a non-blocking call outlives the caller's array); `what` names them.
std::vector<size_t> given_counts(const CommLink& link, const size_t* counts, const char* what);
// The elements a buffer must hold for these parts: the largest displacement + count of a non-empty
// part. Displacements NULL: packed in rank order (written into displs).
size_t extent_of(const std::vector<size_t>& counts, const size_t* given_displs, std::vector<size_t>& displs,
                 const char* what);
// count elements per rank, size of them: the rooted buffer of a gather or a scatter.
size_t per_rank(const CommLink& link, size_t count, DType t, const char* what);

}  // namespace gradsync::capi
