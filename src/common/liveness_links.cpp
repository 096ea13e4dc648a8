// SPDX-License-Identifier: Apache-2.0
#include "common/liveness_links.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>

#include "common/fork.hpp"
#include "common/log.hpp"
#include "common/random.hpp"

namespace gradsync {
namespace {

constexpr uint64_t kHelloMagic = 0x676c696e6b68656cULL;   // a dialer's first words
constexpr uint64_t kAnswerMagic = 0x676c696e6b616e73ULL;  // a listener's answer
// Accepted connections still to send their hello: beyond this, more are closed unread (anyone on
// the network may connect; the members' own come first and are few).
constexpr size_t kMaxUnknown = 64;

struct Hello {
  uint64_t magic;
  uint64_t listener_nonce;
  uint64_t dialer_nonce;
  uint32_t dialer_rank;
  uint32_t listener_rank;
};
static_assert(sizeof(Hello) == 32);
struct Answer {
  uint64_t magic;
  uint64_t dialer_nonce;
  uint64_t listener_nonce;
  uint32_t listener_rank;
  uint32_t dialer_rank;
};
static_assert(sizeof(Answer) == sizeof(Hello));

void close_fd(int& fd) noexcept {
  if (fd < 0) return;
  keep_in_forked_children(fd);
  ::close(fd);
  fd = -1;
}

int new_socket() noexcept {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    if (close_in_forked_children(fd)) return fd;
    ::close(fd);
  }
  return -1;
}

// Reads into buf up to 32 bytes in all: true once it holds them; false while more may come.
// ended: the connection ended (or failed) first.
bool read_message(int fd, unsigned char* buf, size_t& have, bool& ended) noexcept {
  while (have < sizeof(Hello)) {
    const ssize_t n = ::recv(fd, buf + have, sizeof(Hello) - have, MSG_DONTWAIT);
    if (n > 0) {
      have += static_cast<size_t>(n);
    } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      ended = true;
      return false;
    } else if (errno != EINTR) {
      return false;
    }
  }
  return true;
}

}  // namespace

struct LivenessLinks::Link {
  enum class State { None, Connecting, Awaiting, Up, Gone };
  int peer = -1;
  bool dials = false;
  State state = State::None;
  int fd = -1;
  int next_address = 0;
  uint64_t peer_nonce = 0;
  bool refused = false;  // a dial closed unanswered: the next address is tried while connect() runs
  unsigned char buf[sizeof(Hello)] = {};
  size_t have = 0;
};

LivenessLinks::LivenessLinks() {
  self_.nonce = random_nonce();
  listener_ = new_socket();
  sockaddr_in any{};
  any.sin_family = AF_INET;
  any.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(any);
  if (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&any), sizeof(any)) != 0 ||
      ::listen(listener_, SOMAXCONN) != 0 || ::getsockname(listener_, reinterpret_cast<sockaddr*>(&any), &len) != 0) {
    GS_LOG_DEBUG("liveness links: cannot listen ({}): peers on other hosts are seen dead only at the deadline",
                 std::strerror(errno));
    close_fd(listener_);
    return;
  }
  self_.port = any.sin_port;
  // The host's own addresses first; loopback last, for peers in this network namespace but
  // another PID namespace. A dialer's hello names its listener, so an address that leads
  // elsewhere (the same private address on two hosts) is only a wasted try.
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) == 0) {
    for (int pass = 0; pass < 2; ++pass)
      for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
        if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET || !(a->ifa_flags & IFF_UP)) continue;
        if (((a->ifa_flags & IFF_LOOPBACK) != 0) != (pass == 1)) continue;
        if (self_.count == LinkAddress::kMaxAddresses) break;
        self_.ipv4[self_.count++] = reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr;
      }
    ::freeifaddrs(list);
  }
}

LivenessLinks::~LivenessLinks() {
  close_listener();
  for (Link& l : links_) close_fd(l.fd);
}

void LivenessLinks::close_listener() noexcept { close_fd(listener_); }

