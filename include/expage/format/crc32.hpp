/// @file
/// @brief CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), the checksum of expage's containers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace expage {

/// The CRC-32 of @p bytes, continuing from @p crc (the value a previous call returned, 0 to start).
///
/// The same function as zlib's `crc32()`: `crc32("123456789") == 0xCBF43926`. Table-driven,
/// eight bytes per step (about 1–2 GB/s on one core).
///
/// @code
/// std::uint32_t c = expage::crc32(first_part);
/// c = expage::crc32(second_part, c);  // == crc32 of both parts concatenated
/// @endcode
[[nodiscard]] std::uint32_t crc32(std::span<const std::byte> bytes, std::uint32_t crc = 0) noexcept;

}  // namespace expage
