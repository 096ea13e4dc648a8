// SPDX-License-Identifier: Apache-2.0
#pragma once
// Process-wide MPI state shared by every MPI communicator of this process: who initialised MPI,
// the thread level it provides, and whether some communicator abandoned a collective (after a
// timeout or an abort) that a peer may still be blocked in.
//
// Lifecycle (documented in include/gradsync/comm.h):
// - The first MPI communicator initialises MPI when the host program has not (MPI_Init_thread,
//   asking for MPI_THREAD_MULTIPLE), and then registers an exit handler.
// - MPI can be initialised only once per process, so we finalise at exit, never at the last free:
//   a program that frees its communicator and creates another must keep working.
// - At exit, when we initialised MPI: MPI_Finalize, unless a collective was abandoned (timeout,
//   abort, dead peer) and never recovered by a reset. Then MPI_Finalize could block forever in its
//   closing synchronisation with a rank that never arrives or has died, so we call
//   MPI_Abort(MPI_COMM_WORLD, 1) instead, which ends the whole job (mpirun exits non-zero)
//   rather than leaving it hung.
// - When the host initialised MPI, finalising (or aborting) is the host's.
#include "comm/transport/mpi/mpi_api.hpp"

namespace gradsync::comm::mpi {

// Initialises MPI if needed and counts one more communicator. Throws Error on failure.
void acquire_runtime();
// One communicator fewer (no MPI call: finalising happens at exit).
void release_runtime() noexcept;
// MPI_THREAD_* level in effect.
int thread_level() noexcept;
// Whether this process called MPI_Init_thread (and so owns finalising MPI).
bool we_initialised() noexcept;
// True once MPI_Finalize has run (by us or by the host): MPI must not be called any more.
bool finalized() noexcept;
// Counts communicators holding an abandoned collective (marked by timeouts/aborts, cleared by reset).
void mark_abandoned() noexcept;
void clear_abandoned() noexcept;
// Set once a shrink in this process decided that a whole host of the job was lost: Open MPI 4.1's
// MPI_Comm_spawn then ends the whole job (its runtime relays through the lost host's daemon), so a
// grow refuses (mpi_grow.cpp).
void mark_host_lost() noexcept;
bool host_lost() noexcept;

}  // namespace gradsync::comm::mpi
