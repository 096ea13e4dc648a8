// SPDX-License-Identifier: Apache-2.0
// The thread transport: ranks are threads of one process that form a group by name. Its fabric is
// the group's control block in process memory, plain pointers as addresses (every buffer of every
// rank is directly reachable, so rounds take the inline or the direct path), and a registry of
// groups by name. The round protocol and the collectives are the shared-memory ones
// (engine/round_engine.hpp, algorithms/shared_memory.cpp).
#include "comm/transport/thread/thread_comm.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_set>
#include <vector>

#include "comm/algorithms/shared_memory.hpp"
#include "comm/communicator.hpp"
#include "comm/engine/fabric.hpp"
#include "common/bounded_wait.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "common/wait.hpp"

namespace gradsync::comm {
namespace {

// One group's shared state: its control block (zeroed anonymous pages, so the staging areas of
// a copy path cost nothing until used) and its membership.
struct Group {
  Group(std::string n, int s)
      : name(std::move(n)),
        size(s),
        present(static_cast<size_t>(s), 0),
        masks(static_cast<size_t>(s)),
        limits(static_cast<size_t>(s)) {
    layout = control_layout(s, 0);
    bytes = layout.end;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    GS_REQUIRE(p != MAP_FAILED, GRADSYNC_E_NOMEM, "cannot map {} bytes for the control block of group '{}'", bytes,
               name);
    block = static_cast<char*>(p);
    words = new (&words_storage) GroupWords();
    construct_control(block, layout, s);
    left.reset(new std::atomic<uint32_t>[static_cast<size_t>(s)]());
  }
  ~Group() { munmap(block, bytes); }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  const std::string name;
  const int size;
  ControlLayout layout{};
  size_t bytes = 0;
  char* block = nullptr;
  alignas(GroupWords) unsigned char words_storage[sizeof(GroupWords)];
  GroupWords* words = nullptr;
  std::unique_ptr<std::atomic<uint32_t>[]> left;  // rank r freed its communicator

  // Membership, guarded by the registry mutex.
  std::vector<char> present;
  std::vector<wait_detail::CpuMask> masks;  // each rank's thread's affinity as it joined
  std::vector<int> limits;                  // and its cgroups' CPU limit (0: none)
  int cpus = 1;  // how many ranks can each have one of them to itself, set as the group forms
  int joined = 0;
  int members = 0;
  std::atomic<uint32_t> formed{0};
  // Set when a joiner claims another size, or a rank already claimed, while the group forms: the
  // group cannot form, so its waiting members fail at once and later joiners are refused until
  // the last member withdraws.
  std::atomic<uint32_t> broken{0};
  int broken_status = 0;
  std::string broken_reason;
};

struct Registry {
  std::mutex mutex;
  std::map<std::string, std::shared_ptr<Group>> groups;
};

Registry& registry() {
  // Never destroyed: communicators freed from static destructors of other libraries must find it.
  static Registry* r = new Registry;
  return *r;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out + "]";
}

class ThreadFabric final : public Fabric {
 public:
  ThreadFabric(std::shared_ptr<Group> group, int rank) : group_(std::move(group)), rank_(rank) {
    control_ = ControlArea(group_->words, group_->block, group_->layout, group_->size, 0);
  }
  ~ThreadFabric() override {
    leave();
    for (void* p : allocations_) std::free(p);
  }

  Transport transport() const noexcept override { return Transport::Thread; }
  const std::string& group() const noexcept override { return group_->name; }
  uint64_t address_of(const void* p, size_t) const noexcept override { return reinterpret_cast<uintptr_t>(p); }
  bool peers_use_private_memory() const noexcept override { return true; }
  int cpus() const noexcept override { return group_->cpus; }
  bool alive(int r) const override { return group_->left[static_cast<size_t>(r)].load(std::memory_order_seq_cst) == 0; }
  int pid(int) const noexcept override { return static_cast<int>(getpid()); }
  void close_group() noexcept override {}

  void* alloc(size_t bytes) override {
    constexpr size_t kAlign = 4096;
    GS_REQUIRE(bytes <= SIZE_MAX - kAlign, GRADSYNC_E_NOMEM, "cannot allocate {} bytes", bytes);
    void* p = std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
    GS_REQUIRE(p != nullptr, GRADSYNC_E_NOMEM, "cannot allocate {} bytes", bytes);
    allocations_.insert(p);
    return p;
  }
  void dealloc(void* p) override {
    GS_REQUIRE(allocations_.erase(p) == 1, GRADSYNC_E_INVALID_ARG,
               "pointer {} was not allocated by this communicator (or was already freed)", p);
    std::free(p);
  }

 private:
  void leave() noexcept {
    Registry& reg = registry();
    std::lock_guard lock(reg.mutex);
    Group& g = *group_;
    g.present[static_cast<size_t>(rank_)] = 0;
    g.left[static_cast<size_t>(rank_)].store(1, std::memory_order_seq_cst);
    notify(g.words->wake);
    if (--g.members == 0) {
      auto it = reg.groups.find(g.name);
      if (it != reg.groups.end() && it->second == group_) reg.groups.erase(it);
    }
  }

