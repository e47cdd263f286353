#include "expage/format/group_quant.hpp"

#include "common/weights.hpp"

#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/core/precision.hpp"
#include "expage/format/float16.hpp"
#include "expage/format/group_quant_element.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace {

using expage::group_quant_layout;
using expage::precision;
using expage::tensor_shape;

struct group_meta {
  float scale;
  float zero;
};

group_meta meta_of(const std::vector<std::byte>& packed, const group_quant_layout& layout, std::uint64_t group) {
  const auto* b = reinterpret_cast<const std::uint8_t*>(packed.data());
  return {expage::fp16_to_float(expage::load_le16(b + layout.scales_at() + 2 * group)),
          expage::fp16_to_float(expage::load_le16(b + layout.zeros_at() + 2 * group))};
}

TEST(GroupQuantLayout, SizesMatchMoeGeometryForEveryPresetTensor) {
  for (const std::string_view name : expage::moe_geometry::preset_names()) {
    const expage::moe_geometry g = expage::moe_geometry::preset(name);
    for (const auto t : {expage::expert_tensor::gate_up, expage::expert_tensor::down}) {
      for (const precision p : {precision::int8, precision::int4, precision::int2}) {
        const group_quant_layout layout(p, g.shape(t), g.group_size());
        EXPECT_EQ(layout.total_bytes(), g.tensor_bytes(t, p)) << name << " " << expage::to_string(p);
      }
    }
  }
}

TEST(GroupQuantLayout, RejectsWhatItCannotDescribe) {
  EXPECT_THROW(group_quant_layout(precision::bf16, {.rows = 1, .cols = 1}, 32), expage::invalid_argument);
  EXPECT_THROW(group_quant_layout(precision::fp8, {.rows = 1, .cols = 1}, 32), expage::invalid_argument);
  EXPECT_THAT([] { (void)group_quant_layout(static_cast<precision>(9), {.rows = 1, .cols = 1}, 32); },
              ::testing::ThrowsMessage<expage::invalid_argument>(::testing::HasSubstr("precision unknown (9)")));
  EXPECT_THROW(group_quant_layout(precision::int4, {.rows = 1, .cols = 1}, 0), expage::invalid_argument);
  EXPECT_THROW(group_quant_layout(precision::int4, {.rows = 0, .cols = 8}, 32), expage::invalid_argument);
  EXPECT_THROW(group_quant_layout(precision::int4, {.rows = 1U << 30, .cols = 1U << 30}, 32), expage::invalid_argument);
  try {
    (void)group_quant_layout(precision::int4, {.rows = 1, .cols = 1}, (1U << 20) + 1);
    FAIL() << "accepted group size 2^20 + 1";
  } catch (const expage::invalid_argument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("group_size 1048577 out of range [1, 1048576]"));
  }
}

