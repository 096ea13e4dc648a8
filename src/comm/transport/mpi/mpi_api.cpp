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
  const Api* api = entry != nullptr ? entry(kApiVersion) : nullptr;
  if (api == nullptr || api->version != kApiVersion || api->size != sizeof(Api)) {
    why += fmt::format("\n  {}: a plugin of another libgradsync build (its table is not version {} of {} bytes)", path,
                       kApiVersion, sizeof(Api));
    return nullptr;  // left loaded: unloading a library that may have started MPI is not safe
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
    Dl_info self{};
    if (::dladdr(reinterpret_cast<void*>(&find), &self) != 0 && self.dli_fname != nullptr) {
      std::string dir = self.dli_fname;
      dir = dir.find('/') == std::string::npos ? "." : dir.substr(0, dir.rfind('/'));
      p.api = load(dir + "/" + kPluginSoname, why);
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

const Plugin& plugin() {
  static const Plugin p = find();
  return p;
}

}  // namespace

const Api& lib() {
  const Plugin& p = plugin();
  if (p.api == nullptr) fail(GRADSYNC_E_UNSUPPORTED, "{}", p.failure);
  return *p.api;
}

bool available() noexcept { return plugin().api != nullptr; }

}  // namespace gradsync::comm::mpi
