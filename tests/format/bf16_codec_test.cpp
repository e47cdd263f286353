#include "expage/format/bf16_codec.hpp"

#include "common/weights.hpp"

#include "expage/core/error.hpp"
#include "expage/format/crc32.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

using expage::bf16_container_info;
using expage::decode_bf16;
using expage::encode_bf16;
using expage::format_error;
using expage::inspect_bf16;
using expage::testing::random_bits16;
using expage::testing::realistic_bf16;
using ::testing::HasSubstr;

void expect_round_trip(const std::vector<std::uint16_t>& values, std::uint32_t chunk = 8192) {
  const std::vector<std::byte> blob = encode_bf16(values, {.chunk_elements = chunk});
  const bf16_container_info info = inspect_bf16(blob);
  EXPECT_EQ(info.element_count, values.size());
  EXPECT_EQ(info.container_bytes, blob.size());
  const std::vector<std::uint16_t> back = decode_bf16(blob);
  ASSERT_EQ(back.size(), values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(back[i], values[i]) << "element " << i << " of " << values.size() << ", chunk " << chunk;
  }
}

// Rewrites both checksums, so a deliberately corrupted field reaches the structural checks.
void reseal(std::vector<std::byte>& blob) {
  const auto put32 = [&](std::size_t at, std::uint32_t v) {
    for (std::size_t i = 0; i < 4; ++i) blob[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xFFU);
  };
  const std::span<const std::byte> view(blob);
  put32(36, expage::crc32(view.subspan(48)));
  put32(44, expage::crc32(view.first(44)));
}

std::string error_of(const std::vector<std::byte>& blob) {
  try {
    (void)decode_bf16(blob);
  } catch (const format_error& e) {
    return e.what();
  }
  return "decoded without error";
}

TEST(Bf16Codec, RealisticWeightsRoundTripAtAboutTwoThirdsOfTheirSize) {
  const std::vector<std::uint16_t> w = realistic_bf16(1 << 20, 1);
  const std::vector<std::byte> blob = encode_bf16(w);
  const bf16_container_info info = inspect_bf16(blob);
  EXPECT_EQ(decode_bf16(blob), w);
  // Exponent entropy of N(0, 0.02²) in bf16 is ≈ 2.6 bits: (8 + 2.6)/16 ≈ 0.66 plus tables.
  EXPECT_GT(info.ratio(), 0.62);
  EXPECT_LT(info.ratio(), 0.70);
  for (const std::uint8_t len : info.code_lengths) EXPECT_LE(len, 12U);
  std::printf("[ figures  ] realistic bf16 (std 0.02, 0.1%% outliers ×30), 2^20 values: ratio %.4f\n", info.ratio());
}

TEST(Bf16Codec, RatioHoldsAcrossWeightScales) {
  for (const float std_dev : {0.005F, 0.02F, 0.05F}) {
    const std::vector<std::uint16_t> w = realistic_bf16(1 << 18, 2, std_dev);
    const std::vector<std::byte> blob = encode_bf16(w);
    EXPECT_LT(inspect_bf16(blob).ratio(), 0.70) << "std " << std_dev;
    EXPECT_EQ(decode_bf16(blob), w);
  }
}

TEST(Bf16Codec, AllSameExponentCostsOneBitPerExponent) {
  std::vector<std::uint16_t> w = random_bits16(100000, 3);
  for (std::uint16_t& v : w) v = static_cast<std::uint16_t>((v & 0x807FU) | (127U << 7U));  // exponent 127
  const std::vector<std::byte> blob = encode_bf16(w);
  const bf16_container_info info = inspect_bf16(blob);
  EXPECT_EQ(info.exponent_bits, w.size());
  EXPECT_EQ(info.code_lengths[127], 1U);
  EXPECT_NEAR(info.ratio(), 9.0 / 16.0, 0.01);
  EXPECT_EQ(decode_bf16(blob), w);
}

