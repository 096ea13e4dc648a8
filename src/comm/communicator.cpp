// SPDX-License-Identifier: Apache-2.0
#include "comm/communicator.hpp"
#include "comm/transport/shm/shm_communicator.hpp"
#if GRADSYNC_HAVE_MPI
#include "comm/transport/mpi/mpi_communicator.hpp"
#endif

#include <cmath>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <vector>

#include "common/error.hpp"
#include "common/fnv.hpp"

namespace gradsync::comm {

// The staged form of comm::weighted_mean (reduce.hpp) for transports that move data through a
// sum allreduce: each rank's contribution in double (+0 for weight 0), the weights beside them,
// summed in rank order, divided once. The same operations in the same order, so the same bits.
void Communicator::weighted_mean(const void* send, void* recv, size_t count, DType dtype, uint64_t weight,
                                 uint64_t* total_weight) {
  GS_REQUIRE(dtype == DType::F32 || dtype == DType::F64, GRADSYNC_E_INVALID_ARG,
             "weighted mean needs f32 or f64, got {}", dtype_name(dtype));
  // Weights travel as doubles beside the products: exact for counts below 2^53.
  GS_REQUIRE(weight <= (uint64_t{1} << 53), GRADSYNC_E_INVALID_ARG, "weight {} exceeds 2^53", weight);
  std::vector<double> staged = stage_weighted_mean(send, count, dtype, weight);
  const BufferRef buffer{staged.data(), staged.data(), staged.size()};
  allreduce(std::span<const BufferRef>(&buffer, 1), DType::F64, ReduceOp::Sum);
  finish_weighted_mean(staged, send, recv, count, dtype, total_weight);
}

std::vector<double> Communicator::stage_weighted_mean(const void* send, size_t count, DType dtype, uint64_t weight) {
  std::vector<double> staged(count + 1, 0.0);
  const double w = static_cast<double>(weight);
  if (weight != 0) {
    if (dtype == DType::F32) {
      const float* in = static_cast<const float*>(send);
      for (size_t i = 0; i < count; ++i) staged[i] = w * static_cast<double>(in[i]);
    } else {
      const double* in = static_cast<const double*>(send);
      for (size_t i = 0; i < count; ++i) staged[i] = w * in[i];
    }
  }
  staged[count] = w;
  return staged;
}

void Communicator::finish_weighted_mean(const std::vector<double>& summed, const void* send, void* recv, size_t count,
                                        DType dtype, uint64_t* total_weight) const {
  const double total = summed[count];
  if (total_weight != nullptr) *total_weight = static_cast<uint64_t>(total);
  GS_REQUIRE(total > 0.0, GRADSYNC_E_ZERO_WEIGHT, "total weight (sample count) over {} ranks is 0", size());
  // A group of one leaves the data as it is, bit for bit (w * x / w would quiet a signalling NaN).
  if (size() == 1) {
    if (count > 0 && send != recv) std::memmove(recv, send, count * dtype_size(dtype));
    return;
  }
  if (dtype == DType::F32) {
    float* out = static_cast<float*>(recv);
    for (size_t i = 0; i < count; ++i) out[i] = static_cast<float>(summed[i] / total);
  } else {
    double* out = static_cast<double*>(recv);
    for (size_t i = 0; i < count; ++i) out[i] = summed[i] / total;
  }
}

const char* transport_name(Transport t) noexcept {
  switch (t) {
    case Transport::Thread: return "thread";
    case Transport::Shm: return "shm";
    case Transport::Mpi: return "mpi";
  }
  return "unknown";
}

Communicator::~Communicator() {
  for (void* p : allocations_) std::free(p);
}

void Communicator::allreduce_mixed(std::span<const BufferRef> buffers, std::span<const DType> dtypes, ReduceOp op) {
  uint64_t h = fnv1a64(&op, sizeof op);
  for (size_t i = 0; i < buffers.size(); ++i) {
    const uint64_t entry[2] = {buffers[i].count, static_cast<uint64_t>(dtypes[i])};
    h = fnv1a64(entry, sizeof entry, h);
  }
  // min over ranks of h and of ~h: both come back unchanged on every rank exactly when every rank
  // holds the same h (~ reverses the order), so every rank reaches the same verdict.
  int64_t agree[2] = {static_cast<int64_t>(h), static_cast<int64_t>(~h)};
  const BufferRef check{agree, agree, 2};
  allreduce(std::span(&check, 1), DType::I64, ReduceOp::Min);
  GS_REQUIRE(agree[0] == static_cast<int64_t>(h) && agree[1] == static_cast<int64_t>(~h), GRADSYNC_E_MISMATCH,
             "allreduce over mixed dtypes: the ranks passed different lists of buffers (their counts, dtypes or "
             "order, or the op, differ); no buffer was changed");
  std::vector<BufferRef> group;
  for (DType t : {DType::F32, DType::F64, DType::I32, DType::I64, DType::BF16, DType::F16}) {
    group.clear();
    for (size_t i = 0; i < buffers.size(); ++i)
      if (dtypes[i] == t) group.push_back(buffers[i]);
    if (!group.empty()) allreduce(group, t, op);
  }
}

std::span<const size_t> Communicator::rule_counts(size_t total) {
  const auto n = static_cast<uint64_t>(size());
  partition_counts_.resize(n);
  for (uint64_t r = 0; r < n; ++r) partition_counts_[r] = partition(total, n, r).len;
  return partition_counts_;
}

void Communicator::allgather(const void* send, void* recv, size_t total, DType dtype) {
  allgatherv(send, recv, rule_counts(total), dtype);
}

void Communicator::reduce_scatter(const void* send, void* recv, size_t total, DType dtype, ReduceOp op) {
  reduce_scatterv(send, recv, rule_counts(total), dtype, op);
}

void* Communicator::alloc(size_t bytes) {
  constexpr size_t kAlign = 4096;
  GS_REQUIRE(bytes <= std::numeric_limits<size_t>::max() - kAlign, GRADSYNC_E_NOMEM, "cannot allocate {} bytes", bytes);
  void* p = std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  GS_REQUIRE(p != nullptr, GRADSYNC_E_NOMEM, "cannot allocate {} bytes", bytes);
  allocations_.insert(p);
  return p;
}

void Communicator::dealloc(void* p) {
  GS_REQUIRE(allocations_.erase(p) == 1, GRADSYNC_E_INVALID_ARG,
             "pointer {} was not allocated by this communicator (or was already freed)", p);
  std::free(p);
}

std::unique_ptr<Communicator> create(const Options& options) {
  switch (options.transport) {
    case Transport::Thread: return create_thread_communicator(options);
    case Transport::Shm: return create_shm_communicator(options);
    case Transport::Mpi:
#if GRADSYNC_HAVE_MPI
      return create_mpi_communicator(options);
#else
      fail(GRADSYNC_E_UNSUPPORTED, "the MPI transport is not available: libgradsync was built without MPI");
#endif
  }
  fail(GRADSYNC_E_UNSUPPORTED, "transport {} is not in this build", static_cast<int>(options.transport));
}

}  // namespace gradsync::comm
