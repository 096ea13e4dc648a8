// SPDX-License-Identifier: Apache-2.0
// C shims of the communicator (include/gradsync/comm.h) over gradsync::comm::Communicator.
#include <cstring>
#include <limits>
#include <vector>

#include "capi/comm_handle.hpp"
#include "capi/guard.hpp"
#include "capi/options.hpp"
#include "comm/communicator.hpp"
#include "gradsync/comm.h"


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
      transport_(impl_->transport()) {}

CommLink::Call::Call(std::shared_ptr<CommLink> link, const char* function) : link_(std::move(link)) {
  CommLink& l = *link_;
  if ((l.state_.load() & kClosed) != 0) l.fail_closed();
  const char* holder = nullptr;
  if (!l.holder_.compare_exchange_strong(holder, function)) {
    if (l.held_by_this_thread()) {
      fail(GRADSYNC_E_MISUSE,
           "{} is already in a call on this thread ({}): a log callback must not call back into gradsync",
           l.description_, holder);
    }
    fail(GRADSYNC_E_MISUSE,
         "{} is already in a call on another thread ({}); a handle must not be used by two threads at once",
         l.description_, holder);
  }
  if (!l.acquire()) {
    l.holder_.store(nullptr);
    l.fail_closed();
  }
  inside_ = Inside{&l, static_cast<const Inside*>(t_inside)};
  t_inside = &inside_;
}

CommLink::Call::~Call() {
  t_inside = inside_.outer;
  link_->holder_.store(nullptr);
  link_->release();
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
  const uint32_t before = state_.fetch_or(kClosed);
  if ((before & kClosed) != 0) {
    GS_LOG_ERROR("gradsync_comm_free: {} is already being freed by another thread; this free does nothing",
                 description_);
    return false;
  }
  if (held_by_this_thread()) {
    impl_->abort();
    GS_LOG_ERROR("gradsync_comm_free: {} was freed from inside a call on it on the same thread (a log callback "
                 "must not call back into gradsync): that call is aborted and the communicator is not released",
                 description_);
    return false;
  }
  // A call counted before the closed bit has taken holder_ already, so it is seen here.
  if (const char* holder = holder_.load(); holder != nullptr) {
    GS_LOG_WARN("gradsync_comm_free: {} is in a call on another thread ({}): aborting it and waiting for it to return",
                description_, holder);
    impl_->abort();
  }
  for (uint32_t state = state_.load(); state != kClosed; state = state_.load()) state_.wait(state);
  impl_.reset();
  return true;
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

void CommLink::release() noexcept {
  if ((state_.fetch_sub(kUser) & kClosed) != 0) state_.notify_all();
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
using gradsync::capi::CommLink;
using gradsync::capi::guard;
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
  GS_REQUIRE(o.transport >= 0 && o.transport <= 2, GRADSYNC_E_INVALID_ARG, "unknown transport {}", o.transport);
  out.transport = static_cast<gradsync::comm::Transport>(o.transport);
  const bool needs_rank = out.transport != gradsync::comm::Transport::Mpi;
  if (needs_rank) {
    GS_REQUIRE(o.size != GRADSYNC_UNSET_I32, GRADSYNC_E_INVALID_ARG, "size is not set");
    GS_REQUIRE(o.size >= 1, GRADSYNC_E_INVALID_ARG, "size must be at least 1, got {}", o.size);
    GS_REQUIRE(o.rank != GRADSYNC_UNSET_I32, GRADSYNC_E_INVALID_ARG, "rank is not set");
    GS_REQUIRE(o.rank >= 0 && o.rank < o.size, GRADSYNC_E_OUT_OF_RANGE, "rank {} out of range [0, {})", o.rank,
               o.size);
    const size_t name_len = strnlen(o.name, GRADSYNC_COMM_NAME_MAX);
    GS_REQUIRE(name_len < GRADSYNC_COMM_NAME_MAX, GRADSYNC_E_INVALID_ARG, "group name is not NUL-terminated within {} bytes",
               GRADSYNC_COMM_NAME_MAX);
    GS_REQUIRE(name_len > 0, GRADSYNC_E_INVALID_ARG, "group name is empty");
    out.name.assign(o.name, name_len);
    out.rank = o.rank;
    out.size = o.size;
  }
  out.deterministic = o.deterministic == GRADSYNC_UNSET_I32 ? out.transport != gradsync::comm::Transport::Mpi
                                                            : o.deterministic != 0;
  out.check_mismatch = o.check_mismatch == GRADSYNC_UNSET_I32 ? true : o.check_mismatch != 0;
  if (o.timeout_ms != GRADSYNC_UNSET_I64) {
    GS_REQUIRE(o.timeout_ms > 0, GRADSYNC_E_INVALID_ARG, "timeout_ms must be > 0, got {}", o.timeout_ms);
    out.timeout = std::chrono::milliseconds(o.timeout_ms);
  }
  out.mpi_fcomm = o.mpi_fcomm;
  return out;
}

// "communicator 'train' (thread transport, rank 0 of 2)": how messages about a handle name it.
std::string describe(const gradsync::comm::Options& options, const Communicator& c) {
  const char* transport = gradsync::comm::transport_name(c.transport());
  if (c.transport() == gradsync::comm::Transport::Mpi) {
    return fmt::format("communicator ({} transport, rank {} of {})", transport, c.rank(), c.size());
  }
  return fmt::format("communicator '{}' ({} transport, rank {} of {})", options.name, transport, c.rank(), c.size());
}

// The body of an entry point that runs the communicator: it holds the handle's in-call word, so
// a second thread calling at the same time gets GRADSYNC_E_MISUSE (see capi/comm_handle.hpp).
template <class F>
int with_comm(const char* function, gradsync_comm* comm, F&& body) noexcept {
  return guard(function, [&] {
    const CommLink::Call call(check(comm)->link, function);
    body(call.comm());
  });
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
    std::string description = describe(options, *impl);
    return new gradsync_comm(std::make_shared<CommLink>(std::move(impl), std::move(description)));
  });
}

