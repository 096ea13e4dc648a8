// SPDX-License-Identifier: Apache-2.0
// Saving and loading the sharded embedding: every rank writes or reads its part of a checkpoint
// (embedding/checkpoint.hpp), and the ranks agree on each step's outcome.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "comm/types.hpp"
#include "common/error.hpp"
#include "common/random.hpp"
#include "embedding/checkpoint.hpp"
#include "embedding/embedding.hpp"

namespace gradsync::embedding {

using namespace checkpoint;

void ShardedTable::save(const std::string& dir, bool incremental) {
  uint64_t nonce = comm_->rank() == 0 ? random_nonce() : 0;
  comm_->broadcast(&nonce, 1, DType::I64, 0);
  const auto d = static_cast<uint64_t>(options_.dim);
  const auto sw = static_cast<uint64_t>(state_width());

  // An incremental save stacks a layer on the checkpoint in dir, which must be one this table knows
  // the pushed rows since (bases_) and still be there; every rank checks, and all refuse alike.
  Manifest base;
  int from = -1;  // the base the layer builds on
  if (incremental) {
    const Outcome checked = capture([&] {
      for (int k = 0; k < 2 && from < 0; ++k)
        if (!bases_[k].dir.empty() && bases_[k].dir == dir) from = k;
      GS_REQUIRE(from >= 0, GRADSYNC_E_MISUSE,
                 "an incremental save needs the checkpoint this table last saved or loaded, or saved before "
                 "that, in '{}'{}",
                 dir,
                 bases_[0].dir.empty() ? " (it has none: save in full first)"
                                       : fmt::format(" (its last is in '{}')", bases_[0].dir));
      base = read_manifest(dir);
      GS_REQUIRE(base.layers.back().nonce == bases_[from].nonce, GRADSYNC_E_MISUSE,
                 "the checkpoint in '{}' is not the one this table saved or loaded there (another save replaced "
                 "it): save in full",
                 dir);
      GS_REQUIRE(base.layers.size() < static_cast<size_t>(kMaxLayers), GRADSYNC_E_MISUSE,
                 "'{}' holds {} layers already: save in full", dir, base.layers.size());
      GS_REQUIRE(base.header.rows == options_.rows && base.header.dim == options_.dim &&
                     base.header.state_width == static_cast<int32_t>(sw),
                 GRADSYNC_E_MISMATCH, "the checkpoint in '{}' has another shape", dir);
    });
    agree(checked.status, checked.message);
  }

  // 1. Every rank writes its part in parallel: all its rows, or those pushed since the base.
  std::vector<int64_t> ids;
  std::vector<float> rows, state;
  const int64_t* id_data = owned_.data();
  const float* row_data = params_->data();
  const float* state_data = sw != 0 ? state_->data() : nullptr;
  uint64_t count = owned_.size();
  if (incremental) {
    for (size_t l = 0; l < owned_.size(); ++l) {
      if (!(dirty_[l] & (1u << from))) continue;
      ids.push_back(owned_[l]);
      rows.insert(rows.end(), params_->row_ptr(static_cast<int64_t>(l)), params_->row_ptr(static_cast<int64_t>(l)) + d);
      if (sw != 0)
        state.insert(state.end(), state_->row_ptr(static_cast<int64_t>(l)),
                     state_->row_ptr(static_cast<int64_t>(l)) + sw);
    }
    id_data = ids.data();
    row_data = rows.data();
    state_data = state.data();
    count = ids.size();
  }
  uint64_t payload_checksum = 0;
  const Outcome wrote = capture([&] {
    PartHeader h{};
    h.rows = options_.rows;
    h.dim = options_.dim;
    h.state_width = static_cast<int32_t>(sw);
    h.part = comm_->rank();
    h.parts = comm_->size();
    h.nonce = nonce;
    h.count = count;
    payload_checksum = write_part(dir, h, id_data, row_data, state_data, [&] { params_->check_mapping(); });
  });
  const std::vector<int64_t> parts =
      agree(wrote.status, wrote.message, static_cast<int64_t>(count), static_cast<int64_t>(payload_checksum));

  // 2. Rank 0 commits the layer with the manifest, then clears out parts no layer names.
  Outcome committed;
  if (comm_->rank() == 0) {
    committed = capture([&] {
      Manifest m;
      if (incremental) {
        m.layers = base.layers;
        m.parts = base.parts;
      }
      ManifestHeader& h = m.header;
      std::memcpy(h.magic, kManifestMagic, sizeof h.magic);
      h.format_version = kFormatVersion;
      h.byte_order = kByteOrder;
      h.rows = options_.rows;
      h.dim = options_.dim;
      h.optimizer = static_cast<int32_t>(options_.optimizer);
      h.state_width = static_cast<int32_t>(sw);
      h.sharding = static_cast<int32_t>(options_.sharding);
      h.steps = steps_;
      h.lr = options_.lr;
      h.eps = options_.eps;
      m.layers.push_back(LayerEntry{nonce, static_cast<uint64_t>(comm_->size())});
      std::vector<PartEntry> entries(static_cast<size_t>(comm_->size()));
      for (size_t p = 0; p < entries.size(); ++p) {
        entries[p].count = static_cast<uint64_t>(parts[2 * p]);
        entries[p].payload_checksum = static_cast<uint64_t>(parts[2 * p + 1]);
      }
      m.parts.push_back(std::move(entries));
      h.layers = static_cast<int32_t>(m.layers.size());
      h.parts = 0;
      for (const LayerEntry& l : m.layers) h.parts += l.parts;
      commit(dir, m);
    });
  }
  agree(committed.status, committed.message);
  // Saved into another directory than the last: that one becomes the base before, and the rows
  // pushed since it are those pushed since the last save. Into the same one: the base before stays.
  if (bases_[0].dir != dir) {
    bases_[1] = bases_[0];
    for (uint8_t& b : dirty_) b = static_cast<uint8_t>((b & 1u) << 1);
  } else {
    for (uint8_t& b : dirty_) b &= 2u;
  }
  bases_[0] = Base{dir, nonce};
}

void ShardedTable::load(const std::string& dir) {
  const uint64_t local = owned_.size();
  const auto d = static_cast<uint64_t>(options_.dim);
  Shape shape;
  shape.rows = options_.rows;
  shape.dim = options_.dim;
  shape.state_width = state_width();
  shape.optimizer = static_cast<int32_t>(options_.optimizer);
  // Staged, and copied into the shard only when every rank has read all of its rows.
  Staged staged;
  const Outcome read = capture([&] { staged = read_rows(dir, shape, owned_); });
  const ManifestHeader& m = staged.manifest.header;
  const uint64_t last = read.status == GRADSYNC_OK ? staged.manifest.layers.back().nonce : 0;
  const std::vector<int64_t> nonces = agree(read.status, read.message, static_cast<int64_t>(last), m.steps);
  for (size_t r = 1; r < nonces.size() / 2; ++r) {
    GS_REQUIRE(nonces[2 * r] == nonces[0], GRADSYNC_E_MISMATCH,
               "rank {} read another checkpoint than rank 0 in '{}' (was it being saved meanwhile?)", r, dir);
  }
  // The mirrors take the loaded rows before the shard does, so that a failure changes nothing.
  std::vector<Storage> mirrors;
  if (mirror_count(layout_) > 0)
    fill_mirrors(*comm_, rank_, layout_, ring_, staged.values.get(),
                 staged.state.empty() ? nullptr : staged.state.data(), mirrors);
  if (local > 0) {
    std::memcpy(params_->data(), staged.values.get(), local * d * 4);
    if (!staged.state.empty()) std::memcpy(state_->data(), staged.state.data(), staged.state.size() * 4);
    params_->check_mapping();
  }
  steps_ = m.steps;
  if (mirror_count(layout_) > 0) {
    mirrors_ = std::move(mirrors);
    mirrors_valid_ = true;
  }
  std::fill(dirty_.begin(), dirty_.end(), 0);
  bases_[0] = Base{dir, last};
  bases_[1] = Base{};
}

}  // namespace gradsync::embedding
