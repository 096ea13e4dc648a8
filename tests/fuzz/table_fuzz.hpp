// SPDX-License-Identifier: Apache-2.0
#pragma once
#include <cstddef>
#include <cstdint>

// Opens `size` bytes as a table file (read-only, any shape) and as an accumulator's gradient file;
// reads every row of whatever opens. Returns the table open's status; *accum_status gets the
// accumulator's. Aborts on a status that a bad file must never produce (internal, invalid argument).
int gradsync_fuzz_open_table(const uint8_t* data, size_t size, int* accum_status);