GRADSYNC_API void gradsync_comm_free(gradsync_comm* comm) {
  if (comm == nullptr) return;
  try {
    check(comm);
  } catch (const gradsync::Error& e) {
    GS_LOG_ERROR("gradsync_comm_free: {}", e.what());
    return;
  }
  if (comm->link->close()) delete comm;
}

GRADSYNC_API int gradsync_comm_abort(gradsync_comm* comm) {
  return guard(__func__, [&] { CommLink::abort(check(comm)->link); });
}

GRADSYNC_API int gradsync_comm_set_interrupt(gradsync_comm* comm, gradsync_interrupt_fn fn, void* user_data) {
  return with_comm(__func__, comm, [&](Communicator& c) { c.set_interrupt({fn, user_data}); });
}

GRADSYNC_API int gradsync_comm_reset(gradsync_comm* comm) {
  return with_comm(__func__, comm, [&](Communicator& c) { c.reset(); });
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

GRADSYNC_API int gradsync_comm_allreduce(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                         int32_t dtype, int32_t op) {
  return with_comm(__func__, comm, [&](Communicator& c) {
    const DType t = gradsync::to_dtype(dtype);
    const auto o = gradsync::to_op(op);
    require_buffer(send, count, t, "send");
    require_buffer(recv, count, t, "recv");
    require_aligned(send, t, "send");
    require_aligned(recv, t, "recv");
    require_disjoint(send, count, "send", recv, count, "recv", t, recv);
    const gradsync::comm::BufferRef buffer{send, recv, count};
    c.allreduce(std::span<const gradsync::comm::BufferRef>(&buffer, 1), t, o);
  });
}

GRADSYNC_API int gradsync_comm_allreduce_many(gradsync_comm* comm, const void* const* sends, void* const* recvs,
                                              const size_t* counts, size_t nbufs, int32_t dtype, int32_t op) {
  return with_comm(__func__, comm, [&](Communicator& c) {
    const DType t = gradsync::to_dtype(dtype);
    const auto o = gradsync::to_op(op);
    GS_REQUIRE(nbufs <= GRADSYNC_MAX_FUSED_BUFFERS, GRADSYNC_E_INVALID_ARG,
               "{} buffers exceed GRADSYNC_MAX_FUSED_BUFFERS ({})", nbufs, GRADSYNC_MAX_FUSED_BUFFERS);
    GS_REQUIRE(nbufs == 0 || (recvs != nullptr && counts != nullptr), GRADSYNC_E_INVALID_ARG,
               "recvs or counts is NULL for {} buffers", nbufs);
    std::vector<gradsync::comm::BufferRef> buffers(nbufs);
    for (size_t i = 0; i < nbufs; ++i) {
      const void* send = sends != nullptr ? sends[i] : recvs[i];
      require_buffer(send, counts[i], t, "send");
      require_buffer(recvs[i], counts[i], t, "recv");
      require_aligned(send, t, "send");
      require_aligned(recvs[i], t, "recv");
      require_disjoint(send, counts[i], "send", recvs[i], counts[i], "recv", t, recvs[i]);
      buffers[i] = {send, recvs[i], counts[i]};
    }
    c.allreduce(buffers, t, o);
  });
}

GRADSYNC_API int gradsync_comm_weighted_mean(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                             int32_t dtype, uint64_t weight, uint64_t* total_weight) {
  return with_comm(__func__, comm, [&](Communicator& c) {
    const DType t = gradsync::to_dtype(dtype);
    require_buffer(send, count, t, "send");
    require_buffer(recv, count, t, "recv");
    require_aligned(send, t, "send");
    require_aligned(recv, t, "recv");
    require_disjoint(send, count, "send", recv, count, "recv", t, recv);
    c.weighted_mean(send, recv, count, t, weight, total_weight);
  });
}

GRADSYNC_API int gradsync_comm_broadcast(gradsync_comm* comm, void* buf, size_t count, int32_t dtype, int32_t root) {
  return with_comm(__func__, comm, [&](Communicator& c) {
    const DType t = gradsync::to_dtype(dtype);
    require_buffer(buf, count, t, "broadcast");
    // The root is checked inside the round, so a root that one rank gets wrong fails every rank.
    c.broadcast(buf, count, t, root);
  });
}

GRADSYNC_API int gradsync_comm_allgather(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                         int32_t dtype) {
  return with_comm(__func__, comm, [&](Communicator& c) {
    const DType t = gradsync::to_dtype(dtype);
    require_buffer(recv, total_count, t, "recv");
    if (send != nullptr) {
      const gradsync::Part mine = c.my_part(total_count);
      require_buffer(send, mine.len, t, "send");
      // in place: this rank's part already at its offset in recv
      const void* own = recv == nullptr ? nullptr : static_cast<const char*>(recv) + mine.start * gradsync::dtype_size(t);
      require_disjoint(send, mine.len, "send", recv, total_count, "recv", t, own);
    }
    c.allgather(send, recv, total_count, t);
  });
}

GRADSYNC_API int gradsync_comm_reduce_scatter(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                              int32_t dtype, int32_t op) {
  return with_comm(__func__, comm, [&](Communicator& c) {
    const DType t = gradsync::to_dtype(dtype);
    const auto o = gradsync::to_op(op);
    const gradsync::Part mine = c.my_part(total_count);
    require_buffer(send, total_count, t, "send");
    require_buffer(recv, mine.len, t, "recv");
    require_aligned(send, t, "send");
    require_aligned(recv, t, "recv");
    // in place: recv at this rank's offset in send
    const void* own = send == nullptr ? nullptr : static_cast<const char*>(send) + mine.start * gradsync::dtype_size(t);
    require_disjoint(recv, mine.len, "recv", send, total_count, "send", t, own);
    c.reduce_scatter(send, recv, total_count, t, o);
  });
}

GRADSYNC_API int gradsync_comm_alltoall(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                        int32_t dtype) {
  return with_comm(__func__, comm, [&](Communicator& c) {
    const DType t = gradsync::to_dtype(dtype);
    const size_t recv_count = c.my_part(total_count).len * static_cast<size_t>(c.size());
    require_buffer(send, total_count, t, "send");
    require_buffer(recv, recv_count, t, "recv");
    const auto s = reinterpret_cast<uintptr_t>(send), r = reinterpret_cast<uintptr_t>(recv);
    const size_t es = gradsync::dtype_size(t);
    GS_REQUIRE(total_count == 0 || recv_count == 0 || s + total_count * es <= r || r + recv_count * es <= s,
               GRADSYNC_E_INVALID_ARG, "send [{}, +{} elements) overlaps recv [{}, +{} elements)", send, total_count,
               static_cast<const void*>(recv), recv_count);
    c.alltoall(send, recv, total_count, t);
  });
}

GRADSYNC_API int gradsync_comm_barrier(gradsync_comm* comm) {
  return with_comm(__func__, comm, [&](Communicator& c) { c.barrier(); });
}

GRADSYNC_API int gradsync_comm_alloc(gradsync_comm* comm, size_t bytes, void** ptr) {
  if (ptr != nullptr) *ptr = nullptr;
  return with_comm(__func__, comm, [&](Communicator& c) {
    GS_REQUIRE(ptr != nullptr, GRADSYNC_E_INVALID_ARG, "ptr out-parameter is NULL");
    GS_REQUIRE(bytes > 0, GRADSYNC_E_INVALID_ARG, "bytes is 0");
    *ptr = c.alloc(bytes);
  });
}

GRADSYNC_API int gradsync_comm_free_buffer(gradsync_comm* comm, void* ptr) {
  return with_comm(__func__, comm, [&](Communicator& c) {
    if (ptr != nullptr) c.dealloc(ptr);
  });
}

}  // extern "C"
