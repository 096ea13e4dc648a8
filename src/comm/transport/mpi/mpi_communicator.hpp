// SPDX-License-Identifier: Apache-2.0
#pragma once
// The communicator over MPI: processes across machines, same interface as the thread transport.
//
// Every collective is two steps:
// 1. An arrival rendezvous that is non-blocking and polled against the deadline, the abort flag,
//    abort notices from peers and the liveness of peers on this host: an MPI_Iallgather of a
//    40-byte fingerprint (kind, count, dtype, op, root, sequence number) that every rank compares
//    (check_mismatch, the default), or an MPI_Ibarrier when the check is off. A rank that never
//    arrives therefore gives GRADSYNC_E_TIMEOUT, and ranks that disagree all get
//    GRADSYNC_E_MISMATCH before any of them enters the data transfer, so the next round works.
// 2. The data transfer with MPI's own blocking collective (MPI_Allreduce, MPI_Bcast,
//    MPI_Allgatherv, MPI_Reduce_scatter), which every rank is known to have entered with
//    matching arguments. Blocking calls because OpenMPI's non-blocking collectives (libnbc) are up
//    to 10x slower on large messages; MPI cannot interrupt them, but they can only stall if a peer
//    dies inside one, and then mpirun ends the job.
// An allreduce of at most 64 bytes (loss scalars, counters) travels inside the rendezvous itself
// and every rank reduces the gathered contributions in rank order: one round trip, deterministic.
// Deterministic mode replaces MPI's reduction (whose order is implementation-defined) by
// reduce-scatter-by-gathering: MPI_Alltoallv brings every rank's copy of this rank's slice here,
// the shared rank-order kernels (comm/reduce.hpp) fold them, and MPI_Allgatherv shares the slices.
#include <memory>

#include "comm/communicator.hpp"

namespace gradsync::comm {

// Joins the group of MPI_COMM_WORLD, or of the communicator whose Fortran handle is
// options.mpi_fcomm, initialising MPI if the host has not. Rank and size come from MPI.
std::unique_ptr<Communicator> create_mpi_communicator(const Options& options);
// Whether MPI communicators can be created here: the MPI plugin and the MPI runtime load.
bool mpi_transport_available() noexcept;

}  // namespace gradsync::comm
