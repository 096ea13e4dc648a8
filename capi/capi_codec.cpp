// SPDX-License-Identifier: Apache-2.0
// C shims of the codecs (include/gradsync/codec.h).
#include <cstdint>
#include <limits>

#include "capi/guard.hpp"
#include "codec/codec.hpp"
#include "gradsync/codec.h"

namespace {
using gradsync::capi::guard;
using gradsync::codec::Codec;

// Element counts whose byte size cannot be represented are errors, not overflows.
constexpr size_t kMaxCount = std::numeric_limits<size_t>::max() / 8;

void require_buffer(const void* p, size_t count, const char* what) {
  GS_REQUIRE(count <= kMaxCount, GRADSYNC_E_INVALID_ARG, "{} count {} is too large", what, count);
  GS_REQUIRE(p != nullptr || count == 0, GRADSYNC_E_INVALID_ARG, "{} buffer is NULL for count {}", what, count);
}

// [offset, offset + count) must lie inside a buffer of `size` elements.
void require_range(size_t offset, size_t count, size_t size, const char* what) {
  GS_REQUIRE(offset <= size && count <= size - offset, GRADSYNC_E_INVALID_ARG,
             "elements [{}, {}) run past the end of the {}-element {} buffer", offset,
             offset > kMaxCount || count > kMaxCount ? kMaxCount : offset + count, size, what);
}

}  // namespace

extern "C" {

GRADSYNC_API int gradsync_codec_encode(int32_t codec, const float* src, size_t count, void* dst, size_t dst_capacity) {
  return guard(__func__, [&] {
    const Codec c = gradsync::codec::to_codec(codec, false);
    require_buffer(src, count, "source");
    require_buffer(dst, dst_capacity, "destination");
    GS_REQUIRE(count <= dst_capacity, GRADSYNC_E_BUFS,
               "encoding {} elements needs {} in the destination, capacity is {}", count, count, dst_capacity);
    gradsync::codec::encode(c, src, count, static_cast<uint16_t*>(dst));
  });
}

GRADSYNC_API int gradsync_codec_decode(int32_t codec, const void* src, size_t src_count, size_t offset, float* dst,
                                       size_t count) {
  return guard(__func__, [&] {
    const Codec c = gradsync::codec::to_codec(codec, false);
    require_buffer(src, src_count, "encoded source");
    require_buffer(dst, count, "destination");
    require_range(offset, count, src_count, "encoded source");
    gradsync::codec::decode(c, static_cast<const uint16_t*>(src) + offset, count, dst);
  });
}

GRADSYNC_API int gradsync_codec_add(int32_t codec, void* dst, size_t dst_count, size_t offset, const void* src,
                                    size_t count) {
  return guard(__func__, [&] {
    const Codec c = gradsync::codec::to_codec(codec, false);
    require_buffer(dst, dst_count, "encoded destination");
    require_buffer(src, count, "encoded source");
    require_range(offset, count, dst_count, "encoded destination");
    gradsync::codec::add_encoded(c, static_cast<uint16_t*>(dst) + offset, static_cast<const uint16_t*>(src), count);
  });
}

GRADSYNC_API int gradsync_codec_accumulate(int32_t codec, float* dst, size_t dst_count, size_t offset, const void* src,
                                           size_t count) {
  return guard(__func__, [&] {
    const Codec c = gradsync::codec::to_codec(codec, false);
    require_buffer(dst, dst_count, "destination");
    require_buffer(src, count, "encoded source");
    require_range(offset, count, dst_count, "destination");
    gradsync::codec::accumulate(c, static_cast<const uint16_t*>(src), count, dst + offset);
  });
}

}  // extern "C"