TEST(GroupQuant, PacksCodesLittleEndFirstWithFp16ScaleAndZero) {
  // One group of 0..15: zero 0, scale 1, codes equal to the values.
  std::vector<float> w(16);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i);
  const group_quant_layout int4(precision::int4, {.rows = 1, .cols = 16}, 16);
  const std::vector<std::byte> p4 = expage::quantize_groups(w, int4);
  ASSERT_EQ(p4.size(), 8U + 2U + 2U);
  for (std::size_t k = 0; k < 8; ++k) EXPECT_EQ(std::to_integer<unsigned>(p4[k]), (2 * k) | (2 * k + 1) << 4U) << k;
  EXPECT_EQ(std::to_integer<unsigned>(p4[8]) | std::to_integer<unsigned>(p4[9]) << 8U, 0x3C00U);    // scale 1.0
  EXPECT_EQ(std::to_integer<unsigned>(p4[10]) | std::to_integer<unsigned>(p4[11]) << 8U, 0x0000U);  // zero 0.0

  // int2: values 0..3 repeated, two groups of 4 per row, two rows; zero −1 shifts the second row.
  std::vector<float> w2 = {0, 1, 2, 3, 3, 2, 1, 0, -1, 0, 1, 2, 2, 2, 2, 2};
  const group_quant_layout int2(precision::int2, {.rows = 2, .cols = 8}, 4);
  const std::vector<std::byte> p2 = expage::quantize_groups(w2, int2);
  ASSERT_EQ(p2.size(), 4U + 4U * 4U);
  EXPECT_EQ(std::to_integer<unsigned>(p2[0]), 0b11'10'01'00U);
  EXPECT_EQ(std::to_integer<unsigned>(p2[1]), 0b00'01'10'11U);
  EXPECT_EQ(std::to_integer<unsigned>(p2[2]), 0b11'10'01'00U);  // −1..2 with zero −1
  EXPECT_EQ(std::to_integer<unsigned>(p2[3]), 0U);              // constant group: scale 0, codes 0
  EXPECT_EQ(meta_of(p2, int2, 2).zero, -1.0F);
  EXPECT_EQ(meta_of(p2, int2, 3).scale, 0.0F);
  EXPECT_EQ(meta_of(p2, int2, 3).zero, 2.0F);

  // int8 with an odd element count: no padding before the metadata.
  const group_quant_layout int8(precision::int8, {.rows = 1, .cols = 3}, 2);
  const std::vector<std::byte> p8 = expage::quantize_groups(std::vector<float>{0.0F, 1.0F, 5.0F}, int8);
  EXPECT_EQ(p8.size(), 3U + 2U * 4U);
  std::vector<std::uint16_t> out(3);
  expage::dequantize_groups(p8, int8, precision::fp16, out);
  EXPECT_EQ(out[0], expage::float_to_fp16(0.0F));
  EXPECT_EQ(out[2], expage::float_to_fp16(5.0F));  // a group of one: exact
}

struct error_figures {
  double max_excess = 0;  // max over elements of |x − deq| − scale/2 (≤ rounding of the sum)
  double rel_rms = 0;     // ‖x − deq‖₂ / ‖x‖₂
};

error_figures measure(precision p, std::uint32_t group, tensor_shape shape, std::uint64_t seed) {
  const std::vector<float> w = expage::testing::realistic_weights(shape.elements(), seed);
  const group_quant_layout layout(p, shape, group);
  const std::vector<std::byte> packed = expage::quantize_groups(w, layout);
  std::vector<std::uint16_t> bf16(w.size());
  std::vector<std::uint16_t> fp16(w.size());
  expage::dequantize_groups(packed, layout, precision::bf16, bf16);
  expage::dequantize_groups(packed, layout, precision::fp16, fp16);
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(packed.data());
  error_figures f;
  double err2 = 0;
  double ref2 = 0;
  for (std::uint64_t i = 0; i < w.size(); ++i) {
    const std::uint64_t g = (i / shape.cols) * layout.groups_per_row() + (i % shape.cols) / group;
    const group_meta m = meta_of(packed, layout, g);
    const float deq = expage::dequantize_value(expage::packed_code(bytes, i, layout.bits()), m.scale, m.zero);
    const double x = w[i];
    const double err = std::fabs(x - static_cast<double>(deq));
    // The sum q·s + z is rounded once to float: allow half an ulp of the result.
    const double rounding = std::ldexp(std::fabs(static_cast<double>(deq)), -24) + 1e-30;
    EXPECT_LE(err, 0.5 * static_cast<double>(m.scale) + rounding)
        << expage::to_string(p) << " element " << i << " x " << x << " deq " << deq;
    f.max_excess = std::max(f.max_excess, err - 0.5 * static_cast<double>(m.scale));
    // The 16-bit outputs add their own rounding of deq: half an ulp of bf16 (2^-9) or fp16 (2^-11).
    EXPECT_EQ(bf16[i], expage::float_to_bf16(deq));
    EXPECT_EQ(fp16[i], expage::float_to_fp16(deq));
    const double out_err = std::fabs(x - static_cast<double>(expage::bf16_to_float(bf16[i])));
    EXPECT_LE(out_err,
              0.5 * static_cast<double>(m.scale) + std::ldexp(std::fabs(static_cast<double>(deq)), -8) + 1e-30);
    err2 += err * err;
    ref2 += x * x;
  }
  f.rel_rms = std::sqrt(err2 / ref2);
  return f;
}

TEST(GroupQuant, ErrorIsWithinHalfAScalePerElementAndRmsBoundsHold) {
  struct cfg {
    precision p;
    std::uint32_t group;
    double rel_rms_bound;
  };
  // Relative RMS of uniform rounding is s/√12 over σ with s ≈ (range of a group)/(2^b − 1);
  // outliers widen the groups they fall in, hence the margins.
  // the outliers (0.1% at 30σ) widen the groups they fall in, which dominates int4 and int2.
  // Bounds are the measured figures (printed) plus about 15%.
  const cfg cases[] = {{precision::int8, 32, 0.0066}, {precision::int8, 128, 0.0127}, {precision::int4, 32, 0.12},
                       {precision::int4, 64, 0.167},  {precision::int4, 128, 0.22},   {precision::int2, 32, 0.40},
                       {precision::int2, 128, 0.80}};
  for (const cfg& c : cases) {
    const error_figures f = measure(c.p, c.group, {.rows = 96, .cols = 1000}, 21);
    EXPECT_LE(f.rel_rms, c.rel_rms_bound) << expage::to_string(c.p) << " group " << c.group;
    std::printf("[ figures  ] %s group %3u: relative RMS error %.4f, max |x-deq| - scale/2 = %.3g\n",
                std::string(expage::to_string(c.p)).c_str(), c.group, f.rel_rms, f.max_excess);
  }
}

TEST(GroupQuant, GaussianWeightsMeetTheUniformRoundingModel) {
  // Without outliers a group of 128 normals spans ≈ 5.2σ, so int4's s ≈ 0.35σ and the relative
  // RMS error is ≈ s/√12/σ ≈ 0.10; int8's is 17× smaller.
  const tensor_shape shape{.rows = 64, .cols = 1024};
  const std::vector<float> w = expage::testing::realistic_weights(shape.elements(), 41, 0.02F, 0.0);
  for (const auto& [p, expected] : {std::pair{precision::int4, 0.10}, std::pair{precision::int8, 0.0059}}) {
    const group_quant_layout layout(p, shape, 128);
    const std::vector<std::byte> packed = expage::quantize_groups(w, layout);
    std::vector<std::uint16_t> out(w.size());
    expage::dequantize_groups(packed, layout, precision::fp16, out);
    double err2 = 0;
    double ref2 = 0;
    for (std::size_t i = 0; i < w.size(); ++i) {
      const double e = static_cast<double>(w[i]) - static_cast<double>(expage::fp16_to_float(out[i]));
      err2 += e * e;
      ref2 += static_cast<double>(w[i]) * static_cast<double>(w[i]);
    }
    EXPECT_NEAR(std::sqrt(err2 / ref2), expected, 0.15 * expected) << expage::to_string(p);
  }
}

TEST(GroupQuant, PartialGroupsAndWideRanges) {
  for (const precision p : {precision::int8, precision::int4, precision::int2}) {
    (void)measure(p, 7, {.rows = 5, .cols = 23}, 31);   // groups of 7 leave a group of 2 per row
    (void)measure(p, 64, {.rows = 3, .cols = 17}, 32);  // one partial group per row
  }
  // Extreme magnitudes inside the accepted range, and a group entirely above zero.
  std::vector<float> w = {-32768.0F, 32768.0F, 1e-7F, -3e-8F, 1000.0F, 1000.5F, 1001.0F, 1002.0F};
  const group_quant_layout layout(precision::int4, {.rows = 2, .cols = 4}, 2);
  const std::vector<std::byte> packed = expage::quantize_groups(w, layout);
  std::vector<std::uint16_t> out(w.size());
  expage::dequantize_groups(packed, layout, precision::bf16, out);
  for (std::size_t i = 0; i < w.size(); ++i) {
    const group_meta m = meta_of(packed, layout, i / 2);
    EXPECT_LE(std::fabs(static_cast<double>(w[i]) - static_cast<double>(expage::bf16_to_float(out[i]))),
              0.5 * static_cast<double>(m.scale) + std::ldexp(std::fabs(static_cast<double>(w[i])), -8) + 1e-7)
        << i;
  }
}

TEST(GroupQuant, RejectsBadInput) {
  const group_quant_layout layout(precision::int4, {.rows = 2, .cols = 4}, 4);
  std::vector<float> w(8, 0.5F);
  EXPECT_THROW((void)expage::quantize_groups(std::span(w).first(7), layout), expage::invalid_argument);
  w[5] = std::numeric_limits<float>::quiet_NaN();
  try {
    (void)expage::quantize_groups(w, layout);
    FAIL() << "accepted a NaN";
  } catch (const expage::invalid_argument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("weight 5 (row 1, col 1) is nan"));
  }
  w[5] = 40000.0F;
  EXPECT_THROW((void)expage::quantize_groups(w, layout), expage::invalid_argument);
  w[5] = 0.5F;
  const std::vector<std::byte> packed = expage::quantize_groups(w, layout);
  std::vector<std::uint16_t> out(8);
  EXPECT_THROW(expage::dequantize_groups(std::span(packed).first(5), layout, precision::bf16, out),
               expage::invalid_argument);
  EXPECT_THROW(expage::dequantize_groups(packed, layout, precision::int8, out), expage::invalid_argument);
  // A value that is no precision is named by number (its name reads "unknown").
  EXPECT_THAT([&] { expage::dequantize_groups(packed, layout, static_cast<precision>(77), out); },
              ::testing::ThrowsMessage<expage::invalid_argument>(
                  ::testing::HasSubstr("dequantize_groups: output precision unknown (77) is not bf16 or fp16")));
  EXPECT_THAT([&] { expage::dequantize_groups(packed, layout, precision::bf16, std::span(out).first(7)); },
              ::testing::ThrowsMessage<expage::invalid_argument>(
                  ::testing::HasSubstr("output holds 7 values, the layout needs 8")));
  // Corrupted metadata (a scale of +inf, NaN or −1, a NaN zero) is refused before anything is
  // written; it decoded to NaN, ±inf or mirrored values (found by review).
  for (const std::uint16_t bits : {std::uint16_t{0x7C00}, std::uint16_t{0x7E00}, std::uint16_t{0xBC00}}) {
    for (const bool zero : {false, true}) {
      if (zero && bits != 0x7E00) continue;  // a zero may be negative; NaN is the corrupted one
      std::vector<std::byte> bad = packed;
      const std::size_t at = (zero ? layout.zeros_at() : layout.scales_at()) + 2;  // row 1's group
      bad[at] = static_cast<std::byte>(bits & 0xFFU);
      bad[at + 1] = static_cast<std::byte>(bits >> 8U);
      std::ranges::fill(out, std::uint16_t{0x1234});
      EXPECT_THAT([&] { expage::dequantize_groups(bad, layout, precision::bf16, out); },
                  ::testing::ThrowsMessage<expage::invalid_argument>(::testing::HasSubstr("group 0 of row 1: scale")))
          << std::hex << bits << (zero ? " in the zero" : " in the scale");
      EXPECT_TRUE(std::ranges::all_of(out, [](std::uint16_t v) { return v == 0x1234; })) << "nothing written";
    }
  }
  // A finite scale too large for the codes: code 15 at 15 · 8192 = 122880, beyond fp16's range
  // (it decoded to +inf); bf16 holds it. 4368 (15 · 4368 = 65520) rounds to inf too; 4364 does not.
  for (const auto& [scale_bits, overflows] :
       {std::pair{std::uint16_t{0x7000}, true}, std::pair{std::uint16_t{0x6C44}, true},
        std::pair{std::uint16_t{0x6C43}, false}}) {
    std::vector<std::byte> big = packed;
    big[layout.scales_at() + 2] = static_cast<std::byte>(scale_bits & 0xFFU);
    big[layout.scales_at() + 3] = static_cast<std::byte>(scale_bits >> 8U);
    std::ranges::fill(big.begin(), big.begin() + 4, std::byte{0xFF});  // every code 15
    big[layout.zeros_at() + 2] = std::byte{0};
    big[layout.zeros_at() + 3] = std::byte{0};
    std::ranges::fill(out, std::uint16_t{0x1234});
    if (overflows) {
      EXPECT_THAT([&] { expage::dequantize_groups(big, layout, precision::fp16, out); },
                  ::testing::ThrowsMessage<expage::invalid_argument>(::testing::HasSubstr("group 0 of row 1: scale")))
          << std::hex << scale_bits;
      EXPECT_TRUE(std::ranges::all_of(out, [](std::uint16_t v) { return v == 0x1234; })) << "nothing written";
    } else {
      expage::dequantize_groups(big, layout, precision::fp16, out);
      EXPECT_EQ(out[4], 0x7BFEU) << "15 · 4364 = 65460 rounds to 65472";
    }
    EXPECT_NO_THROW(expage::dequantize_groups(big, layout, precision::bf16, out)) << std::hex << scale_bits;
  }
}

}  // namespace
