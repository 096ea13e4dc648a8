// SPDX-License-Identifier: Apache-2.0
// A plugin as a build against another mpi.h would make it: the real plugin's code (compiled into
// this library with its entry point renamed, see CMakeLists.txt), whose table differs only in the
// mpi.h it records. libgradsync must refuse it and say why, rather than call MPI through a table
// whose types it would misread.
#include <cstdint>

#include "comm/transport/mpi/mpi_api.hpp"

using gradsync::comm::mpi::Api;

extern "C" const Api* gradsync_real_mpi_plugin_api(uint32_t version);

extern "C" __attribute__((visibility("default"))) const Api* gradsync_mpi_plugin_api(uint32_t version) {
  static const Api skewed = [version] {
    const Api* real = gradsync_real_mpi_plugin_api(version);
    Api a = real != nullptr ? *real : Api{};
    a.mpi_header_abi ^= 0xff00;  // another Open MPI major release
    return a;
  }();
  return &skewed;
}
