// SPDX-License-Identifier: Apache-2.0
// Runs every file of a fuzz target's corpus (tests/fuzz/corpus/<target>/) through the target's
// entry point, so the normal build (any compiler, no libFuzzer) keeps replaying what the fuzzer
// found. The entry point aborts on any outcome a bad input must not have.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  size_t n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(argv[1])) {
    if (!entry.is_regular_file()) continue;
    std::ifstream f(entry.path(), std::ios::binary);
    const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
    ++n;
  }
  std::printf("replayed %zu inputs from %s\n", n, argv[1]);
  return n > 0 ? 0 : 1;  // an empty corpus tests nothing
}
