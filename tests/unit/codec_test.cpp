// SPDX-License-Identifier: Apache-2.0
// The 16-bit gradient codecs: BigDL's own acceptance cases, rounding, NaN/Inf, F16C equivalence.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "codec/codec.hpp"

using gradsync::codec::Codec;
namespace codec = gradsync::codec;

namespace {

std::vector<float> roundtrip(Codec c, const std::vector<float>& in) {
  std::vector<uint16_t> enc(in.size());
  std::vector<float> out(in.size());
  codec::encode(c, in.data(), in.size(), enc.data());
  codec::decode(c, enc.data(), enc.size(), out.data());
  return out;
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

}  // namespace

TEST_CASE("BigDL fp16 matches BigDL's FP16CompressedTensor test values", "[codec]") {
  const auto out =
      roundtrip(Codec::BigdlFp16, {1.111111f, 2.111111f, 3.111111f, 4.111111f, 5.111111f, -4.111111f, 0.1f});
  CHECK(out[0] == 1.109375f);
  CHECK(out[1] == 2.109375f);
  CHECK(out[2] == 3.109375f);
  CHECK(out[3] == 4.09375f);
  CHECK(out[4] == 5.09375f);
  CHECK(out[5] == -4.09375f);
  CHECK(out[6] == 0.099609375f);
}

TEST_CASE("BigDL fp16 is the high half of the float, big-endian", "[codec]") {
  const float one = 1.0f, minus_two = -2.0f;
  uint16_t enc[2];
  codec::encode(Codec::BigdlFp16, &one, 1, enc);
  codec::encode(Codec::BigdlFp16, &minus_two, 1, enc + 1);
  const auto* bytes = reinterpret_cast<const unsigned char*>(enc);
  // BigDL writes (bits >>> 24, bits >>> 16): 1.0f = 0x3f800000, -2.0f = 0xc0000000.
  CHECK(bytes[0] == 0x3f);
  CHECK(bytes[1] == 0x80);
  CHECK(bytes[2] == 0xc0);
  CHECK(bytes[3] == 0x00);
  // Truncation, never rounding up: the largest float below 2 stays below 2.
  const auto out = roundtrip(Codec::BigdlFp16, {std::nextafter(2.0f, 0.0f)});
  CHECK(out[0] == 1.9921875f);
}

TEST_CASE("integers round-trip exactly in every codec", "[codec]") {
  std::vector<float> ints;
  for (int i = -256; i <= 256; ++i) ints.push_back(static_cast<float>(i));
  for (Codec c : {Codec::BigdlFp16, Codec::Bf16, Codec::Fp16}) {
    CHECK(roundtrip(c, ints) == ints);
  }
  std::vector<float> halves;
  for (int i = -2048; i <= 2048; ++i) halves.push_back(static_cast<float>(i));
  CHECK(roundtrip(Codec::Fp16, halves) == halves);
}

TEST_CASE("compressed add, whole and into a slice, as BigDL's add(data, offset, length)", "[codec]") {
  const std::vector<float> a{1, 2, 3, 4, 5}, b{2, 3, 4, 5, 6};
  for (Codec c : {Codec::BigdlFp16, Codec::Bf16, Codec::Fp16}) {
    std::vector<uint16_t> ea(5), eb(5);
    codec::encode(c, a.data(), 5, ea.data());
    codec::encode(c, b.data(), 5, eb.data());
    std::vector<uint16_t> whole = ea;
    codec::add_encoded(c, whole.data(), eb.data(), 5);
    std::vector<float> out(5);
    codec::decode(c, whole.data(), 5, out.data());
    CHECK(out == std::vector<float>{3, 5, 7, 9, 11});
    // bytes(1, 2) of the second tensor added at offset 1, length 2 of the first.
    std::vector<uint16_t> slice = ea;
    codec::add_encoded(c, slice.data() + 1, eb.data() + 1, 2);
    codec::decode(c, slice.data(), 5, out.data());
    CHECK(out == std::vector<float>{1, 5, 7, 4, 5});
  }
}

TEST_CASE("accumulate sums decoded values in f32", "[codec]") {
  // 1 + 1/512 is not representable in bf16, but the f32 sum of two encoded values is exact.
  const std::vector<float> small{0.001953125f};
  std::vector<uint16_t> enc(1);
  codec::encode(Codec::Bf16, small.data(), 1, enc.data());
  float acc = 1.0f;
  codec::accumulate(Codec::Bf16, enc.data(), 1, &acc);
  CHECK(acc == 1.001953125f);
  codec::accumulate_scaled(Codec::Bf16, enc.data(), 1, 2.0f, &acc);
  CHECK(acc == 1.005859375f);
}

TEST_CASE("bf16 rounds to nearest even", "[codec]") {
  const auto out = roundtrip(
      Codec::Bf16, {1.0f + 1.0f / 256, 1.0f + 3.0f / 256, 1.111111f, -4.111111f, std::numeric_limits<float>::max()});
  CHECK(out[0] == 1.0f);               // halfway, 1.0 is even
  CHECK(out[1] == 1.0f + 4.0f / 256);  // halfway, rounds up to the even neighbour
  CHECK(out[2] == 1.109375f);          // 1.111111 is below the midpoint 1.1132812
  CHECK(out[3] == -4.125f);            // BigDL's truncation gives -4.09375; rounding gives the nearer -4.125
  CHECK(std::isinf(out[4]));           // beyond bf16's largest finite value after rounding
}

TEST_CASE("IEEE half rounds to nearest even, with subnormals and overflow", "[codec]") {
  const auto out =
      roundtrip(Codec::Fp16, {65504.0f, 65519.0f, 65520.0f, -1e6f, 1e-8f, 6e-8f, 0.1f, 1.0f + 1.0f / 2048, -0.0f});
  CHECK(out[0] == 65504.0f);
  CHECK(out[1] == 65504.0f);
  CHECK(std::isinf(out[2]));
  CHECK((std::isinf(out[3]) && out[3] < 0));
  CHECK(out[4] == 0.0f);
  CHECK(out[5] == std::ldexp(1.0f, -24));
  CHECK(out[6] == 0.0999755859375f);
  CHECK(out[7] == 1.0f);
  CHECK((out[8] == 0.0f && std::signbit(out[8])));
}

TEST_CASE("NaN stays NaN and Inf stays Inf in every codec", "[codec]") {
  const float inf = std::numeric_limits<float>::infinity();
  // 0x7f800001: a NaN whose payload is only in the low bits; plain truncation would make it Inf.
  const std::vector<float> specials{inf,
                                    -inf,
                                    std::numeric_limits<float>::quiet_NaN(),
                                    from_bits(0x7f800001u),
                                    from_bits(0xff800001u),
                                    std::numeric_limits<float>::signaling_NaN()};
  for (Codec c : {Codec::BigdlFp16, Codec::Bf16, Codec::Fp16}) {
    INFO(codec::codec_name(c));
    const auto out = roundtrip(c, specials);
    CHECK((std::isinf(out[0]) && out[0] > 0));
    CHECK((std::isinf(out[1]) && out[1] < 0));
    for (size_t i = 2; i < out.size(); ++i) CHECK(std::isnan(out[i]));
  }
}

TEST_CASE("the F16C path and the scalar path give the same bits", "[codec]") {
  std::vector<float> in;
  for (uint64_t u = 0; u <= 0xffffffffu; u += 4099) in.push_back(from_bits(static_cast<uint32_t>(u)));
  for (uint32_t u : {0x477fe000u, 0x477fefffu, 0x477ff000u, 0x477fffffu, 0x47800000u, 0x33000000u, 0x33000001u,
                     0x387fc000u, 0x387fe000u, 0x7f800001u, 0x7fc00000u, 0xffc00123u, 0x00000001u, 0x80000001u})
    in.push_back(from_bits(u));
  std::vector<uint16_t> fast(in.size());
  codec::encode(Codec::Fp16, in.data(), in.size(), fast.data());
  size_t differ = 0;
  for (size_t i = 0; i < in.size(); ++i) differ += fast[i] != codec::float_to_half_scalar(in[i]);
  CHECK(differ == 0);

  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> decoded(all.size());
  codec::decode(Codec::Fp16, all.data(), all.size(), decoded.data());
  size_t decode_differ = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const float ref = codec::half_to_float_scalar(all[i]);
    decode_differ += std::isnan(ref) ? !std::isnan(decoded[i]) : to_bits(ref) != to_bits(decoded[i]);
  }
  CHECK(decode_differ == 0);
}

