// SPDX-License-Identifier: Apache-2.0
#include "comm/async/progress.hpp"

namespace gradsync::comm {

void Completion::finish(int status, std::string message) {
  status_ = status;
  message_ = std::move(message);
  done_.store(true, std::memory_order_seq_cst);  // publishes status_ and message_
  notify(word_);
}

namespace {
// A hand-off's waits yield rather than spin: the thread waited for (the progress thread, or the
// caller that submits) may need this very core, since a communicator with a progress thread has
// two threads for its rank and ranks may already have a core each. A yield lets it run at once; a
// spin would hold the core until its budget ran out.
constexpr WaitPolicy kHandOff{std::chrono::nanoseconds{0}, std::chrono::microseconds{50},
                              std::chrono::microseconds{100}};
}  // namespace

bool Completion::wait(std::chrono::milliseconds timeout) {
  const bool forever = timeout.count() < 0;
  // A wait shorter than the yield phase (a poll, timeout 0) yields no longer than it was given.
  WaitPolicy policy = kHandOff;
  if (!forever && timeout < policy.yield_for) policy.yield_for = timeout;
  const auto deadline = forever ? WaitClock::time_point::max() : deadline_after(timeout);
  return wait_until(
             word_, [&] { return done_.load(std::memory_order_seq_cst); }, deadline, nullptr, ~0u, policy) ==
         WaitResult::Ready;
}

Progress::Progress() : thread_([this] { run(); }) {}

Progress::~Progress() {
  stopping_.store(true, std::memory_order_seq_cst);
  notify(word_);
  thread_.join();
}

void Progress::submit(std::function<void()> task) {
  pending_.fetch_add(1, std::memory_order_seq_cst);
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(task));
  }
  queued_.fetch_add(1, std::memory_order_seq_cst);
  notify(word_);
}

bool Progress::idle() const noexcept { return pending_.load(std::memory_order_seq_cst) == 0; }

void Progress::run() {
  auto ready = [&] {
    return queued_.load(std::memory_order_seq_cst) != 0 || stopping_.load(std::memory_order_seq_cst);
  };
  for (;;) {
    wait_until(word_, ready, WaitClock::time_point::max(), nullptr, ~0u, kHandOff);
    std::function<void()> task;
    {
      std::lock_guard lock(mutex_);
      // queued_ counts a task after its push and uncounts it after its pop, so it never exceeds
      // the queue's length: an empty queue here means stopping, and everything ran.
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    queued_.fetch_sub(1, std::memory_order_seq_cst);
    task();          // never throws: tasks report through their Completion
    task = nullptr;  // what it holds goes before the next task is counted done
    pending_.fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace gradsync::comm
