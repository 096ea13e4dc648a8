// SPDX-License-Identifier: Apache-2.0
// The MPI transport's collectives: what each moves once its round has begun (arrive, in
// mpi_communicator.cpp). The small path's data came with the exchange; the rest goes through MPI's
// blocking collectives, or pairwise in pieces where a count does not fit MPI's int, and the
// deterministic mode folds every rank's copy in rank order with the shared kernels.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "comm/call_signature.hpp"
#include "comm/reduce.hpp"
#include "comm/transport/mpi/mpi_internal.hpp"
#include "common/error.hpp"
#include "common/partition.hpp"

namespace gradsync::comm::mpi {
namespace {

constexpr int kPairwiseTag = 7002;

// Fused allreduce packs small buffers into a staging buffer of this many bytes and reduces it in
// one MPI call per fill: small enough that a fill is still in cache when it is copied back out,
// large enough that the per-call latency is amortised over dozens of buffers. Buffers at least
// this large gain nothing from packing and go to MPI straight from the caller.
constexpr size_t kStagingBytes = size_t{256} << 10;
// Deterministic mode reduces in windows of this many bytes (its scratch memory is bounded by it).
constexpr size_t kWindowBytes = size_t{16} << 20;
// From this many bytes a group of two reduces in rank order by swapping whole copies, where the
// halves of the gather and share cost more (np 2 on one host, deterministic / raw MPI's time, 3 runs
// of mpi_bench each way: 1M floats 1.16-1.22x against 1.31-1.43x, 256K 1.16x against 1.21-1.26x;
// at 64K the halves win, 1.01-1.15x against 1.19-1.25x: each rank folds half the buffer).
constexpr size_t kSwapBytes = size_t{1} << 20;

MPI_Datatype mpi_type(DType t) noexcept {
  switch (t) {
    case DType::F32: return mpi::lib().float_;
    case DType::F64: return mpi::lib().double_;
    case DType::I32: return mpi::lib().int32;
    case DType::I64: return mpi::lib().int64;
    case DType::BF16:
    case DType::F16: return mpi::lib().uint16;  // moved, never reduced by MPI
  }
  return mpi::lib().byte;
}

MPI_Op mpi_op(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Mean: return mpi::lib().sum;
    case ReduceOp::Min: return mpi::lib().min;
    case ReduceOp::Max: return mpi::lib().max;
  }
  return mpi::lib().sum;
}

// Mean after an MPI_SUM: the same finish as the rank-order kernels (float: v / n; integer: the
// wrapped sum, truncated toward zero).
template <class T>
void divide(void* buf, size_t count, int n) noexcept {
  T* p = static_cast<T*>(buf);
  for (size_t i = 0; i < count; ++i) p[i] = static_cast<T>(p[i] / static_cast<T>(n));
}

void finish_mean(DType t, void* buf, size_t count, int n) noexcept {
  switch (t) {
    case DType::F32: return divide<float>(buf, count, n);
    case DType::F64: return divide<double>(buf, count, n);
    case DType::I32: return divide<int32_t>(buf, count, n);
    case DType::I64: return divide<int64_t>(buf, count, n);
    default: return;
  }
}

std::byte* at(void* p, size_t elements, size_t elem) noexcept { return static_cast<std::byte*>(p) + elements * elem; }
const std::byte* at(const void* p, size_t elements, size_t elem) noexcept {
  return static_cast<const std::byte*>(p) + elements * elem;
}

}  // namespace

bool MpiCommunicator::deterministic_for(DType dtype, ReduceOp op) const noexcept {
  // i32 mean sums in 64 bits (as the shared kernels do) so it never wraps, and half precision
  // accumulates in f32: MPI can do neither.
  return options_.deterministic || (dtype == DType::I32 && op == ReduceOp::Mean) || dtype == DType::BF16 ||
         dtype == DType::F16;
}

std::byte* MpiCommunicator::scratch(size_t bytes) {
  // Never null, so that offsets into an empty scratch stay defined.
  if (scratch_.size() < std::max<size_t>(bytes, 64)) scratch_.resize(std::max<size_t>(bytes, 64));
  return scratch_.data();
}