TEST(Bf16Codec, EveryBitPatternIncludingNanInfAndDenormalsRoundTrips) {
  std::vector<std::uint16_t> all(65536);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i);
  expect_round_trip(all);
  std::shuffle(all.begin(), all.end(), std::mt19937_64(4));
  expect_round_trip(all, 128);
  // Uniform exponents: all 256 symbols equally likely, so the code is flat at 8 bits.
  const std::vector<std::byte> blob = encode_bf16(all);
  for (const std::uint8_t len : inspect_bf16(blob).code_lengths) EXPECT_EQ(len, 8U);
}

TEST(Bf16Codec, SpecialValues) {
  const std::vector<std::uint16_t> specials = {0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001,
                                               0x807F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80, 0x0040, 0x7FFF};
  expect_round_trip(specials);
  std::vector<std::uint16_t> mostly_nan(5000, 0x7FC0);
  mostly_nan[1234] = 0x0001;
  expect_round_trip(mostly_nan);
}

TEST(Bf16Codec, EmptyAndTinyInputs) {
  const std::vector<std::byte> empty = encode_bf16({});
  const bf16_container_info info = inspect_bf16(empty);
  EXPECT_EQ(info.element_count, 0U);
  EXPECT_EQ(info.chunk_count, 0U);
  EXPECT_TRUE(decode_bf16(empty).empty());
  expect_round_trip({0x3F80});
  expect_round_trip({0x3F80, 0x3F80});
  expect_round_trip({0x3F80, 0x4000});
}

TEST(Bf16Codec, LengthsThatAreNotMultiplesOfTheChunkOrLaneRow) {
  for (const std::uint32_t chunk : {128U, 384U, 8192U}) {
    for (const std::size_t n :
         {1UL, 3UL, 4UL, 5UL, 127UL, 128UL, 129UL, 131UL, 383UL, 385UL, 8191UL, 8193UL, 20005UL}) {
      expect_round_trip(realistic_bf16(n, n * 7 + chunk), chunk);
    }
  }
}

TEST(Bf16Codec, CodeLengthsAreBoundedByTwelveOnHeavilySkewedInput) {
  // Geometric exponent frequencies (halving per symbol): unconstrained Huffman would use 20+ bits.
  std::vector<std::uint16_t> w;
  for (unsigned e = 0; e < 20; ++e) {
    const std::size_t copies = std::size_t{1} << (19 - e);
    for (std::size_t k = 0; k < copies; ++k) w.push_back(static_cast<std::uint16_t>((100U + e) << 7U | (k & 0x7FU)));
  }
  std::shuffle(w.begin(), w.end(), std::mt19937_64(5));
  const std::vector<std::byte> blob = encode_bf16(w);
  const bf16_container_info info = inspect_bf16(blob);
  const unsigned longest = *std::max_element(info.code_lengths.begin(), info.code_lengths.end());
  EXPECT_EQ(longest, 12U);
  EXPECT_EQ(info.code_lengths[100], 1U);
  EXPECT_EQ(decode_bf16(blob), w);
}

TEST(Bf16Codec, PackageMergeIsOptimalOnADyadicDistribution) {
  // Frequencies 1/2, 1/4, 1/8, 1/8: optimal lengths 1, 2, 3, 3.
  std::vector<std::uint16_t> w;
  const unsigned counts[] = {400, 200, 100, 100};
  for (unsigned e = 0; e < 4; ++e) w.insert(w.end(), counts[e], static_cast<std::uint16_t>((120U + e) << 7U));
  const bf16_container_info info = inspect_bf16(encode_bf16(w));
  EXPECT_EQ(info.code_lengths[120], 1U);
  EXPECT_EQ(info.code_lengths[121], 2U);
  EXPECT_EQ(info.code_lengths[122], 3U);
  EXPECT_EQ(info.code_lengths[123], 3U);
  EXPECT_EQ(info.exponent_bits, 400U * 1 + 200U * 2 + 200U * 3);
}

