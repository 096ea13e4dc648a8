// SPDX-License-Identifier: Apache-2.0
#include "comm/transport/mpi/mpi_api.hpp"

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/error.hpp"

namespace gradsync::comm::mpi {
namespace {

struct Plugin {
  const Api* api = nullptr;
  std::string failure;  // why not, when api is null
};

// Reads exactly n bytes at offset: "" when it did, else why not.
std::string read_at(int fd, void* buf, size_t n, off_t offset) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, offset);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return std::strerror(errno);
    if (r == 0) return "it shrank while being read";
    p += r;
    n -= static_cast<size_t>(r);
    offset += r;
  }
  return {};
}

// Why the file at `path` must not be given to the dynamic loader, or "" when its ELF headers hold
// together. The loader maps each segment where the program headers say and reads it through the
// mapping: a segment that runs past the end of a truncated file (a partial copy, one overwritten
// while loading) raises SIGBUS inside dlopen, which no caller can recover from. So the headers are
// read here with pread (no mapping, so a short file costs no signal here) and every segment's file
// range is checked against the file's size. A file that cannot be opened is left to dlopen to
// explain. A file truncated between this check and dlopen can still fault; that window is the
// length of one dlopen, not of a copy.
std::string elf_problem(const std::string& path) {
  // O_NONBLOCK: a FIFO at that path must not block the open; it has no effect on a regular file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return {};
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return fmt::format("cannot stat it: {}", std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return "not a regular file";
  const auto size = static_cast<uint64_t>(st.st_size);
  ElfW(Ehdr) eh{};
  if (size < sizeof eh) return fmt::format("truncated: {} bytes, shorter than an ELF header", size);
  if (const std::string e = read_at(fd, &eh, sizeof eh, 0); !e.empty()) return "cannot read its ELF header: " + e;
  if (std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0) return "not an ELF file (no ELF magic number)";
  // The machine this code runs on is the one in its own object's ELF header.
  Dl_info self{};
  const auto* own = ::dladdr(reinterpret_cast<void*>(&elf_problem), &self) != 0
                        ? static_cast<const ElfW(Ehdr)*>(self.dli_fbase)
                        : nullptr;
  if (own != nullptr && (eh.e_ident[EI_CLASS] != own->e_ident[EI_CLASS] ||
                         eh.e_ident[EI_DATA] != own->e_ident[EI_DATA] || eh.e_machine != own->e_machine))
    return fmt::format("an ELF file for another machine (class {}, data {}, machine {}; this process's are {}, {}, {})",
                       eh.e_ident[EI_CLASS], eh.e_ident[EI_DATA], eh.e_machine, own->e_ident[EI_CLASS],
                       own->e_ident[EI_DATA], own->e_machine);
  if (eh.e_type != ET_DYN) return fmt::format("not a shared library (ELF type {})", eh.e_type);
  if (eh.e_phentsize != sizeof(ElfW(Phdr)) || eh.e_phnum == 0 || eh.e_phnum == PN_XNUM)
    return fmt::format("damaged: {} program headers of {} bytes", eh.e_phnum, eh.e_phentsize);
  const uint64_t table = uint64_t{eh.e_phnum} * sizeof(ElfW(Phdr));
  if (eh.e_phoff > size || table > size - eh.e_phoff)
    return fmt::format(
        "truncated or damaged: its program headers take {} bytes at offset {}, past the end of its {} bytes", table,
        eh.e_phoff, size);
  std::vector<ElfW(Phdr)> ph(eh.e_phnum);
  if (const std::string e = read_at(fd, ph.data(), table, static_cast<off_t>(eh.e_phoff)); !e.empty())
    return "cannot read its program headers: " + e;
  for (size_t i = 0; i < ph.size(); ++i) {
    if (ph[i].p_offset > size || ph[i].p_filesz > size - ph[i].p_offset)
      return fmt::format("truncated or damaged: its {} {} takes {} bytes at offset {}, past the end of its {} bytes",
                         ph[i].p_type == PT_LOAD ? "loadable segment" : "segment", i, ph[i].p_filesz, ph[i].p_offset,
                         size);
  }
  return {};
}

// Loads the plugin at `path` (a path or a soname); a reason is appended to `why` when it cannot.
const Api* load(const std::string& path, std::string& why) {
  // A soname is searched for by the loader itself; a path is checked first (elf_problem).
  if (path.find('/') != std::string::npos) {
    if (const std::string problem = elf_problem(path); !problem.empty()) {
      why += fmt::format("\n  {}: {}", path, problem);
      return nullptr;
    }
  }
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
    if (::dladdr(reinterpret_cast<void*>(&find), &self) != 0 && self.dli_fname != nullptr && self.dli_fname[0] == '/') {
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