TEST_CASE("odd lengths use the tails correctly", "[codec]") {
  for (size_t n : {0u, 1u, 7u, 8u, 9u, 1023u, 1024u, 1025u, 3001u}) {
    std::vector<float> in(n);
    for (size_t i = 0; i < n; ++i) in[i] = static_cast<float>(i % 200) - 100.0f;
    for (Codec c : {Codec::BigdlFp16, Codec::Bf16, Codec::Fp16}) CHECK(roundtrip(c, in) == in);
    std::vector<float> acc(n, 1.0f);
    std::vector<uint16_t> enc(n);
    codec::encode(Codec::Fp16, in.data(), n, enc.data());
    codec::accumulate(Codec::Fp16, enc.data(), n, acc.data());
    for (size_t i = 0; i < n; ++i) REQUIRE(acc[i] == in[i] + 1.0f);
  }
}

TEST_CASE("error feedback carries what the codec lost into the next step", "[codec]") {
  // A gradient of 1/1000 per step: bf16 loses bits every step, but the residual makes the sum of
  // what was sent track the sum of the true gradients to within one bf16 quantum.
  const float g = 0.001f;
  float residual = 0.0f, sent_total = 0.0f;
  double true_total = 0.0;
  for (int step = 0; step < 1000; ++step) {
    uint16_t enc;
    codec::encode_with_feedback(Codec::Bf16, &g, 1, &residual, &enc);
    float sent;
    codec::decode(Codec::Bf16, &enc, 1, &sent);
    sent_total += sent;
    true_total += g;
  }
  CHECK(std::abs(sent_total - true_total) < 1e-5);
  // A non-finite gradient does not poison the residual.
  const float inf = std::numeric_limits<float>::infinity();
  uint16_t enc;
  codec::encode_with_feedback(Codec::Bf16, &inf, 1, &residual, &enc);
  CHECK(residual == 0.0f);
}

