// SPDX-License-Identifier: Apache-2.0
// The real plugin (compiled in with its entry point renamed, as skewed_plugin.cpp does) with every
// MPI call that moves a message counted: point-to-point sends and receives and every collective.
// A test loads it through GRADSYNC_MPI_PLUGIN and reads gradsync_test_mpi_messages() to prove
// which calls stay off MPI.
#include <atomic>
#include <cstdint>

#include "comm/transport/mpi/mpi_api.hpp"

using gradsync::comm::mpi::Api;

extern "C" const Api* gradsync_real_mpi_plugin_api(uint32_t version);

namespace {
std::atomic<uint64_t> messages{0};
const Api* real = nullptr;

template <class R, class... A>
struct Counted;
template <class R, class... A>
struct Counted<R (*)(A...)> {
  template <R (*Api::*field)(A...)>
  static R call(A... args) {
    messages.fetch_add(1, std::memory_order_relaxed);
    return (real->*field)(args...);
  }
};
#define COUNT(name) a.name = &Counted<decltype(a.name)>::call<&Api::name>
}  // namespace

extern "C" __attribute__((visibility("default"))) uint64_t gradsync_test_mpi_messages() {
  return messages.load(std::memory_order_relaxed);
}

extern "C" __attribute__((visibility("default"))) const Api* gradsync_mpi_plugin_api(uint32_t version) {
  static const Api counted = [version] {
    real = gradsync_real_mpi_plugin_api(version);
    Api a = real != nullptr ? *real : Api{};
    if (real == nullptr) return a;
    COUNT(Iallgather);
    COUNT(Irecv);
    COUNT(Isend);
    COUNT(Allreduce);
    COUNT(Bcast);
    COUNT(Allgatherv);
    COUNT(Alltoallv);
    COUNT(Reduce_scatter);
    return a;
  }();
  return real != nullptr ? &counted : nullptr;
}
