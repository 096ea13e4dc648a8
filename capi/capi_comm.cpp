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

#include "capi/comm_args.hpp"
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

namespace {
// A result struct the caller sizes (struct_size, version set): as the statistics, any size from
// this version's up to a newer header's is taken, and bytes past this version's fields read as 0.
template <typename Result>
void require_result(const Result* result, const char* type, const char* version_macro) {
  if (result == nullptr) return;
  GS_REQUIRE(result->struct_size >= sizeof(Result) && result->struct_size <= gradsync::capi::kMaxOptionsStructSize &&
                 result->version >= 1,
             GRADSYNC_E_INVALID_ARG,
             "result: struct_size {} / version {}: set them to sizeof({}) and {} (a struct_size of {} to {} is "
             "taken); not initialised?",
             result->struct_size, result->version, type, version_macro, sizeof(Result),
             gradsync::capi::kMaxOptionsStructSize);
}

template <typename Result>
void write_result(Result* result, Result out) {
  const size_t size = result->struct_size;
  out.struct_size = static_cast<uint32_t>(size);
  std::memset(reinterpret_cast<char*>(result) + sizeof(out), 0, size - sizeof(out));
  std::memcpy(result, &out, sizeof(out));
}

using gradsync::DType;
using gradsync::capi::check;
using gradsync::capi::check_kind;
using gradsync::capi::CommLink;
using gradsync::capi::guard;
using gradsync::capi::Outcome;
using gradsync::comm::Communicator;
// The argument checks (capi/comm_args.hpp).
using gradsync::capi::extent_of;
using gradsync::capi::given_counts;
using gradsync::capi::given_parts;
using gradsync::capi::part_of;
using gradsync::capi::per_rank;
using gradsync::capi::RankParts;
using gradsync::capi::reducible;
using gradsync::capi::require_aligned;
using gradsync::capi::require_buffer;
using gradsync::capi::require_disjoint;
using gradsync::capi::require_exchange_buffers;
using gradsync::capi::rule_parts;

constexpr size_t kOptionsV1Size = offsetof(gradsync_comm_options, name) + GRADSYNC_COMM_NAME_MAX;

gradsync_comm_options default_options() {
  gradsync_comm_options o = GRADSYNC_COMM_OPTIONS_INIT;
  return o;
}

// Copies what the caller's version of the struct has; later fields keep their defaults.
// join: over MPI too the name is needed (the join name; a group over MPI is MPI's and has none).
gradsync::comm::Options parse_options(const gradsync_comm_options* user, bool join = false) {
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
    out.rank = o.rank;
    out.size = o.size;
  }
  // Threads as ranks: over MPI, threads set (1 too: a process of one thread among processes of
  // more); elsewhere 1 is the only value, and means what the transport does anyway.
  const bool threaded = o.threads != GRADSYNC_UNSET_I32 && (over_mpi || o.threads != 1);
  // Over MPI the name only matters to a join, and to threads as ranks, whose threads of one
  // process meet by it.
  if (needs_rank || join || (threaded && o.name[0] != '\0')) {
    const size_t name_len = strnlen(o.name, GRADSYNC_COMM_NAME_MAX);
    GS_REQUIRE(name_len < GRADSYNC_COMM_NAME_MAX, GRADSYNC_E_INVALID_ARG,
               "group name is not NUL-terminated within {} bytes", GRADSYNC_COMM_NAME_MAX);
    GS_REQUIRE(name_len > 0, GRADSYNC_E_INVALID_ARG, "group name is empty");
    out.name.assign(o.name, name_len);
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
  if (threaded) {
    GS_REQUIRE(over_mpi, GRADSYNC_E_INVALID_ARG,
               "threads is for the MPI and hierarchical transports (on the {} transport every thread or process "
               "is a rank of its own: set rank and size)",
               gradsync::comm::transport_name(out.transport));
    GS_REQUIRE(o.threads >= 1 && o.threads <= 256, GRADSYNC_E_INVALID_ARG, "threads must be in [1, 256], got {}",
               o.threads);
    GS_REQUIRE(o.thread != GRADSYNC_UNSET_I32, GRADSYNC_E_INVALID_ARG,
               "thread is not set: with threads = {} each thread passes its index", o.threads);
    GS_REQUIRE(o.thread >= 0 && o.thread < o.threads, GRADSYNC_E_OUT_OF_RANGE, "thread {} out of range [0, {})",
               o.thread, o.threads);
    out.threads = o.threads;
    out.thread = o.thread;
  } else {
    GS_REQUIRE(o.thread == GRADSYNC_UNSET_I32 || o.thread == 0, GRADSYNC_E_OUT_OF_RANGE,
               "thread {} out of range [0, 1) (threads is {})", o.thread, o.threads == 1 ? "1" : "unset");
  }
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
    require_result(result, "gradsync_shrink_result", "GRADSYNC_SHRINK_RESULT_VERSION");
    gradsync::comm::ShrinkResult shrunk;
    CommLink::run_in_order(link, __func__, [&] { shrunk = link->communicator().shrink(); });
    if (failed != nullptr) std::copy(shrunk.failed.begin(), shrunk.failed.end(), failed);
    if (result != nullptr) {
      gradsync_shrink_result r{};
      r.version = GRADSYNC_SHRINK_RESULT_VERSION;
      r.failed_count = static_cast<int32_t>(shrunk.failed.size());
      r.attempts = shrunk.attempts;
      r.agree_ns = shrunk.agree.count();
      r.form_ns = shrunk.form.count();
      write_result(result, r);
    }
    std::string description = fmt::format("shrunk group of {}", link->description());
    *out = new gradsync_comm(std::make_shared<CommLink>(std::move(shrunk.comm), std::move(description)));
  });
}

