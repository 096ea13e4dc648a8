// SPDX-License-Identifier: Apache-2.0
#include "comm/engine/control.hpp"

#include <new>

namespace gradsync::comm {
namespace {
constexpr uint64_t kPage = 4096;
constexpr uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
}  // namespace

ControlLayout control_layout(int size, uint64_t header_bytes) noexcept {
  const uint64_t n = static_cast<uint64_t>(size);
  ControlLayout l{};
  l.barrier = align_up(header_bytes, 64);
  l.slots = align_up(l.barrier + sizeof(std::atomic<uint64_t>) + n * 2 * sizeof(int64_t), 64);
  l.tables = align_up(l.slots + n * sizeof(RankSlot), 64);
  l.inline_data = align_up(l.tables + n * 2 * kMaxTableBuffers * sizeof(BufferAddress), kPage);
  l.stage_in = align_up(l.inline_data + n * 2 * kInlineBytes, kPage);
  l.stage_out = align_up(l.stage_in + n * kStageDepth * kChunkBytes, kPage);
  l.membership = align_up(l.stage_out + kStageDepth * kChunkBytes, kPage);
  l.end = align_up(l.membership + sizeof(MembershipWords) + n * sizeof(MemberSlot), kPage);
  return l;
}

void construct_control(char* block, const ControlLayout& l, int size) noexcept {
  new (block + l.barrier) std::atomic<uint64_t>(0);
  for (int r = 0; r < size; ++r) new (block + l.slots + static_cast<uint64_t>(r) * sizeof(RankSlot)) RankSlot();
  new (block + l.membership) MembershipWords();
  for (int r = 0; r < size; ++r) {
    new (block + l.membership + sizeof(MembershipWords) + static_cast<uint64_t>(r) * sizeof(MemberSlot)) MemberSlot();
  }
}

}  // namespace gradsync::comm
