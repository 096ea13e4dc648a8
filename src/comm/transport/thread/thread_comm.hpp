// SPDX-License-Identifier: Apache-2.0
#pragma once
// The thread transport: ranks are threads of one process that form a group by name (see
// thread_comm.cpp for its fabric and registry of groups).
//
// The data paths and the round protocol are those of every shared-memory transport
// (algorithms/shared_memory.cpp, engine/round_engine.hpp); this transport provides the fabric.
#include <memory>

#include "comm/communicator.hpp"

namespace gradsync::comm {

std::unique_ptr<Communicator> create_thread_communicator(const Options& options);

}  // namespace gradsync::comm
