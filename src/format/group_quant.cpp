#include "expage/format/group_quant.hpp"

#include "expage/core/error.hpp"
#include "expage/format/float16.hpp"
#include "expage/format/group_quant_element.hpp"
#include "expage/formatters.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace expage {
namespace {

constexpr float max_weight = 32768.0F;

// The fp16 neighbours of a finite fp16 bit pattern, one unit in the last place away.
std::uint16_t fp16_next_down(std::uint16_t h) noexcept {
  if (h == 0x0000U) return 0x8001U;  // +0 → the smallest negative subnormal
  return (h & 0x8000U) != 0 ? static_cast<std::uint16_t>(h + 1U) : static_cast<std::uint16_t>(h - 1U);
}
std::uint16_t fp16_next_up(std::uint16_t h) noexcept {
  if (h == 0x8000U || h == 0x0000U) return 0x0001U;
  return (h & 0x8000U) != 0 ? static_cast<std::uint16_t>(h - 1U) : static_cast<std::uint16_t>(h + 1U);
}

// The largest fp16 ≤ v and the smallest fp16 ≥ v (v finite, |v| well inside fp16's range).
std::uint16_t fp16_at_most(double v) noexcept {
  std::uint16_t h = float_to_fp16(static_cast<float>(v));
  while (static_cast<double>(fp16_to_float(h)) > v) h = fp16_next_down(h);
  return h;
}
std::uint16_t fp16_at_least(double v) noexcept {
  std::uint16_t h = float_to_fp16(static_cast<float>(v));
  while (static_cast<double>(fp16_to_float(h)) < v) h = fp16_next_up(h);
  return h;
}

void put_le16(std::vector<std::byte>& b, std::uint64_t at, std::uint16_t v) {
  b[at] = static_cast<std::byte>(v & 0xFFU);
  b[at + 1] = static_cast<std::byte>(v >> 8U);
}

}  // namespace

group_quant_layout::group_quant_layout(precision format, tensor_shape shape, std::uint32_t group_size)
    : format_(format), shape_(shape), group_size_(group_size) {
  if (format != precision::int8 && format != precision::int4 && format != precision::int2) {
    // By number: to_string() of a value that is no precision reads "unknown".
    throw invalid_argument(fmt::format("group_quant_layout: precision {} ({}) is not one of int8, int4, int2", format,
                                       static_cast<unsigned>(format)));
  }
  if (group_size < 1 || group_size > (1U << 20)) {
    throw invalid_argument(fmt::format("group_quant_layout: group_size {} out of range [1, {}]", group_size, 1U << 20));
  }
  constexpr std::uint64_t max_elements = std::uint64_t{1} << 48;
  if (shape.rows == 0 || shape.cols == 0 || shape.rows > max_elements || shape.cols > max_elements / shape.rows) {
    throw invalid_argument(
        fmt::format("group_quant_layout: shape [{}, {}] must have rows·cols in [1, 2^48]", shape.rows, shape.cols));
  }
}

void check_dequant_output(precision out_format, std::string_view caller) {
  if (out_format != precision::bf16 && out_format != precision::fp16) {
    // By number too: to_string() of a value that is no precision reads "unknown".
    throw invalid_argument(fmt::format("{}: output precision {} ({}) is not bf16 or fp16", caller, out_format,
                                       static_cast<unsigned>(out_format)));
  }
}

