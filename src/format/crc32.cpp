#include "expage/format/crc32.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define EXPAGE_CRC32C_ARM 1
#include <arm_acle.h>
#endif

namespace expage {
namespace {

// Slicing-by-8 tables of a reflected CRC-32 polynomial: table[k][b] is the CRC of byte b
// followed by k zero bytes.
using crc_tables = std::array<std::array<std::uint32_t, 256>, 8>;

constexpr crc_tables make_tables(std::uint32_t polynomial) noexcept {
  crc_tables t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1U) != 0 ? (c >> 1U) ^ polynomial : c >> 1U;
    t[0][b] = c;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::size_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8U) ^ t[0][t[k - 1][b] & 0xFFU];
  }
  return t;
}

constexpr crc_tables ieee_tables = make_tables(0xEDB88320U);
constexpr crc_tables castagnoli_tables = make_tables(0x82F63B78U);

// The reflected CRC of @p bytes with the tables @p tables, from the register value ~crc.
std::uint32_t sliced_crc(const crc_tables& tables, std::span<const std::byte> bytes, std::uint32_t crc) noexcept {
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

#if defined(__x86_64__)
// The SSE4.2 instruction computes the same reflected register update as the tables, eight
// little-endian bytes at a time (x86-64 is little-endian, so a word load is the byte order).
__attribute__((target("sse4.2"))) std::uint32_t crc32c_sse42(std::span<const std::byte> bytes,
                                                             std::uint32_t crc) noexcept {
  std::uint64_t c = ~crc;
  const std::byte* p = bytes.data();
  std::size_t n = bytes.size();
  for (; n >= 8; p += 8, n -= 8) {
    std::uint64_t word = 0;
    std::memcpy(&word, p, sizeof word);
    c = _mm_crc32_u64(c, word);
  }
  auto c32 = static_cast<std::uint32_t>(c);
  for (; n > 0; ++p, --n) c32 = _mm_crc32_u8(c32, std::to_integer<std::uint8_t>(*p));
  return ~c32;
}

bool has_sse42() noexcept {
  static const bool has = __builtin_cpu_supports("sse4.2") != 0;
  return has;
}
#endif

}  // namespace

std::uint32_t crc32(std::span<const std::byte> bytes, std::uint32_t crc) noexcept {
  return sliced_crc(ieee_tables, bytes, crc);
}

std::uint32_t detail::crc32c_tables(std::span<const std::byte> bytes, std::uint32_t crc) noexcept {
  return sliced_crc(castagnoli_tables, bytes, crc);
}

std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t crc) noexcept {
#if defined(__x86_64__)
  if (has_sse42()) return crc32c_sse42(bytes, crc);
#elif defined(EXPAGE_CRC32C_ARM)
  std::uint32_t c = ~crc;
  const std::byte* p = bytes.data();
  std::size_t n = bytes.size();
  for (; n >= 8; p += 8, n -= 8) {
    std::uint64_t word = 0;
    std::memcpy(&word, p, sizeof word);
    c = __crc32cd(c, word);
  }
  for (; n > 0; ++p, --n) c = __crc32cb(c, std::to_integer<std::uint8_t>(*p));
  return ~c;
#endif
#if !defined(EXPAGE_CRC32C_ARM)
  return detail::crc32c_tables(bytes, crc);
#endif
}

}  // namespace expage