  std::shared_ptr<Group> group_;
  const int rank_;
  std::unordered_set<void*> allocations_;
};

}  // namespace

std::unique_ptr<Communicator> create_thread_communicator(const Options& options) {
  GS_REQUIRE(options.size >= 1, GRADSYNC_E_INVALID_ARG, "size must be at least 1, got {}", options.size);
  GS_REQUIRE(options.size <= kMaxLocalRanks, GRADSYNC_E_INVALID_ARG, "thread group size {} exceeds the maximum {}",
             options.size, kMaxLocalRanks);
  GS_REQUIRE(options.rank >= 0 && options.rank < options.size, GRADSYNC_E_OUT_OF_RANGE, "rank {} out of range [0, {})",
             options.rank, options.size);
  GS_REQUIRE(!options.name.empty(), GRADSYNC_E_INVALID_ARG, "group name is empty");
  GS_REQUIRE(options.timeout.count() > 0, GRADSYNC_E_INVALID_ARG, "timeout must be > 0 ms, got {}",
             options.timeout.count());
  // Read before the registry lock: the limit parses /proc/self/mountinfo, which can be long.
  const wait_detail::CpuMask mask = wait_detail::usable_cpu_mask();
  const int cpu_limit = wait_detail::cgroup_cpu_limit();
  Registry& reg = registry();
  std::shared_ptr<Group> group;
  {
    std::lock_guard lock(reg.mutex);
    auto& entry = reg.groups[options.name];
    if (!entry) entry = std::make_shared<Group>(options.name, options.size);
    group = entry;
    // A forming group whose members disagree on its size, or where two threads claim one rank,
    // cannot form as configured: every member fails now (not at its deadline), and so does every
    // later joiner until the last member has withdrawn, whoever arrived first.
    if (group->broken.load(std::memory_order_relaxed)) {
      fail(group->broken_status, "rank {} cannot join group '{}': {}", options.rank, options.name,
           group->broken_reason);
    }
    auto refuse = [&](int status, const std::string& why) {
      if (!group->formed.load(std::memory_order_relaxed)) {
        group->broken_status = status;
        group->broken_reason = why;
        group->broken.store(1, std::memory_order_seq_cst);
        notify(group->words->wake);
      }
      fail(status, "{}", why);
    };
    if (group->size != options.size) {
      refuse(GRADSYNC_E_MISMATCH,
             fmt::format("rank {} joined group '{}' with size {} but its other members use size {}", options.rank,
                         options.name, options.size, group->size));
    }
    const auto r = static_cast<size_t>(options.rank);
    if (group->present[r]) {
      refuse(GRADSYNC_E_MISUSE, fmt::format("rank {} has already joined group '{}' (two threads claim one rank)",
                                            options.rank, options.name));
    }
    if (group->formed.load(std::memory_order_relaxed)) {
      std::vector<int> still;
      for (int i = 0; i < group->size; ++i) {
        if (group->present[static_cast<size_t>(i)]) still.push_back(i);
      }
      fail(GRADSYNC_E_MISUSE, "group '{}' is still in use by rank(s) {}; free them before forming it again",
           options.name, rank_list(still));
    }
    group->present[r] = 1;
    group->masks[r] = mask;
    group->limits[r] = cpu_limit;
    ++group->joined;
    ++group->members;
    if (group->joined == group->size) {
      group->cpus = wait_detail::ranks_with_own_cpu(group->masks, group->limits);
      group->formed.store(1, std::memory_order_seq_cst);
    }
  }
  notify(group->words->wake);

  auto deadline = deadline_after(options.timeout);
  std::string abandoned;
  const WaitEnd waited = bounded_wait(
      [&](WaitClock::time_point until) {
        return wait_until(
            group->words->wake, [&] { return group->formed.load(std::memory_order_seq_cst) != 0; }, until,
            &group->broken);
      },
      wait_never,
      // A shrink forming this group asks now and then whether a member it waits for is lost.
      [&] {
        if (options.forming_abandoned) abandoned = options.forming_abandoned();
        return !abandoned.empty();
      },
      [&](std::chrono::nanoseconds) {
        std::vector<int> missing;
        {
          std::lock_guard lock(reg.mutex);
          for (int i = 0; i < group->size; ++i) {
            if (!group->present[static_cast<size_t>(i)]) missing.push_back(i);
          }
        }
        if (!missing.empty()) {
          GS_LOG_WARN("rank {} of group '{}': waiting for rank(s) {} to join ({} of {} joined; timeout {} ms)",
                      options.rank, options.name, rank_list(missing), group->size - static_cast<int>(missing.size()),
                      group->size, options.timeout.count());
        }
      },
      wait_ends, deadline,
      options.forming_abandoned ? std::chrono::nanoseconds(std::chrono::milliseconds(10))
                                : std::chrono::nanoseconds::max());
  if (waited != WaitEnd::Ready) {
    std::lock_guard lock(reg.mutex);
    // Formed is decided under the registry lock: either the last member came in time, or we withdraw.
    if (!group->formed.load(std::memory_order_relaxed)) {
      std::vector<int> missing;
      for (int i = 0; i < group->size; ++i) {
        if (!group->present[static_cast<size_t>(i)]) missing.push_back(i);
      }
      group->present[static_cast<size_t>(options.rank)] = 0;
      --group->joined;
      --group->members;
      if (group->members == 0) {
        auto it = reg.groups.find(options.name);
        if (it != reg.groups.end() && it->second == group) reg.groups.erase(it);
      }
      if (!abandoned.empty()) {
        fail(GRADSYNC_E_REMOTE, "rank {} of group '{}' gave up forming it: {}", options.rank, options.name, abandoned);
      }
      if (waited == WaitEnd::Stopped) {
        fail(group->broken_status, "rank {} of group '{}' could not form the group: {}", options.rank, options.name,
             group->broken_reason);
      }
      fail(GRADSYNC_E_TIMEOUT, "rank {} of group '{}': rank(s) {} did not join within {} ms", options.rank,
           options.name, rank_list(missing), options.timeout.count());
    }
  }
  return make_shared_memory_communicator(options, std::make_unique<ThreadFabric>(std::move(group), options.rank),
                                         create_thread_communicator);
}

}  // namespace gradsync::comm
