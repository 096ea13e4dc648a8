// SPDX-License-Identifier: Apache-2.0
// The link between a gradsync_comm handle and its communicator (comm_handle.hpp): one call at a
// time, a free during a call, the progress thread of the non-blocking calls, and a forked child's
// copy of the handle.
#include "capi/comm_handle.hpp"

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "common/bounded_wait.hpp"
#include "common/error.hpp"
#include "common/log.hpp"

namespace gradsync::capi {
namespace {
// The links this thread is inside, so that close() can tell a free from inside a call on the
// same thread (a log callback that calls back) from one on another thread.
thread_local const void* t_inside = nullptr;
}  // namespace

CommLink::CommLink(std::unique_ptr<comm::Communicator> impl, std::string description)
    : impl_(std::move(impl)),
      description_(std::move(description)),
      rank_(impl_->rank()),
      size_(impl_->size()),
      member_id_(impl_->member_id()),
      transport_(impl_->transport()),
      topology_(impl_->topology()) {}

CommLink::Call::Call(CommLink& l, const char* function) : link_(l) {
  uint32_t state = l.state_.load(std::memory_order_relaxed);
  do {
    if ((state & kClosed) != 0) l.fail_closed();
    if ((state & kHeld) != 0) {
      // The holder's name is for the message only: a call that took the word an instant ago may
      // not have stored it yet.
      const char* holder = l.holder_.load(std::memory_order_relaxed);
      if (holder == nullptr) holder = "another entry point";
      if (l.held_by_this_thread()) {
        fail(GRADSYNC_E_MISUSE,
             "{} is already in a call on this thread ({}): a log callback must not call back into gradsync",
             l.description_, holder);
      }
      fail(GRADSYNC_E_MISUSE,
           "{} is already in a call on another thread ({}); a handle must not be used by two threads at once",
           l.description_, holder);
    }
  } while (!l.state_.compare_exchange_weak(state, state + kUser + kHeld, std::memory_order_acquire,
                                           std::memory_order_relaxed));
  l.holder_.store(function, std::memory_order_relaxed);
  inside_ = Inside{&l, static_cast<const Inside*>(t_inside)};
  t_inside = &inside_;
}

CommLink::Call::~Call() {
  t_inside = inside_.outer;
  link_.holder_.store(nullptr, std::memory_order_relaxed);
  // The last touch of the link: a close waiting for the count may destroy it from here on.
  link_.state_.fetch_sub(kUser + kHeld, std::memory_order_release);
}

void CommLink::abort(std::shared_ptr<CommLink> link) {
  CommLink& l = *link;  // `link` keeps it alive through release(), whatever a waiting close does
  if (!l.acquire()) l.fail_closed();
  const Inside inside{&l, static_cast<const Inside*>(t_inside)};
  t_inside = &inside;
  struct Leave {
    CommLink& l;
    const Inside& inside;
    ~Leave() {
      t_inside = inside.outer;
      l.release();
    }
  } leave{l, inside};
  l.impl_->abort();
}

// A free while another thread is inside a call on the communicator aborts that call (it returns
// GRADSYNC_E_ABORTED) and waits for it to return before destroying anything. The alternatives are
// worse: destroying at once frees the object under the running call, and leaking leaves this
// rank in the group, so its peers would wait for it until their timeout. The wait is short,
// because after an abort every wait of a collective ends; what an abort cannot stop is bounded
// work (a copy that peers are finishing on this rank's buffers, an MPI transfer under way). The
// one wait that could never end, for a call on this very thread (a free from a log callback
// inside the call), is refused: that call is aborted and the communicator leaked, with an error.
bool CommLink::close() noexcept {
  if (!owner_.here()) {
    forsake();
    return true;
  }
  const uint32_t before = state_.fetch_or(kClosed);
  if ((before & kClosed) != 0) {
    GS_LOG_ERROR("gradsync_comm_free: {} is already being freed by another thread; this free does nothing",
                 description_);
    return false;
  }
  if (held_by_this_thread()) {
    impl_->abort();
    GS_LOG_ERROR(
        "gradsync_comm_free: {} was freed from inside a call on it on the same thread (a log callback "
        "must not call back into gradsync): that call is aborted and the communicator is not released",
        description_);
    return false;
  }
  // A call that took the in-call bit before the closed bit is seen here; none can take it after.
  if ((before & kHeld) != 0) {
    const char* holder = holder_.load(std::memory_order_relaxed);
    if (holder == nullptr) holder = "an entry point";
    GS_LOG_WARN("gradsync_comm_free: {} is in a call on another thread ({}): aborting it and waiting for it to return",
                description_, holder);
    impl_->abort();
  }
  // Polled, not woken: a user that let go must not touch the link again (it may be destroyed the
  // moment the count falls to 0). Usually a call's last steps after the abort; a call whose peers
  // still use its buffers keeps them until they are done, so the polls back off to 5 ms.
  // No deadline: the call ends by its own (its waits are bounded, and the abort ends them).
  auto returned = [&] {
    return state_.load(std::memory_order_acquire) == kClosed ? WaitResult::Ready : WaitResult::Timeout;
  };
  auto never_ends = WaitClock::time_point::max();
  bounded_wait(polled(returned, std::chrono::microseconds(50), std::chrono::microseconds(5000)), wait_never, wait_never,
               wait_silent, wait_ends, never_ends, std::chrono::nanoseconds::max());
  impl_.reset();
  return true;
}

CommLink::~CommLink() {
  if (!owner_.here()) forsake();
}

void CommLink::forsake() noexcept {
  state_.fetch_or(kClosed, std::memory_order_relaxed);
  if (impl_ != nullptr) {
    impl_->release_after_fork();
    static_cast<void>(impl_.release());
  }
  if (progress_ != nullptr) new std::shared_ptr<comm::Progress>(std::move(progress_));
}

void CommLink::refuse_elsewhere() const {
  owner_.refuse(description_,
                "here it can only be freed (gradsync_comm_free releases this process's share and leaves the parent's "
                "group alone); create a communicator of this process's own");
}

void CommLink::fail_closed() const {
  fail(GRADSYNC_E_MISUSE,
       "{} was freed (gradsync_comm_free): neither it nor a shard made on it can communicate any more", description_);
}

bool CommLink::acquire() noexcept {
  if ((state_.fetch_add(kUser) & kClosed) == 0) return true;
  release();
  return false;
}

void CommLink::release() noexcept { state_.fetch_sub(kUser, std::memory_order_release); }

void CommLink::run_in_order(const std::shared_ptr<CommLink>& link, const char* function,
                            const std::function<void()>& body) {
  const std::shared_ptr<comm::Progress> progress = link->progress();
  if (progress == nullptr || progress->idle()) {
    const Call call(*link, function);
    return body();
  }
  auto done = std::make_shared<comm::Completion>();
  // The task holds its own reference: this call is not counted until the task runs, so a free on
  // another thread may destroy the handle (and its reference) before; the task then finds the
  // link closed. body outlives the task: this thread waits for it here. From the submit on, this
  // thread touches only what it holds itself (held, done, progress), never the handle.
  const std::shared_ptr<CommLink> held = link;
  progress->submit([held, function, &body, done] {
    Outcome o = capture([&] {
      const Call call(*held, function);
      body();
    });
    done->finish(o.status, std::move(o.message));
  });
  GS_LOG_DEBUG("{}: {} waits for the non-blocking calls made before it", held->description_, function);
  done->wait(std::chrono::milliseconds(-1));
  if (done->status() != GRADSYNC_OK) throw Error(done->status(), done->message());
}

std::shared_ptr<comm::Progress> CommLink::progress() const {
  if (!has_progress_.load(std::memory_order_acquire)) return nullptr;
  std::lock_guard lock(progress_mutex_);
  return progress_;
}

std::shared_ptr<comm::Progress> CommLink::start_progress() {
  std::lock_guard lock(progress_mutex_);
  if (progress_ == nullptr) {
    if (const char* why = impl_->progress_thread_refused(); why != nullptr) {
      fail(GRADSYNC_E_UNSUPPORTED, "{}: {}", description_, why);
    }
    progress_ = std::make_shared<comm::Progress>();
    has_progress_.store(true, std::memory_order_release);
  }
  return progress_;
}

void CommLink::stop_progress() noexcept {
  if (!owner_.here()) return;  // forsaken by close(): the thread is the parent's
  std::shared_ptr<comm::Progress> last;
  {
    std::lock_guard lock(progress_mutex_);
    last = std::move(progress_);
  }
  // `last` goes here, outside the mutex: joining waits for queued tasks, which may need it.
}

void CommLink::record_async_error(const Outcome& o) {
  std::lock_guard lock(async_mutex_);
  if (async_error_.status == GRADSYNC_OK) async_error_ = o;
}

Outcome CommLink::async_error() const {
  std::lock_guard lock(async_mutex_);
  return async_error_;
}

void CommLink::clear_async_error() {
  std::lock_guard lock(async_mutex_);
  async_error_ = {};
}

bool CommLink::held_by_this_thread() const noexcept {
  for (auto* in = static_cast<const Inside*>(t_inside); in != nullptr; in = in->outer) {
    if (in->link == this) return true;
  }
  return false;
}

}  // namespace gradsync::capi
