// SPDX-License-Identifier: Apache-2.0
#include "comm/transport/mpi/mpi_api.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <string>

#include "common/error.hpp"

namespace gradsync::comm::mpi {
namespace {

struct Plugin {
  const Api* api = nullptr;
  std::string failure;  // why not, when api is null
};

// Loads the plugin at `path` (a path or a soname); a reason is appended to `why` when it cannot.
const Api* load(const std::string& path, std::string& why) {
  // RTLD_GLOBAL: Open MPI's own components, loaded later by libmpi, resolve against it.
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    const char* e = ::dlerror();
    why += fmt::format("\n  {}: {}", path, e != nullptr ? e : "not loadable");
    return nullptr;
  }
  using Entry = const Api* (*)(uint32_t);
  const auto entry = reinterpret_cast<Entry>(::dlsym(handle, kPluginEntry));
  if (entry == nullptr) {
    why += fmt::format("\n  {}: not the gradsync MPI plugin (it has no {})", path, kPluginEntry);
    ::dlclose(handle);  // nothing of it ran
    return nullptr;
  }
  const Api* api = entry(kApiVersion);
  if (api == nullptr || api->version != kApiVersion || api->size != sizeof(Api)) {
    why += fmt::format("\n  {}: a plugin of another libgradsync build (its table is not version {} of {} bytes)", path,
                       kApiVersion, sizeof(Api));
    return nullptr;  // left loaded: unloading a library that may have started MPI is not safe
  }
  if (api->mpi_header_abi != kMpiHeaderAbi) {
    why += fmt::format("\n  {}: built against another mpi.h (ABI {:#x}; this library's is {:#x})", path,
                       api->mpi_header_abi, kMpiHeaderAbi);
    return nullptr;
  }
  return api;
}

Plugin find() {
  Plugin p;
  std::string why;
  if (const char* path = std::getenv("GRADSYNC_MPI_PLUGIN"); path != nullptr && *path != '\0') {
    p.api = load(path, why);
  } else {
    // Beside the library (or program) that holds this code: a build tree, an install prefix, a
    // Python package, wherever they were moved together.
    // Only an absolute path names a directory: a program started through PATH reports its bare
    // name, and the current directory is nobody's to load code from.
    Dl_info self{};
    if (::dladdr(reinterpret_cast<void*>(&find), &self) != 0 && self.dli_fname != nullptr &&
        self.dli_fname[0] == '/') {
      const std::string path = self.dli_fname;
      p.api = load(path.substr(0, path.rfind('/')) + "/" + kPluginSoname, why);
    }
    if (p.api == nullptr) p.api = load(kPluginSoname, why);
  }
  if (p.api == nullptr) {
    p.failure = fmt::format(
        "the MPI transport needs its plugin {} (built and installed beside libgradsync.so.0; Debian "
        "package libgradsync0-mpi) and Open MPI's runtime (apt install libopenmpi3); it could not be loaded:{}",
        kPluginSoname, why);
  }
  return p;
}

// Never destroyed: MPI's finalisation at exit and communicators freed late still call through it.
const Plugin& plugin() {
  static const Plugin* p = new Plugin(find());
  return *p;
}

}  // namespace

const Api& lib() {
  const Plugin& p = plugin();
  if (p.api == nullptr) fail(GRADSYNC_E_UNSUPPORTED, "{}", p.failure);
  return *p.api;
}

bool available() noexcept { return plugin().api != nullptr; }

}  // namespace gradsync::comm::mpi
