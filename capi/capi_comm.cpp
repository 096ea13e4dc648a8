// SPDX-License-Identifier: Apache-2.0
// C shims of the communicator (include/gradsync/comm.h) over gradsync::comm::Communicator.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "capi/comm_handle.hpp"
#include "capi/guard.hpp"
#include "capi/options.hpp"
#include "comm/communicator.hpp"
#include "comm/create.hpp"
#include "comm/types.hpp"
#include "gradsync/comm.h"

struct gradsync_request : gradsync::capi::Handle<gradsync::capi::Kind::Request> {
  explicit gradsync_request(const char* f) : function(f) {}
  void require_this_process() const {
    if (!owner.here()) {
      owner.refuse(fmt::format("the request of {}", function),
                   "its call runs on a thread of the parent, so it never completes here; free it");
    }
  }
  const char* function;  // the entry point that started it, for messages
  const gradsync::OwnerProcess owner;
  std::shared_ptr<gradsync::comm::Completion> done = std::make_shared<gradsync::comm::Completion>();
};

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
  for (auto pause = std::chrono::microseconds(50); state_.load(std::memory_order_acquire) != kClosed;
       pause = std::min(pause * 2, std::chrono::microseconds(5000))) {
    std::this_thread::sleep_for(pause);
  }
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

namespace {
using gradsync::DType;
using gradsync::capi::check;
using gradsync::capi::check_kind;
using gradsync::capi::CommLink;
using gradsync::capi::guard;
using gradsync::capi::Outcome;
using gradsync::comm::Communicator;

constexpr size_t kOptionsV1Size = offsetof(gradsync_comm_options, name) + GRADSYNC_COMM_NAME_MAX;

gradsync_comm_options default_options() {
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  return o;
}

// Copies what the caller's version of the struct has; later fields keep their defaults.
gradsync::comm::Options parse_options(const gradsync_comm_options* user) {
  GS_REQUIRE(user != nullptr, GRADSYNC_E_INVALID_ARG, "options are NULL");
  const gradsync_comm_options o = gradsync::capi::read_options(user, default_options(), kOptionsV1Size, "options");
  GS_REQUIRE(o.reserved0 == 0, GRADSYNC_E_INVALID_ARG, "reserved0 must be 0, got {}", o.reserved0);

  gradsync::comm::Options out;
  GS_REQUIRE(o.transport >= 0 && o.transport <= 3, GRADSYNC_E_INVALID_ARG, "unknown transport {}", o.transport);
  GS_REQUIRE(o.reserved1 == 0, GRADSYNC_E_INVALID_ARG, "reserved1 must be 0, got {}", o.reserved1);
  out.transport = static_cast<gradsync::comm::Transport>(o.transport);
  const bool over_mpi =
      out.transport == gradsync::comm::Transport::Mpi || out.transport == gradsync::comm::Transport::Hier;
  const bool needs_rank = !over_mpi;
  if (needs_rank) {
    GS_REQUIRE(o.size != GRADSYNC_UNSET_I32, GRADSYNC_E_INVALID_ARG, "size is not set");
    GS_REQUIRE(o.size >= 1, GRADSYNC_E_INVALID_ARG, "size must be at least 1, got {}", o.size);
    GS_REQUIRE(o.rank != GRADSYNC_UNSET_I32, GRADSYNC_E_INVALID_ARG, "rank is not set");
    GS_REQUIRE(o.rank >= 0 && o.rank < o.size, GRADSYNC_E_OUT_OF_RANGE, "rank {} out of range [0, {})", o.rank, o.size);
    const size_t name_len = strnlen(o.name, GRADSYNC_COMM_NAME_MAX);
    GS_REQUIRE(name_len < GRADSYNC_COMM_NAME_MAX, GRADSYNC_E_INVALID_ARG,
               "group name is not NUL-terminated within {} bytes", GRADSYNC_COMM_NAME_MAX);
    GS_REQUIRE(name_len > 0, GRADSYNC_E_INVALID_ARG, "group name is empty");
    out.name.assign(o.name, name_len);
    out.rank = o.rank;
    out.size = o.size;
  }
  out.deterministic =
      o.deterministic == GRADSYNC_UNSET_I32 ? out.transport != gradsync::comm::Transport::Mpi : o.deterministic != 0;
  out.topology_independent = o.topology_independent != 0;
  out.check_mismatch = o.check_mismatch == GRADSYNC_UNSET_I32 ? true : o.check_mismatch != 0;
  if (o.timeout_ms != GRADSYNC_UNSET_I64) {
    GS_REQUIRE(o.timeout_ms > 0, GRADSYNC_E_INVALID_ARG, "timeout_ms must be > 0, got {}", o.timeout_ms);
    out.timeout = std::chrono::milliseconds(o.timeout_ms);
  }
  out.mpi_fcomm = o.mpi_fcomm;
  const size_t host_len = strnlen(o.host, GRADSYNC_COMM_NAME_MAX);
  GS_REQUIRE(host_len < GRADSYNC_COMM_NAME_MAX, GRADSYNC_E_INVALID_ARG,
             "host label is not NUL-terminated within {} bytes", GRADSYNC_COMM_NAME_MAX);
  out.host_label.assign(o.host, host_len);
  return out;
}

// "communicator 'train' (thread transport, rank 0 of 2)": how messages about a handle name it.
std::string describe(const gradsync::comm::Options& options, const Communicator& c) {
  const char* transport = gradsync::comm::transport_name(c.transport());
  if (c.transport() == gradsync::comm::Transport::Mpi || c.transport() == gradsync::comm::Transport::Hier) {
    return fmt::format("communicator ({} transport, rank {} of {})", transport, c.rank(), c.size());
  }
  return fmt::format("communicator '{}' ({} transport, rank {} of {})", options.name, transport, c.rank(), c.size());
}

// What a call does once its arguments are checked: run on the communicator, on the caller's
// thread or the progress thread. It holds copies of the arguments; the buffers are borrowed.
using Op = std::function<void(Communicator&)>;

// Runs op holding the handle's in-call bit, so a second thread calling at the same time gets
// GRADSYNC_E_MISUSE (see capi/comm_handle.hpp).
void hold_and_run(const std::shared_ptr<CommLink>& link, const char* function, const Op& op) {
  const CommLink::Call call(*link, function);
  op(call.comm());
}

// The body of a blocking entry point: make_op(link) checks the arguments (on the caller's thread,
// so a bad one is reported at once) and returns what to run, in order with pending requests.
template <class MakeOp>
int run(const char* function, gradsync_comm* comm, MakeOp&& make_op) noexcept {
  return guard(function, [&] {
    const std::shared_ptr<CommLink>& link = check(comm)->link;
    // The op's own type, not an Op: a blocking call allocates nothing (the small calls' ops return
    // their lambdas, whose captures are too big for std::function's inline storage).
    const auto op = make_op(*link);
    CommLink::run_in_order(link, function, [&] { op(link->communicator()); });
  });
}

// The body of a non-blocking entry point: the same checks, then the op goes to the progress
// thread behind whatever is pending, and *out receives the request.
template <class MakeOp>
int start(const char* function, gradsync_comm* comm, gradsync_request** out, MakeOp&& make_op) noexcept {
  if (out != nullptr) *out = nullptr;
  return guard(function, [&] {
    GS_REQUIRE(out != nullptr, GRADSYNC_E_INVALID_ARG, "request out-parameter is NULL");
    const std::shared_ptr<CommLink>& link = check(comm)->link;
    Op op = make_op(*link);
    const std::shared_ptr<gradsync::comm::Progress> progress = link->start_progress();
    auto request = std::make_unique<gradsync_request>(function);
    progress->submit([link, function, op = std::move(op), done = request->done] {
      Outcome o = gradsync::capi::capture([&] { hold_and_run(link, function, op); });
      if (o.status != GRADSYNC_OK) link->record_async_error({o.status, fmt::format("{}: {}", function, o.message)});
      done->finish(o.status, std::move(o.message));
    });
    *out = request.release();
  });
}

gradsync::Part part_of(const CommLink& link, size_t total) {
  return gradsync::partition(total, static_cast<uint64_t>(link.size()), static_cast<uint64_t>(link.rank()));
}

// A buffer of count elements must exist and its byte size must fit in size_t (huge counts are errors).
void require_buffer(const void* p, size_t count, DType dtype, const char* what) {
  GS_REQUIRE(count <= std::numeric_limits<size_t>::max() / 8 / gradsync::dtype_size(dtype), GRADSYNC_E_INVALID_ARG,
             "{} count {} is too large", what, count);
  GS_REQUIRE(p != nullptr || count == 0, GRADSYNC_E_INVALID_ARG, "{} buffer is NULL for count {}", what, count);
}

// The collectives that reduce read and write elements as their type, so a buffer must be aligned
// as an array of that type is (a misaligned one would be undefined behaviour in the kernels).
void require_aligned(const void* p, DType dtype, const char* what) {
  const size_t es = gradsync::dtype_size(dtype);
  GS_REQUIRE(reinterpret_cast<uintptr_t>(p) % es == 0, GRADSYNC_E_INVALID_ARG,
             "{} buffer {} is not aligned to its {}-byte elements ({})", what, p, es, gradsync::dtype_name(dtype));
}

// Buffer a (a_count elements) and buffer b must not overlap, except in place: a exactly at
// `in_place` (a position inside b). Peers read the send buffer while recv is written, so any other
// overlap races them (and copying it is undefined behaviour). Counts have passed require_buffer, so
// the byte sizes do not overflow.
void require_disjoint(const void* a, size_t a_count, const char* a_name, const void* b, size_t b_count,
                      const char* b_name, DType dtype, const void* in_place) {
  const size_t es = gradsync::dtype_size(dtype);
  const size_t a_bytes = a_count * es, b_bytes = b_count * es;
  if (a_bytes == 0 || b_bytes == 0 || a == in_place) return;
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  GS_REQUIRE(pa + a_bytes <= pb || pb + b_bytes <= pa, GRADSYNC_E_INVALID_ARG,
             "{} [{}, +{} bytes) overlaps {} [{}, +{} bytes); in place, {} must be {}", a_name, a, a_bytes, b_name, b,
             b_bytes, a_name, in_place);
}

}  // namespace

