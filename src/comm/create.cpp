// SPDX-License-Identifier: Apache-2.0
#include "comm/create.hpp"

#include <string>
#include <utility>

#include "comm/membership.hpp"
#include "comm/topology.hpp"
#include "comm/transport/hier/hier_communicator.hpp"
#include "comm/transport/shm/shm_communicator.hpp"
#include "comm/transport/thread/thread_comm.hpp"
#include "comm/transport/threaded/threaded_communicator.hpp"
#if GRADSYNC_HAVE_MPI
#include "comm/transport/mpi/mpi_communicator.hpp"
#endif
#include "common/error.hpp"

namespace gradsync::comm {

bool transport_available(Transport t) noexcept {
  if (t != Transport::Mpi && t != Transport::Hier) return true;
#if GRADSYNC_HAVE_MPI
  return mpi_transport_available();
#else
  return false;
#endif
}

namespace {
std::unique_ptr<Communicator> create_transport(const Options& options) {
  switch (options.transport) {
    case Transport::Thread: return create_thread_communicator(options);
    case Transport::Shm: return create_shm_communicator(options);
    case Transport::Mpi:
    case Transport::Hier:
#if GRADSYNC_HAVE_MPI
      return create_mpi_communicator(options);
#else
      fail(GRADSYNC_E_UNSUPPORTED, "the {} transport is not available: libgradsync was built without MPI",
           transport_name(options.transport));
#endif
  }
  fail(GRADSYNC_E_UNSUPPORTED, "transport {} is not in this build", static_cast<int>(options.transport));
}
}  // namespace

std::unique_ptr<Communicator> over_levels(std::unique_ptr<Communicator> world, const Options& options) {
  // The levels over the MPI group (collective over it). Its identity is the MPI group's: options.rank
  // is not set over MPI, where the rank comes from MPI.
  const Communicator* mpi_level = world.get();  // kept by the hierarchical group
  std::unique_ptr<Communicator> hier = make_hierarchical_communicator(std::move(world), options);
  mpi_level->pass_identity(*hier, options, mpi_level->topology());
  return hier;
}

GrowResult join(const Options& options) {
  if (options.threads > 0) {
#if GRADSYNC_HAVE_MPI
    // Refused at once: the threads of a process that no grow started would otherwise wait for each
    // other, and then for a lane that cannot form.
    GS_REQUIRE(spawned_by_grow(), GRADSYNC_E_INVALID_ARG,
               "join '{}' with threads over MPI: this process was not started by a grow (the members' grow starts "
               "its joiners itself, MPI_Comm_spawn of their program); start the program otherwise with "
               "gradsync_comm_create",
               options.name);
#endif
    return join_threaded_communicator(options, &join, &create);
  }
  switch (options.transport) {
    case Transport::Thread: return Membership::join(options, create_thread_communicator);
    case Transport::Shm: return Membership::join(options, create_shm_communicator);
    case Transport::Mpi:
    case Transport::Hier: break;
  }
#if GRADSYNC_HAVE_MPI
  GrowResult grown = join_mpi_group(options);
  if (options.transport == Transport::Hier) {
    // The members build theirs so (HierCommunicator::grow), with the group's options.
    Options o = grown.comm->group_options();
    o.transport = Transport::Hier;
    Communicator* mpi_level = grown.comm.get();  // kept by the hierarchical group
    mpi_level->guard_forming(true);
    grown.comm = over_levels(std::move(grown.comm), o);
    mpi_level->guard_forming(false);
  }
  return grown;
#else
  fail(GRADSYNC_E_UNSUPPORTED, "join over {}: libgradsync was built without MPI", transport_name(options.transport));
#endif
}

std::unique_ptr<Communicator> create(const Options& options) {
  GS_REQUIRE(options.host_label.find('\0') == std::string::npos, GRADSYNC_E_INVALID_ARG,
             "host label contains a NUL byte");
  if (options.threads > 0) {
    std::unique_ptr<Communicator> c = create_threaded_communicator(options, &create);
    c->establish(options);
    return c;
  }
  std::unique_ptr<Communicator> c = create_transport(options);
  c->establish(options);
  if (options.transport != Transport::Hier) return c;
  return over_levels(std::move(c), options);
}

}  // namespace gradsync::comm