TEST(Bf16Codec, RejectsBadOptionsAndOutputSizes) {
  const std::vector<std::uint16_t> w(10, 0x3F80);
  for (const std::uint32_t chunk : {0U, 64U, 200U, 131072U + 128U}) {
    EXPECT_THROW((void)encode_bf16(w, {.chunk_elements = chunk}), expage::invalid_argument) << chunk;
  }
  const std::vector<std::byte> blob = encode_bf16(w);
  std::vector<std::uint16_t> out(9);
  EXPECT_THROW(decode_bf16(blob, out), expage::invalid_argument);
}

TEST(Bf16Codec, EveryTruncationIsAFormatError) {
  const std::vector<std::byte> blob = encode_bf16(realistic_bf16(700, 6), {.chunk_elements = 256});
  for (std::size_t n = 0; n < blob.size(); ++n) {
    const std::vector<std::byte> cut(blob.begin(), blob.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_THROW((void)decode_bf16(cut), format_error) << "truncated to " << n << " bytes";
  }
  EXPECT_THAT(error_of({blob.begin(), blob.begin() + 20}), HasSubstr("shorter than the 48-byte header"));
  std::vector<std::byte> cut(blob.begin(), blob.end() - 1);
  reseal(cut);
  EXPECT_THAT(error_of(cut), HasSubstr("does not match the"));
}

TEST(Bf16Codec, EverySingleByteCorruptionIsAFormatError) {
  const std::vector<std::byte> blob = encode_bf16(realistic_bf16(300, 7), {.chunk_elements = 128});
  for (std::size_t at = 0; at < blob.size(); ++at) {
    std::vector<std::byte> bad = blob;
    bad[at] ^= std::byte{0x5A};
    EXPECT_THROW((void)decode_bf16(bad), format_error) << "byte " << at;
  }
}

TEST(Bf16Codec, StructuralErrorsNameTheField) {
  const std::vector<std::byte> good = encode_bf16(realistic_bf16(1000, 8), {.chunk_elements = 256});
  const auto corrupt = [&](std::size_t at, std::byte value) {
    std::vector<std::byte> b = good;
    b[at] = value;
    reseal(b);
    return error_of(b);
  };
  EXPECT_THAT(corrupt(0, std::byte{'X'}), HasSubstr("bad magic \"XXPAGEBF\" (expected \"EXPAGEBF\")"));
  EXPECT_THAT(corrupt(1, std::byte{0x01}), HasSubstr("bad magic \"E\\x01PAGEBF\""));
  EXPECT_THAT(corrupt(8, std::byte{2}), HasSubstr("version 2 unsupported"));
  EXPECT_THAT(corrupt(10, std::byte{13}), HasSubstr("max code length 13 out of range [1, 12]"));
  EXPECT_THAT(corrupt(11, std::byte{16}), HasSubstr("lanes per chunk 16"));
  EXPECT_THAT(corrupt(12, std::byte{1}), HasSubstr("chunk_elements 257"));
  EXPECT_THAT(corrupt(32, std::byte{9}), HasSubstr("chunk count 9"));
  EXPECT_THAT(corrupt(40, std::byte{7}), HasSubstr("reserved header field at byte 40 is 0x7, must be 0"));
  // A code length table that no longer sums to a complete code.
  const bf16_container_info info = inspect_bf16(good);
  const auto used = static_cast<std::size_t>(
      std::find_if(info.code_lengths.begin(), info.code_lengths.end(), [](std::uint8_t l) { return l != 0; }) -
      info.code_lengths.begin());
  const std::byte other_length{info.code_lengths[used] == 1 ? std::uint8_t{2} : std::uint8_t{1}};
  EXPECT_THAT(corrupt(48 + used, other_length), HasSubstr("complete prefix code"));
  EXPECT_THAT(corrupt(48 + used, std::byte{14}), HasSubstr("out of range [0, 12]"));
  // Lane lengths: out of the range the lane's exponent count allows, or not summing to the chunk.
  EXPECT_THAT(corrupt(info.lane_bits_at + 1, std::byte{0xFF}), HasSubstr("chunk 0 lane 0"));
  std::vector<std::byte> shifted = good;
  shifted[info.lane_bits_at] = static_cast<std::byte>(std::to_integer<unsigned>(shifted[info.lane_bits_at]) + 1);
  shifted[info.lane_bits_at + 2] =
      static_cast<std::byte>(std::to_integer<unsigned>(shifted[info.lane_bits_at + 2]) - 1);
  reseal(shifted);  // lane 0 one bit longer, lane 1 one bit shorter: sums agree, codes do not
  EXPECT_THAT(error_of(shifted), HasSubstr("chunk 0 lane 0: codes take"));
  EXPECT_THAT(corrupt(info.chunk_offsets_at + 8, std::byte{0xFF}), HasSubstr("chunk 0: bit offsets"));
  // The exponent stream's padding after bit E must be zero (its last byte is padding here).
  ASSERT_LT(info.exponent_bits, std::uint64_t{info.exponent_bytes} * 8 - 8);
  const std::size_t pad_byte = info.exponents_at + info.exponent_bytes - 4;  // the last word's lowest byte
  EXPECT_THAT(corrupt(pad_byte, std::byte{1}), HasSubstr("exponent stream: padding word"));
  // An empty container's one chunk offset is E = 0 too.
  const std::vector<std::byte> empty = encode_bf16({});
  const bf16_container_info none = inspect_bf16(empty);
  std::vector<std::byte> bad_empty = empty;
  bad_empty[none.chunk_offsets_at] = std::byte{5};
  reseal(bad_empty);
  EXPECT_THAT(error_of(bad_empty), HasSubstr("last chunk ends at bit 5"));
}

}  // namespace

