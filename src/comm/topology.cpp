// SPDX-License-Identifier: Apache-2.0
#include "comm/topology.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>

#include "common/error.hpp"
#include "common/fnv.hpp"
#include "common/log.hpp"
#include "common/random.hpp"

namespace gradsync::comm {
namespace {

// One rank's record in the exchange: its identity, NUL-padded, then its probe nonce.
constexpr size_t kRecordWords = 32;
constexpr size_t kIdentityBytes = (kRecordWords - 1) * sizeof(int64_t);

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  if (in) std::getline(in, line);
  return line;
}

std::string probe_path(uint64_t nonce) { return fmt::format("/dev/shm/gradsync-probe.{:016x}", nonce); }

// Leaves this rank's nonce where a peer that shares its /dev/shm can read it; false when it cannot
// (no /dev/shm, full, or the name taken): then only this rank is known to share it.
bool write_probe(uint64_t nonce) {
  const std::string path = probe_path(nonce);
  const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    GS_LOG_DEBUG("topology probe: cannot create {}: {}", path, std::strerror(errno));
    return false;
  }
  const bool ok = ::write(fd, &nonce, sizeof nonce) == static_cast<ssize_t>(sizeof nonce);
  ::close(fd);
  if (!ok) ::unlink(path.c_str());
  return ok;
}

bool read_probe(uint64_t nonce) {
  const int fd = ::open(probe_path(nonce).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return false;
  uint64_t seen = 0;
  const bool ok = ::read(fd, &seen, sizeof seen) == static_cast<ssize_t>(sizeof seen) && seen == nonce;
  ::close(fd);
  return ok;
}

// Greedy in rank order: a rank joins the host of the lowest rank it shares memory with both ways,
// if it does so with every rank already there (a relation that is not transitive, which no real
// machine gives, still yields hosts whose ranks all reach each other).
std::vector<int> group_hosts(int n, const std::function<bool(int, int)>& shares) {
  std::vector<int> host(static_cast<size_t>(n), -1);
  std::vector<std::vector<int>> members;
  for (int r = 0; r < n; ++r) {
    for (size_t h = 0; h < members.size() && host[static_cast<size_t>(r)] < 0; ++h) {
      if (std::all_of(members[h].begin(), members[h].end(), [&](int s) { return shares(r, s); })) {
        host[static_cast<size_t>(r)] = static_cast<int>(h);
        members[h].push_back(r);
      }
    }
    if (host[static_cast<size_t>(r)] < 0) {
      host[static_cast<size_t>(r)] = static_cast<int>(members.size());
      members.push_back({r});
    }
  }
  return host;
}

}  // namespace

std::string host_identity(const std::string& label) {
  if (!label.empty()) return "label:" + label;
  std::array<char, 256> name{};
  if (::gethostname(name.data(), name.size() - 1) != 0) name[0] = '\0';
  struct stat st {};
  const unsigned long long dev = ::stat("/dev/shm", &st) == 0 ? static_cast<unsigned long long>(st.st_dev) : 0;
  std::string id = fmt::format("{}|{}|{:x}", name.data(), read_first_line("/proc/sys/kernel/random/boot_id"), dev);
  if (id.size() >= kIdentityBytes) id.resize(kIdentityBytes - 1);
  return id;
}

Topology topology_from_hosts(const std::vector<int>& rank_host, int my_rank) {
  Topology t;
  t.rank_host = rank_host;
  t.host = rank_host[static_cast<size_t>(my_rank)];
  t.num_hosts = rank_host.empty() ? 0 : *std::max_element(rank_host.begin(), rank_host.end()) + 1;
  t.local_rank = static_cast<int>(std::count(rank_host.begin(), rank_host.begin() + my_rank, t.host));
  t.local_size = static_cast<int>(std::count(rank_host.begin(), rank_host.end(), t.host));
  return t;
}

ReplicaRing::ReplicaRing(const Topology& topology, int size) : order_(static_cast<size_t>(size)) {
  const auto n = static_cast<size_t>(size);
  for (size_t r = 0; r < n; ++r) order_[r] = static_cast<int>(r);
  if (topology.rank_host.size() == n) {
    const std::vector<int>& host = topology.rank_host;
    std::vector<int> local(n, 0), seen(static_cast<size_t>(topology.num_hosts), 0);
    for (size_t r = 0; r < n; ++r) local[r] = seen[static_cast<size_t>(host[r])]++;
    std::stable_sort(order_.begin(), order_.end(), [&](int a, int b) {
      const auto x = static_cast<size_t>(a), y = static_cast<size_t>(b);
      return local[x] != local[y] ? local[x] < local[y] : host[x] < host[y];
    });
  }
  pos_.assign(n, 0);
  for (size_t i = 0; i < n; ++i) pos_[static_cast<size_t>(order_[i])] = static_cast<int>(i);
}

