#pragma once
// The shared-memory transport: processes of one host that join a named group through a segment
// in /dev/shm (see segment.hpp for its layout and rendezvous).
//
// Every collective is one "round": each rank writes a Descriptor of what it is about to do (and,
// for small payloads, the payload itself) into its slot, indexed by the round's parity, then
// arrives at the group barrier. After the barrier every rank reads every descriptor, so all ranks
// reach the same verdict on a mismatch, and no rank touches a peer's data before it is validated.
// Parity double buffering is enough: a rank can only overwrite its round-r slot in round r+2,
// which it cannot enter before every rank has arrived at round r+1, i.e. finished reading round r.
//
// Data paths:
// - small (payload <= kSmallBytes): inline in the slot; one barrier per collective, every rank
//   reduces the whole payload itself, in rank order (same code, same order: same bits).
// - zero copy (every rank's buffers lie in its heap of the segment): ranks publish OFFSETS; each
//   rank reduces its slice straight from the peers' buffers into all of them, then one barrier.
// - copy (ordinary caller buffers): allreduce streams chunks of kChunkBytes through kStageDepth
//   stages: each rank stages the slices its peers reduce, reduces its own slice straight from its
//   own buffer and the peers' stages (into its buffer and the result stage), and copies the other
//   slices out; each step waits only for the counters it depends on, not for a group barrier.
//   broadcast, allgather and reduce_scatter stage double-buffered blocks, one barrier per block.
// A round is decided once (committed when every rank arrived, else aborted for all), so a rank
// never returns while a peer still uses its buffers; a dead peer (its kernel-held lock is gone)
// turns every wait into GRADSYNC_E_REMOTE.
#include <memory>

#include "comm/communicator.hpp"

namespace gradsync::comm {

std::unique_ptr<Communicator> create_shm_communicator(const Options& options);

}  // namespace gradsync::comm
