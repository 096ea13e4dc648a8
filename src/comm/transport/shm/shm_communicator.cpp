// SPDX-License-Identifier: Apache-2.0
// The shared-memory transport's fabric: the group's segment (segment.hpp: layout, rendezvous,
// liveness, heaps). Addresses are offsets into the segment, so only buffers in this rank's heap
// (gradsync_comm_alloc) are reachable by peers; the others take the copy path through the
// segment's stages. The round protocol and the collectives are the shared-memory ones
// (engine/round_engine.hpp, algorithms/shared_memory.cpp).
#include "comm/transport/shm/shm_communicator.hpp"

#include "comm/algorithms/shared_memory.hpp"
#include "comm/transport/shm/segment.hpp"
#include "common/error.hpp"

namespace gradsync::comm {
namespace {

class ShmFabric final : public Fabric {
 public:
  explicit ShmFabric(std::unique_ptr<shm::Segment> segment) : segment_(std::move(segment)) {
    control_ = segment_->control();
  }

  Transport transport() const noexcept override { return Transport::Shm; }
  const std::string& group() const noexcept override { return segment_->group(); }
  uint64_t address_of(const void* p, size_t bytes) const noexcept override {
    return segment_->own_heap_offset(p, bytes);
  }
  // Peers only ever touch this rank's buffers in the segment, which outlives any call.
  bool peers_use_private_memory() const noexcept override { return false; }
  bool reaches_peer_processes() const noexcept override { return segment_->reaches_peers(); }
  bool read_peer(int r, uint64_t address, void* dst, size_t bytes) const noexcept override {
    return segment_->peer_copy(r, address, dst, bytes, false);
  }
  bool write_peer(int r, uint64_t address, const void* src, size_t bytes) const noexcept override {
    return segment_->peer_copy(r, address, const_cast<void*>(src), bytes, true);
  }
  int cpus() const noexcept override { return segment_->cpus(); }
  // The waits ask this every liveness interval: a segment truncated under the group fails the
  // call here (E_IO) rather than waiting out the deadline on memory that no peer writes any more.
  bool alive(int r) const override {
    segment_->check_intact();
    return segment_->alive(r);
  }
  int pid(int r) const noexcept override { return segment_->slot(r).pid.load(std::memory_order_relaxed); }
  void close_group() noexcept override { segment_->close_group(); }
  void release_after_fork() noexcept override { segment_->release_after_fork(); }
  void* alloc(size_t bytes) override { return segment_->allocate(bytes); }
  void dealloc(void* p) override {
    GS_REQUIRE(segment_->deallocate(p), GRADSYNC_E_INVALID_ARG,
               "pointer {} was not allocated by this communicator (or was already freed)", p);
  }

 private:
  std::unique_ptr<shm::Segment> segment_;
};

}  // namespace

std::unique_ptr<Communicator> create_shm_communicator(const Options& options) {
  GS_REQUIRE(!options.name.empty(), GRADSYNC_E_INVALID_ARG, "an shm group needs a name");
  auto segment = shm::Segment::join(options.name, options.rank, options.size, deadline_after(options.timeout),
                                    options.forming_abandoned);
  return make_shared_memory_communicator(options, std::make_unique<ShmFabric>(std::move(segment)),
                                         create_shm_communicator);
}

}  // namespace gradsync::comm
