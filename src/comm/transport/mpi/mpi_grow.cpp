// SPDX-License-Identifier: Apache-2.0
// The MPI transport's grow. Open MPI 4.1 takes new processes into a running job only through
// MPI_Comm_spawn (connect/accept would need a name server the job does not have), so the members
// start the joiners themselves: rank 0's program, with its arguments and working directory, and
// GRADSYNC_JOIN=<join name> in the joiners' environment, which tells that program to join
// (comm.h, gradsync_comm_join). Then:
// 1. Agree: the members allgather (joiners, the join name's hash, the next member id, whether this
//    process saw a whole host lost, whether rank 0 could read its program) over the group, a
//    verified collective, and judge it alike: all go on, or all fail with one status.
// 2. Spawn: MPI_Comm_spawn over the members (blocking; the joiners' MPI_Init completes it).
// 3. Merge: MPI_Intercomm_merge, members low, so they keep their ranks and joiner j is size + j.
// 4. Offer: rank 0 broadcasts the group's options and ids over the merged communicator.
// 5. Form: an MPI communicator of the transport's own over the merged one (its setup bounded as
//    at creation), its topology detected; an allgather over it of every joiner's verdict on the
//    offer, so that a joiner that came with another join name or transport fails every rank alike;
//    then the commit, one barrier. Both are rounds of the grown group: a rank lost in them fails
//    its peers (E_REMOTE), or, once they completed, their next call, as after a shrink.
// Steps 2-4 are MPI's blocking collectives, which nothing can interrupt: each runs under a
// watchdog that ends the job with MPI_Abort at the group's timeout, so a joiner that never comes (a
// program that does not call gradsync_comm_join) or a member lost inside them ends the job rather
// than hang it. After a whole host was lost the members refuse in step 1: Open MPI's spawn would end
// the job (docs/mpi.md). tests/model/mpi_grow.pml checks these steps over deaths at each of them.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "comm/engine/control.hpp"
#include "comm/transport/mpi/mpi_internal.hpp"
#include "comm/transport/mpi/mpi_runtime.hpp"
#include "common/error.hpp"
#include "common/fnv.hpp"
#include "common/log.hpp"
#include "common/wait.hpp"

