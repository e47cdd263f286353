// The GPU decoder's tables and lane reader (format/detail/bf16_lane_reader.hpp), run on the host
// with the kernel's exact sequence of ticks and clamped loads, against the host decoder and
// canonical_lookup. The kernel itself is checked bit for bit on a device
// (tests/kernels/bf16_decode_cuda_test.cpp); this runs everywhere.
#include "expage/format/detail/bf16_lane_reader.hpp"

#include "common/weights.hpp"

#include "expage/format/bf16_codec.hpp"
#include "expage/format/detail/bf16_layout.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace {

using expage::detail::bf16_lane_reader;
using expage::detail::bf16_lanes;
using expage::detail::bf16_lut_entries;
using expage::detail::bf16_max_code_length;
using expage::detail::bf16_values_per_step;
using expage::detail::bf16_word_pair;
using expage::detail::canonical_code;

std::uint64_t get_le(std::span<const std::byte> b, std::uint64_t at, unsigned bytes) {
  std::uint64_t v = 0;
  for (unsigned i = 0; i < bytes; ++i) v |= std::to_integer<std::uint64_t>(b[at + i]) << (8 * i);
  return v;
}

// The kernel's loads: the pair q places after the lane's first, clamped to the lane's last.
struct host_pair_load {
  std::span<const std::byte> container;
  std::uint64_t first_at;  // byte offset of the lane's first pair
  unsigned last;
  bf16_word_pair operator()(unsigned q) const {
    const std::uint64_t at = first_at + 8 * std::uint64_t{std::min(q, last)};
    return {static_cast<std::uint32_t>(get_le(container, at, 4)),
            static_cast<std::uint32_t>(get_le(container, at + 4, 4))};
  }
};

canonical_code code_of(const expage::bf16_container_info& info) {
  std::uint8_t lengths[256];
  std::copy(info.code_lengths.begin(), info.code_lengths.end(), lengths);
  return expage::detail::make_canonical_code(lengths);
}

std::vector<std::uint16_t> lut_by_length(const canonical_code& c) {
  std::vector<std::uint16_t> lut(bf16_lut_entries, 0xFFFF);
  expage::detail::fill_canonical_lut(c, c.symbols, lut.data(), 0, 1);
  return lut;
}

// Decodes @p container exactly as decode_kernel does, one lane after another: each row of four
// values as a tick and two decode_two, then the partial row's values as a tick and decode_one.
std::vector<std::uint16_t> decode_as_the_kernel(std::span<const std::byte> container) {
  const expage::bf16_container_info info = expage::inspect_bf16(container);
  const canonical_code code = code_of(info);
  const std::vector<std::uint16_t> lut = lut_by_length(code);
  std::vector<std::uint32_t> pairs(bf16_lut_entries);
  for (unsigned v = 0; v < bf16_lut_entries; ++v) pairs[v] = expage::detail::bf16_pair_entry(lut.data(), v);

  std::vector<std::uint16_t> out(info.element_count, 0);
  const std::uint64_t last_pair = info.exponent_bytes / 8 - 1;
  const auto join = [](unsigned sm, unsigned e) {
    return static_cast<std::uint16_t>(((sm & 0x80U) << 8U) | (e << 7U) | (sm & 0x7FU));
  };
  const std::uint32_t row = bf16_lanes * bf16_values_per_step;
  for (std::uint64_t c = 0; c < info.chunk_count; ++c) {
    const std::uint64_t base = c * info.chunk_elements;
    const auto m = static_cast<std::uint32_t>(std::min<std::uint64_t>(info.chunk_elements, info.element_count - base));
    std::uint64_t start = get_le(container, info.chunk_offsets_at + 8 * c, 8);
    for (unsigned lane = 0; lane < bf16_lanes; ++lane) {
      const std::uint64_t bits_here = get_le(container, info.lane_bits_at + 2 * (c * bf16_lanes + lane), 2);
      const std::uint64_t first = std::min(start / 64, last_pair);
      const auto last = static_cast<unsigned>(bits_here == 0 ? 0 : (start + bits_here - 1) / 64 - first);
      bf16_lane_reader<host_pair_load> reader(host_pair_load{container, info.exponents_at + 8 * first, last},
                                              static_cast<unsigned>(start % 64));
      const auto sm = [&](std::uint64_t i) {
        return std::to_integer<unsigned>(container[info.sign_mantissa_at + base + i]);
      };
      const std::uint32_t rows = m / row;
      std::uint32_t i = bf16_values_per_step * lane;
      for (std::uint32_t r = 0; r < rows; ++r, i += row) {
        reader.tick();
        const unsigned e01 = reader.decode_two(pairs.data());
        const unsigned e23 = reader.decode_two(pairs.data());
        out[base + i] = join(sm(i), e01 & 0xFFU);
        out[base + i + 1] = join(sm(i + 1), e01 >> 8U);
        out[base + i + 2] = join(sm(i + 2), e23 & 0xFFU);
        out[base + i + 3] = join(sm(i + 3), e23 >> 8U);
      }
      const std::uint32_t left = m - rows * row;
      const std::uint32_t mine = bf16_values_per_step * lane;
      const std::uint32_t count = left <= mine ? 0 : std::min(left - mine, bf16_values_per_step);
      if (count > 0) {
        reader.tick();
        for (std::uint32_t k = 0; k < count; ++k) out[base + i + k] = join(sm(i + k), reader.decode_one(pairs.data()));
      }
      start += bits_here;
    }
  }
  return out;
}

