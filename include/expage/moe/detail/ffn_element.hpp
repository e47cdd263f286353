// Per-element code of the expert FFN, shared by the host implementation (src/moe/expert_ffn.cpp)
// and the CUDA kernel (kernels/expert_ffn.cu): how one weight of one version is read, and SiLU.
// Not API.
#pragma once

#include "expage/core/precision.hpp"
#include "expage/detail/host_device.hpp"
#include "expage/format/float16.hpp"
#include "expage/format/group_quant_element.hpp"
#include "expage/residency/version_record.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace expage::detail {

/// One weight matrix of one version, as the FFN reads it.
struct ffn_tensor {
  const std::uint8_t* data;    // bf16/fp16 values, or packed codes
  const std::uint8_t* scales;  // fp16 per group (integer formats)
  const std::uint8_t* zeros;   // fp16 per group (integer formats)
  std::uint64_t cols;
  std::uint64_t groups_per_row;
  std::uint32_t group_size;
  precision format;
};

/// True for the formats the FFN reads: bf16, fp16, int8, int4, int2.
[[nodiscard]] EXPAGE_HOST_DEVICE inline bool ffn_format_supported(precision format) noexcept {
  return format == precision::bf16 || format == precision::fp16 || format == precision::int8 ||
         format == precision::int4 || format == precision::int2;
}

/// True when @p r is a version the FFN can read as an expert of @p hidden × @p intermediate in
/// groups of @p group_size: raw, in a format ffn_format_supported() names, both tensors' weights
/// set, its bytes the shape's, and for the integer formats each tensor's scales and zeros where
/// the packed layout puts them (packed_extent_of(); packed_version_record() builds such records).
/// A record of another shape would be read past its end. The host expert_ffn() throws, naming
/// what differs; the device kernel writes NaN to the expert's tokens. A bf16 or fp16 record of
/// another H × I with the same product cannot be told apart. Tensors: gate_up [2·I, H], down [H, I].
[[nodiscard]] EXPAGE_HOST_DEVICE inline bool ffn_record_fits(const version_record& r, std::uint64_t hidden,
                                                             std::uint64_t intermediate,
                                                             std::uint32_t group_size) noexcept {
  if (r.encoding != version_encoding::raw || !ffn_format_supported(r.format)) return false;
  const bool integer = metadata_bytes_per_group(r.format) == 4;
  const std::uint64_t rows[expert_tensor_count] = {2 * intermediate, hidden};
  const std::uint64_t cols[expert_tensor_count] = {hidden, intermediate};
  std::uint64_t bytes = 0;
  for (std::size_t t = 0; t < expert_tensor_count; ++t) {
    const packed_extent e = packed_extent_of(r.format, rows[t], cols[t], group_size);
    bytes += e.total_bytes;
    if (r.data[t] == nullptr) return false;
    if (integer && (r.scales[t] != r.data[t] + e.weight_bytes || r.zeros[t] != r.data[t] + e.zeros_at)) return false;
  }
  return r.bytes == bytes;
}

/// Weight (row, col) of @p t as a float: 16-bit values widened exactly, integer codes
/// dequantized as q·s + z (the element code of expage/format/group_quant_element.hpp, not
/// rounded to 16 bits). @pre ffn_format_supported(t.format).
[[nodiscard]] EXPAGE_HOST_DEVICE inline float ffn_weight(const ffn_tensor& t, std::uint64_t row,
                                                         std::uint64_t col) noexcept {
  const std::uint64_t i = row * t.cols + col;
  if (t.format == precision::bf16) return bf16_to_float(load_le16(t.data + 2 * i));
  if (t.format == precision::fp16) return fp16_to_float(load_le16(t.data + 2 * i));
  const unsigned bits = bits_per_weight(t.format);  // int8 → 8, int4 → 4, int2 → 2
  const std::uint64_t group = row * t.groups_per_row + col / t.group_size;
  return dequantize_value(packed_code(t.data, i, bits), fp16_to_float(load_le16(t.scales + 2 * group)),
                          fp16_to_float(load_le16(t.zeros + 2 * group)));
}

/// SiLU (swish): x · sigmoid(x) = x / (1 + e^−x).
[[nodiscard]] EXPAGE_HOST_DEVICE inline float silu(float x) noexcept { return x / (1.0F + expf(-x)); }

}  // namespace expage::detail