extern "C" {

GRADSYNC_API int gradsync_comm_options_init(gradsync_comm_options* opts, size_t struct_size) {
  return guard(__func__,
               [&] { gradsync::capi::init_options(opts, struct_size, default_options(), kOptionsV1Size, "options"); });
}

GRADSYNC_API int gradsync_comm_create(gradsync_comm** out, const gradsync_comm_options* opts) {
  return gradsync::capi::create(__func__, out, [&] {
    const auto options = parse_options(opts);
    auto impl = gradsync::comm::create(options);
    if (const char* prefix = std::getenv("GRADSYNC_TIMELINE"); prefix != nullptr && *prefix != '\0') {
      impl->telemetry().open_timeline(fmt::format("{}.{}", prefix, impl->rank()), impl->rank());
    }
    std::string description = describe(options, *impl);
    return new gradsync_comm(std::make_shared<CommLink>(std::move(impl), std::move(description)));
  });
}

GRADSYNC_API int gradsync_comm_split(gradsync_comm* comm, int32_t color, int32_t key, gradsync_comm** out) {
  if (out != nullptr) *out = nullptr;
  return guard(__func__, [&] {
    GS_REQUIRE(out != nullptr, GRADSYNC_E_INVALID_ARG, "out-parameter is NULL");
    const std::shared_ptr<CommLink>& link = check(comm)->link;
    std::unique_ptr<Communicator> impl;
    CommLink::run_in_order(link, __func__, [&] { impl = link->communicator().split(color, key); });
    if (impl == nullptr) return;
    std::string description = fmt::format("subgroup (color {}) of {}", color, link->description());
    *out = new gradsync_comm(std::make_shared<CommLink>(std::move(impl), std::move(description)));
  });
}

GRADSYNC_API int gradsync_comm_shrink(gradsync_comm* comm, gradsync_comm** out, int32_t* failed, size_t failed_capacity,
                                      gradsync_shrink_result* result) {
  if (out != nullptr) *out = nullptr;
  return guard(__func__, [&] {
    GS_REQUIRE(out != nullptr, GRADSYNC_E_INVALID_ARG, "out-parameter is NULL");
    const std::shared_ptr<CommLink>& link = check(comm)->link;
    GS_REQUIRE(failed == nullptr || failed_capacity >= static_cast<size_t>(link->size()), GRADSYNC_E_INVALID_ARG,
               "failed holds {} entries; the group has {} ranks, so as many may be out", failed_capacity, link->size());
    if (result != nullptr) {
      GS_REQUIRE(result->struct_size >= sizeof(gradsync_shrink_result) && result->version >= 1, GRADSYNC_E_INVALID_ARG,
                 "result: struct_size {} / version {}: set them to sizeof(gradsync_shrink_result) "
                 "and GRADSYNC_SHRINK_RESULT_VERSION",
                 result->struct_size, result->version);
    }
    gradsync::comm::ShrinkResult shrunk;
    CommLink::run_in_order(link, __func__, [&] { shrunk = link->communicator().shrink(); });
    if (failed != nullptr) std::copy(shrunk.failed.begin(), shrunk.failed.end(), failed);
    if (result != nullptr) {
      result->failed_count = static_cast<int32_t>(shrunk.failed.size());
      result->attempts = shrunk.attempts;
      result->agree_ns = shrunk.agree.count();
      result->form_ns = shrunk.form.count();
    }
    std::string description = fmt::format("shrunk group of {}", link->description());
    *out = new gradsync_comm(std::make_shared<CommLink>(std::move(shrunk.comm), std::move(description)));
  });
}

GRADSYNC_API int gradsync_comm_member_id(const gradsync_comm* comm, int64_t* id) {
  return guard(__func__, [&] {
    GS_REQUIRE(id != nullptr, GRADSYNC_E_INVALID_ARG, "id is NULL");
    *id = check(comm)->link->member_id();
  });
}

GRADSYNC_API int gradsync_comm_topology(const gradsync_comm* comm, int32_t* host, int32_t* local_rank,
                                        int32_t* local_size, int32_t* num_hosts, int32_t* rank_hosts,
                                        size_t rank_hosts_len) {
  return guard(__func__, [&] {
    const CommLink& link = *check(comm)->link;
    const gradsync::comm::Topology& t = link.topology();
    GS_REQUIRE(rank_hosts == nullptr || rank_hosts_len >= t.rank_host.size(), GRADSYNC_E_INVALID_ARG,
               "rank_hosts holds {} entries; the group has {} ranks", rank_hosts_len, t.rank_host.size());
    if (host != nullptr) *host = t.host;
    if (local_rank != nullptr) *local_rank = t.local_rank;
    if (local_size != nullptr) *local_size = t.local_size;
    if (num_hosts != nullptr) *num_hosts = t.num_hosts;
    if (rank_hosts != nullptr) std::copy(t.rank_host.begin(), t.rank_host.end(), rank_hosts);
  });
}

GRADSYNC_API void gradsync_comm_free(gradsync_comm* comm) {
  if (comm == nullptr) return;
  try {
    check_kind(comm);
  } catch (const gradsync::Error& e) {
    GS_LOG_ERROR("gradsync_comm_free: {}", e.what());
    return;
  }
  if (!comm->link->close()) return;
  // Non-blocking calls still queued run now and fail fast (the link is closed); the one running,
  // if any, was aborted by close.
  comm->link->stop_progress();
  delete comm;
}

GRADSYNC_API int gradsync_comm_abort(gradsync_comm* comm) {
  return guard(__func__, [&] { CommLink::abort(check(comm)->link); });
}

GRADSYNC_API int gradsync_comm_set_interrupt(gradsync_comm* comm, gradsync_interrupt_fn fn, void* user_data) {
  return run(__func__, comm, [&](const CommLink&) -> Op {
    return [fn, user_data](Communicator& c) { c.set_interrupt({fn, user_data}); };
  });
}

GRADSYNC_API int gradsync_comm_reset(gradsync_comm* comm) {
  return run(__func__, comm, [&](const CommLink&) -> Op {
    return [link = comm->link](Communicator& c) {
      c.reset();
      link->clear_async_error();
    };
  });
}

GRADSYNC_API int gradsync_comm_rank(const gradsync_comm* comm, int32_t* rank) {
  return guard(__func__, [&] {
    GS_REQUIRE(rank != nullptr, GRADSYNC_E_INVALID_ARG, "rank out-parameter is NULL");
    *rank = check(comm)->link->rank();
  });
}

GRADSYNC_API int gradsync_comm_size(const gradsync_comm* comm, int32_t* size) {
  return guard(__func__, [&] {
    GS_REQUIRE(size != nullptr, GRADSYNC_E_INVALID_ARG, "size out-parameter is NULL");
    *size = check(comm)->link->size();
  });
}

GRADSYNC_API int gradsync_comm_transport(const gradsync_comm* comm, int32_t* transport) {
  return guard(__func__, [&] {
    GS_REQUIRE(transport != nullptr, GRADSYNC_E_INVALID_ARG, "transport out-parameter is NULL");
    *transport = static_cast<int32_t>(check(comm)->link->transport());
  });
}

}  // extern "C"