namespace gradsync::comm::mpi {
namespace {

constexpr const char* kJoinVariable = "GRADSYNC_JOIN";

// Rank 0's broadcast to the joiners (step 4).
enum : size_t {
  kOldSize,
  kJoiners,
  kFirstId,
  kNameHash,
  kTransport,  // the members': MPI, or hier (whose levels the joiners then build too)
  kTimeoutMs,
  kCheckMismatch,
  kDeterministic,
  kTopologyIndependent,
  kOfferWords
};

// The join name as the agreement hashes it (agree_grow), which the offer carries to the joiners.
uint64_t name_hash(const std::string& name) { return fnv1a64(name.data(), name.size()); }

// This process's program as MPI_Comm_spawn takes it: the executable, the arguments after argv[0],
// and the working directory. The executable is argv[0] made absolute (found on PATH when it names
// no directory) without following links: /proc/self/exe would resolve a virtualenv's bin/python
// to the interpreter it links to, which then starts without the virtualenv. /proc/self/exe only
// when argv[0] cannot be found.
struct Program {
  std::string exe, wdir;
  std::vector<std::string> args;
};

bool executable(const std::string& path) { return ::access(path.c_str(), X_OK) == 0; }

Program this_program() {
  Program p;
  std::array<char, PATH_MAX> path{};
  GS_REQUIRE(::getcwd(path.data(), path.size()) != nullptr, GRADSYNC_E_IO,
             "grow over MPI: cannot read the working directory the joiners start in: {}", std::strerror(errno));
  p.wdir = path.data();
  std::ifstream cmdline("/proc/self/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(cmdline)), std::istreambuf_iterator<char>());
  GS_REQUIRE(!all.empty(), GRADSYNC_E_IO, "grow over MPI: cannot read /proc/self/cmdline");
  const std::string argv0 = all.substr(0, all.find('\0'));
  size_t at = all.find('\0');
  while (at != std::string::npos && at + 1 < all.size()) {
    const size_t end = all.find('\0', at + 1);
    p.args.push_back(all.substr(at + 1, end == std::string::npos ? std::string::npos : end - at - 1));
    at = end;
  }
  if (argv0.find('/') != std::string::npos) {
    p.exe = argv0[0] == '/' ? argv0 : p.wdir + "/" + argv0;
  } else if (const char* dirs = std::getenv("PATH"); dirs != nullptr) {
    for (std::string rest = dirs; p.exe.empty() && !rest.empty();) {
      const size_t colon = rest.find(':');
      const std::string dir = rest.substr(0, colon);
      const std::string candidate = (dir.empty() ? p.wdir : dir) + "/" + argv0;
      if (executable(candidate)) p.exe = candidate;
      rest = colon == std::string::npos ? std::string() : rest.substr(colon + 1);
    }
  }
  if (p.exe.empty() || !executable(p.exe)) {
    const ssize_t n = ::readlink("/proc/self/exe", path.data(), path.size() - 1);
    GS_REQUIRE(n > 0, GRADSYNC_E_IO, "grow over MPI: cannot find argv[0] ('{}') nor read /proc/self/exe: {}", argv0,
               std::strerror(errno));
    p.exe.assign(path.data(), static_cast<size_t>(n));
  }
  return p;
}

// The grow's MPI objects, freed on every way out.
struct GrowHandles {
  MPI_Info info = mpi::lib().info_null;
  MPI_Comm inter = mpi::lib().comm_null, merged = mpi::lib().comm_null;
  GrowHandles() = default;
  GrowHandles(const GrowHandles&) = delete;
  GrowHandles& operator=(const GrowHandles&) = delete;
  ~GrowHandles() {
    const mpi::Api& m = mpi::lib();
    if (info != m.info_null) m.Info_free(&info);
    if (merged != m.comm_null) m.Comm_free(&merged);
    if (inter != m.comm_null) m.Comm_free(&inter);
  }
};

// Runs `call` (a blocking MPI collective) under a watchdog at the group's timeout.
template <class Call>
int guarded(std::chrono::milliseconds timeout, const std::string& why, Call call) {
  Watchdog watchdog(deadline_after(timeout), why);
  return call();
}

// Steps 3 and 4 on either side (members: high 0, the offer theirs to send; joiners: high 1, the
// offer to receive), under the watchdog: the merged communicator in `merged`.
void merge_and_offer(MPI_Comm inter, int high, std::array<int64_t, kOfferWords>& offer, MPI_Comm& merged,
                     std::chrono::milliseconds timeout, const std::string& who) {
  const mpi::Api& m = mpi::lib();
  const char* failed_call = "MPI_Intercomm_merge";
  const int rc = guarded(timeout,
                         fmt::format("{}: merging the joiners in (MPI_Intercomm_merge, then the offer's MPI_Bcast) "
                                     "did not end within {} ms: a joiner or a member was lost inside it",
                                     who, timeout.count()),
                         [&] {
                           // Errors returned, not fatal, on the communicators MPI made for the spawn.
                           m.Comm_set_errhandler(inter, m.errors_return);
                           int r = m.Intercomm_merge(inter, high, &merged);
                           if (r != MPI_SUCCESS) return r;
                           failed_call = "MPI_Bcast";
                           m.Comm_set_errhandler(merged, m.errors_return);
                           return m.Bcast(offer.data(), static_cast<int>(kOfferWords), m.int64, 0, merged);
                         });
  GS_REQUIRE(rc == MPI_SUCCESS, GRADSYNC_E_REMOTE, "{}: merging the joiners in failed ({}): {}", who, failed_call,
             mpi_error_string(rc));
}

// What a member or a joiner returns, the grown group committed.
GrowResult grown_result(std::unique_ptr<Communicator> grown, Clock::time_point start, Clock::time_point formed_start,
                        int64_t old_size, int joiners, int64_t first_id) {
  GrowResult result;
  result.agree = formed_start - start;
  result.form = Clock::now() - formed_start;
  result.old_size = static_cast<int>(old_size);
  result.new_size = static_cast<int>(old_size) + joiners;
  result.first_member_id = first_id;
  result.comm = std::move(grown);
  return result;
}

// Whether any rank of the grown group refused the offer (its verdict nonzero): every rank learns it
// alike, from one verified collective.
bool joiner_refused(Communicator& grown, int64_t verdict) {
  std::vector<int64_t> all(static_cast<size_t>(grown.size()));
  grown.allgather(&verdict, all.data(), all.size(), DType::I64);
  return std::any_of(all.begin(), all.end(), [](int64_t v) { return v != 0; });
}

}  // namespace

GrowResult MpiCommunicator::grow(const std::string& join_name, int joiners) {
  const mpi::Api& m = mpi::lib();
  const auto start = Clock::now();
  const std::string group =
      options_.name.empty() ? std::string("the MPI group") : fmt::format("MPI group '{}'", options_.name);
  // This member only, before anything starts (as the other transports).
  GS_REQUIRE(joiners >= 1 && joiners <= kMaxLocalRanks - size_, GRADSYNC_E_INVALID_ARG,
             "grow of {}: {} joiner(s); a group of {} takes 1 to {} (at most {} ranks)", group, joiners, size_,
             kMaxLocalRanks - size_, kMaxLocalRanks);
  GS_REQUIRE(join_name.find('\n') == std::string::npos, GRADSYNC_E_INVALID_ARG,
             "grow of {}: join_name holds a newline, which the joiners' environment cannot carry", group);
  // The program the joiners run and the spawn's info, made by rank 0 before the agreement, which
  // carries whether it could: a failure there fails every member alike, instead of leaving the
  // others in the spawn.
  GrowHandles h;
  Program program{"rank 0's program", {}, {}};
  const std::string env = fmt::format("{}={}", kJoinVariable, join_name);
  std::string unreadable;
  if (rank_ == 0) {
    // Not check(): a failure here is this grow's, told to all through the agreement; the group
    // stays usable.
    auto info_call = [](int rc, const char* call) {
      GS_REQUIRE(rc == MPI_SUCCESS, GRADSYNC_E_INTERNAL, "{} failed: {}", call, mpi_error_string(rc));
    };
    try {
      program = this_program();
      info_call(m.Info_create(&h.info), "MPI_Info_create");
      info_call(m.Info_set(h.info, "env", env.c_str()), "MPI_Info_set");
      info_call(m.Info_set(h.info, "wdir", program.wdir.c_str()), "MPI_Info_set");
    } catch (const Error& e) {
      unreadable = e.what();
    }
  }
  // 1. Agree, with this transport's words: whether this process saw a host lost, and (rank 0's)
  // whether it could prepare the spawn.
  const int64_t extra[2] = {mpi::host_lost() ? 1 : 0, unreadable.empty() ? 0 : 1};
  const std::vector<int64_t> all = agree_grow(*this, group, join_name, joiners, extra);
  const size_t words = kGrowWords + 2;
  int lost_host_seen_by = -1;
  for (int r = size_ - 1; r >= 0; --r)
    if (all[static_cast<size_t>(r) * words + kGrowWords] != 0) lost_host_seen_by = r;
  GS_REQUIRE(lost_host_seen_by < 0, GRADSYNC_E_UNSUPPORTED,
             "grow of {}: rank {} saw a shrink lose every rank of a host. After a host is lost (its Open MPI daemon "
             "with it), Open MPI 4.1's MPI_Comm_spawn ends the whole job, so this job cannot grow over MPI: go on with "
             "the survivors, or restart the job from a checkpoint with the hosts it needs",
             group, lost_host_seen_by);
  GS_REQUIRE(all[kGrowWords + 1] == 0, GRADSYNC_E_IO, "grow of {}: rank 0 cannot start the joiners{}", group,
             unreadable.empty() ? std::string() : ": " + unreadable);
  const int64_t first_id = all[kGrowNext];

  // 2. Spawn: rank 0's program; its arguments matter at the root only.
  std::vector<char*> argv;
  for (const std::string& a : program.args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<int> errcodes(static_cast<size_t>(joiners), MPI_SUCCESS);
  const int spawned = guarded(
      options_.timeout,
      fmt::format(
          "rank {}: MPI_Comm_spawn of {} joiner(s) ('{}') did not return within {} ms: a joiner did not "
          "start MPI in time (it died, or never calls gradsync_comm_join), or a member was lost inside the call",
          rank_, joiners, program.exe, options_.timeout.count()),
      [&] {
        return m.Comm_spawn(program.exe.c_str(), argv.data(), joiners, h.info, 0, base_, &h.inter, errcodes.data());
      });
  GS_REQUIRE(spawned == MPI_SUCCESS, GRADSYNC_E_REMOTE,
             "grow of {}: rank {}: MPI_Comm_spawn could not start the {} joiner(s) running {}: {}{}", group, rank_,
             joiners, program.exe, mpi_error_string(spawned),
             rank_ == 0 ? fmt::format(" (the first joiner's error code {})", errcodes[0]) : std::string());
  // 3. Merge, 4. offer.
  std::array<int64_t, kOfferWords> offer{};
  offer[kOldSize] = size_;
  offer[kJoiners] = joiners;
  offer[kFirstId] = first_id;
  offer[kNameHash] = static_cast<int64_t>(name_hash(join_name));
  offer[kTimeoutMs] = options_.timeout.count();
  offer[kCheckMismatch] = options_.check_mismatch ? 1 : 0;
  offer[kDeterministic] = options_.deterministic ? 1 : 0;
  offer[kTransport] = static_cast<int64_t>(options_.transport);
  offer[kTopologyIndependent] = options_.topology_independent ? 1 : 0;
  merge_and_offer(h.inter, 0, offer, h.merged, options_.timeout, fmt::format("grow of {}: rank {}", group, rank_));
  const auto formed_start = Clock::now();
  // 5. Form and commit.
  Options o = options_;
  o.name = join_name;
  auto grown = std::make_unique<MpiCommunicator>(o, h.merged);
  grown->establish(o);
  grown->take_identity(member_id(), first_id + joiners);
  GS_REQUIRE(!joiner_refused(*grown, 0), GRADSYNC_E_MISMATCH,
             "grow of {}: a joiner started for join name '{}' called gradsync_comm_join with another name or "
             "transport",
             group, join_name);
  grown->barrier();
  GrowResult result = grown_result(std::move(grown), start, formed_start, size_, joiners, first_id);
  GS_LOG_INFO("grow of {}: rank {} of {} by {} joiner(s) ('{}', member ids from {}; spawn and merge {} us)", group,
              rank_, result.new_size, joiners, join_name, first_id,
              std::chrono::duration_cast<std::chrono::microseconds>(result.agree).count());
  return result;
}

GrowResult MpiCommunicator::join(const Options& options) {
  const mpi::Api& m = mpi::lib();
  const auto start = Clock::now();
  const char* variable = std::getenv(kJoinVariable);
  auto not_spawned = [&] {
    return fmt::format(
        "join '{}' over MPI: this process was not started by a grow. A grow over MPI starts its joiners itself "
        "(MPI_Comm_spawn of the members' program, with {} set to the join name{}); start the program otherwise with "
        "gradsync_comm_create",
        options.name, kJoinVariable,
        variable != nullptr ? fmt::format(": here it is '{}'", variable) : ": not set here");
  };
  // Every process a grow starts has it: without it, refused before MPI is initialised (a process
  // that forks afterwards must not have initialised MPI for nothing).
  GS_REQUIRE(variable != nullptr, GRADSYNC_E_INVALID_ARG, "{}", not_spawned());
  {
    // MPI's initialisation answers the members' spawn: with every member gone it would wait for good.
    Watchdog watchdog(deadline_after(options.timeout),
                      fmt::format("join '{}' over MPI: MPI's initialisation, which completes the members' spawn, did "
                                  "not end within {} ms: the members are gone",
                                  options.name, options.timeout.count()),
                      true);
    mpi::acquire_runtime();
  }
  struct Release {
    ~Release() { mpi::release_runtime(); }
  } release;
  MPI_Comm parent = m.comm_null;
  m.Comm_get_parent(&parent);
  GS_REQUIRE(parent != m.comm_null, GRADSYNC_E_INVALID_ARG, "{}", not_spawned());
  int index = 0, joiners = 1;
  m.Comm_rank(m.comm_world, &index);
  m.Comm_size(m.comm_world, &joiners);
  GrowHandles h;
  std::array<int64_t, kOfferWords> offer{};
  merge_and_offer(parent, 1, offer, h.merged, options.timeout,
                  fmt::format("join '{}' over MPI: joiner {}", options.name, index));
  // Every word is checked before it sizes or times anything: the members run this program too, but
  // a joiner trusts nothing it did not compute.
  const int64_t old_size = offer[kOldSize], first_id = offer[kFirstId];
  auto flag = [&](size_t word) { return offer[word] == 0 || offer[word] == 1; };
  const bool flags_ok = flag(kCheckMismatch) && flag(kDeterministic) && flag(kTopologyIndependent);
  GS_REQUIRE(old_size >= 1 && offer[kJoiners] == joiners && old_size <= kMaxLocalRanks - joiners &&
                 first_id >= old_size && first_id <= std::numeric_limits<int64_t>::max() - kMaxLocalRanks &&
                 offer[kTimeoutMs] > 0 && flags_ok,
             GRADSYNC_E_CORRUPT,
             "join '{}' over MPI: the offer from the members' rank 0 is corrupt (group size {}, {} joiner(s) of {} "
             "spawned, member ids from {}, timeout {} ms, flags {}/{}/{})",
             options.name, old_size, offer[kJoiners], joiners, first_id, offer[kTimeoutMs], offer[kCheckMismatch],
             offer[kDeterministic], offer[kTopologyIndependent]);
  const auto formed_start = Clock::now();
  Options o = options;  // its transport (MPI or hier) is the members', as the verdict below checks
  o.timeout = std::chrono::milliseconds(offer[kTimeoutMs]);
  o.check_mismatch = offer[kCheckMismatch] != 0;
  o.deterministic = offer[kDeterministic] != 0;
  o.topology_independent = offer[kTopologyIndependent] != 0;
  auto grown = std::make_unique<MpiCommunicator>(o, h.merged);
  grown->establish(o);
  grown->take_identity(first_id + index, first_id + joiners);
  const bool same_name = static_cast<uint64_t>(offer[kNameHash]) == name_hash(options.name);
  const bool same_transport = offer[kTransport] == static_cast<int64_t>(options.transport);
  const bool mine_ok = same_name && same_transport;
  GS_REQUIRE(!joiner_refused(*grown, mine_ok ? 0 : 1), GRADSYNC_E_MISMATCH, "join '{}' over MPI: {}", options.name,
             mine_ok     ? std::string("another joiner came with another join name or transport")
             : same_name ? fmt::format("the members' group is of the other transport over MPI (this joiner: {})",
                                       transport_name(options.transport))
                         : fmt::format("the members grow by another join name (this joiner was started for '{}')",
                                       variable != nullptr ? variable : ""));
  grown->barrier();
  return grown_result(std::move(grown), start, formed_start, old_size, joiners, first_id);
}

}  // namespace gradsync::comm::mpi

namespace gradsync::comm {

bool spawned_by_grow() noexcept { return std::getenv(mpi::kJoinVariable) != nullptr; }

}  // namespace gradsync::comm
