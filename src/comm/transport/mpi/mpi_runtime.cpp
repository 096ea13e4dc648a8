// SPDX-License-Identifier: Apache-2.0
#include "comm/transport/mpi/mpi_runtime.hpp"

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "common/error.hpp"
#include "common/fork.hpp"
#include "common/log.hpp"

namespace gradsync::comm::mpi {
namespace {

std::mutex g_mutex;
int g_communicators = 0;
bool g_we_initialised = false;
bool g_exit_handler = false;
std::atomic<int> g_thread_level{MPI_THREAD_SINGLE};
std::atomic<int> g_abandoned{0};
std::atomic<bool> g_host_lost{false};
OwnerProcess g_initialiser;  // set as MPI is initialised

void finalize_at_exit() {
  // A forked child inherits the handler, not the MPI rank: finalising there would join the
  // parent's job in its parent's name.
  if (!g_initialiser.here()) return;
  int initialised = 0, finalised = 0;
  lib().Initialized(&initialised);
  lib().Finalized(&finalised);
  if (!initialised || finalised) return;
  if (g_abandoned.load() > 0) {
    GS_LOG_ERROR(
        "MPI transport: a collective was abandoned (timeout, abort or dead peer) and never recovered by "
        "gradsync_comm_reset, so MPI_Finalize could wait forever for a missing rank: calling "
        "MPI_Abort(MPI_COMM_WORLD, 1) to end the job");
    lib().Abort(lib().comm_world, 1);
    return;
  }
  lib().Finalize();
}

}  // namespace

void acquire_runtime() {
  std::lock_guard lock(g_mutex);
  int initialised = 0, finalised = 0;
  lib().Initialized(&initialised);
  lib().Finalized(&finalised);
  GS_REQUIRE(!finalised, GRADSYNC_E_MISUSE, "MPI has already been finalized in this process (MPI cannot be restarted)");
  if (!initialised) {
    int provided = MPI_THREAD_SINGLE;
    const int rc = lib().Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    GS_REQUIRE(rc == MPI_SUCCESS, GRADSYNC_E_IO, "MPI_Init_thread failed with MPI error {}", rc);
    g_we_initialised = true;
    g_initialiser = OwnerProcess();
    GS_LOG_DEBUG("MPI transport: initialised MPI (thread level {})", provided);
    if (!g_exit_handler) {
      // Exit handlers and static destructors run in reverse order of registration: constructing
      // the logger first keeps it alive for the handler's message.
      (void)gradsync::log::logger();
      std::atexit(finalize_at_exit);
      g_exit_handler = true;
    }
  }
  int level = MPI_THREAD_SINGLE;
  lib().Query_thread(&level);
  g_thread_level.store(level);
  ++g_communicators;
}

void release_runtime() noexcept {
  std::lock_guard lock(g_mutex);
  --g_communicators;
}

int thread_level() noexcept { return g_thread_level.load(); }

bool we_initialised() noexcept {
  std::lock_guard lock(g_mutex);
  return g_we_initialised;
}

bool finalized() noexcept {
  int finalised = 0;
  lib().Finalized(&finalised);
  return finalised != 0;
}

void mark_abandoned() noexcept { g_abandoned.fetch_add(1); }
void clear_abandoned() noexcept { g_abandoned.fetch_sub(1); }
void mark_host_lost() noexcept { g_host_lost.store(true); }
bool host_lost() noexcept { return g_host_lost.load(); }

}  // namespace gradsync::comm::mpi
