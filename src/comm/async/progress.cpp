// SPDX-License-Identifier: Apache-2.0
#include "comm/async/progress.hpp"

namespace gradsync::comm {

void Completion::finish(int status, std::string message) {
  {
    std::lock_guard lock(mutex_);
    status_ = status;
    message_ = std::move(message);
    done_ = true;
  }
  cv_.notify_all();
}

bool Completion::wait(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  if (timeout.count() < 0) {
    cv_.wait(lock, [&] { return done_; });
    return true;
  }
  return cv_.wait_for(lock, timeout, [&] { return done_; });
}

bool Completion::done() const {
  std::lock_guard lock(mutex_);
  return done_;
}

Progress::Progress() : thread_([this] { run(); }) {}

Progress::~Progress() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Progress::submit(std::function<void()> task) {
  pending_.fetch_add(1, std::memory_order_seq_cst);
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

bool Progress::idle() const noexcept { return pending_.load(std::memory_order_seq_cst) == 0; }

void Progress::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything ran
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();  // never throws: tasks report through their Completion
    task = nullptr;  // what it holds goes before the next task is counted done
    pending_.fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace gradsync::comm
