/// @file
/// @brief Per-element code of group-wise dequantization, shared by the host reference and the
/// CUDA kernel (EXPAGE_HOST_DEVICE), so both produce the same bits.
///
/// A weight w of a group with fp16 `scale` s and fp16 `zero` z (the value code 0 stands for)
/// is stored as an unsigned code q of b bits and read back as `q · s + z`. Because q < 2^8 and
/// s has an 11-bit significand, q · s is exact in float: the only rounding is the addition
/// (identical with or without FMA contraction) and the final rounding to bf16 or fp16.
/// Layout: docs/kernels.md and expage/format/group_quant.hpp.
#pragma once

#include "expage/detail/host_device.hpp"
#include "expage/format/float16.hpp"

#include <cstdint>

namespace expage {

/// The @p bits-bit code of element @p i in a packed code array: element i occupies bits
/// [(i·bits) mod 8, …) of byte ⌊i·bits/8⌋, low bits first ("little-end first"); @p bits is 8, 4 or 2.
[[nodiscard]] EXPAGE_HOST_DEVICE inline unsigned packed_code(const std::uint8_t* codes, std::uint64_t i,
                                                             unsigned bits) noexcept {
  const std::uint64_t bit = i * bits;
  return (static_cast<unsigned>(codes[bit / 8]) >> (bit % 8)) & ((1U << bits) - 1U);
}

/// The 16-bit little-endian value at @p p (metadata is not 2-byte aligned in general).
[[nodiscard]] EXPAGE_HOST_DEVICE inline std::uint16_t load_le16(const std::uint8_t* p) noexcept {
  return static_cast<std::uint16_t>(p[0] | (p[1] << 8U));
}

/// The float value of code @p code in a group with scale @p scale and zero @p zero.
[[nodiscard]] EXPAGE_HOST_DEVICE inline float dequantize_value(unsigned code, float scale, float zero) noexcept {
  return static_cast<float>(code) * scale + zero;
}

/// dequantize_value() rounded to bf16 (@p to_bf16) or fp16, as a bit pattern.
[[nodiscard]] EXPAGE_HOST_DEVICE inline std::uint16_t dequantize_to_16(unsigned code, float scale, float zero,
                                                                       bool to_bf16) noexcept {
  const float v = dequantize_value(code, scale, zero);
  return to_bf16 ? float_to_bf16(v) : float_to_fp16(v);
}

}  // namespace expage