TEST_CASE("codec values are validated", "[codec]") {
  CHECK(codec::to_codec(GRADSYNC_CODEC_BF16, false) == Codec::Bf16);
  CHECK(codec::to_codec(GRADSYNC_CODEC_NONE, true) == Codec::None);
  CHECK_THROWS_WITH(codec::to_codec(GRADSYNC_CODEC_NONE, false), Catch::Contains("no 16-bit encoding"));
  CHECK_THROWS_WITH(codec::to_codec(7, true), Catch::Contains("unknown codec 7"));
}

TEST_CASE("vector encoders give the reference bits, specials included", "[codec]") {
  // Reference element conversions, written from the definitions.
  auto bf16_ref = [](uint32_t x) -> uint16_t {
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
    return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
  };
  auto bigdl_ref = [](uint32_t x) -> uint16_t {
    uint32_t h = x >> 16;
    if ((x & 0x7fffffffu) > 0x7f800000u && (h & 0x7fu) == 0) h |= 0x40u;
    return static_cast<uint16_t>(((h & 0xffu) << 8) | (h >> 8));
  };
  std::vector<float> in;
  for (uint64_t u = 0; u <= 0xffffffffu; u += 65537) in.push_back(from_bits(static_cast<uint32_t>(u)));
  // Specials inside the vector body, at every lane position.
  for (uint32_t u : {0x7f800000u, 0xff800000u, 0x7f800001u, 0xff80ffffu, 0x7fc00000u, 0x7fffffffu, 0x7f7fffffu,
                     0x3f808000u, 0x3f818000u, 0x00000001u, 0x80000000u, 0x7f80ffffu, 0x7f810000u, 0x007fffffu,
                     0x00008000u, 0x0000ffffu, 0x80408000u, 0x00018000u})
    for (int lane = 0; lane < 17; ++lane) in.push_back(from_bits(u));
  std::vector<uint16_t> all(65536 + 5);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  int paths = 0;
  for (codec::Path path : {codec::Path::Portable, codec::Path::Avx2, codec::Path::Avx512}) {
    if (!codec::path_available(path)) continue;
    ++paths;
    INFO("path " << static_cast<int>(path));
    std::vector<uint16_t> out(in.size());
    codec::encode_via(path, Codec::Bf16, in.data(), in.size(), out.data());
    size_t bf16_differ = 0;
    for (size_t i = 0; i < in.size(); ++i) bf16_differ += out[i] != bf16_ref(to_bits(in[i]));
    CHECK(bf16_differ == 0);
    codec::encode_via(path, Codec::BigdlFp16, in.data(), in.size(), out.data());
    size_t bigdl_differ = 0;
    for (size_t i = 0; i < in.size(); ++i) bigdl_differ += out[i] != bigdl_ref(to_bits(in[i]));
    CHECK(bigdl_differ == 0);
    codec::encode_via(path, Codec::Fp16, in.data(), in.size(), out.data());
    size_t half_differ = 0;
    for (size_t i = 0; i < in.size(); ++i) half_differ += out[i] != codec::float_to_half_scalar(in[i]);
    CHECK(half_differ == 0);
    // And back: every 16-bit pattern decodes to its definition.
    std::vector<float> back(all.size());
    codec::decode_via(path, Codec::Bf16, all.data(), all.size(), back.data());
    size_t bf16_back = 0;
    for (size_t i = 0; i < all.size(); ++i) bf16_back += to_bits(back[i]) != static_cast<uint32_t>(all[i]) << 16;
    CHECK(bf16_back == 0);
    codec::decode_via(path, Codec::BigdlFp16, all.data(), all.size(), back.data());
    size_t bigdl_back = 0;
    for (size_t i = 0; i < all.size(); ++i) {
      const uint32_t swapped = ((all[i] & 0xffu) << 8) | (all[i] >> 8);
      bigdl_back += to_bits(back[i]) != swapped << 16;
    }
    CHECK(bigdl_back == 0);
  }
  CHECK(paths >= 1);  // the portable path always exists
}