void MpiCommunicator::allreduce_one(const void* send, void* recv, size_t count, DType dtype, ReduceOp op, bool det) {
  if (count == 0) return;
  if (det) return rank_order_allreduce(send, recv, count, dtype, op);
  const size_t elem = dtype_size(dtype);
  for (size_t lo = 0; lo < count; lo += max_count_) {
    const int n = static_cast<int>(std::min(max_count_, count - lo));
    const void* from = send == recv ? MPI_IN_PLACE : at(send, lo, elem);
    check(mpi::lib().Allreduce(from, at(recv, lo, elem), n, mpi_type(dtype), mpi_op(op), comm_), "MPI_Allreduce");
  }
  if (op == ReduceOp::Mean) finish_mean(dtype, recv, count, size_);
}

// Reduce-scatter by gathering, window by window (bounded memory): each rank receives every rank's
// copy of its slice of the window (MPI_Alltoallv), folds them in rank order with the shared
// kernels, and the slices are shared again (MPI_Allgatherv in place). Two ranks with at least
// kSwapBytes each swap their copies instead and both fold rank 0's then rank 1's: the same bits in
// one exchange, the traffic of MPI's own allreduce of two (hier's cross-host level of two hosts
// does the same).
void MpiCommunicator::rank_order_allreduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  const size_t elem = dtype_size(dtype);
  if (size_ == 2 && count * elem >= kSwapBytes) return swap_fold(send, recv, count, dtype, op);
  const size_t window = std::max<size_t>(kWindowBytes / elem, static_cast<size_t>(size_));
  const auto n = static_cast<size_t>(size_);
  std::vector<int> send_counts(n), send_displs(n), recv_counts(n), recv_displs(n);
  std::vector<const void*> sources(n);
  for (size_t lo = 0; lo < count; lo += window) {
    const size_t m = std::min(window, count - lo);
    const Part mine = partition(m, n, static_cast<uint64_t>(rank_));
    for (size_t r = 0; r < n; ++r) {
      const Part p = partition(m, n, r);
      send_counts[r] = static_cast<int>(p.len);
      send_displs[r] = static_cast<int>(p.start);
      recv_counts[r] = static_cast<int>(mine.len);
      recv_displs[r] = static_cast<int>(r * mine.len);
    }
    std::byte* copies = scratch(n * mine.len * elem);
    check(mpi::lib().Alltoallv(at(send, lo, elem), send_counts.data(), send_displs.data(), mpi_type(dtype), copies,
                               recv_counts.data(), recv_displs.data(), mpi_type(dtype), comm_),
          "MPI_Alltoallv");
    for (size_t r = 0; r < n; ++r) sources[r] = copies + r * mine.len * elem;
    reduce(dtype, op, sources.data(), n, at(recv, lo + mine.start, elem), 0, mine.len);
    check(mpi::lib().Allgatherv(MPI_IN_PLACE, 0, mpi_type(dtype), at(recv, lo, elem), send_counts.data(),
                                send_displs.data(), mpi_type(dtype), comm_),
          "MPI_Allgatherv");
  }
}

void MpiCommunicator::swap_fold(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  const mpi::Api& m = mpi::lib();
  const size_t elem = dtype_size(dtype);
  const size_t window = std::min(std::max<size_t>(kWindowBytes / elem, 1), max_count_);
  const int other = 1 - rank_;
  for (size_t lo = 0; lo < count; lo += window) {
    const size_t n = std::min(window, count - lo);
    std::byte* theirs = scratch(n * elem);
    MPI_Request requests[2] = {m.request_null, m.request_null};
    check(m.Irecv(theirs, static_cast<int>(n), mpi_type(dtype), other, kPairwiseTag, comm_, &requests[0]), "MPI_Irecv",
          other);
    check(m.Isend(at(send, lo, elem), static_cast<int>(n), mpi_type(dtype), other, kPairwiseTag, comm_, &requests[1]),
          "MPI_Isend", other);
    check(m.Waitall(2, requests, MPI_STATUSES_IGNORE), "MPI_Waitall");
    const std::byte* mine = at(send, lo, elem);
    const std::array<const void*, 2> sources =
        rank_ == 0 ? std::array<const void*, 2>{mine, theirs} : std::array<const void*, 2>{theirs, mine};
    reduce(dtype, op, sources.data(), sources.size(), at(recv, lo, elem), 0, n);
  }
}