namespace {

// Issue 15, item 10: the GPU decoder relies on inspect_bf16() alone, so whatever inspection
// accepts must decode. Tampered containers with both checksums recomputed: every byte of the
// code table, the lane lengths, the chunk offsets and the exponent stream, and random multi-byte
// edits; inspection must either refuse the container or it must decode without error.
TEST(Bf16Codec, EveryContainerInspectionAcceptsDecodes) {
  const std::vector<std::uint16_t> values = expage::testing::realistic_bf16(3000, 11);
  const std::vector<std::byte> good = expage::encode_bf16(values, {.chunk_elements = 1024});
  const bf16_container_info info = inspect_bf16(good);
  std::size_t accepted = 0;
  std::size_t tampered = 0;
  const auto check = [&](std::vector<std::byte> blob) {
    reseal(blob);
    ++tampered;
    bool inspected = false;
    try {
      (void)inspect_bf16(blob);
      inspected = true;
    } catch (const format_error&) {
    }
    if (!inspected) return;
    ++accepted;
    EXPECT_NO_THROW((void)decode_bf16(blob)) << "inspect_bf16 accepted a container decode_bf16 refuses";
  };
  // Every byte of the tables and the first exponent words: +1, xor 0x80.
  const std::size_t end = std::min<std::size_t>(info.exponents_at + 256, info.sign_mantissa_at);
  for (std::size_t at = 48; at < end; ++at) {
    for (const unsigned delta : {1U, 0x80U}) {
      std::vector<std::byte> b = good;
      b[at] = static_cast<std::byte>(std::to_integer<unsigned>(b[at]) ^ delta);
      check(std::move(b));
    }
  }
  // Random multi-byte edits anywhere after the header.
  std::mt19937_64 rng(15);
  for (int i = 0; i < 2000; ++i) {
    std::vector<std::byte> b = good;
    for (int k = 0; k < 3; ++k) b[48 + rng() % (b.size() - 48)] = static_cast<std::byte>(rng() & 0xFFU);
    check(std::move(b));
  }
  EXPECT_GT(tampered, 2000U);
  EXPECT_GT(accepted, 0U) << "some edits (sign and mantissa bytes) are legitimately accepted";
}

}  // namespace
