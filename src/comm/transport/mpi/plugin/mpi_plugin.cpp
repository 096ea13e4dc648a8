// SPDX-License-Identifier: Apache-2.0
// libgradsync-mpi.so.0: the one part of libgradsync linked against the MPI runtime. It hands the
// MPI transport (in libgradsync) the table of MPI's functions and handles it calls through
// (comm/transport/mpi/mpi_api.hpp), and nothing else.
#include "comm/transport/mpi/mpi_api.hpp"

namespace {

using gradsync::comm::mpi::Api;

Api make() {
  Api a{};
  a.version = gradsync::comm::mpi::kApiVersion;
  a.size = sizeof(Api);
  a.mpi_header_abi = gradsync::comm::mpi::kMpiHeaderAbi;
  a.comm_world = MPI_COMM_WORLD;
  a.comm_null = MPI_COMM_NULL;
  a.request_null = MPI_REQUEST_NULL;
  a.errors_return = MPI_ERRORS_RETURN;
  a.float_ = MPI_FLOAT;
  a.double_ = MPI_DOUBLE;
  a.int32 = MPI_INT32_T;
  a.int64 = MPI_INT64_T;
  a.uint16 = MPI_UINT16_T;
  a.byte = MPI_BYTE;
  a.int_ = MPI_INT;
  a.sum = MPI_SUM;
  a.min = MPI_MIN;
  a.max = MPI_MAX;
  a.Init_thread = &MPI_Init_thread;
  a.Initialized = &MPI_Initialized;
  a.Finalized = &MPI_Finalized;
  a.Finalize = &MPI_Finalize;
  a.Abort = &MPI_Abort;
  a.Query_thread = &MPI_Query_thread;
  a.Error_string = &MPI_Error_string;
  a.Comm_f2c = &MPI_Comm_f2c;
  a.Comm_test_inter = &MPI_Comm_test_inter;
  a.Comm_idup = &MPI_Comm_idup;
  a.Comm_free = &MPI_Comm_free;
  a.Comm_set_errhandler = &MPI_Comm_set_errhandler;
  a.Comm_rank = &MPI_Comm_rank;
  a.Comm_size = &MPI_Comm_size;
  a.Comm_group = &MPI_Comm_group;
  a.Group_incl = &MPI_Group_incl;
  a.Group_free = &MPI_Group_free;
  a.Comm_create_group = &MPI_Comm_create_group;
  a.Iallgather = &MPI_Iallgather;
  a.Irecv = &MPI_Irecv;
  a.Isend = &MPI_Isend;
  a.Test = &MPI_Test;
  a.Testall = &MPI_Testall;
  a.Wait = &MPI_Wait;
  a.Waitall = &MPI_Waitall;
  a.Cancel = &MPI_Cancel;
  a.Request_free = &MPI_Request_free;
  a.Allreduce = &MPI_Allreduce;
  a.Bcast = &MPI_Bcast;
  a.Allgatherv = &MPI_Allgatherv;
  a.Alltoallv = &MPI_Alltoallv;
  a.Reduce_scatter = &MPI_Reduce_scatter;
  a.info_null = MPI_INFO_NULL;
  a.Info_create = &MPI_Info_create;
  a.Info_set = &MPI_Info_set;
  a.Info_free = &MPI_Info_free;
  a.Comm_spawn = &MPI_Comm_spawn;
  a.Comm_get_parent = &MPI_Comm_get_parent;
  a.Intercomm_merge = &MPI_Intercomm_merge;
  return a;
}

}  // namespace

// The table, for the version the library was built with; NULL for another.
extern "C" __attribute__((visibility("default"))) const Api* gradsync_mpi_plugin_api(uint32_t version) {
  static const Api api = make();
  return version == gradsync::comm::mpi::kApiVersion ? &api : nullptr;
}
