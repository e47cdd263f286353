#include "expage/format/crc32.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace expage {
namespace {

// Slicing-by-8 tables: table[k][b] is the CRC of byte b followed by k zero bytes.
using crc_tables = std::array<std::array<std::uint32_t, 256>, 8>;

constexpr crc_tables make_tables() noexcept {
  crc_tables t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1U) != 0 ? (c >> 1U) ^ 0xEDB88320U : c >> 1U;
    t[0][b] = c;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::size_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8U) ^ t[0][t[k - 1][b] & 0xFFU];
  }
  return t;
}

constexpr crc_tables tables = make_tables();

}  // namespace

std::uint32_t crc32(std::span<const std::byte> bytes, std::uint32_t crc) noexcept {
  std::uint32_t c = ~crc;
  const std::byte* p = bytes.data();
  std::size_t n = bytes.size();
  const auto at = [&](std::size_t i) { return std::to_integer<std::uint32_t>(p[i]); };
  while (n >= 8) {
    const std::uint32_t lo = c ^ (at(0) | at(1) << 8U | at(2) << 16U | at(3) << 24U);
    c = tables[7][lo & 0xFFU] ^ tables[6][(lo >> 8U) & 0xFFU] ^ tables[5][(lo >> 16U) & 0xFFU] ^ tables[4][lo >> 24U] ^
        tables[3][at(4)] ^ tables[2][at(5)] ^ tables[1][at(6)] ^ tables[0][at(7)];
    p += 8;
    n -= 8;
  }
  for (std::size_t i = 0; i < n; ++i) c = (c >> 8U) ^ tables[0][(c ^ at(i)) & 0xFFU];
  return ~c;
}

}  // namespace expage