std::vector<std::byte> quantize_groups(std::span<const float> weights, const group_quant_layout& layout) {
  const tensor_shape shape = layout.shape();
  if (weights.size() != shape.elements()) {
    throw invalid_argument(fmt::format("quantize_groups: {} weights given, shape [{}, {}] holds {}", weights.size(),
                                       shape.rows, shape.cols, shape.elements()));
  }
  for (std::size_t i = 0; i < weights.size(); ++i) {
    if (!(std::fabs(weights[i]) <= max_weight)) {
      throw invalid_argument(
          fmt::format("quantize_groups: weight {} (row {}, col {}) is {}; weights must be finite "
                      "with |w| ≤ {}",
                      i, i / shape.cols, i % shape.cols, weights[i], max_weight));
    }
  }
  const unsigned bits = layout.bits();
  const unsigned max_code = (1U << bits) - 1U;
  std::vector<std::byte> out(layout.total_bytes());
  const std::uint64_t gpr = layout.groups_per_row();
  for (std::uint64_t r = 0; r < shape.rows; ++r) {
    for (std::uint64_t j = 0; j < gpr; ++j) {
      const std::uint64_t begin = r * shape.cols + j * layout.group_size();
      const std::uint64_t end = r * shape.cols + std::min<std::uint64_t>(shape.cols, (j + 1) * layout.group_size());
      const auto [lo, hi] = std::minmax_element(weights.begin() + static_cast<std::ptrdiff_t>(begin),
                                                weights.begin() + static_cast<std::ptrdiff_t>(end));
      const std::uint16_t zero_bits = fp16_at_most(static_cast<double>(*lo));
      const double zero = static_cast<double>(fp16_to_float(zero_bits));
      const double range = static_cast<double>(*hi) - zero;
      const std::uint16_t scale_bits = range > 0 ? fp16_at_least(range / max_code) : std::uint16_t{0};
      const double scale = static_cast<double>(fp16_to_float(scale_bits));
      put_le16(out, layout.scales_at() + 2 * (r * gpr + j), scale_bits);
      put_le16(out, layout.zeros_at() + 2 * (r * gpr + j), zero_bits);
      for (std::uint64_t i = begin; i < end; ++i) {
        const double q = scale > 0 ? std::nearbyint((static_cast<double>(weights[i]) - zero) / scale) : 0.0;
        const auto code = static_cast<unsigned>(std::clamp(q, 0.0, static_cast<double>(max_code)));
        const std::uint64_t bit = i * bits;
        out[bit / 8] |= static_cast<std::byte>(code << (bit % 8));
      }
    }
  }
  return out;
}

void dequantize_groups(std::span<const std::byte> packed, const group_quant_layout& layout, precision out_format,
                       std::span<std::uint16_t> out) {
  if (packed.size() != layout.total_bytes()) {
    throw invalid_argument(fmt::format("dequantize_groups: {} packed bytes, the {} layout of [{}, {}] holds {}",
                                       packed.size(), layout.format(), layout.shape().rows, layout.shape().cols,
                                       layout.total_bytes()));
  }
  if (out.size() != layout.shape().elements()) {
    throw invalid_argument(fmt::format("dequantize_groups: output holds {} values, the layout needs {}", out.size(),
                                       layout.shape().elements()));
  }
  check_dequant_output(out_format, "dequantize_groups");
  const bool to_bf16 = out_format == precision::bf16;
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(packed.data());
  const tensor_shape shape = layout.shape();
  const std::uint64_t gpr = layout.groups_per_row();
  const unsigned bits = layout.bits();
  // Every group's metadata before any value is written (nothing half-written): quantize_groups()
  // writes finite scales ≥ 0 and finite zeros, and such a corrupted one decoded to NaN, ±inf or
  // mirrored values without a word. With a scale ≥ 0 the group's values grow with the code, so
  // its largest code bounds them: a scale that puts it beyond fp16's range (±65504, a value
  // that rounds to ±inf) is refused for an fp16 output. (bf16's range holds any such value.)
  const unsigned largest_code = (1U << bits) - 1U;
  for (std::uint64_t g = 0; g < shape.rows * gpr; ++g) {
    const float scale = fp16_to_float(load_le16(bytes + layout.scales_at() + 2 * g));
    const float zero = fp16_to_float(load_le16(bytes + layout.zeros_at() + 2 * g));
    if (!(scale >= 0.0F && std::isfinite(scale)) || !std::isfinite(zero)) {
      throw invalid_argument(fmt::format(
          "dequantize_groups: group {} of row {}: scale {} (allowed: finite, ≥ 0) and zero {} (allowed: finite)",
          g % gpr, g / gpr, scale, zero));
    }
    if (!to_bf16 && (dequantize_to_16(largest_code, scale, zero, false) & 0x7FFFU) == 0x7C00U) {
      throw invalid_argument(fmt::format(
          "dequantize_groups: group {} of row {}: scale {} and zero {} put code {} at {}, out of fp16's range "
          "[-65504, 65504]",
          g % gpr, g / gpr, scale, zero, largest_code, dequantize_value(largest_code, scale, zero)));
    }
  }
  for (std::uint64_t r = 0; r < shape.rows; ++r) {
    for (std::uint64_t j = 0; j < gpr; ++j) {
      const float scale = fp16_to_float(load_le16(bytes + layout.scales_at() + 2 * (r * gpr + j)));
      const float zero = fp16_to_float(load_le16(bytes + layout.zeros_at() + 2 * (r * gpr + j)));
      const std::uint64_t begin = r * shape.cols + j * layout.group_size();
      const std::uint64_t end = r * shape.cols + std::min<std::uint64_t>(shape.cols, (j + 1) * layout.group_size());
      for (std::uint64_t i = begin; i < end; ++i) {
        out[i] = dequantize_to_16(packed_code(bytes, i, bits), scale, zero, to_bf16);
      }
    }
  }
}

}  // namespace expage
