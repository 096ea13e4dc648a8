// SPDX-License-Identifier: Apache-2.0
#pragma once
// What the round engine and the shared-memory collectives need from a transport whose ranks
// share memory: where the group's control block is, how a peer reaches this rank's buffers,
// whether a peer is alive, and memory for buffers. Everything else (the round protocol, the
// algorithms, the errors) is written once above it, in engine/ and algorithms/.
#include <cstddef>
#include <cstdint>
#include <string>

#include "comm/engine/control.hpp"
#include "comm/types.hpp"

namespace gradsync::comm {

class Fabric {
 public:
  virtual ~Fabric() = default;

  const ControlArea& control() const noexcept { return control_; }
  virtual Transport transport() const noexcept = 0;
  virtual const std::string& group() const noexcept = 0;

  // The address a peer uses to reach [p, p + bytes) of this rank (ControlArea::at turns it back
  // into a pointer), or kNoAddress when peers cannot reach it: the copy path then stages it.
  virtual uint64_t address_of(const void* p, size_t bytes) const noexcept = 0;
  // Whether peers touch memory the caller owns outright while they run a direct round (thread
  // transport: the caller's own buffers). Then a rank must wait for its peers to finish with its
  // buffers whatever the deadline says; otherwise (buffers in a shared segment that outlives the
  // call) it may give up at the deadline or on abort, and the group fails the round for everyone.
  virtual bool peers_use_private_memory() const noexcept = 0;

  // Whether this rank can copy to and from every peer's process memory at addresses of the peer's
  // own (process_vm_readv/writev; shm only, checked once as the group formed). When every rank
  // can, an allreduce of ordinary buffers reads and writes the peers' slices where they are, as
  // the direct path does, instead of staging them through the segment.
  virtual bool reaches_peer_processes() const noexcept { return false; }
  // Copies bytes from rank r's process at `address` into dst, or from src to there; false when
  // the kernel refuses (the range is not mapped in r, or r is gone).
  virtual bool read_peer(int, uint64_t, void*, size_t) const noexcept { return false; }
  virtual bool write_peer(int, uint64_t, const void*, size_t) const noexcept { return false; }

  // How many of the group's ranks can each have a CPU of its own (wait_detail::ranks_with_own_cpu
  // over the affinities they joined with, capped by their cgroups' CPU limits), taken once as the
  // group formed: fewer than the ranks means they outnumber the CPUs, which chooses how they wait
  // and which data paths they take, as every rank should choose alike.
  virtual int cpus() const noexcept = 0;

  // False once rank r is gone for good (its process died, or it freed its communicator).
  virtual bool alive(int r) const = 0;
  virtual int pid(int r) const noexcept = 0;
  // A peer died: nobody may join what is left of the group.
  virtual void close_group() noexcept = 0;
  // Communicator::release_after_fork's part here.
  virtual void release_after_fork() noexcept {}

  virtual void* alloc(size_t bytes) = 0;
  virtual void dealloc(void* p) = 0;

 protected:
  ControlArea control_;
};

}  // namespace gradsync::comm
