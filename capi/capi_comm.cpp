// C shims of the communicator (include/gradsync/comm.h) over gradsync::comm::Communicator.
#include <cstring>
#include <limits>
#include <vector>

#include "capi/comm_handle.hpp"
#include "capi/guard.hpp"
#include "capi/options.hpp"
#include "comm/communicator.hpp"
#include "gradsync/comm.h"


namespace {
using gradsync::DType;
using gradsync::capi::check;
using gradsync::capi::guard;

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

// A buffer of count elements must exist and its byte size must fit in size_t (huge counts are errors).
void require_buffer(const void* p, size_t count, DType dtype, const char* what) {
  GS_REQUIRE(count <= std::numeric_limits<size_t>::max() / 8 / gradsync::dtype_size(dtype), GRADSYNC_E_INVALID_ARG,
             "{} count {} is too large", what, count);
  GS_REQUIRE(p != nullptr || count == 0, GRADSYNC_E_INVALID_ARG, "{} buffer is NULL for count {}", what, count);
}

}  // namespace

extern "C" {

GRADSYNC_API int gradsync_comm_options_init(gradsync_comm_options* opts, size_t struct_size) {
  return guard(__func__,
               [&] { gradsync::capi::init_options(opts, struct_size, default_options(), kOptionsV1Size, "options"); });
}

GRADSYNC_API int gradsync_comm_create(gradsync_comm** out, const gradsync_comm_options* opts) {
  return gradsync::capi::create(__func__, out, [&] {
    auto impl = gradsync::comm::create(parse_options(opts));
    return new gradsync_comm(std::move(impl));
  });
}

GRADSYNC_API void gradsync_comm_free(gradsync_comm* comm) { gradsync::capi::destroy(comm); }

GRADSYNC_API int gradsync_comm_abort(gradsync_comm* comm) {
  return guard(__func__, [&] { check(comm)->impl->abort(); });
}

GRADSYNC_API int gradsync_comm_reset(gradsync_comm* comm) {
  return guard(__func__, [&] { check(comm)->impl->reset(); });
}

GRADSYNC_API int gradsync_comm_rank(const gradsync_comm* comm, int32_t* rank) {
  return guard(__func__, [&] {
    GS_REQUIRE(rank != nullptr, GRADSYNC_E_INVALID_ARG, "rank out-parameter is NULL");
    *rank = check(comm)->impl->rank();
  });
}

GRADSYNC_API int gradsync_comm_size(const gradsync_comm* comm, int32_t* size) {
  return guard(__func__, [&] {
    GS_REQUIRE(size != nullptr, GRADSYNC_E_INVALID_ARG, "size out-parameter is NULL");
    *size = check(comm)->impl->size();
  });
}

GRADSYNC_API int gradsync_comm_transport(const gradsync_comm* comm, int32_t* transport) {
  return guard(__func__, [&] {
    GS_REQUIRE(transport != nullptr, GRADSYNC_E_INVALID_ARG, "transport out-parameter is NULL");
    *transport = static_cast<int32_t>(check(comm)->impl->transport());
  });
}

GRADSYNC_API int gradsync_comm_allreduce(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                         int32_t dtype, int32_t op) {
  return guard(__func__, [&] {
    auto* c = check(comm);
    const DType t = gradsync::to_dtype(dtype);
    const auto o = gradsync::to_op(op);
    require_buffer(send, count, t, "send");
    require_buffer(recv, count, t, "recv");
    const gradsync::comm::BufferRef buffer{send, recv, count};
    c->impl->allreduce(std::span<const gradsync::comm::BufferRef>(&buffer, 1), t, o);
  });
}

GRADSYNC_API int gradsync_comm_allreduce_many(gradsync_comm* comm, const void* const* sends, void* const* recvs,
                                              const size_t* counts, size_t nbufs, int32_t dtype, int32_t op) {
  return guard(__func__, [&] {
    auto* c = check(comm);
    const DType t = gradsync::to_dtype(dtype);
    const auto o = gradsync::to_op(op);
    GS_REQUIRE(nbufs == 0 || (recvs != nullptr && counts != nullptr), GRADSYNC_E_INVALID_ARG,
               "recvs or counts is NULL for {} buffers", nbufs);
    std::vector<gradsync::comm::BufferRef> buffers(nbufs);
    for (size_t i = 0; i < nbufs; ++i) {
      const void* send = sends != nullptr ? sends[i] : recvs[i];
      require_buffer(send, counts[i], t, "send");
      require_buffer(recvs[i], counts[i], t, "recv");
      buffers[i] = {send, recvs[i], counts[i]};
    }
    c->impl->allreduce(buffers, t, o);
  });
}

GRADSYNC_API int gradsync_comm_weighted_mean(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                             int32_t dtype, uint64_t weight, uint64_t* total_weight) {
  return guard(__func__, [&] {
    auto* c = check(comm);
    const DType t = gradsync::to_dtype(dtype);
    require_buffer(send, count, t, "send");
    require_buffer(recv, count, t, "recv");
    c->impl->weighted_mean(send, recv, count, t, weight, total_weight);
  });
}

GRADSYNC_API int gradsync_comm_broadcast(gradsync_comm* comm, void* buf, size_t count, int32_t dtype, int32_t root) {
  return guard(__func__, [&] {
    auto* c = check(comm);
    const DType t = gradsync::to_dtype(dtype);
    require_buffer(buf, count, t, "broadcast");
    // The root is checked inside the round, so a root that one rank gets wrong fails every rank.
    c->impl->broadcast(buf, count, t, root);
  });
}

GRADSYNC_API int gradsync_comm_allgather(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                         int32_t dtype) {
  return guard(__func__, [&] {
    auto* c = check(comm);
    const DType t = gradsync::to_dtype(dtype);
    require_buffer(recv, total_count, t, "recv");
    if (send != nullptr) require_buffer(send, c->impl->my_part(total_count).len, t, "send");
    c->impl->allgather(send, recv, total_count, t);
  });
}

GRADSYNC_API int gradsync_comm_reduce_scatter(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                              int32_t dtype, int32_t op) {
  return guard(__func__, [&] {
    auto* c = check(comm);
    const DType t = gradsync::to_dtype(dtype);
    const auto o = gradsync::to_op(op);
    require_buffer(send, total_count, t, "send");
    require_buffer(recv, c->impl->my_part(total_count).len, t, "recv");
    c->impl->reduce_scatter(send, recv, total_count, t, o);
  });
}

GRADSYNC_API int gradsync_comm_alltoall(gradsync_comm* comm, const void* send, void* recv, size_t total_count,
                                        int32_t dtype) {
  return guard(__func__, [&] {
    auto* c = check(comm);
    const DType t = gradsync::to_dtype(dtype);
    const size_t recv_count = c->impl->my_part(total_count).len * static_cast<size_t>(c->impl->size());
    require_buffer(send, total_count, t, "send");
    require_buffer(recv, recv_count, t, "recv");
    const auto s = reinterpret_cast<uintptr_t>(send), r = reinterpret_cast<uintptr_t>(recv);
    const size_t es = gradsync::dtype_size(t);
    GS_REQUIRE(total_count == 0 || recv_count == 0 || s + total_count * es <= r || r + recv_count * es <= s,
               GRADSYNC_E_INVALID_ARG, "send [{}, +{} elements) overlaps recv [{}, +{} elements)", send, total_count,
               static_cast<const void*>(recv), recv_count);
    c->impl->alltoall(send, recv, total_count, t);
  });
}

GRADSYNC_API int gradsync_comm_barrier(gradsync_comm* comm) {
  return guard(__func__, [&] { check(comm)->impl->barrier(); });
}

GRADSYNC_API int gradsync_comm_alloc(gradsync_comm* comm, size_t bytes, void** ptr) {
  if (ptr != nullptr) *ptr = nullptr;
  return guard(__func__, [&] {
    auto* c = check(comm);
    GS_REQUIRE(ptr != nullptr, GRADSYNC_E_INVALID_ARG, "ptr out-parameter is NULL");
    GS_REQUIRE(bytes > 0, GRADSYNC_E_INVALID_ARG, "bytes is 0");
    *ptr = c->impl->alloc(bytes);
  });
}

GRADSYNC_API int gradsync_comm_free_buffer(gradsync_comm* comm, void* ptr) {
  return guard(__func__, [&] {
    auto* c = check(comm);
    if (ptr != nullptr) c->impl->dealloc(ptr);
  });
}

}  // extern "C"
