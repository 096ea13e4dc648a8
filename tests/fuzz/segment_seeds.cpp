// SPDX-License-Identifier: Apache-2.0
// Writes seeds of segment_fuzz in this build's segment format: a group of 1 to 4 ranks forming,
// every rank but the joiner (the last) already in with a live lock, and the peers' CPU masks all
// CPUs, none, one each, or (with rank 0 still missing, so the join times out) CPU 0; then all CPUs
// with a cgroup CPU limit of 1 each, and with limits no kernel gives (-7, then INT32_MAX). Run it
// after a change of the segment's format; the fuzzer grows the corpus from them.
//   segment_seeds DIR
#include <cstdio>
#include <new>
#include <string>
#include <vector>

#include "comm/transport/shm/segment.hpp"

namespace shm = gradsync::comm::shm;
using gradsync::comm::RankSlot;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  for (int n = 1; n <= 4; ++n) {
    // The harness sizes the file in 64 KiB units (input byte 3), and a valid header's total must be
    // the file's size: the smallest heap that makes it so.
    uint64_t heap = 1;
    while ((shm::compute_layout(n, heap).total_bytes % 65536) != 0) ++heap;
    const shm::Layout l = shm::compute_layout(n, heap);
    if (l.total_bytes / 65536 > 255) return 1;
    for (int variant = 0; variant < 7; ++variant) {
      const int joiner = n - 1;
      std::vector<unsigned char> image(l.control.slots + n * sizeof(RankSlot), 0);
      auto* h = new (image.data()) shm::Header();
      h->format_version = shm::kFormatVersion;
      h->generation = 0x5eed0000u + static_cast<uint64_t>(variant);
      h->size = n;
      h->creator_pid = 1;
      h->total_bytes = l.total_bytes;
      h->heap_offset = l.heap_offset;
      h->heap_bytes_per_rank = heap;
      h->joined.store(static_cast<uint32_t>(n - 1));
      h->magic.store(shm::kSegmentMagic);
      unsigned alive = 0;
      for (int r = 0; r < joiner; ++r) {
        if (variant == 3 && r == 0) continue;
        auto* s = new (image.data() + l.control.slots + r * sizeof(RankSlot)) RankSlot();
        s->pid.store(1);  // a live process (kill(1, 0) does not say ESRCH)
        s->generation.store(h->generation);
        for (int i = 0; i < 16; ++i) {
          const uint64_t all = ~uint64_t{0}, one = i == r / 64 ? uint64_t{1} << (r % 64) : 0, cpu0 = i == 0 ? 1 : 0;
          s->cpu_mask[i].store(variant == 1 ? 0 : variant == 2 ? one : variant == 3 ? cpu0 : all);
        }
        s->cpu_limit.store(variant == 4 ? 1 : variant == 5 ? -7 : variant == 6 ? 0x7fffffff : 0);
        alive |= 1u << r;
      }
      std::vector<unsigned char> input = {static_cast<unsigned char>(joiner), static_cast<unsigned char>(n - 1),
                                          static_cast<unsigned char>(alive),
                                          static_cast<unsigned char>(l.total_bytes / 65536)};
      input.insert(input.end(), image.begin(), image.end());
      const std::string path = std::string(argv[1]) + "/seed-format" + std::to_string(shm::kFormatVersion) + "-size" +
                               std::to_string(n) + "-v" + std::to_string(variant);
      FILE* f = std::fopen(path.c_str(), "wb");
      if (f == nullptr || std::fwrite(input.data(), 1, input.size(), f) != input.size() || std::fclose(f) != 0) {
        std::perror(path.c_str());
        return 1;
      }
    }
  }
  return 0;
}
