// SPDX-License-Identifier: Apache-2.0
#pragma once
// The owner threads of one owner-mode accumulator handle. Jobs enter one sequence (publication
// order, under submit_); every owner runs every job, in sequence order, each on its own share: so
// a row, which has one owner, receives the batches in sequence order whatever the number of owners
// and their timing. Owner 0 is no thread of its own but the submitting threads, each in its turn:
// a submitter runs owner 0's share of its own job once owner 0 has finished the jobs before it.
// So a lone caller works instead of sleeping while the others work (and a team of 1 has no
// thread: nothing to wake), and owners 1..n-1 are threads. A job lives on its submitter's stack;
// the submitter returns once every owner is done with it.
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/fork.hpp"
#include "common/wait.hpp"

namespace gradsync::accumulator {

class Team {
 public:
  using Fn = void (*)(void* ctx, unsigned owner, unsigned owners);

  explicit Team(unsigned owners);
  ~Team() { stop(); }
  Team(const Team&) = delete;
  Team& operator=(const Team&) = delete;

  unsigned size() const noexcept { return static_cast<unsigned>(taken_.size()); }

  // Runs fn(ctx, w, owners) for every owner w, after every job published before it; returns when
  // all are done. The first error an owner raised is rethrown here, with its status and message.
  void run(Fn fn, void* ctx);

 private:
  static constexpr uint64_t kRing = 64;
  struct Job {
    Fn fn = nullptr;
    void* ctx = nullptr;
    std::atomic<uint32_t> remaining{0};
    std::atomic<bool> claimed{false};  // the first failing owner reports
    std::atomic<bool> failed{false};
    int status = 0;
    std::string message;
  };
  struct alignas(64) Taken {
    std::atomic<uint64_t> n{0};  // jobs this owner has taken from the ring
  };

  uint64_t slowest() const noexcept;
  void run_share(Job& job, unsigned w) noexcept;
  // The job may be gone once its count reaches 0: nothing of it is touched after the decrement.
  void finish(Job& job) noexcept;
  static void fail_job(Job& job, int status, std::string message) noexcept;
  void work(unsigned w);
  void stop() noexcept;

  const OwnerProcess owner_;
  std::vector<Taken> taken_;  // [0]: owner 0, the submitters in turn
  std::vector<std::thread> threads_;
  std::mutex submit_;
  std::atomic<uint64_t> published_{0};
  std::atomic<uint32_t> stop_{0};
  std::atomic<Job*> ring_[kRing];
  WaitWord published_word_;
  WaitWord done_word_;
};

}  // namespace gradsync::accumulator
