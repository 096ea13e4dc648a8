// SPDX-License-Identifier: Apache-2.0
// Liveness links (common/liveness_links.hpp) over real TCP connections on this host: members in
// threads of this process, in a forked child and SIGKILLed; strangers that connect to a listener;
// a forked child that must not keep a link open for its parent.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "common/liveness_links.hpp"

using namespace std::chrono_literals;
using gradsync::LinkAddress;
using gradsync::LivenessLinks;
using Clock = std::chrono::steady_clock;

namespace {

// Members 0..n-1 of one group in threads: member r dials every lower rank and accepts every higher
// one. Returns each member's missing peers.
std::vector<std::vector<int>> connect_all(std::vector<std::unique_ptr<LivenessLinks>>& m) {
  const int n = static_cast<int>(m.size());
  std::vector<LinkAddress> all;
  for (auto& l : m) all.push_back(l->address());
  std::vector<std::vector<int>> missing(m.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      std::vector<int> dial, accept;
      for (int p = 0; p < n; ++p)
        if (p != r) (p < r ? dial : accept).push_back(p);
      missing[static_cast<size_t>(r)] = m[static_cast<size_t>(r)]->connect(r, all, dial, accept, Clock::now() + 10s);
    });
  for (auto& t : threads) t.join();
  return missing;
}

// Polls until peer shows gone, for at most `bound` (an event awaited, not a time asserted).
bool seen_gone(LivenessLinks& l, int peer, std::chrono::milliseconds bound = 20000ms) {
  const auto until = Clock::now() + bound;
  while (Clock::now() < until) {
    l.poll();
    if (l.gone(peer)) return true;
    std::this_thread::sleep_for(5ms);
  }
  return false;
}

// A stranger's connection to member `to`'s listener: whatever it sends, then whether the member
// closed it (end of file) within the bound.
int dial(const LinkAddress& to) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = to.port;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  return fd;
}

bool closed_by_peer(int fd) {
  timeval t{20, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof(t));
  char buf[64];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) {
  }
  return n == 0 || (n < 0 && errno == ECONNRESET);
}

}  // namespace

TEST_CASE("linked_peers: symmetric, across groups only, every member watched from every other group", "[links]") {
  const std::vector<std::vector<uint64_t>> layouts = {
      {7, 7, 9, 9}, {1, 2, 3}, {5, 5, 5}, {1, 2, 2}, {4, 4, 4, 4, 8, 8, 3}, {1, 1, 1, 1, 1, 2}, {3, 1, 3, 1, 2}};
  for (const auto& group : layouts) {
    const int n = static_cast<int>(group.size());
    std::vector<std::set<int>> peers(group.size());
    for (int r = 0; r < n; ++r)
      for (int p : gradsync::linked_peers(r, group)) peers[static_cast<size_t>(r)].insert(p);
    for (int r = 0; r < n; ++r) {
      std::set<uint64_t> watched_from;
      for (int p : peers[static_cast<size_t>(r)]) {
        CHECK(group[static_cast<size_t>(p)] != group[static_cast<size_t>(r)]);
        CHECK(peers[static_cast<size_t>(p)].count(r) == 1);
        watched_from.insert(group[static_cast<size_t>(p)]);
      }
      std::set<uint64_t> others(group.begin(), group.end());
      others.erase(group[static_cast<size_t>(r)]);
      CHECK(watched_from == others);
    }
  }
}

TEST_CASE("links come up between members, and a freed member's link ends", "[links]") {
  std::vector<std::unique_ptr<LivenessLinks>> m;
  for (int r = 0; r < 3; ++r) m.push_back(std::make_unique<LivenessLinks>());
  REQUIRE(m[0]->address().port != 0);
  for (const auto& missing : connect_all(m)) CHECK(missing.empty());
  std::this_thread::sleep_for(50ms);
  for (int r = 0; r < 3; ++r) CHECK(m[static_cast<size_t>(r)]->poll() == -1);
  m[1].reset();
  CHECK(seen_gone(*m[0], 1));
  CHECK(seen_gone(*m[2], 1));
  CHECK_FALSE(m[0]->gone(2));
  CHECK(m[2]->poll() == 1);
}

