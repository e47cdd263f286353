#include "expage/format/float16.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

namespace {

bool is_nan16(std::uint16_t h, bool bf16) { return bf16 ? (h & 0x7FFFU) > 0x7F80U : (h & 0x7FFFU) > 0x7C00U; }

TEST(Float16, EveryFp16AndBf16PatternRoundTripsThroughFloat) {
  for (std::uint32_t h = 0; h <= 0xFFFFU; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    if (is_nan16(b, false)) {
      ASSERT_TRUE(std::isnan(expage::fp16_to_float(b))) << std::hex << h;
    } else {
      ASSERT_EQ(expage::float_to_fp16(expage::fp16_to_float(b)), b) << std::hex << h;
    }
    if (is_nan16(b, true)) {
      ASSERT_TRUE(is_nan16(expage::float_to_bf16(expage::bf16_to_float(b)), true)) << std::hex << h;
    } else {
      ASSERT_EQ(expage::float_to_bf16(expage::bf16_to_float(b)), b) << std::hex << h;
    }
  }
}

TEST(Float16, KnownValues) {
  EXPECT_EQ(expage::float_to_fp16(1.0F), 0x3C00U);
  EXPECT_EQ(expage::float_to_fp16(-2.0F), 0xC000U);
  EXPECT_EQ(expage::float_to_fp16(65504.0F), 0x7BFFU);
  EXPECT_EQ(expage::float_to_fp16(65520.0F), 0x7C00U);  // the tie above the largest finite rounds to infinity
  EXPECT_EQ(expage::float_to_fp16(std::ldexp(1.0F, -24)), 0x0001U);
  EXPECT_EQ(expage::float_to_fp16(std::ldexp(1.0F, -25)), 0x0000U);  // tie to even (zero)
  EXPECT_EQ(expage::float_to_fp16(std::ldexp(3.0F, -26)), 0x0001U);
  EXPECT_EQ(expage::float_to_bf16(1.0F), 0x3F80U);
  EXPECT_EQ(expage::float_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80U);
  EXPECT_TRUE(std::isnan(expage::fp16_to_float(expage::float_to_fp16(std::numeric_limits<float>::quiet_NaN()))));
}

// True when @p h is a nearest 16-bit value to @p f, ties to even, checked against both
// neighbours of @p h (exact in float), for either format.
bool is_nearest_even(float f, std::uint16_t h, float (*to_float)(std::uint16_t), bool bf16) {
  const double err = std::fabs(static_cast<double>(to_float(h)) - static_cast<double>(f));
  for (const int d : {-1, 1}) {
    const auto n = static_cast<std::uint16_t>(h + d);
    if (is_nan16(n, bf16) || ((n ^ h) & 0x8000U) != 0) continue;
    const double other = std::fabs(static_cast<double>(to_float(n)) - static_cast<double>(f));
    if (!(err < other || (err == other && (h & 1U) == 0))) return false;
  }
  return true;
}

TEST(Float16, RoundsToNearestEvenOnRandomFloats) {
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<std::uint32_t> bits(0, 0xFFFFFFFFU);
  for (int i = 0; i < 200000; ++i) {
    const float f = expage::float_from_bits(bits(rng) & 0xC7FFFFFFU);  // |f| < 2^17 or tiny: mostly in range
    if (std::isnan(f) || std::fabs(f) >= 65504.0F) continue;
    ASSERT_TRUE(is_nearest_even(f, expage::float_to_fp16(f), expage::fp16_to_float, false)) << f;
    ASSERT_TRUE(is_nearest_even(f, expage::float_to_bf16(f), expage::bf16_to_float, true)) << f;
  }
}

}  // namespace
