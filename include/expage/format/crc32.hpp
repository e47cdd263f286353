/// @file
/// @brief CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), the checksum of expage's containers,
/// and CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the block checksum of binary traces.
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

/// The CRC-32C of @p bytes, continuing from @p crc (the value a previous call returned, 0 to start).
///
/// The checksum of iSCSI (RFC 3720), ext4 and the SSE4.2 `crc32` instruction:
/// `crc32c("123456789") == 0xE3069283`. Computed with that instruction (eight bytes per
/// instruction, about 9 GB/s on one core of docs/performance.md) when the CPU has it, checked once at run time on
/// x86-64, or with ARMv8's CRC32C instructions when the build targets them; otherwise with the
/// same slicing-by-8 tables as crc32() (about 1–2 GB/s). Every path gives the same value.
///
/// @code
/// std::uint32_t c = expage::crc32c(first_part);
/// c = expage::crc32c(second_part, c);  // == crc32c of both parts concatenated
/// @endcode
[[nodiscard]] std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t crc = 0) noexcept;

namespace detail {
/// crc32c() through the tables alone, whatever the CPU offers (not API: tests compare the paths).
[[nodiscard]] std::uint32_t crc32c_tables(std::span<const std::byte> bytes, std::uint32_t crc = 0) noexcept;
}  // namespace detail

}  // namespace expage