std::vector<int> LivenessLinks::connect(int rank, std::span<const LinkAddress> all, std::span<const int> dial,
                                        std::span<const int> accept, std::chrono::steady_clock::time_point until) {
  std::lock_guard lock(mutex_);
  std::map<int, size_t> at;  // peer -> its link
  for (int p : dial) {
    at[p] = links_.size();
    links_.push_back(Link{.peer = p, .dials = true, .peer_nonce = all[static_cast<size_t>(p)].nonce});
  }
  for (int p : accept) {
    at[p] = links_.size();
    links_.push_back(Link{.peer = p, .peer_nonce = all[static_cast<size_t>(p)].nonce});
  }
  auto hello_for = [&](const Link& l) {
    return Hello{kHelloMagic, all[static_cast<size_t>(l.peer)].nonce, self_.nonce, static_cast<uint32_t>(rank),
                 static_cast<uint32_t>(l.peer)};
  };
  // Dials the peer's next address; None when none is left.
  auto dial_next = [&](Link& l) {
    close_fd(l.fd);
    l.have = 0;
    const LinkAddress& to = all[static_cast<size_t>(l.peer)];
    l.state = Link::State::None;
    while (to.port != 0 && l.next_address < std::min<int>(to.count, LinkAddress::kMaxAddresses)) {
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = to.port;
      addr.sin_addr.s_addr = to.ipv4[l.next_address++];
      if ((l.fd = new_socket()) < 0) return;
      if (::connect(l.fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 || errno == EINPROGRESS) {
        l.state = Link::State::Connecting;
        return;
      }
      close_fd(l.fd);
    }
  };
  for (Link& l : links_)
    if (l.dials) dial_next(l);

  struct Unknown {
    int fd;
    unsigned char buf[sizeof(Hello)];
    size_t have;
  };
  std::vector<Unknown> unknown;
  auto done = [&] {
    return std::all_of(links_.begin(), links_.end(), [](const Link& l) {
      return l.state == Link::State::Up || l.state == Link::State::Gone || (l.dials && l.state == Link::State::None);
    });
  };
  std::vector<pollfd> fds;
  std::vector<int> slot;  // by link: its entry in fds, or -1
  while (!done()) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= until) break;
    fds.clear();
    slot.assign(links_.size(), -1);
    for (size_t k = 0; k < links_.size(); ++k) {
      const Link& l = links_[k];
      if (l.state != Link::State::Connecting && l.state != Link::State::Awaiting) continue;
      slot[k] = static_cast<int>(fds.size());
      fds.push_back({l.fd, static_cast<short>(l.state == Link::State::Connecting ? POLLOUT : POLLIN), 0});
    }
    for (const Unknown& u : unknown) fds.push_back({u.fd, POLLIN, 0});
    if (listener_ >= 0) fds.push_back({listener_, POLLIN, 0});
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count() + 1;
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(left, 100))) < 0 && errno != EINTR) break;

    for (size_t k = 0; k < links_.size(); ++k) {
      Link& l = links_[k];
      if (l.state == Link::State::Connecting && slot[k] >= 0 && fds[static_cast<size_t>(slot[k])].revents != 0) {
        int err = 0;
        socklen_t len = sizeof(err);
        const Hello h = hello_for(l);
        if (::getsockopt(l.fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0 ||
            ::send(l.fd, &h, sizeof(h), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(h))) {
          dial_next(l);
        } else {
          l.state = Link::State::Awaiting;
        }
      }
    }
    poll_locked();  // answers, and links that ended meanwhile
    for (Link& l : links_)
      if (l.refused) {
        l.refused = false;
        dial_next(l);
      }

    // Hellos from whoever connected.
    while (listener_ >= 0) {
      const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) break;
      if (unknown.size() >= kMaxUnknown || !close_in_forked_children(fd)) {
        ::close(fd);
        continue;
      }
      unknown.push_back(Unknown{fd, {}, 0});
    }
    for (size_t i = 0; i < unknown.size();) {
      Unknown& u = unknown[i];
      bool ended = false;
      if (!read_message(u.fd, u.buf, u.have, ended) && !ended) {
        ++i;
        continue;
      }
      Hello h{};
      std::memcpy(&h, u.buf, sizeof(h));
      const auto it = ended ? at.end() : at.find(static_cast<int>(h.dialer_rank));
      const bool valid = it != at.end() && h.magic == kHelloMagic && h.listener_nonce == self_.nonce &&
                         h.listener_rank == static_cast<uint32_t>(rank) && !links_[it->second].dials &&
                         links_[it->second].state != Link::State::Up &&
                         h.dialer_nonce == all[static_cast<size_t>(h.dialer_rank)].nonce;
      const Answer answer{kAnswerMagic, h.dialer_nonce, self_.nonce, static_cast<uint32_t>(rank), h.dialer_rank};
      if (valid && ::send(u.fd, &answer, sizeof(answer), MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof(answer))) {
        Link& l = links_[it->second];
        l.fd = u.fd;
        l.state = Link::State::Up;
      } else {
        close_fd(u.fd);
      }
      unknown[i] = unknown.back();
      unknown.pop_back();
    }
  }
  for (Unknown& u : unknown) close_fd(u.fd);
  close_listener();
  std::vector<int> missing;
  for (Link& l : links_) {
    // A dial whose answer is still to come stays: poll() reads it (the listener may have answered).
    if (l.state == Link::State::Connecting ||
        (!l.dials && l.state != Link::State::Up && l.state != Link::State::Gone)) {
      close_fd(l.fd);
      l.state = Link::State::None;
    }
    if (l.state == Link::State::None) missing.push_back(l.peer);
  }
  std::sort(missing.begin(), missing.end());
  return missing;
}