// In step s a rank sends to rank + s and receives from rank - s, so each step is a set of disjoint
// pairs; pieces are non-blocking sends and receives of at most max_count_ elements, matched in
// order (MPI keeps the order of messages between two ranks on one tag), so the two sides need not
// cut their blocks the same way. Step 0 is the rank's own block, copied.
void MpiCommunicator::pairwise(DType dtype, const std::function<Block(int)>& block) {
  const size_t elem = dtype_size(dtype);
  std::vector<MPI_Request> requests;
  for (int s = 0; s < size_; ++s) {
    const int to = (rank_ + s) % size_, from = (rank_ - s + size_) % size_;
    if (s == 0) {
      const Block self = block(rank_);
      if (self.send_count > 0 && self.send != self.recv) std::memmove(self.recv, self.send, self.send_count * elem);
      continue;
    }
    const Block out = block(to), in = block(from);
    requests.clear();
    for (size_t lo = 0; lo < in.recv_count; lo += max_count_) {
      requests.emplace_back();
      check(mpi::lib().Irecv(const_cast<std::byte*>(at(in.recv, lo, elem)),
                             static_cast<int>(std::min(max_count_, in.recv_count - lo)), mpi_type(dtype), from,
                             kPairwiseTag, comm_, &requests.back()),
            "MPI_Irecv");
    }
    for (size_t lo = 0; lo < out.send_count; lo += max_count_) {
      requests.emplace_back();
      check(mpi::lib().Isend(at(out.send, lo, elem), static_cast<int>(std::min(max_count_, out.send_count - lo)),
                             mpi_type(dtype), to, kPairwiseTag, comm_, &requests.back()),
            "MPI_Isend");
    }
    check(mpi::lib().Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
  }
}

void MpiCommunicator::allreduce(std::span<const BufferRef> buffers, DType dtype, ReduceOp op) {
  telemetry_.measure(Collective::Allreduce, payload_bytes(buffers, dtype), [&] {
    const CallSignature call = allreduce_call(buffers, dtype, op);
    const size_t elem = dtype_size(dtype);
    arrive(call, Payload{buffers, elem});
    if (packed_) {
      // Every rank's data came with the exchange: folded here in rank order, the same on every rank.
      const auto n = static_cast<size_t>(size_);
      sources_.resize(n);
      size_t at_byte = 0;
      for (const BufferRef& b : buffers) {
        for (size_t r = 0; r < n; ++r) sources_[r] = exchange_->data(static_cast<int>(r)) + at_byte;
        reduce(dtype, op, sources_.data(), n, b.recv, 0, b.count);
        at_byte += b.count * elem;
      }
      return;
    }
    if (size_ == 1) {
      for (const BufferRef& b : buffers) copy(dtype, b.send, b.recv, 0, b.count);
      return;
    }
    const InTransfer transfer(*this);
    const bool det = deterministic_for(dtype, op);
    if (buffers.size() == 1) return allreduce_one(buffers[0].send, buffers[0].recv, buffers[0].count, dtype, op, det);

    // Fused: small buffers are packed back to back into the staging buffer, reduced in one call per
    // fill, and unpacked; a buffer may straddle two fills. Large ones go straight to MPI.
    const size_t capacity = kStagingBytes / elem;
    struct Piece {
      void* recv;
      size_t at;  // element offset in staging
      size_t len;
    };
    std::vector<Piece> pieces;
    size_t used = 0;
    auto flush = [&] {
      if (used == 0) return;
      allreduce_one(staging_.data(), staging_.data(), used, dtype, op, det);
      for (const Piece& p : pieces) std::memcpy(p.recv, at(staging_.data(), p.at, elem), p.len * elem);
      pieces.clear();
      used = 0;
    };
    for (const BufferRef& b : buffers) {
      if (b.count == 0) continue;
      if (b.count * elem >= kStagingBytes) {
        allreduce_one(b.send, b.recv, b.count, dtype, op, det);
        continue;
      }
      if (staging_.size() < capacity * elem) staging_.resize(capacity * elem);
      for (size_t done = 0; done < b.count;) {
        const size_t len = std::min(b.count - done, capacity - used);
        std::memcpy(at(staging_.data(), used, elem), at(b.send, done, elem), len * elem);
        pieces.push_back(Piece{at(b.recv, done, elem), used, len});
        used += len;
        done += len;
        if (used == capacity) flush();
      }
    }
    flush();
  });
}

// A collective of its own, judged like the others (collective, dtype, count, and every rank's
// weight, so a bad weight fails every rank alike), then the staged products summed in rank order.
void MpiCommunicator::weighted_mean(const void* send, void* recv, size_t count, DType dtype, uint64_t weight,
                                    uint64_t* total_weight) {
  telemetry_.measure(Collective::WeightedMean, count * dtype_size(dtype), [&] {
    arrive(weighted_mean_call(count, dtype), {}, weight);
    const InTransfer transfer(*this);
    // Windows of one rank-order window each (its f64 products and the weight after them).
    windowed_weighted_mean(send, recv, count, dtype, weight, total_weight, kWindowBytes / sizeof(double) - 1,
                           [&](double* data, size_t n) {
                             if (size_ > 1) rank_order_allreduce(data, data, n, DType::F64, ReduceOp::Sum);
                           });
  });
}

void MpiCommunicator::broadcast(void* buf, size_t count, DType dtype, int root) {
  telemetry_.measure(Collective::Broadcast, count * dtype_size(dtype), [&] {
    arrive(broadcast_call(count, dtype, root));
    const InTransfer transfer(*this);
    if (size_ == 1) return;
    const size_t elem = dtype_size(dtype);
    for (size_t lo = 0; lo < count; lo += max_count_) {
      const int n = static_cast<int>(std::min(max_count_, count - lo));
      check(mpi::lib().Bcast(at(buf, lo, elem), n, mpi_type(dtype), root, comm_), "MPI_Bcast");
    }
  });
}

void MpiCommunicator::allgatherv(const void* send, void* recv, std::span<const size_t> counts, DType dtype) {
  const auto n = static_cast<size_t>(size_);
  std::vector<Part> parts(n);
  const size_t total = pack_parts(counts, parts.data());
  const size_t elem = dtype_size(dtype);
  telemetry_.measure(Collective::Allgather, total * elem, [&] {
    arrive(allgather_call(counts, dtype));
    const InTransfer transfer(*this);
    const Part mine = parts[static_cast<size_t>(rank_)];
    if (size_ == 1) {
      if (send != nullptr && total > 0) std::memmove(recv, send, total * elem);
      return;
    }
    // Every rank sees the same counts here (the fingerprints matched), so all take the same path.
    if (total > max_count_) {
      const void* own = send == nullptr ? at(recv, mine.start, elem) : send;
      return pairwise(dtype, [&](int peer) {
        const Part p = parts[static_cast<size_t>(peer)];
        return Block{own, mine.len, const_cast<std::byte*>(at(recv, p.start, elem)), p.len};
      });
    }
    std::vector<int> icounts(n), displs(n);
    for (size_t r = 0; r < n; ++r) {
      icounts[r] = static_cast<int>(parts[r].len);
      displs[r] = static_cast<int>(parts[r].start);
    }
    const void* from = send == nullptr || (total > 0 && send == at(recv, mine.start, elem)) ? MPI_IN_PLACE : send;
    check(mpi::lib().Allgatherv(from, icounts[static_cast<size_t>(rank_)], mpi_type(dtype), recv, icounts.data(),
                                displs.data(), mpi_type(dtype), comm_),
          "MPI_Allgatherv");
  });
}

void MpiCommunicator::exchange(const void* send, void* recv, const Routes& routes, DType dtype) {
  const size_t elem = dtype_size(dtype);
  const auto n = static_cast<size_t>(size_), me = static_cast<size_t>(rank_);
  uint64_t sent = 0;
  for (size_t d = 0; d < n; ++d) sent += routes.count[routes.at(me, d)];
  telemetry_.measure(Collective::Alltoall, sent * elem, [&] {
    arrive(exchange_call(routes, dtype));
    const InTransfer transfer(*this);
    // Every rank holds the same routes (the fingerprints matched), so all take the same path.
    bool fits = true;
    for (size_t i = 0; i < n * n; ++i)
      fits &= routes.count[i] <= max_count_ && routes.send_displ[i] <= max_count_ && routes.recv_displ[i] <= max_count_;
    if (size_ == 1 || !fits) {
      return pairwise(dtype, [&](int peer) {
        const size_t out = routes.at(me, static_cast<size_t>(peer)), in = routes.at(static_cast<size_t>(peer), me);
        return Block{at(send, routes.send_displ[out], elem), routes.count[out],
                     const_cast<std::byte*>(at(recv, routes.recv_displ[in], elem)), routes.count[in]};
      });
    }
    std::vector<int> send_counts(n), send_displs(n), recv_counts(n), recv_displs(n);
    for (size_t r = 0; r < n; ++r) {
      send_counts[r] = static_cast<int>(routes.count[routes.at(me, r)]);
      send_displs[r] = static_cast<int>(routes.send_displ[routes.at(me, r)]);
      recv_counts[r] = static_cast<int>(routes.count[routes.at(r, me)]);
      recv_displs[r] = static_cast<int>(routes.recv_displ[routes.at(r, me)]);
    }
    check(mpi::lib().Alltoallv(send, send_counts.data(), send_displs.data(), mpi_type(dtype), recv, recv_counts.data(),
                               recv_displs.data(), mpi_type(dtype), comm_),
          "MPI_Alltoallv");
  });
}

void MpiCommunicator::reduce_scatterv(const void* send, void* recv, std::span<const size_t> counts, DType dtype,
                                      ReduceOp op, std::optional<int> root) {
  const auto n = static_cast<size_t>(size_);
  std::vector<Part> parts(n);
  const size_t total = pack_parts(counts, parts.data());
  const size_t longest = *std::max_element(counts.begin(), counts.end());  // a group has a rank
  const size_t elem = dtype_size(dtype);
  telemetry_.measure(Collective::ReduceScatter, total * elem, [&] {
    arrive(reduce_scatter_call(counts, dtype, op, root));
    const InTransfer transfer(*this);
    const Part mine = parts[static_cast<size_t>(rank_)];
    if (size_ == 1) {
      if (recv != send && total > 0) std::memmove(recv, send, total * elem);
      return;
    }
    if (total > max_count_) {
      // Window by window of the slices (bounded scratch): every rank's copy of this rank's window
      // comes here pairwise and is folded in rank order, as the deterministic path does. Every
      // rank runs the windows of the longest slice.
      const size_t window = std::min(max_count_, std::max<size_t>(kWindowBytes / elem, 1));
      std::vector<const void*> sources(n);
      for (size_t lo = 0; lo < longest; lo += window) {
        const size_t m = lo < mine.len ? std::min(window, mine.len - lo) : 0;
        std::byte* copies = scratch(n * m * elem);
        pairwise(dtype, [&](int peer) {
          const Part p = parts[static_cast<size_t>(peer)];
          const size_t theirs = lo < p.len ? std::min(window, p.len - lo) : 0;
          return Block{at(send, p.start + lo, elem), theirs, copies + static_cast<size_t>(peer) * m * elem, m};
        });
        for (size_t r = 0; r < n; ++r) sources[r] = copies + r * m * elem;
        reduce(dtype, op, sources.data(), n, const_cast<std::byte*>(at(recv, lo, elem)), 0, m);
      }
      return;
    }
    std::vector<int> icounts(n), displs(n);
    for (size_t r = 0; r < n; ++r) {
      icounts[r] = static_cast<int>(parts[r].len);
      displs[r] = static_cast<int>(parts[r].start);
    }
    if (deterministic_for(dtype, op)) {
      std::vector<int> recv_counts(n, static_cast<int>(mine.len)), recv_displs(n);
      for (size_t r = 0; r < n; ++r) recv_displs[r] = static_cast<int>(r * mine.len);
      std::byte* copies = scratch(n * mine.len * elem);
      check(mpi::lib().Alltoallv(send, icounts.data(), displs.data(), mpi_type(dtype), copies, recv_counts.data(),
                                 recv_displs.data(), mpi_type(dtype), comm_),
            "MPI_Alltoallv");
      std::vector<const void*> sources(n);
      for (size_t r = 0; r < n; ++r) sources[r] = copies + r * mine.len * elem;
      reduce(dtype, op, sources.data(), n, recv, 0, mine.len);
      return;
    }
    // MPI forbids recv overlapping send; the caller may pass recv inside send (at its offset).
    const auto* s = static_cast<const std::byte*>(send);
    const auto* r = static_cast<const std::byte*>(recv);
    const bool overlaps = r < s + total * elem && s < r + mine.len * elem;
    void* out = overlaps ? scratch(mine.len * elem) : recv;
    check(mpi::lib().Reduce_scatter(send, out, icounts.data(), mpi_type(dtype), mpi_op(op), comm_),
          "MPI_Reduce_scatter");
    if (overlaps) std::memcpy(recv, out, mine.len * elem);
    if (op == ReduceOp::Mean) finish_mean(dtype, recv, mine.len, size_);
  });
}

void MpiCommunicator::barrier() {
  telemetry_.measure(Collective::Barrier, 0, [&] {
    // The exchange completes only once every rank has posted it: it is the barrier.
    arrive(barrier_call(), {}, 0, false);
  });
}

}  // namespace gradsync::comm::mpi
