// SPDX-License-Identifier: Apache-2.0
// The conformance suite: the one place where the communicator's transport-neutral semantics
// (comm.h, "Semantics common to every transport") are tested. One list of scenarios runs, through
// the public C API only, over threads of one process, over processes sharing memory (forked here
// before any communicator exists) and over MPI under a real mpirun, against one reference
// reduction written here in plain rank order. The per-transport suites keep only what is
// particular to their transport (joining, segments, dying peers, MPI's non-deterministic mode, ...).
//
//   conformance thread|shm <ranks> [filter]           starts the ranks itself
//   mpirun -np <ranks> conformance mpi <ranks> [filter]
//   mpirun -np <ranks> conformance hier <ranks>        the hierarchical transport
//   mpirun -np <ranks> conformance hier/hosts2 <ranks> ... with ranks labelled onto two hosts
//   mpirun -np <ranks> conformance hier/hosts=0110 <ranks> ... rank r on host digit r
//   conformance thread/split|shm/split <ranks> ...     every scenario's group a subgroup
//   mpirun -np <ranks> conformance mpi/split <ranks>   of a subgroup (gradsync_comm_split)
//   mpirun -np <procs> conformance mpi/threads=T <procs * T>   T ranks per process, one per thread
//   (also hier/threads=T on one host, and /split after it)
//
// Every rank runs every scenario whose name contains the filter. A failed check is recorded with
// its rank and message and the scenario goes on, so that one run reports every failure. Between
// scenarios the ranks align on the main group (resetting it if a scenario left it stopped).
// Threads and forked processes publish their records into a shared ledger that the main thread
// or the parent reads: it prints one line per scenario, and it notices a rank that died or hangs,
// which the group under test could not be trusted to report. Under MPI the records travel to
// rank 0 through the main group, and a per-scenario alarm is the watchdog.
//
// Output: one line per scenario, "ok", "FAIL <name>: <first failure>" or "n/a <name>: <why>",
// then a summary; the exit status is non-zero on any failure, a dead rank or a hang. A scenario
// that a known library bug breaks on a transport names the bug in the registry: it still runs
// and asserts comm.h, and prints XFAIL (not failing the run) until the fix, then XPASS (failing
#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "harness.hpp"

