// SPDX-License-Identifier: Apache-2.0
#pragma once
// The input of checkpoint_fuzz: a checkpoint directory packed into one byte string.
//   4 bytes   the loading table: rows - 1, (dim - 1) % 16, optimizer % 3 (0 sgd, 1 row-wise
//             Adagrad, 2 Adam), then a byte whose low two bits say which rows this reader owns (all; the
//             first half; the second half; the odd ids: a part not read in place) and whose bit 2
//             has the harness write every checksum as a writer would (parts' payload and header,
//             the manifest's part entries, entries and header), so that mutations reach the
//             checks behind the checksums, which a fuzzer does not solve
//   then files, each a uint32 length (little-endian; a length past the end takes what is left)
//   and its bytes: first checkpoint.gsemb, then the parts in the order its layers list them,
//   each named as the manifest's bytes name it (so a mutated nonce or part count renames them).
#include <cstddef>
#include <cstdint>

namespace gradsync_fuzz {
constexpr size_t kCheckpointPrefix = 4;
}  // namespace gradsync_fuzz