namespace {
void require_grow_result(const gradsync_grow_result* result) {
  require_result(result, "gradsync_grow_result", "GRADSYNC_GROW_RESULT_VERSION");
}

gradsync_comm* grown_handle(gradsync::comm::GrowResult& grown, gradsync_grow_result* result, std::string description) {
  if (result != nullptr) {
    gradsync_grow_result r{};
    r.version = GRADSYNC_GROW_RESULT_VERSION;
    r.old_size = grown.old_size;
    r.new_size = grown.new_size;
    r.first_member_id = grown.first_member_id;
    r.agree_ns = grown.agree.count();
    r.form_ns = grown.form.count();
    write_result(result, r);
  }
  return new gradsync_comm(std::make_shared<CommLink>(std::move(grown.comm), std::move(description)));
}
}  // namespace

GRADSYNC_API int gradsync_comm_grow(gradsync_comm* comm, const char* join_name, int32_t joiners, gradsync_comm** out,
                                    gradsync_grow_result* result) {
  if (out != nullptr) *out = nullptr;
  return guard(__func__, [&] {
    GS_REQUIRE(out != nullptr, GRADSYNC_E_INVALID_ARG, "out-parameter is NULL");
    const std::shared_ptr<CommLink>& link = check(comm)->link;
    GS_REQUIRE(join_name != nullptr, GRADSYNC_E_INVALID_ARG, "join_name is NULL");
    const size_t name_len = strnlen(join_name, GRADSYNC_COMM_NAME_MAX);
    GS_REQUIRE(name_len > 0 && name_len < GRADSYNC_COMM_NAME_MAX, GRADSYNC_E_INVALID_ARG,
               "join_name is empty or not NUL-terminated within {} bytes", GRADSYNC_COMM_NAME_MAX);
    require_grow_result(result);
    gradsync::comm::GrowResult grown;
    const std::string name(join_name, name_len);
    CommLink::run_in_order(link, __func__, [&] { grown = link->communicator().grow(name, joiners); });
    *out = grown_handle(grown, result, fmt::format("grown group '{}' of {}", name, link->description()));
  });
}

GRADSYNC_API int gradsync_comm_join(gradsync_comm** out, const gradsync_comm_options* opts,
                                    gradsync_grow_result* result) {
  return gradsync::capi::create(__func__, out, [&] {
    const auto options = parse_options(opts, true);
    require_grow_result(result);
    gradsync::comm::GrowResult grown = gradsync::comm::join(options);
    std::string description = describe(options, *grown.comm);
    return grown_handle(grown, result, fmt::format("joined {}", description));
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
