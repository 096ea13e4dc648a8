// SPDX-License-Identifier: Apache-2.0
#pragma once
// The words every layer of the communicator shares: which transport, a group's options, the
// collectives by name, a buffer of a fused allreduce, and the routes of an exchange. Plain types
// that need nothing of the communicator, so the telemetry, the call signatures, the round engine
// and the transports all stand on them without standing on each other.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "common/dtype.hpp"

namespace gradsync::comm {

enum class Transport : int32_t { Thread = 0, Shm = 1, Mpi = 2, Hier = 3 };
const char* transport_name(Transport t) noexcept;

struct Options {
  Transport transport = Transport::Thread;
  int32_t rank = 0;
  int32_t size = 1;
  bool deterministic = true;
  bool check_mismatch = true;
  std::chrono::milliseconds timeout{300000};
  int64_t mpi_fcomm = INT64_MIN;  // INT64_MIN: MPI_COMM_WORLD
  std::string name;
  std::string host_label;             // replaces the detected host identity when not empty (comm/topology.hpp)
  bool topology_independent = false;  // Hier: the flat rank-order reduction's bits, whatever the hosts
  // Mpi, Hier: the ranks this process holds, one per thread that creates the group, and this
  // thread's index among them (transport/threaded/threaded_communicator.hpp); 0: one rank per
  // process, without a team of threads.
  int32_t threads = 0;
  int32_t thread = 0;
  // Why this group cannot grow (E_UNSUPPORTED saying it), or empty: a shared-memory group that an
  // MPI shrink formed, inside an MPI job whose joiners only MPI could start (mpi_shrink.cpp).
  std::string grow_refused;
  // Asked now and then while create() waits for the other members: a non-empty answer gives up
  // with E_REMOTE saying it (a shrink forming its group from a group that lost another member).
  // Kept only for the create() call.
  std::function<std::string()> forming_abandoned;
};

// Asked now and then (every 10 to 100 ms) by a call of this communicator that is waiting for its
// peers, on the waiting thread: true means the caller wants out (Ctrl-C in a host language), and
// the group is aborted. Empty by default.
struct InterruptCheck {
  int (*fn)(void* user) = nullptr;
  void* user = nullptr;
  bool operator()() const { return fn != nullptr && fn(user) != 0; }
};

enum class Collective : int32_t {
  Allreduce = 1,
  Broadcast = 2,
  Allgather = 3,
  ReduceScatter = 4,
  Barrier = 5,
  WeightedMean = 6,
  Alltoall = 7,
  // Forms of the exchange (alltoallv) in signatures only, so that messages name what the caller
  // called; statistics count them as alltoall.
  Gather = 8,
  Scatter = 9,
};

const char* collective_name(Collective c) noexcept;

// One buffer of a fused allreduce.
struct BufferRef {
  const void* send;
  void* recv;
  size_t count;
};

// The bytes of a (fused) allreduce, as its statistics count them.
inline uint64_t payload_bytes(std::span<const BufferRef> buffers, DType dtype) noexcept {
  uint64_t n = 0;
  for (const BufferRef& b : buffers) n += b.count;
  return n * dtype_size(dtype);
}

// Who sends what to whom in an exchange, the same on every rank. Entry [s * n + d] is the part
// rank s sends rank d: its count, where it starts in s's send buffer and where it lands in d's
// recv buffer, in elements.
struct Routes {
  Collective form;  // Alltoall, Gather or Scatter: what the caller called, for messages
  int32_t root = -1;
  uint64_t n = 0;
  std::vector<uint64_t> count, send_displ, recv_displ;

  Routes(Collective f, int32_t r, uint64_t ranks)
      : form(f), root(r), n(ranks), count(ranks * ranks), send_displ(ranks * ranks), recv_displ(ranks * ranks) {}
  size_t at(uint64_t s, uint64_t d) const noexcept { return s * n + d; }
  // Elements of rank s's send buffer (d's recv buffer) that the parts span.
  uint64_t send_extent(uint64_t s) const noexcept;
  uint64_t recv_extent(uint64_t d) const noexcept;
  uint64_t longest() const noexcept;  // the largest part
};

}  // namespace gradsync::comm