// Each collective's checks and op, once for its blocking and its non-blocking entry point.
namespace {

// One buffer of a reduction: present, aligned, and send either recv or apart from it.
gradsync::comm::BufferRef reducible(const void* send, void* recv, size_t count, DType t) {
  require_buffer(send, count, t, "send");
  require_buffer(recv, count, t, "recv");
  require_aligned(send, t, "send");
  require_aligned(recv, t, "recv");
  require_disjoint(send, count, "send", recv, count, "recv", t, recv);
  return {send, recv, count};
}

auto allreduce_op(const void* send, void* recv, size_t count, int32_t dtype, int32_t op) {
  const DType t = gradsync::to_dtype(dtype);
  const auto o = gradsync::to_op(op);
  return [buffer = reducible(send, recv, count, t), t, o](Communicator& c) {
    c.allreduce(std::span<const gradsync::comm::BufferRef>(&buffer, 1), t, o);
  };
}

Op allreduce_many_op(const void* const* sends, void* const* recvs, const size_t* counts, size_t nbufs, int32_t dtype,
                     int32_t op) {
  const DType t = gradsync::to_dtype(dtype);
  const auto o = gradsync::to_op(op);
  GS_REQUIRE(nbufs <= GRADSYNC_MAX_FUSED_BUFFERS, GRADSYNC_E_INVALID_ARG,
             "{} buffers exceed GRADSYNC_MAX_FUSED_BUFFERS ({})", nbufs, GRADSYNC_MAX_FUSED_BUFFERS);
  GS_REQUIRE(nbufs == 0 || (recvs != nullptr && counts != nullptr), GRADSYNC_E_INVALID_ARG,
             "recvs or counts is NULL for {} buffers", nbufs);
  std::vector<gradsync::comm::BufferRef> buffers(nbufs);
  for (size_t i = 0; i < nbufs; ++i) {
    buffers[i] = reducible(sends != nullptr ? sends[i] : recvs[i], recvs[i], counts[i], t);
  }
  return [buffers = std::move(buffers), t, o](Communicator& c) { c.allreduce(buffers, t, o); };
}

Op allreduce_mixed_op(const void* const* sends, void* const* recvs, const size_t* counts, const int32_t* dtypes,
                      size_t nbufs, int32_t op) {
  const auto o = gradsync::to_op(op);
  GS_REQUIRE(nbufs <= GRADSYNC_MAX_FUSED_BUFFERS, GRADSYNC_E_INVALID_ARG,
             "{} buffers exceed GRADSYNC_MAX_FUSED_BUFFERS ({})", nbufs, GRADSYNC_MAX_FUSED_BUFFERS);
  GS_REQUIRE(nbufs == 0 || (recvs != nullptr && counts != nullptr && dtypes != nullptr), GRADSYNC_E_INVALID_ARG,
             "recvs, counts or dtypes is NULL for {} buffers", nbufs);
  std::vector<gradsync::comm::BufferRef> buffers(nbufs);
  std::vector<DType> types(nbufs);
  for (size_t i = 0; i < nbufs; ++i) {
    types[i] = gradsync::to_dtype(dtypes[i]);
    buffers[i] = reducible(sends != nullptr ? sends[i] : recvs[i], recvs[i], counts[i], types[i]);
  }
  return [buffers = std::move(buffers), types = std::move(types), o](Communicator& c) {
    c.allreduce_mixed(buffers, types, o);
  };
}

auto weighted_mean_op(const void* send, void* recv, size_t count, int32_t dtype, uint64_t weight,
                      uint64_t* total_weight) {
  const DType t = gradsync::to_dtype(dtype);
  reducible(send, recv, count, t);
  return [=](Communicator& c) { c.weighted_mean(send, recv, count, t, weight, total_weight); };
}

auto broadcast_op(void* buf, size_t count, int32_t dtype, int32_t root) {
  const DType t = gradsync::to_dtype(dtype);
  require_buffer(buf, count, t, "broadcast");
  // The root is checked inside the round, so a root that one rank gets wrong fails every rank.
  return [=](Communicator& c) { c.broadcast(buf, count, t, root); };
}

// The parts of an allgather or a reduce_scatter: every rank's count, their sum, this rank's part.
struct RankParts {
  std::vector<size_t> counts;
  size_t total = 0;
  gradsync::Part mine{};
};

// By the partition rule.
RankParts rule_parts(const CommLink& link, size_t total) {
  const auto n = static_cast<uint64_t>(link.size());
  RankParts p;
  p.counts.resize(n);
  for (uint64_t r = 0; r < n; ++r) p.counts[r] = gradsync::partition(total, n, r).len;
  p.total = total;
  p.mine = part_of(link, total);
  return p;
}

// As the caller gives them (copied: a non-blocking call outlives the caller's array).
RankParts given_parts(const CommLink& link, const size_t* counts) {
  GS_REQUIRE(counts != nullptr, GRADSYNC_E_INVALID_ARG, "counts is NULL");
  const auto n = static_cast<size_t>(link.size());
  RankParts p;
  p.counts.assign(counts, counts + n);
  for (size_t r = 0; r < n; ++r) {
    GS_REQUIRE(p.counts[r] <= SIZE_MAX - p.total, GRADSYNC_E_INVALID_ARG, "the counts' sum overflows at rank {}", r);
    if (r == static_cast<size_t>(link.rank())) p.mine = {p.total, p.counts[r]};
    p.total += p.counts[r];
  }
  return p;
}

Op allgather_op(const void* send, void* recv, RankParts p, int32_t dtype) {
  const DType t = gradsync::to_dtype(dtype);
  require_buffer(recv, p.total, t, "recv");
  if (send != nullptr) {
    require_buffer(send, p.mine.len, t, "send");
    // in place: this rank's part already at its offset in recv
    const void* own =
        recv == nullptr ? nullptr : static_cast<const char*>(recv) + p.mine.start * gradsync::dtype_size(t);
    require_disjoint(send, p.mine.len, "send", recv, p.total, "recv", t, own);
  }
  return [=, counts = std::move(p.counts)](Communicator& c) { c.allgatherv(send, recv, counts, t); };
}

Op reduce_scatter_op(const void* send, void* recv, RankParts p, int32_t dtype, int32_t op) {
  const DType t = gradsync::to_dtype(dtype);
  const auto o = gradsync::to_op(op);
  require_buffer(send, p.total, t, "send");
  require_buffer(recv, p.mine.len, t, "recv");
  require_aligned(send, t, "send");
  require_aligned(recv, t, "recv");
  // in place: recv at this rank's offset in send
  const void* own = send == nullptr ? nullptr : static_cast<const char*>(send) + p.mine.start * gradsync::dtype_size(t);
  require_disjoint(recv, p.mine.len, "recv", send, p.total, "send", t, own);
  return
      [=, counts = std::move(p.counts)](Communicator& c) { c.reduce_scatterv(send, recv, counts, t, o, std::nullopt); };
}

// An exchange's buffers: send (send_extent elements) and recv (recv_extent) must not overlap.
void require_exchange_buffers(const void* send, size_t send_extent, const void* recv, size_t recv_extent, DType t) {
  require_buffer(send, send_extent, t, "send");
  require_buffer(recv, recv_extent, t, "recv");
  require_disjoint(send, send_extent, "send", recv, recv_extent, "recv", t, nullptr);
}

// size entries, copied (a non-blocking call outlives the caller's array); `what` names them.
std::vector<size_t> given_counts(const CommLink& link, const size_t* counts, const char* what) {
  GS_REQUIRE(counts != nullptr, GRADSYNC_E_INVALID_ARG, "{} is NULL", what);
  return std::vector<size_t>(counts, counts + link.size());
}

// The elements a buffer must hold for these parts: the largest displacement + count of a non-empty
// part. Displacements NULL: packed in rank order (written into displs).
size_t extent_of(const std::vector<size_t>& counts, const size_t* given_displs, std::vector<size_t>& displs,
                 const char* what) {
  displs.resize(counts.size());
  size_t end = 0, packed = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    displs[r] = given_displs != nullptr ? given_displs[r] : packed;
    GS_REQUIRE(counts[r] <= SIZE_MAX - displs[r], GRADSYNC_E_INVALID_ARG,
               "{} part {}: displacement {} + count {} overflows", what, r, displs[r], counts[r]);
    if (counts[r] > 0) end = std::max(end, displs[r] + counts[r]);
    if (given_displs == nullptr) packed += counts[r];
  }
  return end;
}

