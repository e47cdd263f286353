/// @file
/// @brief Bit-exact conversions between float and the 16-bit formats bf16 and fp16.
///
/// Host and device run the same code (EXPAGE_HOST_DEVICE), so a CUDA kernel and its host
/// reference produce identical bits. 16-bit values are carried as their bit patterns
/// (`std::uint16_t`): expage's formats are about bytes, and neither the host compiler nor the
/// standard library is required to provide a 16-bit float type.
#pragma once

#include "expage/detail/host_device.hpp"

#include <cstdint>
#include <cstring>

namespace expage {

/// The float whose bit pattern is @p bits (a `memcpy`, usable on host and device).
[[nodiscard]] EXPAGE_HOST_DEVICE inline float float_from_bits(std::uint32_t bits) noexcept {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

/// The bit pattern of @p f.
[[nodiscard]] EXPAGE_HOST_DEVICE inline std::uint32_t bits_of(float f) noexcept {
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

/// The float a bf16 bit pattern denotes (exact: bf16 is the top half of a float).
[[nodiscard]] EXPAGE_HOST_DEVICE inline float bf16_to_float(std::uint16_t bf16) noexcept {
  return float_from_bits(std::uint32_t{bf16} << 16U);
}

/// @p f rounded to the nearest bf16, ties to even; NaN stays a (quiet) NaN, infinities stay.
[[nodiscard]] EXPAGE_HOST_DEVICE inline std::uint16_t float_to_bf16(float f) noexcept {
  const std::uint32_t bits = bits_of(f);
  if ((bits & 0x7FFFFFFFU) > 0x7F800000U) {
    return static_cast<std::uint16_t>((bits >> 16U) | 0x0040U);  // NaN: keep sign and payload top, force quiet
  }
  const std::uint32_t rounding = 0x7FFFU + ((bits >> 16U) & 1U);
  return static_cast<std::uint16_t>((bits + rounding) >> 16U);
}

/// The float an IEEE binary16 bit pattern denotes (exact, subnormals included).
[[nodiscard]] EXPAGE_HOST_DEVICE inline float fp16_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = std::uint32_t{h & 0x8000U} << 16U;
  const std::uint32_t exponent = (h >> 10U) & 0x1FU;
  const std::uint32_t mantissa = h & 0x3FFU;
  if (exponent == 0x1FU) return float_from_bits(sign | 0x7F800000U | (mantissa << 13U));
  if (exponent != 0) return float_from_bits(sign | ((exponent + 112U) << 23U) | (mantissa << 13U));
  // Subnormal or zero: mantissa · 2^-24, exact in float.
  const float magnitude = static_cast<float>(mantissa) * float_from_bits(0x33800000U);  // 2^-24
  return sign != 0 ? -magnitude : magnitude;
}

/// @p f rounded to the nearest IEEE binary16, ties to even; overflow gives ±infinity, NaN a quiet NaN.
[[nodiscard]] EXPAGE_HOST_DEVICE inline std::uint16_t float_to_fp16(float f) noexcept {
  const std::uint32_t bits = bits_of(f);
  const auto sign = static_cast<std::uint16_t>((bits >> 16U) & 0x8000U);
  const std::uint32_t abs = bits & 0x7FFFFFFFU;
  if (abs > 0x7F800000U) return static_cast<std::uint16_t>(sign | 0x7E00U);
  if (abs >= 0x477FF000U) return static_cast<std::uint16_t>(sign | 0x7C00U);  // rounds to ≥ 65520: infinity
  if (abs >= 0x38800000U) {                                                   // normal in fp16 (≥ 2^-14)
    const std::uint32_t rounded = abs + 0xFFFU + ((abs >> 13U) & 1U);
    return static_cast<std::uint16_t>(sign | ((rounded - 0x38000000U) >> 13U));
  }
  // Subnormal (or zero) in fp16: the float's significand shifted into units of 2^-24, rounded to even.
  const std::uint32_t exponent = abs >> 23U;
  if (exponent < 102U) return sign;  // below 2^-25: rounds to zero
  const std::uint32_t significand = (abs & 0x7FFFFFU) | 0x800000U;
  const std::uint32_t shift = 126U - exponent;  // in [14, 24]
  const std::uint32_t half = 1U << (shift - 1U);
  const std::uint32_t remainder = significand & ((1U << shift) - 1U);
  std::uint32_t result = significand >> shift;
  if (remainder > half || (remainder == half && (result & 1U) != 0)) ++result;
  return static_cast<std::uint16_t>(sign | result);
}

}  // namespace expage
