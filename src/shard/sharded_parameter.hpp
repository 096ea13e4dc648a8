// SPDX-License-Identifier: Apache-2.0
#pragma once
// The sharded parameter (BigDL's AllReduceParameter, ZeRO stage 1) over any communicator.
//
// A flat parameter of N floats is split over the P ranks by the library's partition rule. Rank r
// owns part r: it keeps that slice of the weights and the optimizer state for that slice only.
// One training step is:
//   put       local    the rank's gradient (and sample count) is staged, encoded if compressed
//   aggregate collect  reduce-scatter: rank r gets the weighted mean of everyone's part r
//                      (compressed: an alltoall of the encoded parts, decoded and summed in f32)
//   update    local    the optimizer updates the rank's weight slice
//   gather    collect  allgather of the new weight slices (always full precision)
// step() runs all four in one call without copying the caller's gradient.
//
// Never hang, never reuse: each collective stage starts with a small allgather of a header
// (stage, local status, sample count, size, configuration), so a rank whose put or update failed
// locally, or that calls a different stage, makes every rank fail instead of blocking the others
// in a collective they never join. A gradient is consumed by the aggregate that reads it, and an
// aggregate without a fresh put is an error on every rank.
#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "codec/codec.hpp"
#include "comm/communicator.hpp"
#include "common/partition.hpp"

namespace gradsync::shard {

// The allocator of the slices and their replicas: elements are left uninitialised (every use
// writes them first, or assigns), and large blocks ask for transparent huge pages, so that a
// reshard's new slices cost one write each rather than a zeroing pass and a page fault every 4 KiB.
template <class T>
struct SliceAllocator {
  using value_type = T;
  SliceAllocator() = default;
  template <class U>
  SliceAllocator(const SliceAllocator<U>&) noexcept {}
  T* allocate(size_t n);
  void deallocate(T* p, size_t n) noexcept;
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    if constexpr (sizeof...(Args) == 0) {
      ::new (static_cast<void*>(p)) U;
    } else {
      ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
    }
  }
  friend bool operator==(const SliceAllocator&, const SliceAllocator&) noexcept { return true; }
};
void* allocate_slice(size_t bytes);
void free_slice(void* p, size_t bytes) noexcept;
template <class T>
T* SliceAllocator<T>::allocate(size_t n) {
  return static_cast<T*>(allocate_slice(n * sizeof(T)));
}
template <class T>
void SliceAllocator<T>::deallocate(T* p, size_t n) noexcept {
  free_slice(p, n * sizeof(T));
}
using SliceVector = std::vector<float, SliceAllocator<float>>;

enum class Optimizer : int32_t { Sgd = 0, Momentum = 1, Adam = 2, AdamW = 3 };

const char* optimizer_name(Optimizer o) noexcept;

struct Options {
  Optimizer optimizer = Optimizer::Sgd;
  codec::Codec compress = codec::Codec::None;
  bool error_feedback = false;
  double lr = 0.01;
  double momentum = 0.9;                          // Momentum only
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // Adam, AdamW
  // L2 penalty added to the gradient (Sgd, Momentum, Adam); decoupled decay for AdamW.
  double weight_decay = 0.0;
  // BigDL's gradient processors, applied in this order after aggregation.
  bool clamp = false;
  double clamp_min = 0.0, clamp_max = 0.0;
  double clip_norm = 0.0;  // > 0: scale the gradient so its global L2 norm is at most clip_norm
  // Each rank's slice (weights and optimizer state) also lives on the next `replicas` ranks, so a
  // reshard after losing up to that many ranks loses nothing.
  int replicas = 0;
};

// Throws Error(INVALID_ARG) naming the bad field.
void validate(const Options& options);

enum class Slice : int32_t { Weights = 0, Gradient = 1, State1 = 2, State2 = 3 };

class ShardedParameter {
 public:
  // The communicator is borrowed: it must outlive this object and not be used by another thread
  // during a collective stage.
  ShardedParameter(comm::Communicator& comm, uint64_t total, const Options& options);