namespace {

using namespace conformance;

bool selected(const Scenario& s, const char* filter) {
  return filter == nullptr || std::strstr(s.name, filter) != nullptr;
}

const char* transport_name(int t) {
  return t == GRADSYNC_TRANSPORT_THREAD ? "thread" : t == GRADSYNC_TRANSPORT_SHM ? "shm" : "mpi";
}

// ---------------------------------------------------------------- running and reporting

Record make_record(const Ctx& x) {
  Record r{};
  r.failures = x.failures;
  std::snprintf(r.message, sizeof r.message, "%s", x.first.c_str());
  return r;
}

// The tally over the group: one line per scenario.
struct Tally {
  bool print = true;  // MPI ranks other than 0 only count
  int passed = 0, failed = 0, skipped = 0, known = 0;
  void say(const char* fmt, ...) __attribute__((format(printf, 2, 3))) {
    if (!print) return;
    va_list ap;
    va_start(ap, fmt);
    std::vprintf(fmt, ap);
    va_end(ap);
    std::fflush(stdout);
  }
  // extra: what the harness saw (a rank that died, a hang): never a known bug.
  void line(const Scenario& s, const Record* recs, int size, const std::string& extra, const char* bug) {
    int total = 0, first = -1;
    for (int r = 0; r < size; ++r) {
      total += recs[r].failures;
      if (first < 0 && recs[r].failures > 0) first = r;
    }
    if (total == 0 && extra.empty()) {
      if (bug != nullptr) {
        say("XPASS %s: passes, but is listed as broken by a known library bug (%s); remove the entry\n", s.name, bug);
        ++failed;
      } else {
        say("ok   %s\n", s.name);
        ++passed;
      }
      return;
    }
    std::string msg = extra;
    if (first >= 0) {
      if (!msg.empty()) msg += "; ";
      msg += format("rank %d: %s", first, recs[first].message);
      if (total > 1) msg += format(" (%d failed checks in all)", total);
    }
    if (bug != nullptr && extra.empty()) {
      say("XFAIL %s: %s [known library bug: %s]\n", s.name, msg.c_str(), bug);
      ++known;
    } else {
      say("FAIL %s: %s\n", s.name, msg.c_str());
      ++failed;
    }
  }
  void not_applicable(const Scenario& s, const char* why) {
    say("n/a  %s: %s\n", s.name, why);
    ++skipped;
  }
  void summary(int transport, int size) {
    say("conformance %s x%d: %d passed, %d failed, %d not applicable", transport_name(transport), size, passed, failed,
        skipped);
    if (known > 0) say(", %d failed by known library bugs (XFAIL)", known);
    say("\n");
  }
};

// MPI: the watchdog is an alarm per scenario; its handler may only write and exit.
char g_watchdog_line[512];
size_t g_watchdog_len = 0;
extern "C" void on_watchdog(int) {
  ssize_t unused = write(STDOUT_FILENO, g_watchdog_line, g_watchdog_len);
  (void)unused;
  _exit(3);
}

// Brings every rank to the end of the scenario, with the main group usable.
void align(Ctx& x) {
  int st = gradsync_comm_barrier(x.c);
  if (st == GRADSYNC_OK) return;
  x.fail_at(__LINE__, "the main group is unusable after the scenario (%d: %s); resetting it", st,
            gradsync_last_error_message());
  st = gradsync_comm_reset(x.c);
  if (st == GRADSYNC_OK) st = gradsync_comm_barrier(x.c);
  if (st != GRADSYNC_OK) {
    x.broken = gradsync_last_error_message();
    x.fail_at(__LINE__, "the main group did not recover: %d: %s", st, x.broken.c_str());
  }
}

// Resets (collective, harmless on a working group; on MPI a group that timed out must be reset
// before exit) and frees the scenario's own groups.
void close_groups(Ctx& x) {
  if (x.groups.empty()) return;
  for (gradsync_comm* g : x.groups) EXPECT_OK(x, gradsync_comm_reset(g));
  // A rank whose reset returned must not free before every peer's reset has returned: a member
  // that leaves fails the reset of a peer still inside it.
  align(x);
  for (gradsync_comm* g : x.groups) gradsync_comm_free(g);
  x.groups.clear();
}

// One rank: join the main group, run every selected scenario, publish each record.
int run_rank(int transport, int rank, int size, const std::string& name, const char* filter, Ledger* ledger) {
  Ctx x;
  x.transport = transport;
  x.rank = rank;
  x.size = size;
  x.name = name;
  x.ledger = ledger;
  int st = 0;
  x.c = join(transport, rank, size, name, kMainTimeoutMs, &st);
  if (st == GRADSYNC_OK) {
    int32_t r = -1, s = -1;
    gradsync_comm_rank(x.c, &r);
    gradsync_comm_size(x.c, &s);
    x.rank = r;
    if (s != size) {
      x.first = format("the group has %d ranks, %d were asked for", s, size);
      st = GRADSYNC_E_MISMATCH;
    }
  } else {
    x.first = format("rank %d cannot join: %s", rank, gradsync_last_error_message());
  }
  if (st != GRADSYNC_OK) {
    std::fprintf(stderr, "%s\n", x.first.c_str());
    if (ledger != nullptr) {
      x.failures = 1;
      for (int i = 0; i < kCount; ++i) ledger->rec[i][x.rank] = make_record(x);
      ledger->done[x.rank].store(kCount, std::memory_order_release);
    }
    return 2;
  }
  if (g_threads > 1) {
    g_level_procs.resize(static_cast<size_t>(x.size));
    for (int r = 0; r < x.size; ++r) g_level_procs[static_cast<size_t>(r)] = r / g_threads;
  }
  if (transport == GRADSYNC_TRANSPORT_HIER) {
    int32_t hosts = 1;
    std::vector<int32_t> rank_hosts(static_cast<size_t>(x.size));
    gradsync_comm_topology(x.c, nullptr, nullptr, nullptr, &hosts, rank_hosts.data(), rank_hosts.size());
    if (hosts > 1) g_level_hosts.assign(rank_hosts.begin(), rank_hosts.end());
  }
  // The watchdog is the process's: its thread 0 keeps it (its stall stalls every thread's rank).
  const bool watchdog = x.mpi() && g_thread == 0;
  if (watchdog) std::signal(SIGALRM, on_watchdog);
  Tally tally;
  tally.print = x.mpi() && x.rank == 0;
  for (int i = 0; i < kCount; ++i) {
    const Scenario& s = kScenarios[i];
    if (!selected(s, filter)) continue;
    if (const char* why = s.not_applicable(x)) {
      if (x.mpi()) tally.not_applicable(s, why);
      continue;
    }
    x.scenario = s.name;
    x.index = i;
    x.failures = 0;
    x.first.clear();
    if (ledger != nullptr) ledger->running[x.rank].store(i + 1, std::memory_order_release);
    if (watchdog) {
      g_watchdog_len = static_cast<size_t>(std::snprintf(g_watchdog_line, sizeof g_watchdog_line,
                                                         "FAIL %s: watchdog: rank %d made no progress for %d s\n",
                                                         s.name, x.rank, kStallSeconds));
      g_watchdog_len = std::min(g_watchdog_len, sizeof g_watchdog_line - 1);
      alarm(kStallSeconds);
    }
    s.run(x);
    align(x);
    if (x.broken.empty()) close_groups(x);
    if (x.broken.empty()) align(x);
    const Record mine = make_record(x);
    // With the main group gone the later scenarios cannot run: each is failed once, not retried.
    Ctx rest = x;
    rest.failures = 1;
    rest.first = "not run: the main group is broken: " + x.broken;
    if (ledger != nullptr) {
      ledger->rec[i][x.rank] = mine;
      ledger->done[x.rank].store(i + 1, std::memory_order_release);
      if (!x.broken.empty()) {
        for (int j = i + 1; j < kCount; ++j) ledger->rec[j][x.rank] = make_record(rest);
        ledger->done[x.rank].store(kCount, std::memory_order_release);
        break;
      }
      continue;
    }
    // MPI: the records travel to every rank through the main group (no side channel under mpirun).
    std::vector<Record> all(static_cast<size_t>(x.size));
    const size_t words = sizeof(Record) / sizeof(int32_t) * static_cast<size_t>(x.size);
    st = gradsync_comm_allgather(x.c, &mine, all.data(), words, GRADSYNC_I32);
    if (st != GRADSYNC_OK) {
      gradsync_comm_reset(x.c);
      st = gradsync_comm_allgather(x.c, &mine, all.data(), words, GRADSYNC_I32);
    }
    if (st != GRADSYNC_OK) {
      for (Record& r : all) r = mine;
      all[0].failures += 1;
      std::snprintf(all[0].message, sizeof all[0].message, "the records could not be gathered: %s",
                    gradsync_last_error_message());
    }
    tally.line(s, all.data(), x.size, "", s.known_bug(x));
    if (!x.broken.empty()) {
      for (int j = i + 1; j < kCount; ++j) {
        if (!selected(kScenarios[j], filter) || kScenarios[j].not_applicable(x) != nullptr) continue;
        const Record r = make_record(rest);
        tally.line(kScenarios[j], &r, 1, "", nullptr);
      }
      break;
    }
  }
  if (watchdog) alarm(0);
  if (x.mpi()) tally.summary(transport, x.size);
  gradsync_comm_free(x.c);
  if (ledger != nullptr) return 0;
  return tally.failed == 0 ? 0 : 1;
}

struct Verdict {
  bool ok, hung;
};

// Thread and shm: reads the ledger in scenario order and prints as scenarios finish on every rank.
// rank_gone(r) says (non-empty) how rank r ended if it ended before finishing. A stall of
// kStallSeconds without any rank finishing a scenario is a hang: reported, and the run ends there.
Verdict report(Ledger& ledger, int transport, int size, const char* filter,
               const std::function<std::string(int)>& rank_gone) {
  Ctx probe;
  probe.transport = transport;
  probe.size = size;
  Tally tally;
  std::vector<int32_t> last_seen(static_cast<size_t>(size), 0);
  auto last_progress = Clock::now();
  bool hung = false;
  for (int i = 0; i < kCount && !hung; ++i) {
    const Scenario& s = kScenarios[i];
    if (!selected(s, filter)) continue;
    if (const char* why = s.not_applicable(probe)) {
      tally.not_applicable(s, why);
      continue;
    }
    std::string extra;
    for (;;) {
      bool all_done = true;
      extra.clear();
      for (int r = 0; r < size; ++r) {
        const int32_t d = ledger.done[r].load(std::memory_order_acquire);
        if (d != last_seen[static_cast<size_t>(r)]) {
          last_seen[static_cast<size_t>(r)] = d;
          last_progress = Clock::now();
        }
        if (d > i) continue;
        const std::string gone = rank_gone(r);
        if (!gone.empty()) {
          extra += (extra.empty() ? "" : "; ") + gone;
          continue;
        }
        all_done = false;
      }
      if (all_done) break;
      if (Clock::now() - last_progress > std::chrono::seconds(kStallSeconds)) {
        extra = format("hung: no rank finished a scenario for %d s;", kStallSeconds);
        for (int r = 0; r < size; ++r) {
          const int32_t at = ledger.running[r].load(std::memory_order_acquire);
          if (ledger.done[r].load(std::memory_order_acquire) < at) {
            extra += format(" rank %d is in %s", r, kScenarios[at - 1].name);
          }
        }
        hung = true;
        break;
      }
      sleep_ms(2);
    }
    Record recs[kMaxRanks];
    for (int r = 0; r < size; ++r) {
      recs[r] = ledger.done[r].load(std::memory_order_acquire) > i ? ledger.rec[i][r] : Record{};
    }
    tally.line(s, recs, size, extra, s.known_bug(probe));
  }
  tally.summary(transport, size);
  return {tally.failed == 0 && !hung, hung};
}

Ledger* new_ledger() {
  void* p = mmap(nullptr, sizeof(Ledger), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(2);
  }
  return new (p) Ledger();  // zeroed: nothing done, nothing running
}

int run_threads(int size, const std::string& name, const char* filter) {
  Ledger* ledger = new_ledger();
  std::vector<std::thread> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.emplace_back([=] { run_rank(GRADSYNC_TRANSPORT_THREAD, r, size, name, filter, ledger); });
  }
  const Verdict v = report(*ledger, GRADSYNC_TRANSPORT_THREAD, size, filter, [](int) { return std::string(); });
  if (v.hung) {
    // A rank is stuck: its thread cannot be joined, so the process ends here.
    std::fflush(stdout);
    std::fflush(stderr);
    _exit(1);
  }
  for (auto& t : ranks) t.join();
  return v.ok ? 0 : 1;
}

