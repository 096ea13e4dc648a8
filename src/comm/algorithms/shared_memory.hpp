// SPDX-License-Identifier: Apache-2.0
#pragma once
// The collectives over a shared-memory Fabric (see shared_memory.cpp for the data paths).
#include <memory>

#include "comm/communicator.hpp"
#include "comm/engine/fabric.hpp"

namespace gradsync::comm {

// join: how the transport forms a group of its own by name (JoinGroup, comm/communicator.hpp).
std::unique_ptr<Communicator> make_shared_memory_communicator(const Options& options, std::unique_ptr<Fabric> fabric,
                                                              JoinGroup join);

}  // namespace gradsync::comm
