#include "expage/core/precision.hpp"

#include "expage/core/error.hpp"
#include "expage/formatters.hpp"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <iterator>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>

namespace {

using expage::precision;
using ::testing::HasSubstr;

static_assert(expage::bits_per_weight(precision::int4) == 4U);
static_assert(expage::metadata_bytes_per_group(precision::fp8) == 2U);
static_assert(expage::to_string(precision::int2) == "int2");

TEST(Precision, AllPrecisionsListsEveryValueInDeclarationOrder) {
  ASSERT_EQ(std::size(expage::all_precisions), std::size_t{6});
  EXPECT_EQ(expage::all_precisions[0], precision::bf16);
  EXPECT_EQ(expage::all_precisions[1], precision::fp16);
  EXPECT_EQ(expage::all_precisions[2], precision::fp8);
  EXPECT_EQ(expage::all_precisions[3], precision::int8);
  EXPECT_EQ(expage::all_precisions[4], precision::int4);
  EXPECT_EQ(expage::all_precisions[5], precision::int2);
}

TEST(Precision, BitsPerWeight) {
  EXPECT_EQ(expage::bits_per_weight(precision::bf16), 16U);
  EXPECT_EQ(expage::bits_per_weight(precision::fp16), 16U);
  EXPECT_EQ(expage::bits_per_weight(precision::fp8), 8U);
  EXPECT_EQ(expage::bits_per_weight(precision::int8), 8U);
  EXPECT_EQ(expage::bits_per_weight(precision::int4), 4U);
  EXPECT_EQ(expage::bits_per_weight(precision::int2), 2U);
}

TEST(Precision, MetadataBytesPerGroup) {
  // 16-bit formats are raw; fp8 has an fp16 scale; integer formats an fp16 scale and zero.
  EXPECT_EQ(expage::metadata_bytes_per_group(precision::bf16), 0U);
  EXPECT_EQ(expage::metadata_bytes_per_group(precision::fp16), 0U);
  EXPECT_EQ(expage::metadata_bytes_per_group(precision::fp8), 2U);
  EXPECT_EQ(expage::metadata_bytes_per_group(precision::int8), 4U);
  EXPECT_EQ(expage::metadata_bytes_per_group(precision::int4), 4U);
  EXPECT_EQ(expage::metadata_bytes_per_group(precision::int2), 4U);
}

TEST(Precision, ToStringGivesTheLowercaseName) {
  EXPECT_EQ(expage::to_string(precision::bf16), "bf16");
  EXPECT_EQ(expage::to_string(precision::fp16), "fp16");
  EXPECT_EQ(expage::to_string(precision::fp8), "fp8");
  EXPECT_EQ(expage::to_string(precision::int8), "int8");
  EXPECT_EQ(expage::to_string(precision::int4), "int4");
  EXPECT_EQ(expage::to_string(precision::int2), "int2");
}

TEST(Precision, NamesAreDistinct) {
  std::set<std::string_view> names;
  for (const precision p : expage::all_precisions) {
    EXPECT_TRUE(names.insert(expage::to_string(p)).second) << expage::to_string(p);
  }
}

TEST(Precision, ParseRoundTripsEveryPrecision) {
  for (const precision p : expage::all_precisions) {
    EXPECT_EQ(expage::parse_precision(expage::to_string(p)), p) << expage::to_string(p);
    // From a separately owned string, not the literal to_string() returns.
    const std::string owned(expage::to_string(p));
    EXPECT_EQ(expage::parse_precision(owned), p) << owned;
  }
}

TEST(Precision, ParseRejectsAnUnknownNameNamingItAndTheAcceptedOnes) {
  try {
    (void)expage::parse_precision("int3");
    FAIL() << "parse_precision(\"int3\") did not throw";
  } catch (const expage::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_THAT(what, HasSubstr("'int3'"));
    for (const precision p : expage::all_precisions) {
      EXPECT_THAT(what, HasSubstr(std::string(expage::to_string(p))));
    }
  }
}

TEST(Precision, ParseIsExact) {
  // No case folding, trimming or prefix matching.
  EXPECT_THROW((void)expage::parse_precision(""), expage::invalid_argument);
  EXPECT_THROW((void)expage::parse_precision("BF16"), expage::invalid_argument);
  EXPECT_THROW((void)expage::parse_precision(" int4"), expage::invalid_argument);
  EXPECT_THROW((void)expage::parse_precision("int"), expage::invalid_argument);
  EXPECT_THROW((void)expage::parse_precision("int44"), expage::invalid_argument);
  EXPECT_THROW((void)expage::parse_precision(std::string_view("int4", 3)), expage::invalid_argument);
  // The std base is what engines catch.
  EXPECT_THROW((void)expage::parse_precision("unknown"), std::invalid_argument);
}

TEST(Precision, FmtPrintsTheName) {
  for (const precision p : expage::all_precisions) {
    EXPECT_EQ(fmt::format("{}", p), expage::to_string(p));
  }
  EXPECT_EQ(fmt::format("weights in {}", precision::int4), "weights in int4");
  // The string_view spec is inherited: width and alignment work.
  EXPECT_EQ(fmt::format("[{:>5}]", precision::fp8), "[  fp8]");
}

}  // namespace
