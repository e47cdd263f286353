/// @file
/// @brief Weight precisions an expert version can be stored in, and their byte cost.
///
/// Free of fmt, so kernels include it; expage/formatters.hpp formats a precision.
#pragma once

#include <cstdint>
#include <string_view>

namespace expage {

/// @brief The storage format of one version of an expert's weights.
///
/// 16-bit formats store each weight raw. The others are group-wise: every run
/// of `group_size` consecutive weights along a row (the input dimension) shares
/// per-group metadata, laid out as documented in docs/kernels.md:
/// - `fp8` (e4m3): one fp16 scale per group;
/// - `int8`, `int4`, `int2`: one fp16 scale and one fp16 zero point per group
///   (asymmetric quantization), weights packed little-end first.
enum class precision : std::uint8_t {
  bf16,  ///< bfloat16, 2 bytes per weight.
  fp16,  ///< IEEE half, 2 bytes per weight.
  fp8,   ///< e4m3, 1 byte per weight plus a scale per group.
  int8,  ///< 8-bit integers plus scale and zero per group.
  int4,  ///< 4-bit integers, two per byte, plus scale and zero per group.
  int2,  ///< 2-bit integers, four per byte, plus scale and zero per group.
};

/// Every precision, in declaration order.
inline constexpr precision all_precisions[] = {precision::bf16, precision::fp16, precision::fp8,
                                               precision::int8, precision::int4, precision::int2};

/// Bits one weight occupies in @p p, metadata excluded.
[[nodiscard]] constexpr unsigned bits_per_weight(precision p) noexcept {
  switch (p) {
    case precision::bf16:
    case precision::fp16: return 16;
    case precision::fp8:
    case precision::int8: return 8;
    case precision::int4: return 4;
    case precision::int2: return 2;
  }
  return 0;
}

/// Bytes of per-group metadata in @p p: 0 for 16-bit formats, 2 (scale) for
/// fp8, 4 (scale and zero point, fp16 each) for the integer formats.
[[nodiscard]] constexpr unsigned metadata_bytes_per_group(precision p) noexcept {
  switch (p) {
    case precision::bf16:
    case precision::fp16: return 0;
    case precision::fp8: return 2;
    case precision::int8:
    case precision::int4:
    case precision::int2: return 4;
  }
  return 0;
}

/// @brief Where a [rows, cols] weight matrix stored in one precision keeps its bytes
/// (docs/kernels.md): the weights first, then the fp16 scales (fp8 and the integer formats, one
/// per group of `group_size` weights along a row, groups never crossing rows), then the fp16 zero
/// points (the integer formats), packed with no padding. The one owner of these offsets:
/// moe_geometry's sizes, group_quant_layout, packed_version_record() and the FFN's record check
/// (host and device) all read them here.
struct packed_extent {
  std::uint64_t weight_bytes = 0;  ///< ⌈rows·cols·bits/8⌉: the weights, and where the scales begin.
  std::uint64_t groups = 0;        ///< rows · ⌈cols / group_size⌉.
  std::uint64_t zeros_at = 0;      ///< Where the zero points begin: weight_bytes + 2 · groups.
  std::uint64_t total_bytes = 0;   ///< weight_bytes + groups · metadata_bytes_per_group(p).
};

/// The packed_extent of a [@p rows, @p cols] matrix in @p p with groups of @p group_size.
/// @pre group_size ≥ 1 and rows·cols·16 below 2^64 (the callers' shape checks).
[[nodiscard]] constexpr packed_extent packed_extent_of(precision p, std::uint64_t rows, std::uint64_t cols,
                                                       std::uint32_t group_size) noexcept {
  const std::uint64_t bits = rows * cols * bits_per_weight(p);
  packed_extent e;
  e.weight_bytes = bits / 8 + (bits % 8 != 0);  // rounded up without overflowing near 2^64
  e.groups = rows * (cols / group_size + (cols % group_size != 0));
  e.zeros_at = e.weight_bytes + 2 * e.groups;
  e.total_bytes = e.weight_bytes + e.groups * metadata_bytes_per_group(p);
  return e;
}

/// The lowercase name of @p p: "bf16", "int4", ...
[[nodiscard]] constexpr std::string_view to_string(precision p) noexcept {
  switch (p) {
    case precision::bf16: return "bf16";
    case precision::fp16: return "fp16";
    case precision::fp8: return "fp8";
    case precision::int8: return "int8";
    case precision::int4: return "int4";
    case precision::int2: return "int2";
  }
  return "unknown";
}

/// Parses a name produced by to_string(precision).
/// @throws expage::invalid_argument naming @p name and the accepted names.
[[nodiscard]] precision parse_precision(std::string_view name);

}  // namespace expage
