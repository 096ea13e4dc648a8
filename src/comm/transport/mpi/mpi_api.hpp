// SPDX-License-Identifier: Apache-2.0
#pragma once
// MPI as the transport reaches it: a table of MPI's functions and handles, filled by the plugin
// libgradsync-mpi.so.0 (plugin/mpi_plugin.cpp, the only code linked against the MPI runtime) and
// loaded when the first MPI communicator is created. libgradsync itself does not link MPI: a
// program that never asks for the MPI transport never needs Open MPI installed.
//
// mpi.h is used for its types and integer constants only. Its handles (MPI_COMM_WORLD, MPI_FLOAT,
// MPI_SUM, ...) are addresses of objects inside libmpi in Open MPI, so they come from the table.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1  // not the deprecated C++ bindings
#endif
#include <mpi.h>

#include <cstdint>

namespace gradsync::comm::mpi {

// Bumped whenever Api changes: a plugin of another build is refused, not misread.
inline constexpr uint32_t kApiVersion = 5;

// The mpi.h a build was compiled against, as far as the transport depends on it: the standard's
// version, the sizes of the types it passes by value or lays out (MPI_Status in MPI_Test's
// arguments), and Open MPI's major release (its ABI series). A plugin built against another mpi.h
// is refused.
inline constexpr uint64_t kMpiHeaderAbi = (uint64_t{MPI_VERSION} << 56) | (uint64_t{MPI_SUBVERSION} << 48) |
                                          (uint64_t{sizeof(MPI_Status)} << 32) | (uint64_t{sizeof(MPI_Aint)} << 24) |
                                          (uint64_t{sizeof(MPI_Comm)} << 16)
#if defined(OMPI_MAJOR_VERSION)
                                          | (uint64_t{OMPI_MAJOR_VERSION & 0xff} << 8)
#endif
    ;
inline constexpr const char* kPluginSoname = "libgradsync-mpi.so.0";
inline constexpr const char* kPluginEntry = "gradsync_mpi_plugin_api";

struct Api {
  uint32_t version;
  uint32_t size;            // sizeof(Api) as the plugin was compiled
  uint64_t mpi_header_abi;  // kMpiHeaderAbi as the plugin was compiled

  MPI_Comm comm_world, comm_null;
  MPI_Request request_null;
  MPI_Errhandler errors_return;
  MPI_Datatype float_, double_, int32, int64, uint16, byte, int_;
  MPI_Op sum, min, max;

  decltype(&MPI_Init_thread) Init_thread;
  decltype(&MPI_Initialized) Initialized;
  decltype(&MPI_Finalized) Finalized;
  decltype(&MPI_Finalize) Finalize;
  decltype(&MPI_Abort) Abort;
  decltype(&MPI_Query_thread) Query_thread;
  decltype(&MPI_Error_string) Error_string;
  decltype(&MPI_Comm_f2c) Comm_f2c;
  decltype(&MPI_Comm_test_inter) Comm_test_inter;
  decltype(&MPI_Comm_idup) Comm_idup;
  decltype(&MPI_Comm_free) Comm_free;
  decltype(&MPI_Comm_set_errhandler) Comm_set_errhandler;
  decltype(&MPI_Comm_rank) Comm_rank;
  decltype(&MPI_Comm_size) Comm_size;
  decltype(&MPI_Comm_group) Comm_group;
  decltype(&MPI_Group_incl) Group_incl;
  decltype(&MPI_Group_free) Group_free;
  decltype(&MPI_Comm_create_group) Comm_create_group;
  decltype(&MPI_Iallgather) Iallgather;
  decltype(&MPI_Irecv) Irecv;
  decltype(&MPI_Isend) Isend;
  decltype(&MPI_Test) Test;
  decltype(&MPI_Testall) Testall;
  decltype(&MPI_Wait) Wait;
  decltype(&MPI_Waitall) Waitall;
  decltype(&MPI_Cancel) Cancel;
  decltype(&MPI_Request_free) Request_free;
  decltype(&MPI_Allreduce) Allreduce;
  decltype(&MPI_Bcast) Bcast;
  decltype(&MPI_Allgatherv) Allgatherv;
  decltype(&MPI_Alltoallv) Alltoallv;
  decltype(&MPI_Reduce_scatter) Reduce_scatter;
  // A grow's (mpi_grow.cpp).
  MPI_Info info_null;
  decltype(&MPI_Info_create) Info_create;
  decltype(&MPI_Info_set) Info_set;
  decltype(&MPI_Info_free) Info_free;
  decltype(&MPI_Comm_spawn) Comm_spawn;
  decltype(&MPI_Comm_get_parent) Comm_get_parent;
  decltype(&MPI_Intercomm_merge) Intercomm_merge;
};

// The table, loading the plugin on first use: beside the library that holds this code, then by
// its soname (LD_LIBRARY_PATH, the caller's RUNPATH), or at $GRADSYNC_MPI_PLUGIN when set.
// Throws Error(GRADSYNC_E_UNSUPPORTED) saying what to install when it cannot be loaded.
const Api& lib();
// Whether lib() would succeed (loads the plugin if it can); never throws.
bool available() noexcept;

}  // namespace gradsync::comm::mpi
