// SPDX-License-Identifier: Apache-2.0
#pragma once
// The communicator over MPI: processes across machines, same interface as the thread transport.
//
// Every call starts with an exchange: each rank sends every peer a 32-byte header (a key of the
// call, its arrival time, a weighted mean's weight) point to point and receives theirs, polled
// against the deadline, the abort flag, abort notices and the liveness of peers on this host.
// Every rank then holds the same table and reaches the same verdict (E_MISMATCH on every rank when
// the keys differ, after a second exchange of whole fingerprints that names the ranks).
// - The small path: an allreduce of at most 16 KiB per rank (64 KiB over the group) carries its data
//   behind the header, and every rank folds the contributions in rank order; a barrier is the
//   exchange. One round trip, no blocking call.
// - The other calls commit with a barrier, then move their data through MPI's own blocking
//   collectives (MPI_Allreduce, MPI_Bcast, MPI_Allgatherv, MPI_Reduce_scatter, MPI_Alltoallv):
//   Open MPI's non-blocking collectives (libnbc) are up to 10x slower on large messages.
// Deterministic mode replaces MPI's reduction (whose order is implementation-defined) by
// reduce-scatter-by-gathering: MPI_Alltoallv brings every rank's copy of this rank's slice here,
// the shared rank-order kernels (comm/reduce.hpp) fold them, and MPI_Allgatherv shares the slices.
// The round protocol (commitment, abort notices, deadlines) is described above
// MpiCommunicator::arrive, in docs/mpi.md, and checked in tests/model/mpi_round.pml.
#include <memory>

#include "comm/communicator.hpp"

namespace gradsync::comm {

// Joins the group of MPI_COMM_WORLD, or of the communicator whose Fortran handle is
// options.mpi_fcomm, initialising MPI if the host has not. Rank and size come from MPI.
std::unique_ptr<Communicator> create_mpi_communicator(const Options& options);
// A joiner's side of a grow over MPI, in a process that the members' grow spawned (mpi_grow.cpp).
GrowResult join_mpi_group(const Options& options);
// Whether a grow over MPI started this process (its environment says so): join_mpi_group refuses
// any other.
bool spawned_by_grow() noexcept;
// Whether MPI communicators can be created here: the MPI plugin and the MPI runtime load.
bool mpi_transport_available() noexcept;

}  // namespace gradsync::comm
