/// @file
/// @brief Group-wise asymmetric int8/int4/int2 quantization (offline, host) and its dequantization
/// reference, in the byte layout that expage::precision and moe_geometry size.
///
/// A [rows, cols] weight matrix (row-major, cols = the input dimension K) is split along each
/// row into groups of `group_size` consecutive weights (the last group of a row may be shorter;
/// groups never cross rows). Each group stores an fp16 scale s and an fp16 zero z, the value
/// code 0 stands for; weight w becomes the code q = clamp(round((w − z)/s), 0, 2^b − 1) and reads
/// back as q·s + z (expage/format/group_quant_element.hpp). The quantizer takes z = the group's
/// minimum rounded down to fp16 and s = (max − z)/(2^b − 1) rounded up to fp16, so no code is
/// clamped and every weight is within s/2 (plus one rounding of the sum) of q·s + z in fp32; the
/// dequantizers return that rounded to bf16 or fp16, which adds half an ulp of the output format
/// (docs/kernels.md: for int8 of the order of s itself).
///
/// Bytes (docs/kernels.md): the codes of all rows·cols weights in flat row-major order, packed
/// little-end first (int4: element 2k in the low nibble of byte k; int2: element 4k in bits 0–1),
/// ⌈rows·cols·b/8⌉ bytes; then rows·⌈cols/group_size⌉ fp16 scales (group (r, j) at r·⌈cols/group⌉
/// + j); then as many fp16 zeros. All little-endian, no padding: the total is
/// moe_geometry::tensor_bytes() for the same shape, precision and group size.
#pragma once

#include "expage/core/moe_geometry.hpp"
#include "expage/core/precision.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace expage {

/// @brief The byte layout of one group-quantized matrix: shape, precision, group size, offsets.
///
/// @code
/// expage::group_quant_layout layout(expage::precision::int4, {.rows = 4096, .cols = 14336}, 128);
/// std::vector<std::byte> packed = expage::quantize_groups(weights, layout);   // layout.total_bytes()
/// expage::dequantize_groups(packed, layout, expage::precision::bf16, out);   // out: rows·cols bf16
/// @endcode
/// @threadsafety thread-compatible (immutable after construction).
class group_quant_layout {
 public:
  /// @throws expage::invalid_argument unless @p format is int8, int4 or int2, @p group_size is in
  /// [1, 2^20] and rows·cols is in [1, 2^48].
  group_quant_layout(precision format, tensor_shape shape, std::uint32_t group_size);

  [[nodiscard]] precision format() const noexcept { return format_; }                ///< int8, int4 or int2.
  [[nodiscard]] tensor_shape shape() const noexcept { return shape_; }               ///< Rows × cols.
  [[nodiscard]] std::uint32_t group_size() const noexcept { return group_size_; }    ///< Weights per group.
  [[nodiscard]] unsigned bits() const noexcept { return bits_per_weight(format_); }  ///< Bits per code.
  /// ⌈cols / group_size⌉.
  [[nodiscard]] std::uint64_t groups_per_row() const noexcept { return (shape_.cols + group_size_ - 1) / group_size_; }
  /// rows · groups_per_row(): scales (and zeros) stored.
  [[nodiscard]] std::uint64_t group_count() const noexcept { return shape_.rows * groups_per_row(); }
  /// Bytes of packed codes: ⌈rows·cols·bits/8⌉ (also the offset of the scales).
  [[nodiscard]] std::uint64_t code_bytes() const noexcept { return extent().weight_bytes; }
  /// Byte offset of the fp16 scales.
  [[nodiscard]] std::uint64_t scales_at() const noexcept { return code_bytes(); }
  /// Byte offset of the fp16 zeros.
  [[nodiscard]] std::uint64_t zeros_at() const noexcept { return extent().zeros_at; }
  /// Total bytes: codes plus metadata_bytes_per_group(format) per group.
  [[nodiscard]] std::uint64_t total_bytes() const noexcept { return extent().total_bytes; }
  /// The offsets above (packed_extent_of(), their one owner).
  [[nodiscard]] packed_extent extent() const noexcept {
    return packed_extent_of(format_, shape_.rows, shape_.cols, group_size_);
  }

 private:
  precision format_;
  tensor_shape shape_;
  std::uint32_t group_size_;
};

/// Quantizes @p weights (rows·cols floats, row-major) into a new buffer of layout.total_bytes().
/// O(n).
/// @throws expage::invalid_argument when the size differs from rows·cols or a weight is not
/// finite or exceeds 32768 in magnitude (scales and zeros must stay finite in fp16).
[[nodiscard]] std::vector<std::byte> quantize_groups(std::span<const float> weights, const group_quant_layout& layout);

/// The output precisions a dequantizer writes: bf16 and fp16 (the host's and the device's one check).
/// @throws expage::invalid_argument naming @p out_format (by name and number) after "@p caller: ".
void check_dequant_output(precision out_format, std::string_view caller);

/// The host reference dequantizer: writes q·s + z of every weight, rounded to @p out_format
/// (bf16 or fp16), as 16-bit patterns in row-major order. The CUDA kernel
/// (expage/cuda/dequant.hpp) produces the same bits for metadata quantize_groups() wrote (the
/// kernel does not check it).
/// @throws expage::invalid_argument when @p packed is not layout.total_bytes() long, @p out does
/// not hold rows·cols values, @p out_format is not bf16 or fp16, a group's scale is not finite
/// and ≥ 0 or its zero not finite, or (fp16 output) its largest code's value rounds beyond fp16's
/// range (all checked before anything is written).
void dequantize_groups(std::span<const std::byte> packed, const group_quant_layout& layout, precision out_format,
                       std::span<std::uint16_t> out);

}  // namespace expage
