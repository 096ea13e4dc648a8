// SPDX-License-Identifier: Apache-2.0
#pragma once
// Seeing a peer on another host die without waiting for a deadline: a TCP connection to it that
// carries nothing, whose end shows the peer's. The kernel closes a process's sockets however the
// process ends (SIGKILL included), and the peer's kernel then sends FIN or RST: the connection
// reads end-of-file or an error at once. Nothing else closes it: this side never closes a link
// while its owner lives, the peer closes its own only when its owner goes (exit, free), and a
// child forked from either closes its inherited copies at once (fork.hpp), so that it cannot keep
// a dead parent's link open. So a link that ends is a peer gone, never a doubt: no keepalive
// probes, which would take a slow network for a death.
//
// Not seen: a host that loses power or network (no FIN is sent). Its ranks' deaths show at the
// deadline, as without links.
//
// Setting the links up is collective over the peers that get one (every member's constructor,
// then connect(), within a bound), and never blocks on what a peer does outside it:
// 1. each member connects to the peers it dials (the caller says who dials whom) and sends a
//    hello naming both ends and both nonces;
// 2. it accepts the hellos it expects on its listener (others, from other processes or from
//    anyone on the host, are closed unread past the hello) and answers each with the dialer's
//    nonce;
// 3. it reads its answers. A link is up on the listener's side once it answered, and on the
//    dialer's once it read the answer. An answer not read by the bound is read later (poll());
//    a dial that the listener closed unanswered is not a link on either side, and is never
//    taken for a death.
// Where no link comes up with a peer (a firewall, no common network), its death shows only at the
// deadline; connect() says which peers those are.
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

namespace gradsync {

// Where a member listens, exchanged as raw bytes with its peers.
struct LinkAddress {
  static constexpr int kMaxAddresses = 6;
  uint32_t ipv4[kMaxAddresses];  // network byte order; the host's non-loopback addresses first
  uint16_t port;                 // network byte order; 0: not listening
  uint16_t count;                // addresses in ipv4
  uint32_t reserved;
  uint64_t nonce;  // random, per member: who dials it names it, and it answers with the dialer's
};
static_assert(sizeof(LinkAddress) == 40, "exchanged as raw bytes");

class LivenessLinks {
 public:
  // Listens on an ephemeral port of every address (none on failure: address().port is 0).
  LivenessLinks();
  ~LivenessLinks();
  LivenessLinks(const LivenessLinks&) = delete;
  LivenessLinks& operator=(const LivenessLinks&) = delete;

  const LinkAddress& address() const noexcept { return self_; }

  // Sets the links up (above): `all` holds every member's address by rank (this one's at `rank`),
  // `dial` the peers this member connects to, `accept` those that connect to it. Waits at most
  // until `until`. Returns the peers with no link (up or pending); closes the listener.
  std::vector<int> connect(int rank, std::span<const LinkAddress> all, std::span<const int> dial,
                           std::span<const int> accept, std::chrono::steady_clock::time_point until);

  // Reads what the links have to say, without waiting: answers that came late, and ends. Returns
  // the lowest rank whose link has ended, or -1. Any thread.
  int poll() noexcept;
  // Whether peer r's link has ended (as of the last poll()).
  bool gone(int r) const noexcept;

 private:
  struct Link;
  void close_listener() noexcept;
  int poll_locked() noexcept;
  mutable std::mutex mutex_;
  LinkAddress self_{};
  int listener_ = -1;
  std::vector<Link> links_;
  int first_gone_ = -1;
};

// The peers that member `rank` links with, given each member's group (members of one group see
// each other die by other means: one host's processes). Every member of every other group is
// linked with at least one member of each group other than its own, and the links per member stay
// about the number of other groups: member i of group G pairs with member j of group H when
// i mod |H| = j or j mod |G| = i. Sorted; the same pairs seen from both ends.
std::vector<int> linked_peers(int rank, std::span<const uint64_t> group_of);

}  // namespace gradsync
