#include "expage/core/units.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

namespace {

using expage::byte_size;

static_assert(expage::KiB == 1024U);
static_assert(expage::MiB == 1024U * 1024U);
static_assert(expage::GiB == std::size_t{1024} * 1024U * 1024U);
static_assert(expage::TiB == std::size_t{1024} * 1024U * 1024U * 1024U);
static_assert(expage::max_bytes == static_cast<std::size_t>(PTRDIFF_MAX));
static_assert(expage::max_bytes == static_cast<std::size_t>(std::numeric_limits<std::ptrdiff_t>::max()));

TEST(Units, ConstantsArePowersOf1024) {
  EXPECT_EQ(expage::KiB, std::size_t{1024});
  EXPECT_EQ(expage::MiB, std::size_t{1048576});
  EXPECT_EQ(expage::GiB, std::size_t{1073741824});
  EXPECT_EQ(expage::TiB, std::size_t{1099511627776});
  EXPECT_EQ(expage::max_bytes, std::size_t{9223372036854775807});
}

TEST(Units, LiteralsScaleByTheirUnit) {
  using namespace expage::literals;
  static_assert(2_MiB == 2097152U);
  EXPECT_EQ(0_B, std::size_t{0});
  EXPECT_EQ(7_B, std::size_t{7});
  EXPECT_EQ(1_KiB, std::size_t{1024});
  EXPECT_EQ(3_KiB, std::size_t{3072});
  EXPECT_EQ(2_MiB, std::size_t{2097152});
  EXPECT_EQ(512_MiB, std::size_t{536870912});
  EXPECT_EQ(80_GiB, std::size_t{85899345920});
  EXPECT_EQ(2_TiB, std::size_t{2199023255552});
}

TEST(Units, LiteralsReachTheLargestCount) {
  using namespace expage::literals;
  // 2^63 - 1 bytes fits; 8388607 TiB is the largest whole TiB count below it.
  EXPECT_EQ(9223372036854775807_B, expage::max_bytes);
  EXPECT_EQ(8388607_TiB, std::size_t{8388607} * expage::TiB);
  EXPECT_LE(8388607_TiB, expage::max_bytes);
}

TEST(ByteSize, BelowOneKiBPrintsExactBytes) {
  EXPECT_EQ(expage::to_string(byte_size{0}), "0 B");
  EXPECT_EQ(expage::to_string(byte_size{1}), "1 B");
  EXPECT_EQ(expage::to_string(byte_size{1023}), "1023 B");
}

TEST(ByteSize, FromOneKiBPrintsTwoDecimalsInTheLargestUnit) {
  EXPECT_EQ(expage::to_string(byte_size{1024}), "1.00 KiB");
  EXPECT_EQ(expage::to_string(byte_size{1048575}), "1.00 MiB") << "the unit is chosen after rounding";
  EXPECT_EQ(expage::to_string(byte_size{1048565}), "1023.99 KiB");
  EXPECT_EQ(expage::to_string(byte_size{1536}), "1.50 KiB");
  EXPECT_EQ(expage::to_string(byte_size{3 * expage::MiB}), "3.00 MiB");
  EXPECT_EQ(expage::to_string(byte_size{expage::GiB + expage::GiB / 2}), "1.50 GiB");
  EXPECT_EQ(expage::to_string(byte_size{352321536}), "336.00 MiB");  // a bf16 Mixtral expert
  EXPECT_EQ(expage::to_string(byte_size{expage::TiB}), "1.00 TiB");
}

TEST(ByteSize, TiBIsTheLargestUnit) { EXPECT_EQ(expage::to_string(byte_size{2048 * expage::TiB}), "2048.00 TiB"); }

TEST(ByteSize, FmtDefaultIsHumanReadable) {
  EXPECT_EQ(fmt::format("{}", byte_size{0}), "0 B");
  EXPECT_EQ(fmt::format("{}", byte_size{1023}), "1023 B");
  EXPECT_EQ(fmt::format("{}", byte_size{1024}), "1.00 KiB");
  EXPECT_EQ(fmt::format("{}", byte_size{3 * expage::MiB}), "3.00 MiB");
  EXPECT_EQ(fmt::format("{}", byte_size{expage::GiB + expage::GiB / 2}), "1.50 GiB");
  EXPECT_EQ(fmt::format("[{}]", byte_size{2048}), "[2.00 KiB]");
}

TEST(ByteSize, FmtDPrintsTheExactCount) {
  EXPECT_EQ(fmt::format("{:d}", byte_size{0}), "0");
  EXPECT_EQ(fmt::format("{:d}", byte_size{1536}), "1536");
  EXPECT_EQ(fmt::format("{:d}", byte_size{expage::GiB + expage::GiB / 2}), "1610612736");
  EXPECT_EQ(fmt::format("{:d}", byte_size{std::numeric_limits<std::uint64_t>::max()}), "18446744073709551615");
}

TEST(ByteSize, FmtRejectsOtherSpecs) {
  EXPECT_THROW((void)fmt::format(fmt::runtime("{:x}"), byte_size{1}), fmt::format_error);
  EXPECT_THROW((void)fmt::format(fmt::runtime("{:dx}"), byte_size{1}), fmt::format_error);
  EXPECT_THROW((void)fmt::format(fmt::runtime("{:.2f}"), byte_size{1}), fmt::format_error);
  EXPECT_EQ(fmt::format(fmt::runtime("{:d}"), byte_size{5}), "5");
}

TEST(ByteSize, FmtHumanReadableTakesStringSpecs) {
  EXPECT_EQ(fmt::format("[{:>10}]", byte_size{1}), "[       1 B]");
  EXPECT_EQ(fmt::format("[{:<10}]", byte_size{1536}), "[1.50 KiB  ]");
  EXPECT_EQ(fmt::format("[{:*^12}]", byte_size{3 * expage::MiB}), "[**3.00 MiB**]");
  // Width is a minimum: a longer text is not truncated.
  EXPECT_EQ(fmt::format("[{:>2}]", byte_size{expage::GiB}), "[1.00 GiB]");
}

TEST(ByteCounts, AddAndMultiplyUpToTheLargestCountAndRefuseBeyond) {
  constexpr std::uint64_t top = std::numeric_limits<std::uint64_t>::max();
  EXPECT_EQ(expage::add_bytes(top - 5, 5, "t"), top);
  EXPECT_EQ(expage::multiply_bytes(top / 3, 3, "t"), top / 3 * 3);
  EXPECT_EQ(expage::multiply_bytes(0, top, "t"), 0U);
  EXPECT_THAT([] { (void)expage::add_bytes(top - 5, 6, "sim: bytes moved"); },
              ::testing::ThrowsMessage<expage::invalid_argument>(::testing::HasSubstr(
                  "sim: bytes moved: 18446744073709551610 + 6 bytes is out of range [0, 2^64 - 1]")));
  EXPECT_THAT(
      [] { (void)expage::multiply_bytes(top / 3 + 1, 3, "replay"); },
      ::testing::ThrowsMessage<expage::invalid_argument>(::testing::HasSubstr("6148914691236517206 × 3 bytes")));
}

}  // namespace