ReplicaRing ReplicaRing::broadcast(const BroadcastWords& broadcast, const ReplicaRing& mine, int size, bool root) {
  const auto n = static_cast<size_t>(size);
  std::vector<int64_t> order(n, 0);
  // A root whose ring has another size sends what fits: no longer a permutation, every rank refuses it.
  if (root) std::copy_n(mine.order_.begin(), std::min(n, mine.order_.size()), order.begin());
  broadcast(order.data(), n);
  ReplicaRing ring;
  ring.pos_.assign(n, -1);
  ring.order_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    GS_REQUIRE(order[i] >= 0 && static_cast<size_t>(order[i]) < n && ring.pos_[static_cast<size_t>(order[i])] < 0,
               GRADSYNC_E_MISMATCH, "a replica ring of {} ranks that is not a permutation of them", n);
    ring.order_[i] = static_cast<int>(order[i]);
    ring.pos_[static_cast<size_t>(order[i])] = static_cast<int>(i);
  }
  return ring;
}

int ReplicaRing::distance(int h, int o) const noexcept {
  const auto n = static_cast<int>(order_.size());
  return ((pos_[static_cast<size_t>(h)] - pos_[static_cast<size_t>(o)]) % n + n) % n;
}

uint64_t ReplicaRing::fingerprint() const noexcept { return fnv1a64(order_.data(), order_.size() * sizeof(int), 0); }

Topology Topology::restricted(const std::vector<int>& members, int my_rank) const {
  // Renumbered by lowest rank, as detection numbers them.
  std::vector<int> renumber(static_cast<size_t>(num_hosts), -1);
  std::vector<int> hosts;
  hosts.reserve(members.size());
  int next = 0;
  for (int parent : members) {
    int& h = renumber[static_cast<size_t>(rank_host[static_cast<size_t>(parent)])];
    if (h < 0) h = next++;
    hosts.push_back(h);
  }
  return topology_from_hosts(hosts, my_rank);
}

Topology detect_topology(int rank, int size, const AllgatherWords& allgather, const std::string& label,
                         bool shares_memory) {
  const int n = size;
  const auto un = static_cast<size_t>(n);
  const std::string identity = host_identity(label);
  const uint64_t nonce = random_nonce() | 1;  // 0 says "no probe file"
  const bool probing = !shares_memory && n > 1;
  const bool probe_written = probing && write_probe(nonce);
  struct Unlink {
    bool armed;
    uint64_t nonce;
    ~Unlink() {
      if (armed) ::unlink(probe_path(nonce).c_str());
    }
  } unlink_probe{probe_written, nonce};

  std::vector<int64_t> records(kRecordWords * un, 0);
  std::array<int64_t, kRecordWords> mine{};
  std::memcpy(mine.data(), identity.data(), std::min(identity.size(), kIdentityBytes - 1));
  mine[kRecordWords - 1] = static_cast<int64_t>(probe_written ? nonce : 0);
  allgather(mine.data(), records.data(), records.size());

  auto identity_of = [&](int r) {
    const char* p = reinterpret_cast<const char*>(&records[kRecordWords * static_cast<size_t>(r)]);
    return std::string(p, strnlen(p, kIdentityBytes));
  };
  std::vector<std::string> ids(un);
  for (int r = 0; r < n; ++r) ids[static_cast<size_t>(r)] = identity_of(r);

  std::vector<uint64_t> sees;  // sees[r * words + s / 64] bit s % 64: r read s's probe
  const size_t words = (un + 63) / 64;
  if (probing) {
    std::vector<uint64_t> row(words, 0);
    for (int s = 0; s < n; ++s) {
      const auto nonce_s = static_cast<uint64_t>(records[kRecordWords * static_cast<size_t>(s) + kRecordWords - 1]);
      const bool seen = s == rank || (ids[static_cast<size_t>(s)] == identity && nonce_s != 0 && probe_written &&
                                      read_probe(nonce_s));
      if (seen) row[static_cast<size_t>(s) / 64] |= uint64_t{1} << (s % 64);
    }
    sees.assign(words * un, 0);
    // Every rank's reads are done once this returns: the files may go.
    allgather(row.data(), sees.data(), sees.size());
  }
  auto shares = [&](int r, int s) {
    if (ids[static_cast<size_t>(r)] != ids[static_cast<size_t>(s)]) return false;
    if (!probing) return true;
    auto bit = [&](int a, int b) {
      return (sees[static_cast<size_t>(a) * words + static_cast<size_t>(b) / 64] >> (b % 64)) & 1u;
    };
    return bit(r, s) != 0 && bit(s, r) != 0;
  };
  Topology t = topology_from_hosts(group_hosts(n, shares), rank);
  GS_LOG_DEBUG("topology: rank {} of {} is local rank {} of {} on host {} of {} ({})", rank, n, t.local_rank,
               t.local_size, t.host, t.num_hosts, identity);
  return t;
}

}  // namespace gradsync::comm
