// SPDX-License-Identifier: Apache-2.0
// Writes seeds of checkpoint_fuzz: real checkpoints of small sharded tables (1, 2 and 3 ranks on
// threads; SGD, row-wise Adagrad and Adam; contiguous and hash; a full save alone and with an
// incremental layer on it), each packed as checkpoint_fuzz.hpp says and read by every kind of
// reader, with and without the harness's sealing. Run it after a change of the checkpoint format;
// the fuzzer grows the corpus from them.
//   checkpoint_seeds DIR
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint_fuzz.hpp"
#include "embedding/checkpoint.hpp"
#include "gradsync/comm.h"
#include "gradsync/embedding.h"
#include "gradsync/errors.h"

namespace ck = gradsync::embedding::checkpoint;

namespace {

struct Config {
  int ranks;
  int64_t rows, dim;
  int32_t optimizer, sharding;
  bool incremental;
};

bool ok(int status, const char* what) {
  if (status == GRADSYNC_OK) return true;
  std::fprintf(stderr, "%s: %s\n", what, gradsync_last_error_message());
  return false;
}

bool save_rank(const Config& c, int rank, const std::string& group, const std::string& dir) {
  gradsync_comm_options co = GRADSYNC_COMM_OPTIONS_INIT;
  co.transport = GRADSYNC_TRANSPORT_THREAD;
  co.rank = rank;
  co.size = c.ranks;
  std::snprintf(co.name, sizeof co.name, "%s", group.c_str());
  gradsync_comm* comm = nullptr;
  if (!ok(gradsync_comm_create(&comm, &co), "join")) return false;
  gradsync_embedding_options o = GRADSYNC_EMBEDDING_OPTIONS_INIT;
  o.rows = c.rows;
  o.dim = c.dim;
  o.optimizer = c.optimizer;
  o.sharding = c.sharding;
  o.init = GRADSYNC_TABLE_INIT_UNIFORM;
  o.seed = 7;
  gradsync_embedding* t = nullptr;
  bool good = ok(gradsync_embedding_create(&t, comm, nullptr, &o), "create");
  // Each rank pushes a few ids of its own (some repeated), so that the rows differ and the
  // incremental layer holds some rows of every part.
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 6; ++i) ids.push_back((rank * 7 + i * 5) % c.rows);
  std::vector<float> grads(ids.size() * static_cast<size_t>(c.dim));
  for (size_t i = 0; i < grads.size(); ++i) grads[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
  good = good && ok(gradsync_embedding_push(t, ids.data(), ids.size(), grads.data(), grads.size()), "push");
  good = good && ok(gradsync_embedding_save(t, dir.c_str()), "save");
  if (c.incremental) {
    good = good && ok(gradsync_embedding_push(t, ids.data(), 2, grads.data(), 2 * c.dim), "push");
    good = good && ok(gradsync_embedding_save_incremental(t, dir.c_str()), "incremental save");
  }
  gradsync_embedding_free(t);
  gradsync_comm_free(comm);
  return good;
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void put_file(std::vector<uint8_t>& out, const std::vector<uint8_t>& bytes) {
  const auto len = static_cast<uint32_t>(bytes.size());
  const auto* p = reinterpret_cast<const uint8_t*>(&len);
  out.insert(out.end(), p, p + sizeof len);
  out.insert(out.end(), bytes.begin(), bytes.end());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string out_dir = argv[1];
  const Config configs[] = {
      {1, 50, 4, GRADSYNC_OPTIM_SGD, GRADSYNC_EMBEDDING_CONTIGUOUS, false},
      {2, 60, 3, GRADSYNC_OPTIM_ROW_ADAGRAD, GRADSYNC_EMBEDDING_CONTIGUOUS, true},
      {3, 37, 5, GRADSYNC_OPTIM_ROW_ADAGRAD, GRADSYNC_EMBEDDING_HASH, false},
      {2, 1, 16, GRADSYNC_OPTIM_SGD, GRADSYNC_EMBEDDING_HASH, true},
      {2, 40, 3, GRADSYNC_OPTIM_ADAM, GRADSYNC_EMBEDDING_CONTIGUOUS, true},
      {3, 29, 2, GRADSYNC_OPTIM_ADAM, GRADSYNC_EMBEDDING_HASH, false},
  };
  int n = 0;
  for (const Config& c : configs) {
    char tmpl[] = "/tmp/gradsync-checkpoint-seeds-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return 1;
    const std::string dir = std::string(tmpl) + "/ckpt", group = "ckseeds-" + std::to_string(n);
    std::vector<std::thread> threads;
    std::vector<char> good(static_cast<size_t>(c.ranks), 0);
    for (int r = 0; r < c.ranks; ++r) threads.emplace_back([&, r] { good[r] = save_rank(c, r, group, dir); });
    for (std::thread& t : threads) t.join();
    for (char g : good)
      if (!g) return 1;
    const std::vector<uint8_t> manifest = read_file(dir + "/" + ck::kManifestName);
    ck::ManifestHeader h{};
    std::memcpy(&h, manifest.data(), sizeof h);
    std::vector<uint8_t> files;
    put_file(files, manifest);
    for (int32_t l = 0; l < h.layers; ++l) {
      ck::LayerEntry le{};
      std::memcpy(&le, manifest.data() + sizeof h + l * sizeof le, sizeof le);
      for (uint64_t p = 0; p < le.parts; ++p)
        put_file(files,
                 read_file(dir + "/" + ck::part_name(static_cast<int>(p), static_cast<int>(le.parts), le.nonce)));
    }
    for (uint8_t reader = 0; reader < 8; ++reader) {
      std::vector<uint8_t> input = {static_cast<uint8_t>(c.rows - 1), static_cast<uint8_t>(c.dim - 1),
                                    static_cast<uint8_t>(c.optimizer), reader};
      input.insert(input.end(), files.begin(), files.end());
      std::ofstream(out_dir + "/seed-" + std::to_string(n) + "-" + std::to_string(reader), std::ios::binary)
          .write(reinterpret_cast<const char*>(input.data()), static_cast<std::streamsize>(input.size()));
    }
    std::filesystem::remove_all(tmpl);
    ++n;
  }
  std::printf("wrote %d checkpoints x 8 readers to %s\n", n, out_dir.c_str());
  return 0;
}