// Removes what a crashed rank may leave in /dev/shm; returns the names it found.
std::string remove_segments(const std::string& name) {
  std::string found;
  const std::string prefix = "gradsync." + name;
  if (DIR* d = opendir("/dev/shm")) {
    while (const dirent* e = readdir(d)) {
      const std::string entry = e->d_name;
      if (entry != prefix && entry.rfind(prefix + "-", 0) != 0) continue;  // this run's groups only
      found += (found.empty() ? "" : ", ") + entry;
      unlink(("/dev/shm/" + entry).c_str());
    }
    closedir(d);
  }
  return found;
}

int run_processes(int size, const std::string& name, const char* filter) {
  Ledger* ledger = new_ledger();
  const pid_t parent = getpid();
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork");
      for (pid_t p : pids) kill(p, SIGKILL);
      return 2;
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // a rank never outlives the harness
      if (getppid() != parent) _exit(9);
      _exit(run_rank(GRADSYNC_TRANSPORT_SHM, r, size, name, filter, ledger));
    }
    pids.push_back(pid);
  }
  std::vector<std::string> ended(static_cast<size_t>(size));  // how each rank ended, if it did badly
  std::vector<bool> reaped(static_cast<size_t>(size), false);
  auto poll = [&](int r, bool block) {
    const size_t u = static_cast<size_t>(r);
    if (reaped[u]) return;
    int status = 0;
    if (waitpid(pids[u], &status, block ? 0 : WNOHANG) != pids[u]) return;
    reaped[u] = true;
    if (WIFSIGNALED(status)) {
      ended[u] = format("rank %d (pid %d) was killed by signal %d (%s)", r, static_cast<int>(pids[u]), WTERMSIG(status),
                        strsignal(WTERMSIG(status)));
    } else if (WEXITSTATUS(status) != 0) {
      ended[u] = format("rank %d (pid %d) exited with status %d", r, static_cast<int>(pids[u]), WEXITSTATUS(status));
    }
  };
  const Verdict v = report(*ledger, GRADSYNC_TRANSPORT_SHM, size, filter, [&](int r) {
    poll(r, false);
    const size_t u = static_cast<size_t>(r);
    return reaped[u] ? (ended[u].empty() ? format("rank %d ended early", r) : ended[u]) : std::string();
  });
  bool ok = v.ok;
  // Every rank has published its last record; give them a while to leave (none after a hang).
  const auto deadline = Clock::now() + (v.hung ? 0s : 60s);
  for (int r = 0; r < size; ++r) {
    while (!reaped[static_cast<size_t>(r)] && Clock::now() < deadline) {
      poll(r, false);
      if (!reaped[static_cast<size_t>(r)]) sleep_ms(5);
    }
    if (!reaped[static_cast<size_t>(r)]) {
      std::fprintf(stderr, "rank %d (pid %d) did not exit; killing it\n", r,
                   static_cast<int>(pids[static_cast<size_t>(r)]));
      kill(pids[static_cast<size_t>(r)], SIGKILL);
      poll(r, true);
      ok = false;
    }
    if (!ended[static_cast<size_t>(r)].empty()) {
      std::fprintf(stderr, "%s\n", ended[static_cast<size_t>(r)].c_str());
      ok = false;
    }
  }
  // comm.h: the last member to leave removes the segment, so a clean run leaves nothing behind
  // (a rank that crashed leaves its groups' segments, removed here all the same).
  const std::string left = remove_segments(name);
  const bool clean = std::all_of(ended.begin(), ended.end(), [](const std::string& e) { return e.empty(); });
  if (!left.empty() && clean && !v.hung) {
    std::printf("FAIL segments left behind in /dev/shm: %s\n", left.c_str());
    ok = false;
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s thread|shm|mpi <ranks> [scenario filter]\n", argv[0]);
    return 2;
  }
  std::string kind = argv[1];
  if (kind.size() > 6 && kind.compare(kind.size() - 6, 6, "/split") == 0) {
    g_split = true;
    kind.resize(kind.size() - 6);
  }
  if (const size_t at = kind.find("/threads="); at != std::string::npos) {
    g_threads = std::atoi(kind.c_str() + at + 9);
    kind.resize(at);
  }
  if (kind == "hier/hosts2") {
    g_two_hosts = true;
    kind = "hier";
  }
  if (kind.rfind("hier/hosts=", 0) == 0) {
    g_host_digits = kind.substr(11);
    kind = "hier";
  }
  const int size = std::atoi(argv[2]);
  const char* filter = argc > 3 ? argv[3] : nullptr;
  if (size < 1 || size > kMaxRanks) {
    std::fprintf(stderr, "ranks must be 1 to %d\n", kMaxRanks);
    return 2;
  }
  const std::string name = "conformance-" + std::to_string(getpid());
  if (kind == "thread") return run_threads(size, name, filter);
  if (kind == "shm") return run_processes(size, name, filter);
  if (kind == "mpi" || kind == "hier") {
    if (!gradsync_has_feature(GRADSYNC_FEATURE_MPI_TRANSPORT)) {
      std::fprintf(stderr, "this build has no MPI transport\n");
      return 2;
    }
    const int transport = kind == "mpi" ? GRADSYNC_TRANSPORT_MPI : GRADSYNC_TRANSPORT_HIER;
    if (g_threads <= 1) return run_rank(transport, 0, size, name, filter, nullptr);
    std::vector<int> status(static_cast<size_t>(g_threads), 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < g_threads; ++t) {
      threads.emplace_back([&, t] {
        g_thread = t;
        status[static_cast<size_t>(t)] = run_rank(transport, t, size, name, filter, nullptr);
      });
    }
    for (auto& t : threads) t.join();
    return *std::max_element(status.begin(), status.end());
  }
  std::fprintf(stderr, "unknown transport '%s'\n", kind.c_str());
  return 2;
}