TEST_CASE("a SIGKILLed member's link ends", "[links]") {
  LivenessLinks parent;
  int to_child[2], to_parent[2];
  REQUIRE(::pipe(to_child) == 0);
  REQUIRE(::pipe(to_parent) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    LivenessLinks child;
    LinkAddress all[2];
    const LinkAddress mine = child.address();
    if (::read(to_child[0], &all[0], sizeof(LinkAddress)) != sizeof(LinkAddress)) ::_exit(2);
    all[1] = mine;
    if (::write(to_parent[1], &mine, sizeof(mine)) != sizeof(mine)) ::_exit(2);
    const int dial[] = {0};
    const bool up = child.connect(1, all, dial, {}, Clock::now() + 10s).empty();
    char c = up ? 'u' : 'n';
    if (::write(to_parent[1], &c, 1) != 1) ::_exit(2);
    ::pause();
    ::_exit(0);
  }
  LinkAddress all[2];
  all[0] = parent.address();
  REQUIRE(::write(to_child[1], &all[0], sizeof(LinkAddress)) == sizeof(LinkAddress));
  REQUIRE(::read(to_parent[0], &all[1], sizeof(LinkAddress)) == sizeof(LinkAddress));
  const int accept[] = {1};
  CHECK(parent.connect(0, all, {}, accept, Clock::now() + 10s).empty());
  char c = 0;
  REQUIRE(::read(to_parent[0], &c, 1) == 1);
  CHECK(c == 'u');
  std::this_thread::sleep_for(50ms);
  CHECK(parent.poll() == -1);
  ::kill(pid, SIGKILL);
  CHECK(seen_gone(parent, 1));
  ::waitpid(pid, nullptr, 0);
}

TEST_CASE("strangers at a listener are closed, and the members' links still come up", "[links]") {
  std::vector<std::unique_ptr<LivenessLinks>> m;
  for (int r = 0; r < 2; ++r) m.push_back(std::make_unique<LivenessLinks>());
  // Before the members dial: one that says nothing, one with garbage, one that names member 0
  // with a wrong nonce (the layout of a hello, as one who read this source would send).
  const int silent = dial(m[0]->address());
  const int garbage = dial(m[0]->address());
  const int forged = dial(m[0]->address());
  const char junk[32] = "GET / HTTP/1.0\r\n\r\n";
  REQUIRE(::send(garbage, junk, sizeof(junk), 0) == sizeof(junk));
  struct {
    uint64_t magic, listener_nonce, dialer_nonce;
    uint32_t dialer_rank, listener_rank;
  } hello{0x676c696e6b68656cULL, m[0]->address().nonce + 1, m[1]->address().nonce, 1, 0};
  REQUIRE(::send(forged, &hello, sizeof(hello), 0) == sizeof(hello));
  for (const auto& missing : connect_all(m)) CHECK(missing.empty());
  CHECK(closed_by_peer(garbage));
  CHECK(closed_by_peer(forged));
  CHECK(closed_by_peer(silent));  // the listener is closed once the members are linked
  CHECK(m[0]->poll() == -1);
  CHECK(m[1]->poll() == -1);
  ::close(silent);
  ::close(garbage);
  ::close(forged);
}

TEST_CASE("a peer that never dials: connect() returns it as missing at its bound, and nothing is gone", "[links]") {
  LivenessLinks lonely;
  LivenessLinks absent;  // listed, never connects
  const LinkAddress all[] = {lonely.address(), absent.address()};
  const int accept[] = {1};
  CHECK(lonely.connect(0, all, {}, accept, Clock::now() + 300ms) == std::vector<int>{1});
  CHECK(lonely.poll() == -1);
  CHECK_FALSE(lonely.gone(1));
}

TEST_CASE("a forked child does not keep its parent's links open", "[links]") {
  std::vector<std::unique_ptr<LivenessLinks>> m;
  for (int r = 0; r < 2; ++r) m.push_back(std::make_unique<LivenessLinks>());
  for (const auto& missing : connect_all(m)) CHECK(missing.empty());
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::pause();  // alive, holding whatever it inherited
    ::_exit(0);
  }
  // Member 1's link closes here; had the child kept its copy, the connection would stay up.
  m[1].reset();
  CHECK(seen_gone(*m[0], 1, 5000ms));
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
}