Op alltoall_op(const CommLink& link, const void* send, void* recv, size_t total_count, int32_t dtype) {
  const DType t = gradsync::to_dtype(dtype);
  const size_t recv_count = part_of(link, total_count).len * static_cast<size_t>(link.size());
  require_exchange_buffers(send, total_count, recv, recv_count, t);
  return [=](Communicator& c) { c.alltoall(send, recv, total_count, t); };
}

Op alltoallv_op(const CommLink& link, const void* send, const size_t* send_counts, const size_t* send_displs,
                void* recv, const size_t* recv_counts, const size_t* recv_displs, int32_t dtype) {
  const DType t = gradsync::to_dtype(dtype);
  std::vector<size_t> sc = given_counts(link, send_counts, "send_counts"), sd;
  std::vector<size_t> rc = given_counts(link, recv_counts, "recv_counts"), rd;
  const size_t send_extent = extent_of(sc, send_displs, sd, "send");
  const size_t recv_extent = extent_of(rc, recv_displs, rd, "recv");
  require_exchange_buffers(send, send_extent, recv, recv_extent, t);
  return [=, sc = std::move(sc), sd = std::move(sd), rc = std::move(rc), rd = std::move(rd)](Communicator& c) {
    c.alltoallv(send, sc, sd, recv, rc, rd, t);
  };
}

