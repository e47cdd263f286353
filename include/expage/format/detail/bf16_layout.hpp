/// @file
/// @brief Byte layout constants of the bf16 container, shared by the codec and the CUDA decoder
/// (not API; docs/kernels.md specifies the format).
#pragma once

#include "expage/detail/host_device.hpp"

#include <cstdint>
#include <string_view>

namespace expage::detail {

inline constexpr std::string_view bf16_magic = "EXPAGEBF";
inline constexpr std::uint16_t bf16_version = 1;
inline constexpr std::uint64_t bf16_header_bytes = 48;
inline constexpr unsigned bf16_lanes = 32;           // lane streams per chunk: one warp
inline constexpr unsigned bf16_values_per_step = 4;  // consecutive values a lane decodes per step

/// Exponents lane @p lane of a chunk holding @p m values codes: values 4·(32·j + lane) + q < m.
[[nodiscard]] EXPAGE_HOST_DEVICE constexpr std::uint64_t bf16_lane_symbols(std::uint64_t m, unsigned lane) noexcept {
  const std::uint64_t row = bf16_lanes * bf16_values_per_step;
  const std::uint64_t rem = m % row;
  const std::uint64_t first = std::uint64_t{bf16_values_per_step} * lane;
  const std::uint64_t tail =
      rem <= first ? 0 : (rem - first < bf16_values_per_step ? rem - first : bf16_values_per_step);
  return (m / row) * bf16_values_per_step + tail;
}

/// Section offsets of a container (see docs/kernels.md): header, 256 code lengths, chunk bit
/// offsets (u64), lane bit lengths (u16), exponent words (u32, padded to 8 bytes), sign+mantissa.
struct bf16_layout {
  std::uint64_t chunk_offsets_at;
  std::uint64_t lane_bits_at;
  std::uint64_t exponents_at;
  std::uint64_t exponent_bytes;
  std::uint64_t sign_mantissa_at;
  std::uint64_t total_bytes;

  /// @pre the sizes are bounded by a real container's size (no overflow).
  [[nodiscard]] static constexpr bf16_layout of(std::uint64_t elements, std::uint64_t chunks,
                                                std::uint64_t exponent_bits) noexcept {
    bf16_layout l{};
    l.chunk_offsets_at = bf16_header_bytes + 256;
    l.lane_bits_at = l.chunk_offsets_at + 8 * (chunks + 1);
    l.exponents_at = l.lane_bits_at + 2 * std::uint64_t{bf16_lanes} * chunks;
    l.exponent_bytes = (exponent_bits + 63) / 64 * 8;
    l.sign_mantissa_at = l.exponents_at + l.exponent_bytes;
    l.total_bytes = l.sign_mantissa_at + elements;
    return l;
  }
};

}  // namespace expage::detail
