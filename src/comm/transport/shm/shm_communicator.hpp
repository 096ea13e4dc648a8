// SPDX-License-Identifier: Apache-2.0
#pragma once
// The shared-memory transport: processes of one host that join a named group through a segment
// in /dev/shm (see segment.hpp for its layout and rendezvous).
//
// The data paths and the round protocol are those of every shared-memory transport
// (algorithms/shared_memory.cpp, engine/round_engine.hpp); this transport provides the fabric.
#include <memory>

#include "comm/communicator.hpp"

namespace gradsync::comm {

std::unique_ptr<Communicator> create_shm_communicator(const Options& options);

}  // namespace gradsync::comm