// count elements per rank, size of them: the rooted buffer of a gather or a scatter.
size_t per_rank(const CommLink& link, size_t count, DType t, const char* what) {
  const auto n = static_cast<size_t>(link.size());
  GS_REQUIRE(count <= std::numeric_limits<size_t>::max() / 8 / gradsync::dtype_size(t) / n, GRADSYNC_E_INVALID_ARG,
             "{} of {} x {} elements is too large", what, n, count);
  return count * n;
}

// The root is judged inside the round (a root one rank gets wrong fails every rank); here it only
// says which buffers this rank uses.
Op gather_op(const CommLink& link, const void* send, void* recv, size_t count, int32_t dtype, int32_t root) {
  const DType t = gradsync::to_dtype(dtype);
  const bool at_root = root == link.rank();
  require_exchange_buffers(send, count, recv, at_root ? per_rank(link, count, t, "recv") : 0, t);
  return [=](Communicator& c) { c.gather(send, recv, count, t, root); };
}

Op gatherv_op(const CommLink& link, const void* send, size_t send_count, void* recv, const size_t* recv_counts,
              int32_t dtype, int32_t root) {
  const DType t = gradsync::to_dtype(dtype);
  const bool at_root = root == link.rank();
  std::vector<size_t> rc, rd;
  if (at_root) rc = given_counts(link, recv_counts, "recv_counts at the root");
  const size_t recv_extent = at_root ? extent_of(rc, nullptr, rd, "recv") : 0;
  require_exchange_buffers(send, send_count, recv, recv_extent, t);
  return [=, rc = std::move(rc)](Communicator& c) { c.gatherv(send, send_count, recv, rc, t, root); };
}

Op scatter_op(const CommLink& link, const void* send, void* recv, size_t count, int32_t dtype, int32_t root) {
  const DType t = gradsync::to_dtype(dtype);
  const bool at_root = root == link.rank();
  require_exchange_buffers(send, at_root ? per_rank(link, count, t, "send") : 0, recv, count, t);
  return [=](Communicator& c) { c.scatter(send, recv, count, t, root); };
}

Op scatterv_op(const CommLink& link, const void* send, const size_t* send_counts, void* recv, size_t recv_count,
               int32_t dtype, int32_t root) {
  const DType t = gradsync::to_dtype(dtype);
  const bool at_root = root == link.rank();
  std::vector<size_t> sc, sd;
  if (at_root) sc = given_counts(link, send_counts, "send_counts at the root");
  const size_t send_extent = at_root ? extent_of(sc, nullptr, sd, "send") : 0;
  require_exchange_buffers(send, send_extent, recv, recv_count, t);
  return [=, sc = std::move(sc)](Communicator& c) { c.scatterv(send, sc, recv, recv_count, t, root); };
}

Op reduce_op(const CommLink& link, const void* send, void* recv, size_t count, int32_t dtype, int32_t op,
             int32_t root) {
  const DType t = gradsync::to_dtype(dtype);
  const auto o = gradsync::to_op(op);
  require_buffer(send, count, t, "send");
  require_aligned(send, t, "send");
  if (root == link.rank()) {
    require_buffer(recv, count, t, "recv");
    require_aligned(recv, t, "recv");
    require_disjoint(recv, count, "recv", send, count, "send", t, send);
  }
  return [=](Communicator& c) { c.reduce_to(send, recv, count, t, o, root); };
}