int LivenessLinks::poll() noexcept {
  std::lock_guard lock(mutex_);
  return poll_locked();
}

int LivenessLinks::poll_locked() noexcept {
  for (Link& l : links_) {
    if (l.state != Link::State::Awaiting && l.state != Link::State::Up) continue;
    if (l.state == Link::State::Awaiting) {
      bool ended = false;
      if (read_message(l.fd, l.buf, l.have, ended)) {
        Answer a{};
        std::memcpy(&a, l.buf, sizeof(a));
        if (a.magic == kAnswerMagic && a.dialer_nonce == self_.nonce && a.listener_nonce == l.peer_nonce &&
            a.listener_rank == static_cast<uint32_t>(l.peer)) {
          l.state = Link::State::Up;  // an end that came with the answer shows at the next poll
          continue;
        }
        ended = true;  // not the peer's answer: not a link
      }
      if (ended) {
        // Closed unanswered (or answered by someone else): the listener there refused it; no death.
        close_fd(l.fd);
        l.state = Link::State::None;
        l.refused = true;
      }
      continue;
    }
    // Up: nothing is ever sent on a link, so anything readable is its end.
    char byte;
    const ssize_t n = ::recv(l.fd, &byte, 1, MSG_DONTWAIT | MSG_PEEK);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      l.state = Link::State::Gone;
      if (first_gone_ < 0 || l.peer < first_gone_) first_gone_ = l.peer;
    }
  }
  return first_gone_;
}

bool LivenessLinks::gone(int r) const noexcept {
  std::lock_guard lock(mutex_);
  for (const Link& l : links_)
    if (l.peer == r) return l.state == Link::State::Gone;
  return false;
}

std::vector<int> linked_peers(int rank, std::span<const uint64_t> group_of) {
  const uint64_t mine = group_of[static_cast<size_t>(rank)];
  std::map<uint64_t, std::vector<int>> groups;
  for (size_t r = 0; r < group_of.size(); ++r) groups[group_of[r]].push_back(static_cast<int>(r));
  const std::vector<int>& own = groups[mine];
  const size_t i = static_cast<size_t>(std::find(own.begin(), own.end(), rank) - own.begin());
  std::vector<int> peers;
  for (const auto& [key, members] : groups) {
    if (key == mine) continue;
    for (size_t j = 0; j < members.size(); ++j)
      if (i % members.size() == j || j % own.size() == i) peers.push_back(members[j]);
  }
  std::sort(peers.begin(), peers.end());
  return peers;
}

}  // namespace gradsync
