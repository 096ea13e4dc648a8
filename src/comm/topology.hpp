// SPDX-License-Identifier: Apache-2.0
#pragma once
// Which ranks of a group share a host, decided from facts every rank can check, never from
// environment variables (a launcher's LOCAL_WORLD_SIZE is a claim, and a wrong claim makes a
// shared-memory path deadlock or read another host's memory).
//
// A host is a set of ranks that can map each other's shared memory. Each rank names its candidate
// host by an identity: the hostname, the kernel's boot id, and the device of the /dev/shm mount
// (unique per tmpfs superblock within one boot, so two containers or namespaces with private
// /dev/shm differ even under one hostname). A caller's host label replaces that identity (odd
// clusters, tests). Ranks with equal identities are one host only where they also prove it:
// transports whose ranks share memory by construction (threads of one process, the processes of
// one shm segment) have that proof already; others run a probe in which every rank writes a
// nonce to a file in /dev/shm and reads its candidate peers' files.
//
// Hosts are numbered in the order of their lowest rank; local ranks in rank order. Every rank
// computes the same Topology from the same gathered records.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace gradsync::comm {

struct Topology {
  int host = 0;        // this rank's host
  int local_rank = 0;  // this rank's place among its host's ranks
  int local_size = 1;  // ranks on this rank's host
  int num_hosts = 1;
  std::vector<int> rank_host;  // every rank's host, by rank

  // The topology of a subgroup: members[i] is the parent rank of the subgroup's rank i;
  // my_rank is this rank's place in the subgroup. Hosts are renumbered, as detection does.
  Topology restricted(const std::vector<int>& members, int my_rank) const;
};

// Where replicated state lives (a ZeRO slice's replicas, an embedding shard's): every rank once,
// by local rank and then host, so that a rank's next ranks are on other hosts (on each of them
// while the hosts hold as many ranks) and a copy outlives its owner's host. On one host (or with
// no topology) it is rank order. Rank r's j-th copy is on ahead(r, j); the j-th copy rank h keeps
// is behind(h, j)'s.
class ReplicaRing {
 public:
  ReplicaRing() = default;
  ReplicaRing(const Topology& topology, int size);
  // The ring one rank of a group holds, on every rank of it: for ranks that do not hold it (a
  // reshard's joiners). `broadcast` sends `count` words from that rank to every rank (the group's
  // broadcast, as detect_topology takes its allgather); `size` is the ring's, which every rank
  // passes alike; mine is read on the root only. Collective; throws E_MISMATCH if what arrives is
  // not a permutation of [0, size).
  using BroadcastWords = std::function<void(int64_t* words, size_t count)>;
  static ReplicaRing broadcast(const BroadcastWords& broadcast, const ReplicaRing& mine, int size, bool root);
  const std::vector<int>& order() const noexcept { return order_; }
  int ahead(int r, int j) const noexcept { return at(pos_[static_cast<size_t>(r)] + j); }
  int behind(int r, int j) const noexcept { return at(pos_[static_cast<size_t>(r)] - j); }
  // j in [0, size) such that behind(h, j) == o.
  int distance(int h, int o) const noexcept;
  // Equal on ranks that hold the same ring.
  uint64_t fingerprint() const noexcept;

 private:
  int at(int i) const noexcept {
    const auto n = static_cast<int>(order_.size());
    return order_[static_cast<size_t>((i % n + n) % n)];
  }
  std::vector<int> order_, pos_;  // pos_[order_[i]] == i
};

// This process's host identity (hostname, boot id, /dev/shm device), or label when not empty.
std::string host_identity(const std::string& label);

// The group's allgather of 64-bit words: `all` holds `total` words, every rank's part of them by
// the partition rule, this rank's from `mine`.
using AllgatherWords = std::function<void(const void* mine, void* all, size_t total)>;

// Collective over the group of `size` ranks whose allgather it is (two small allgathers, plus the
// probe's when !shares_memory): every rank passes the same shares_memory. Throws what the
// collectives throw.
Topology detect_topology(int rank, int size, const AllgatherWords& allgather, const std::string& label,
                         bool shares_memory);

// The topology of groups whose ranks are their hosts: rank_host as given.
Topology topology_from_hosts(const std::vector<int>& rank_host, int my_rank);

}  // namespace gradsync::comm
