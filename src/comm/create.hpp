// SPDX-License-Identifier: Apache-2.0
#pragma once
// Making a communicator: the one place that knows every transport.
#include <memory>

#include "comm/communicator.hpp"
#include "comm/types.hpp"

namespace gradsync::comm {

// Creates and joins; blocks until the whole group has joined or the timeout passes.
std::unique_ptr<Communicator> create(const Options& options);
// A joiner's side of Communicator::grow: options.name is the join name. Threads and shm:
// options.rank is this joiner's index among options.size joiners (comm/membership.hpp). MPI and
// hier: a process that the members' grow spawned, its index and their count from MPI (mpi_grow.cpp).
GrowResult join(const Options& options);
// Whether create() can make communicators of this transport here (MPI: built with it, and its
// plugin and the MPI runtime load).
bool transport_available(Transport t) noexcept;

}  // namespace gradsync::comm