// A completed request's status, and its message recorded as the failure of the call that started it.
int request_outcome(const gradsync_request* r) noexcept {
  const int status = r->done->status();
  return status == GRADSYNC_OK ? status
                               : gradsync::capi::set_last_error(status, r->function, r->done->message().c_str());
}

auto barrier_op() {
  return [](Communicator& c) { c.barrier(); };
}

}  // namespace

extern "C" {

GRADSYNC_API int gradsync_comm_allreduce(gradsync_comm* comm, const void* send, void* recv, size_t count, int32_t dtype,
                                         int32_t op) {
  return run(__func__, comm, [&](const CommLink&) { return allreduce_op(send, recv, count, dtype, op); });
}

GRADSYNC_API int gradsync_comm_iallreduce(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                          int32_t dtype, int32_t op, gradsync_request** request) {
  return start(__func__, comm, request, [&](const CommLink&) { return allreduce_op(send, recv, count, dtype, op); });
}

GRADSYNC_API int gradsync_comm_allreduce_many(gradsync_comm* comm, const void* const* sends, void* const* recvs,
                                              const size_t* counts, size_t nbufs, int32_t dtype, int32_t op) {
  return run(__func__, comm,
             [&](const CommLink&) { return allreduce_many_op(sends, recvs, counts, nbufs, dtype, op); });
}

GRADSYNC_API int gradsync_comm_iallreduce_many(gradsync_comm* comm, const void* const* sends, void* const* recvs,
                                               const size_t* counts, size_t nbufs, int32_t dtype, int32_t op,
                                               gradsync_request** request) {
  return start(__func__, comm, request,
               [&](const CommLink&) { return allreduce_many_op(sends, recvs, counts, nbufs, dtype, op); });
}

GRADSYNC_API int gradsync_comm_allreduce_mixed(gradsync_comm* comm, const void* const* sends, void* const* recvs,
                                               const size_t* counts, const int32_t* dtypes, size_t nbufs, int32_t op) {
  return run(__func__, comm,
             [&](const CommLink&) { return allreduce_mixed_op(sends, recvs, counts, dtypes, nbufs, op); });
}

GRADSYNC_API int gradsync_comm_iallreduce_mixed(gradsync_comm* comm, const void* const* sends, void* const* recvs,
                                                const size_t* counts, const int32_t* dtypes, size_t nbufs, int32_t op,
                                                gradsync_request** request) {
  return start(__func__, comm, request,
               [&](const CommLink&) { return allreduce_mixed_op(sends, recvs, counts, dtypes, nbufs, op); });
}

GRADSYNC_API int gradsync_comm_weighted_mean(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                             int32_t dtype, uint64_t weight, uint64_t* total_weight) {
  return run(__func__, comm,
             [&](const CommLink&) { return weighted_mean_op(send, recv, count, dtype, weight, total_weight); });
}

GRADSYNC_API int gradsync_comm_iweighted_mean(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                              int32_t dtype, uint64_t weight, uint64_t* total_weight,
                                              gradsync_request** request) {
  return start(__func__, comm, request,
               [&](const CommLink&) { return weighted_mean_op(send, recv, count, dtype, weight, total_weight); });
}

GRADSYNC_API int gradsync_comm_broadcast(gradsync_comm* comm, void* buf, size_t count, int32_t dtype, int32_t root) {
  return run(__func__, comm, [&](const CommLink&) { return broadcast_op(buf, count, dtype, root); });
}

GRADSYNC_API int gradsync_comm_ibroadcast(gradsync_comm* comm, void* buf, size_t count, int32_t dtype, int32_t root,
                                          gradsync_request** request) {
  return start(__func__, comm, request, [&](const CommLink&) { return broadcast_op(buf, count, dtype, root); });
}

GRADSYNC_API int gradsync_comm_allgather(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                         int32_t dtype) {
  return run(__func__, comm,
             [&](const CommLink& l) { return allgather_op(send, recv, rule_parts(l, total_count), dtype); });
}

GRADSYNC_API int gradsync_comm_iallgather(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                          int32_t dtype, gradsync_request** request) {
  return start(__func__, comm, request,
               [&](const CommLink& l) { return allgather_op(send, recv, rule_parts(l, total_count), dtype); });
}

GRADSYNC_API int gradsync_comm_allgatherv(gradsync_comm* comm, const void* send, void* recv, const size_t* counts,
                                          int32_t dtype) {
  return run(__func__, comm,
             [&](const CommLink& l) { return allgather_op(send, recv, given_parts(l, counts), dtype); });
}

GRADSYNC_API int gradsync_comm_iallgatherv(gradsync_comm* comm, const void* send, void* recv, const size_t* counts,
                                           int32_t dtype, gradsync_request** request) {
  return start(__func__, comm, request,
               [&](const CommLink& l) { return allgather_op(send, recv, given_parts(l, counts), dtype); });
}

GRADSYNC_API int gradsync_comm_reduce_scatterv(gradsync_comm* comm, const void* send, void* recv, const size_t* counts,
                                               int32_t dtype, int32_t op) {
  return run(__func__, comm,
             [&](const CommLink& l) { return reduce_scatter_op(send, recv, given_parts(l, counts), dtype, op); });
}

GRADSYNC_API int gradsync_comm_ireduce_scatterv(gradsync_comm* comm, const void* send, void* recv, const size_t* counts,
                                                int32_t dtype, int32_t op, gradsync_request** request) {
  return start(__func__, comm, request,
               [&](const CommLink& l) { return reduce_scatter_op(send, recv, given_parts(l, counts), dtype, op); });
}

GRADSYNC_API int gradsync_comm_reduce_scatter(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                              int32_t dtype, int32_t op) {
  return run(__func__, comm,
             [&](const CommLink& l) { return reduce_scatter_op(send, recv, rule_parts(l, total_count), dtype, op); });
}

GRADSYNC_API int gradsync_comm_ireduce_scatter(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                               int32_t dtype, int32_t op, gradsync_request** request) {
  return start(__func__, comm, request,
               [&](const CommLink& l) { return reduce_scatter_op(send, recv, rule_parts(l, total_count), dtype, op); });
}

GRADSYNC_API int gradsync_comm_alltoall(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                        int32_t dtype) {
  return run(__func__, comm, [&](const CommLink& l) { return alltoall_op(l, send, recv, total_count, dtype); });
}

GRADSYNC_API int gradsync_comm_ialltoall(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                         int32_t dtype, gradsync_request** request) {
  return start(__func__, comm, request,
               [&](const CommLink& l) { return alltoall_op(l, send, recv, total_count, dtype); });
}

GRADSYNC_API int gradsync_comm_alltoallv(gradsync_comm* comm, const void* send, const size_t* send_counts,
                                         const size_t* send_displs, void* recv, const size_t* recv_counts,
                                         const size_t* recv_displs, int32_t dtype) {
  return run(__func__, comm, [&](const CommLink& l) {
    return alltoallv_op(l, send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype);
  });
}

GRADSYNC_API int gradsync_comm_ialltoallv(gradsync_comm* comm, const void* send, const size_t* send_counts,
                                          const size_t* send_displs, void* recv, const size_t* recv_counts,
                                          const size_t* recv_displs, int32_t dtype, gradsync_request** request) {
  return start(__func__, comm, request, [&](const CommLink& l) {
    return alltoallv_op(l, send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype);
  });
}

GRADSYNC_API int gradsync_comm_reduce(gradsync_comm* comm, const void* send, void* recv, size_t count, int32_t dtype,
                                      int32_t op, int32_t root) {
  return run(__func__, comm, [&](const CommLink& l) { return reduce_op(l, send, recv, count, dtype, op, root); });
}

GRADSYNC_API int gradsync_comm_ireduce(gradsync_comm* comm, const void* send, void* recv, size_t count, int32_t dtype,
                                       int32_t op, int32_t root, gradsync_request** request) {
  return start(__func__, comm, request,
               [&](const CommLink& l) { return reduce_op(l, send, recv, count, dtype, op, root); });
}

GRADSYNC_API int gradsync_comm_gather(gradsync_comm* comm, const void* send, void* recv, size_t count, int32_t dtype,
                                      int32_t root) {
  return run(__func__, comm, [&](const CommLink& l) { return gather_op(l, send, recv, count, dtype, root); });
}

GRADSYNC_API int gradsync_comm_igather(gradsync_comm* comm, const void* send, void* recv, size_t count, int32_t dtype,
                                       int32_t root, gradsync_request** request) {
  return start(__func__, comm, request,
               [&](const CommLink& l) { return gather_op(l, send, recv, count, dtype, root); });
}

GRADSYNC_API int gradsync_comm_gatherv(gradsync_comm* comm, const void* send, size_t send_count, void* recv,
                                       const size_t* recv_counts, int32_t dtype, int32_t root) {
  return run(__func__, comm,
             [&](const CommLink& l) { return gatherv_op(l, send, send_count, recv, recv_counts, dtype, root); });
}

GRADSYNC_API int gradsync_comm_igatherv(gradsync_comm* comm, const void* send, size_t send_count, void* recv,
                                        const size_t* recv_counts, int32_t dtype, int32_t root,
                                        gradsync_request** request) {
  return start(__func__, comm, request,
               [&](const CommLink& l) { return gatherv_op(l, send, send_count, recv, recv_counts, dtype, root); });
}

GRADSYNC_API int gradsync_comm_scatter(gradsync_comm* comm, const void* send, void* recv, size_t count, int32_t dtype,
                                       int32_t root) {
  return run(__func__, comm, [&](const CommLink& l) { return scatter_op(l, send, recv, count, dtype, root); });
}

GRADSYNC_API int gradsync_comm_iscatter(gradsync_comm* comm, const void* send, void* recv, size_t count, int32_t dtype,
                                        int32_t root, gradsync_request** request) {
  return start(__func__, comm, request,
               [&](const CommLink& l) { return scatter_op(l, send, recv, count, dtype, root); });
}

GRADSYNC_API int gradsync_comm_scatterv(gradsync_comm* comm, const void* send, const size_t* send_counts, void* recv,
                                        size_t recv_count, int32_t dtype, int32_t root) {
  return run(__func__, comm,
             [&](const CommLink& l) { return scatterv_op(l, send, send_counts, recv, recv_count, dtype, root); });
}

GRADSYNC_API int gradsync_comm_iscatterv(gradsync_comm* comm, const void* send, const size_t* send_counts, void* recv,
                                         size_t recv_count, int32_t dtype, int32_t root, gradsync_request** request) {
  return start(__func__, comm, request,
               [&](const CommLink& l) { return scatterv_op(l, send, send_counts, recv, recv_count, dtype, root); });
}

GRADSYNC_API int gradsync_comm_barrier(gradsync_comm* comm) {
  return run(__func__, comm, [&](const CommLink&) { return barrier_op(); });
}

GRADSYNC_API int gradsync_comm_ibarrier(gradsync_comm* comm, gradsync_request** request) {
  return start(__func__, comm, request, [&](const CommLink&) { return barrier_op(); });
}

GRADSYNC_API int gradsync_comm_get_async_error(const gradsync_comm* comm, int32_t* status) {
  return guard(__func__, [&] {
    GS_REQUIRE(status != nullptr, GRADSYNC_E_INVALID_ARG, "status out-parameter is NULL");
    const Outcome o = check(comm)->link->async_error();
    *status = o.status;
    // The message is the failed call's, "gradsync_comm_i...: ..."; recorded without the prefix
    // of this function, which did not fail.
    if (o.status != GRADSYNC_OK) gradsync::capi::set_last_error(o.status, "async error", o.message.c_str());
  });
}

GRADSYNC_API int gradsync_request_wait(gradsync_request* request, int64_t timeout_ms) {
  return guard(__func__, [&] {
    gradsync_request* r = check(request);
    if (!r->done->wait(std::chrono::milliseconds(timeout_ms < 0 ? -1 : timeout_ms))) {
      gradsync::fail(GRADSYNC_E_IN_PROGRESS, "the request of {} did not complete within {} ms (it is still pending)",
                     r->function, timeout_ms);
    }
    return request_outcome(r);
  });
}

GRADSYNC_API int gradsync_request_test(gradsync_request* request, int32_t* done) {
  return guard(__func__, [&] {
    GS_REQUIRE(done != nullptr, GRADSYNC_E_INVALID_ARG, "done out-parameter is NULL");
    gradsync_request* r = check(request);
    *done = r->done->done() ? 1 : 0;
    return *done != 0 ? request_outcome(r) : static_cast<int>(GRADSYNC_OK);
  });
}

GRADSYNC_API void gradsync_request_free(gradsync_request* request) {
  if (request == nullptr) return;
  try {
    check_kind(request);
  } catch (const gradsync::Error& e) {
    GS_LOG_ERROR("gradsync_request_free: {}", e.what());
    return;
  }
  // The buffers stay borrowed until the call completes: freeing the request waits for it (a
  // collective's wait is bounded by the communicator's timeout). In a forked child nothing runs
  // the call, and nothing borrows the child's copy of the buffers.
  if (request->owner.here()) request->done->wait(std::chrono::milliseconds(-1));
  delete request;
}

static_assert(GRADSYNC_COLLECTIVE_SLOTS == gradsync::comm::kCollectiveSlots &&
                  GRADSYNC_COLLECTIVE_ALLREDUCE == static_cast<int>(gradsync::comm::Collective::Allreduce) &&
                  GRADSYNC_COLLECTIVE_BROADCAST == static_cast<int>(gradsync::comm::Collective::Broadcast) &&
                  GRADSYNC_COLLECTIVE_ALLGATHER == static_cast<int>(gradsync::comm::Collective::Allgather) &&
                  GRADSYNC_COLLECTIVE_REDUCE_SCATTER == static_cast<int>(gradsync::comm::Collective::ReduceScatter) &&
                  GRADSYNC_COLLECTIVE_BARRIER == static_cast<int>(gradsync::comm::Collective::Barrier) &&
                  GRADSYNC_COLLECTIVE_WEIGHTED_MEAN == static_cast<int>(gradsync::comm::Collective::WeightedMean) &&
                  GRADSYNC_COLLECTIVE_ALLTOALL == static_cast<int>(gradsync::comm::Collective::Alltoall),
              "gradsync_collective indexes the statistics by the internal Collective values");

GRADSYNC_API int gradsync_comm_stats(const gradsync_comm* comm, gradsync_comm_statistics* stats,
                                     gradsync_comm_peer_stats* peers, size_t capacity) {
  return guard(__func__, [&]() -> int {
    const CommLink& link = *check(comm)->link;
    GS_REQUIRE(stats != nullptr, GRADSYNC_E_INVALID_ARG, "stats is NULL");
    GS_REQUIRE(peers != nullptr || capacity == 0, GRADSYNC_E_INVALID_ARG, "peers is NULL for capacity {}", capacity);
    const size_t size = stats->struct_size;
    GS_REQUIRE(size >= sizeof(gradsync_comm_statistics) && size <= gradsync::capi::kMaxOptionsStructSize,
               GRADSYNC_E_INVALID_ARG,
               "stats.struct_size {} is not the size of any version of the struct (accepted: {} to {}); not "
               "initialised?",
               size, sizeof(gradsync_comm_statistics), gradsync::capi::kMaxOptionsStructSize);
    const gradsync::comm::StatsSnapshot snap = link.communicator().telemetry().stats();
    gradsync_comm_statistics out{};
    out.struct_size = static_cast<uint32_t>(size);
    out.version = GRADSYNC_COMM_STATISTICS_VERSION;
    out.rank = link.rank();
    out.size = link.size();
    out.straggler = snap.straggler;
    out.rounds = snap.rounds;
    for (size_t c = 0; c < GRADSYNC_COLLECTIVE_SLOTS; ++c) {
      const gradsync::comm::CollectiveTotals& t = snap.collectives[c];
      out.collective[c] = {t.calls, t.failed, t.bytes, t.wait_ns, t.move_ns};
    }
    // A newer caller's fields that this library does not know read as 0.
    std::memset(reinterpret_cast<char*>(stats) + sizeof(out), 0, size - sizeof(out));
    std::memcpy(stats, &out, sizeof(out));
    if (capacity == 0) return GRADSYNC_OK;
    const auto n = static_cast<size_t>(link.size());
    if (capacity < n) {
      return gradsync::capi::set_last_error(
          GRADSYNC_E_BUFS, __func__,
          fmt::format("peers holds {} entries; the group has {} ranks", capacity, n).c_str());
    }
    for (size_t r = 0; r < n; ++r) {
      const gradsync::comm::PeerLateness p = r < snap.peers.size() ? snap.peers[r] : gradsync::comm::PeerLateness{};
      peers[r] = {p.late_ns, p.max_late_ns, p.last};
    }
    return GRADSYNC_OK;
  });
}

GRADSYNC_API int gradsync_comm_timeline(gradsync_comm* comm, const char* path) {
  return run(__func__, comm, [&](const CommLink& l) -> Op {
    GS_REQUIRE(path == nullptr || *path != '\0', GRADSYNC_E_INVALID_ARG, "timeline path is empty (NULL stops it)");
    return [p = std::string(path == nullptr ? "" : path), rank = l.rank()](Communicator& c) {
      c.telemetry().open_timeline(p, rank);
    };
  });
}

GRADSYNC_API int gradsync_comm_alloc(gradsync_comm* comm, size_t bytes, void** ptr) {
  if (ptr != nullptr) *ptr = nullptr;
  return run(__func__, comm, [&](const CommLink&) -> Op {
    GS_REQUIRE(ptr != nullptr, GRADSYNC_E_INVALID_ARG, "ptr out-parameter is NULL");
    GS_REQUIRE(bytes > 0, GRADSYNC_E_INVALID_ARG, "bytes is 0");
    return [=](Communicator& c) { *ptr = c.alloc(bytes); };
  });
}

GRADSYNC_API int gradsync_comm_free_buffer(gradsync_comm* comm, void* ptr) {
  return run(__func__, comm, [&](const CommLink&) -> Op {
    return [=](Communicator& c) {
      if (ptr != nullptr) c.dealloc(ptr);
    };
  });
}

}  // extern "C"
