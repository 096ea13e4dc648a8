// SPDX-License-Identifier: Apache-2.0
#pragma once
// The progress thread behind a communicator's non-blocking calls: tasks run one at a time, in the
// order they were submitted, on a thread of their own, so a collective makes progress whether or
// not its caller ever tests it. A blocking call made while tasks are pending is submitted too and
// waited for, so every call of a communicator runs in the order it was made, whichever form.
//
// Why a thread per communicator rather than progress inside test/wait: the shared-memory and
// thread transports move data with the caller's CPU, so a request nobody polls would never finish,
// and MPI's non-blocking collectives progress only inside MPI calls unless the MPI library runs
// a thread of its own. The thread starts at the first non-blocking call: blocking-only users pay
// nothing, and a blocking call with nothing pending runs on its caller's thread as before.
//
// Both hand-offs (a task to the thread, a finished request to its waiter) wait with the project's
// futex waits (common/wait.hpp), as the round engine does: a short yield, then a sleep. A
// condition variable would put the thread to sleep at once, and waking it costs microseconds at
// each end.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "common/wait.hpp"

namespace gradsync::comm {

// One request's outcome, set once by the task that ran it; waited for by any thread.
class Completion {
 public:
  void finish(int status, std::string message);
  // True once finished; waits at most `timeout` (forever when negative).
  bool wait(std::chrono::milliseconds timeout);
  bool done() const noexcept { return done_.load(std::memory_order_acquire); }
  // Valid once done() (finish happens-before done() returning true).
  int status() const noexcept { return status_; }
  const std::string& message() const noexcept { return message_; }

 private:
  WaitWord word_;
  std::atomic<bool> done_{false};
  int status_ = 0;
  std::string message_;
};

class Progress {
 public:
  Progress();
  // Runs what is still queued (tasks see their communicator closed and fail fast), then joins.
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void submit(std::function<void()> task);
  // Nothing queued and nothing running. Only the submitting thread may rely on the answer
  // staying true (nobody else submits).
  bool idle() const noexcept;

 private:
  void run();

  std::mutex mutex_;  // guards queue_
  std::deque<std::function<void()>> queue_;
  WaitWord word_;                    // the thread waits here for queued_ or stopping_
  std::atomic<uint64_t> queued_{0};  // tasks in queue_
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> pending_{0};  // queued + running
  std::thread thread_;
};

}  // namespace gradsync::comm