  uint64_t total() const noexcept { return total_; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  Part part() const noexcept { return part_; }
  Part part_of(int rank) const noexcept;
  const Options& options() const noexcept { return options_; }
  // Bytes of optimizer state this rank holds (1/P of the unsharded optimizer's).
  uint64_t optimizer_bytes() const noexcept;
  uint64_t weight_bytes() const noexcept { return part_.len * sizeof(float); }
  // Staging and wire buffers (gradient copy, encoded blocks, residual).
  uint64_t buffer_bytes() const noexcept;
  int64_t updates() const noexcept { return updates_; }
  void set_lr(double lr);

  // Local: keeps this rank's slice of the full weights (N floats) and zeroes the optimizer state.
  void init(const float* weights, size_t count);
  // Local: init() with the optimizer state (full arrays of N floats, each rank keeps its slice and
  // its replicas'; NULL where the optimizer keeps no such state) and the update count.
  void restore(const float* weights, const float* state1, const float* state2, size_t count, int64_t updates);
  // Local: stages a gradient of N floats with this rank's sample count (its weight in the mean).
  void put(const float* gradient, size_t count, uint64_t samples);
  // Collective: the weighted mean of the staged gradients, this rank's part, then the processors.
  void aggregate();
  // Local: the optimizer on this rank's slice, with the aggregated gradient.
  void update();
  // Local alternative to update() for users who run their own optimizer: the new weight slice.
  void write_weights(const float* slice, size_t count);
  // Local: copies this rank's slice of the weights, aggregated gradient or an optimizer state (part().len floats).
  void read_slice(Slice which, float* out, size_t count) const;
  // Collective: every rank's weight slice into weights (N floats).
  void gather(float* weights, size_t count);
  // Collective: put + aggregate + update + gather. weights may equal gradient.
  // Arguments are validated inside, before the first collective, so bad input on one rank is an
  // error on every rank rather than a hang.
  void step(const float* gradient, size_t gradient_count, uint64_t samples, float* weights, size_t weights_count);

  // What a reshard moved and how long it took.
  struct ReshardReport {
    uint64_t moved_floats = 0;        // floats this rank received from other members
    std::vector<int> lost_old_ranks;  // old ranks whose slices were rebuilt from replicas
  };
  // Collective over next (a group of this parameter's surviving members, gradsync_comm_shrink):
  // the slices are recomputed for next's size and what moves goes straight into them, one exchange
  // per kept array; this parameter then runs on next. A slice that lived only on lost ranks fails
  // every member with E_LOST naming its range, and nothing changes.
  ReshardReport reshard(comm::Communicator& next);

 private:
  enum class Stage : int64_t { Aggregate = 1, Gather = 2, Step = 3 };
  struct Header {
    int64_t stage, status, samples, total, config;
  };
  static constexpr size_t kHeaderWords = sizeof(Header) / sizeof(int64_t);

  // Allgathers this rank's header; throws on every rank if any rank failed or disagrees.
  void exchange(Stage stage, int status, const std::string& message, uint64_t samples);
  // Local failure to report at the next collective stage.
  void remember_failure(int status, std::string message) noexcept;
  std::pair<int, std::string> take_failure() noexcept;
  void stage_gradient(const float* gradient);
  void reduce(const float* gradient);
  void process_gradient();
  void apply_optimizer();
  // Allgather of the weight slices (full precision) into weights (N floats).
  void publish(float* weights);
  int64_t config_word() const noexcept;

  // How many state arrays the optimizer keeps (0 SGD, 1 momentum, 2 Adam).
  int optimizer_states() const noexcept;
  // Takes this rank's slices (and its replicas') of the full arrays; NULL states start at zero.
  void adopt(const float* weights, const float* state1, const float* state2, int64_t updates);
  // Floats per element of a slice as it travels: the weight, then the optimizer's state.
  size_t state_arrays() const noexcept { return 1 + (state1_.empty() ? 0 : 1) + (state2_.empty() ? 0 : 1); }
  // The replicas this group keeps: the option, capped by the ranks there are to hold them.
  int replica_count() const noexcept { return std::min(options_.replicas, size_ - 1); }
  // Sends this rank's aggregated gradient slice to the ranks that hold its replicas, and takes
  // theirs, so that every holder applies the same update to its replicas (replicate_gradient) and
  // the replicas stay at the owners' step without shipping the state itself.
  void replicate_gradient();
  void apply_to_replicas();
  void size_buffers();

  comm::Communicator* comm_;
  uint64_t total_;
  Options options_;
  int rank_, size_;
  comm::ReplicaRing ring_;  // where the replicas live (comm/topology.hpp), of comm_, as rank_ and size_
  Part part_;

  SliceVector weights_;             // this rank's slice
  SliceVector grad_;                // aggregated gradient slice
  SliceVector state1_, state2_;     // momentum / Adam moments, slice-sized
  std::vector<float> staging_;      // uncompressed: a gradient copy of N floats (put, weighted step)
  std::vector<float> own_;          // compressed: this rank's own part, kept in f32
  std::vector<float> residual_;     // compressed with error feedback: N floats
  std::vector<uint16_t> wire_out_;  // compressed: the encoded gradient, N halves (own part unused)
  std::vector<uint16_t> wire_in_;   // compressed: every rank's encoded copy of this rank's part
  std::vector<Header> headers_;
  // Replica j (1..replica_count()) holds ring_.behind(rank, j)'s slice: weights, state1, state2
  // (each that slice's length), and the aggregated gradient that rank sent for its next update.
  struct Replica {
    SliceVector weights, state1, state2;
    SliceVector grad;
  };
  std::vector<Replica> replicas_;
  SliceVector replica_recv_;

  bool initialised_ = false;
  bool fresh_gradient_ = false;
  bool aggregated_ = false;
  uint64_t samples_ = 0;
  std::vector<uint64_t> weights_of_ranks_;
  int64_t updates_ = 0;
  int pending_status_ = 0;
  std::string pending_message_;
};

}  // namespace gradsync::shard
