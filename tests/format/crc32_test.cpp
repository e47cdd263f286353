#include "expage/format/crc32.hpp"

#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace {

std::span<const std::byte> bytes_of(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

// Bit-at-a-time reflected CRC-32 with @p polynomial (0xEDB88320: CRC-32; 0x82F63B78: CRC-32C),
// the obviously correct reference for the sliced tables and the instructions.
std::uint32_t slow_crc(std::span<const std::byte> bytes, std::uint32_t polynomial) {
  std::uint32_t c = 0xFFFFFFFFU;
  for (const std::byte b : bytes) {
    c ^= std::to_integer<std::uint32_t>(b);
    for (int bit = 0; bit < 8; ++bit) c = (c & 1U) != 0 ? (c >> 1U) ^ polynomial : c >> 1U;
  }
  return ~c;
}
std::uint32_t slow_crc32(std::span<const std::byte> bytes) { return slow_crc(bytes, 0xEDB88320U); }
std::uint32_t slow_crc32c(std::span<const std::byte> bytes) { return slow_crc(bytes, 0x82F63B78U); }

TEST(Crc32, MatchesTheStandardCheckValue) {
  EXPECT_EQ(expage::crc32(bytes_of("123456789")), 0xCBF43926U);
  EXPECT_EQ(expage::crc32(bytes_of("")), 0U);
  EXPECT_EQ(expage::crc32(bytes_of("The quick brown fox jumps over the lazy dog")), 0x414FA339U);
}

TEST(Crc32, EqualsTheBitwiseReferenceAtEveryLengthAndSplit) {
  std::vector<std::byte> data(300);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>((i * 131 + 7) & 0xFFU);
  const std::span<const std::byte> all(data);
  for (std::size_t n = 0; n <= data.size(); n += 7) {
    ASSERT_EQ(expage::crc32(all.first(n)), slow_crc32(all.first(n))) << "length " << n;
    const std::size_t split = n / 3;
    ASSERT_EQ(expage::crc32(all.subspan(split, n - split), expage::crc32(all.first(split))), slow_crc32(all.first(n)))
        << "length " << n << " split at " << split;
  }
}

TEST(Crc32c, MatchesTheStandardCheckValueAndRfc3720) {
  EXPECT_EQ(expage::crc32c(bytes_of("123456789")), 0xE3069283U);
  EXPECT_EQ(expage::crc32c(bytes_of("")), 0U);
  // RFC 3720, appendix B.4: 32 bytes of zeros, of ones, ascending, descending.
  std::array<std::byte, 32> b{};
  EXPECT_EQ(expage::crc32c(b), 0x8A9136AAU);
  b.fill(std::byte{0xFF});
  EXPECT_EQ(expage::crc32c(b), 0x62A8AB43U);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::byte>(i);
  EXPECT_EQ(expage::crc32c(b), 0x46DD794EU);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::byte>(31 - i);
  EXPECT_EQ(expage::crc32c(b), 0x113FDB5CU);
}

TEST(Crc32c, EveryPathEqualsTheBitwiseReferenceAtEveryLengthSplitAndAlignment) {
  std::vector<std::byte> data(300);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>((i * 131 + 7) & 0xFFU);
  const std::span<const std::byte> all(data);
  for (std::size_t n = 0; n + 3 <= data.size(); n += 5) {
    const std::span<const std::byte> part = all.subspan(n % 3, n);  // unaligned starts too
    const std::uint32_t want = slow_crc32c(part);
    ASSERT_EQ(expage::crc32c(part), want) << "length " << n;
    ASSERT_EQ(expage::detail::crc32c_tables(part), want) << "length " << n;
    const std::size_t split = n / 3;
    ASSERT_EQ(expage::crc32c(part.subspan(split), expage::crc32c(part.first(split))), want) << "split at " << split;
    ASSERT_EQ(expage::detail::crc32c_tables(part.subspan(split), expage::detail::crc32c_tables(part.first(split))),
              want)
        << "split at " << split;
  }
}

}  // namespace