void expect_kernel_order_decodes(const std::vector<std::uint16_t>& values, std::uint32_t chunk) {
  const std::vector<std::byte> blob = expage::encode_bf16(values, {.chunk_elements = chunk});
  const std::vector<std::uint16_t> back = decode_as_the_kernel(blob);
  ASSERT_EQ(back.size(), values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(back[i], values[i]) << "element " << i << " of " << values.size() << ", chunk " << chunk;
  }
}

TEST(Bf16LaneReader, TheLutFilledByLengthEqualsTheCanonicalLookup) {
  // Codes of real containers (complete) and hand-made length sets, some incomplete (entries that
  // no code prefixes must be 0), one with every length from 1 to 12.
  std::vector<std::vector<std::uint8_t>> length_sets;
  for (const std::uint64_t seed : {1U, 2U, 3U}) {
    const auto info = expage::inspect_bf16(expage::encode_bf16(expage::testing::realistic_bf16(5000, seed)));
    length_sets.emplace_back(info.code_lengths.begin(), info.code_lengths.end());
  }
  std::vector<std::uint8_t> ladder(256, 0);
  for (unsigned len = 1; len <= bf16_max_code_length; ++len) ladder[len * 7] = static_cast<std::uint8_t>(len);
  length_sets.push_back(ladder);
  std::vector<std::uint8_t> single(256, 0);
  single[127] = 1;
  length_sets.push_back(single);
  std::mt19937_64 rng(17);
  for (int k = 0; k < 50; ++k) {  // random incomplete codes: Kraft sum below 1
    std::vector<std::uint8_t> lengths(256, 0);
    double kraft = 0;
    for (unsigned s = 0; s < 256; ++s) {
      if (rng() % 3 != 0) continue;
      const auto len = static_cast<unsigned>(1 + rng() % bf16_max_code_length);
      if (kraft + 1.0 / (1U << len) >= 1.0) continue;
      kraft += 1.0 / (1U << len);
      lengths[s] = static_cast<std::uint8_t>(len);
    }
    length_sets.push_back(lengths);
  }
  for (std::size_t k = 0; k < length_sets.size(); ++k) {
    std::uint8_t raw[256];
    std::copy(length_sets[k].begin(), length_sets[k].end(), raw);
    const canonical_code c = expage::detail::make_canonical_code(raw);
    const std::vector<std::uint16_t> lut = lut_by_length(c);
    for (unsigned v = 0; v < bf16_lut_entries; ++v) {
      ASSERT_EQ(lut[v], expage::detail::canonical_lookup(c, v)) << "length set " << k << ", window " << v;
    }
    // Threads of a block fill disjoint shares that cover the table.
    std::vector<std::uint16_t> shared(bf16_lut_entries, 0xFFFF);
    for (unsigned t = 0; t < 256; ++t) expage::detail::fill_canonical_lut(c, c.symbols, shared.data(), t, 256);
    ASSERT_EQ(shared, lut) << "length set " << k;
  }
}

TEST(Bf16LaneReader, DecodesInTheKernelsOrderAsTheHostDecoderDoes) {
  // Realistic weights, every chunk size class, lengths that leave partial rows and short lanes.
  for (const std::uint32_t chunk : {128U, 384U, 1024U, 8192U}) {
    for (const std::size_t n : {1U, 5U, 127U, 128U, 129U, 1000U, 20000U}) {
      expect_kernel_order_decodes(expage::testing::realistic_bf16(n, n * 31 + chunk), chunk);
    }
  }
}

TEST(Bf16LaneReader, DecodesLongCodesAndRandomBits) {
  // Random bits: every exponent, the longest codes (12 bits), a buffer that merges every step.
  expect_kernel_order_decodes(expage::testing::random_bits16(70000, 5), 8192);
  expect_kernel_order_decodes(expage::testing::random_bits16(3000, 6), 128);
  // One exponent: 1-bit codes, 64 values per merge.
  expect_kernel_order_decodes(std::vector<std::uint16_t>(9000, 0x3F80), 1024);
  // A heavy-tailed mix: mostly one exponent, rare ones with 12-bit codes.
  std::vector<std::uint16_t> skewed = expage::testing::realistic_bf16(40000, 9);
  std::mt19937_64 rng(3);
  for (std::size_t i = 0; i < skewed.size(); i += 1 + rng() % 5) skewed[i] = 0x3F80;
  expect_kernel_order_decodes(skewed, 2048);
}

TEST(Bf16LaneReader, DecodesStepsOfFourTwelveBitCodes) {
  // A dyadic histogram whose optimal code has lengths 1, 2, ..., 11 and two of 12 (the longest):
  // 2^16 values, 2^(16-k) of exponent 100 + k, 16 each of exponents 150 and 151. The 32 rare
  // values form one run at the start of a row, so eight lanes' steps take 4 · 12 bits each: the
  // most a tick must leave in the buffer.
  std::vector<std::uint16_t> values;
  for (unsigned k = 1; k <= 11; ++k)
    values.insert(values.end(), std::size_t{1} << (16 - k), static_cast<std::uint16_t>((100 + k) << 7U));
  std::mt19937_64 rng(11);
  std::shuffle(values.begin(), values.end(), rng);
  std::vector<std::uint16_t> rare;
  for (unsigned i = 0; i < 32; ++i) rare.push_back(static_cast<std::uint16_t>((150 + i % 2) << 7U | i));
  values.insert(values.begin() + 1024, rare.begin(), rare.end());
  const auto info = expage::inspect_bf16(expage::encode_bf16(values, {.chunk_elements = 8192}));
  ASSERT_EQ(info.code_lengths[150], bf16_max_code_length);
  ASSERT_EQ(info.code_lengths[151], bf16_max_code_length);
  expect_kernel_order_decodes(values, 8192);
  expect_kernel_order_decodes(values, 128);
}

}  // namespace
