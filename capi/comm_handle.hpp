// SPDX-License-Identifier: Apache-2.0
#pragma once
// The object behind a gradsync_comm handle, shared by the shims that take a communicator
// (capi_comm.cpp, capi_shard.cpp), and what turns misuse of it into errors:
// - One call at a time. Every entry point that runs the communicator (the collectives, reset,
//   alloc and free_buffer, a shard's collective stages) holds the handle while it runs, by a
//   compare-exchange that sets the in-call bit of the state word; a second thread gets
//   GRADSYNC_E_MISUSE naming the holder instead of racing the first inside a transport that is not
//   thread-safe. abort is exempt:
//   stopping a call from another thread is its purpose. The rank, size and transport getters are
//   too: they read values fixed at creation.
// - Free during a call: CommLink::close aborts the call and waits for it to return.
// - Non-blocking calls run on the link's progress thread (comm/async/progress.hpp), each holding
//   the link like any call; a blocking call made while some are pending is queued behind them.
// - Shards outlive their communicator safely: a shard holds the link, not the handle, and its
//   collective stages find the link closed (GRADSYNC_E_MISUSE) once the communicator is freed.
// - A fork() copies the handle into the child, where it is the parent's (common/fork.hpp): every
//   entry point refuses it (check() in capi/handle.hpp asks require_this_process), before looking
//   at a word or a mutex that a thread of the parent may have held at the fork; and the link's
//   end there only releases the child's own resources (forsake).
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <mutex>

#include "capi/guard.hpp"
#include "capi/handle.hpp"
#include "comm/async/progress.hpp"
#include "comm/communicator.hpp"
#include "common/fork.hpp"

namespace gradsync::capi {

class CommLink {
  // A thread's stack of the links it is inside (in a call or an abort), innermost first.
  struct Inside {
    const CommLink* link;
    const Inside* outer;
  };

 public:
  // description names the communicator in messages: "communicator 'train' (thread transport, rank 0 of 2)".
  CommLink(std::unique_ptr<comm::Communicator> impl, std::string description);
  CommLink(const CommLink&) = delete;
  CommLink& operator=(const CommLink&) = delete;
  ~CommLink();

  // One entry point's hold on the link, from construction to destruction: one atomic operation
  // each way. Letting go is its last touch of the link (a waiting close polls for it).
  class Call {
   public:
    // Throws GRADSYNC_E_MISUSE when another call holds the link or it is closed.
    Call(CommLink& link, const char* function);
    ~Call();
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;
    comm::Communicator& comm() const noexcept { return *link_.impl_; }

   private:
    CommLink& link_;
    Inside inside_;
  };

  int32_t rank() const noexcept { return rank_; }
  int32_t size() const noexcept { return size_; }
  int64_t member_id() const noexcept { return member_id_; }
  comm::Transport transport() const noexcept { return transport_; }
  // Fixed at creation, like the rank: read by any thread.
  const comm::Topology& topology() const noexcept { return topology_; }
  const std::string& description() const noexcept { return description_; }
  // The communicator, for what only reads it while the link is open (a shard's constructor).
  comm::Communicator& communicator() const noexcept { return *impl_; }

  // gradsync_comm_abort: any thread, also while a call runs; GRADSYNC_E_MISUSE once closed. Takes
  // its own reference: a close may be waiting for it to let go.
  static void abort(std::shared_ptr<CommLink> link);
  // gradsync_comm_free. Returns true when the communicator is destroyed and the handle may go.
  bool close() noexcept;
  // Throws GRADSYNC_E_MISUSE in a process forked from the one that created the communicator.
  void require_this_process() const {
    if (!owner_.here()) refuse_elsewhere();
  }

  // Runs body holding the link (a Call), in the order of the handle's calls: on this thread when no
  // non-blocking call is pending, else queued behind them on the progress thread and waited for.
  // Throws what body threw (as a gradsync::Error when it crossed threads).
  static void run_in_order(const std::shared_ptr<CommLink>& link, const char* function,
                           const std::function<void()>& body);

  // The progress thread, or null before the first non-blocking call. Started and stopped by the
  // thread that uses the handle; read by that one and by its shards' (other handles, other
  // threads), which is why it is shared and kept under a mutex: a shard waiting on a queued stage
  // keeps it alive through a free.
  std::shared_ptr<comm::Progress> progress() const;
  std::shared_ptr<comm::Progress> start_progress();
  // After close(): what is still queued fails fast (the link is closed), and the thread is joined
  // by whoever lets go of it last.
  void stop_progress() noexcept;
  // The first failure of a non-blocking call since creation or the last reset.
  void record_async_error(const Outcome& o);
  Outcome async_error() const;
  void clear_async_error();

 private:
  // The state word: the closed bit, the in-call bit (the lock of "one call at a time"), and above
  // them the number of calls and aborts using the communicator, which close waits to fall to 0
  // before destroying it. A call takes the in-call bit and a count in one compare-exchange and
  // gives both back in one subtraction.
  static constexpr uint32_t kClosed = 1u, kHeld = 2u, kUser = 4u;

  [[noreturn]] void fail_closed() const;
  [[noreturn]] void refuse_elsewhere() const;
  // close() and the destructor outside the owner process: the communicator releases what is this
  // process's alone and is leaked with the progress thread's handle (the thread is the parent's),
  // without a look at the state word or a mutex.
  void forsake() noexcept;
  // Counts a user (an abort) in; false (and nothing counted) once the link is closed: a close
  // either sees the user and waits for it, or the user sees the close.
  bool acquire() noexcept;
  // Counts a user out; its last touch of the link.
  void release() noexcept;
  bool held_by_this_thread() const noexcept;

  std::atomic<uint32_t> state_{0};
  // The entry point in a call, for the messages of a refused caller and of a close.
  std::atomic<const char*> holder_{nullptr};
  std::unique_ptr<comm::Communicator> impl_;
  mutable std::mutex progress_mutex_;
  std::shared_ptr<comm::Progress> progress_;
  std::atomic<bool> has_progress_{false};  // so that blocking-only users never take the mutex
  mutable std::mutex async_mutex_;
  Outcome async_error_;
  const std::string description_;
  const int32_t rank_, size_;
  const int64_t member_id_;
  const comm::Transport transport_;
  const comm::Topology topology_;
  const OwnerProcess owner_;
};

}  // namespace gradsync::capi

struct gradsync_comm : gradsync::capi::Handle<gradsync::capi::Kind::Comm> {
  explicit gradsync_comm(std::shared_ptr<gradsync::capi::CommLink> l) : link(std::move(l)) {}
  void require_this_process() const { link->require_this_process(); }
  std::shared_ptr<gradsync::capi::CommLink> link;
};
