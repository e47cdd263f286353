/// @file
/// @brief Where a version's tensors keep their codes, scales and zeros in each precision: the
/// shape of an expert (expert_ffn_shape) and packed_version_record(), the one owner of these
/// layouts, which transition_manager, expert_runtime and the FFN kernels' callers all use.
#pragma once

#include "expage/core/moe_geometry.hpp"
#include "expage/core/precision.hpp"
#include "expage/residency/version_record.hpp"

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace expage {

/// @brief The dimensions of the experts one expert_ffn() call runs.
struct expert_ffn_shape {
  std::uint64_t hidden = 0;        ///< H: model width, in [1, 2^20].
  std::uint64_t intermediate = 0;  ///< I: expert FFN width, in [1, 2^20].
  std::uint32_t group_size = 128;  ///< Quantization group of integer versions, in [1, 2^20].
  /// The routed experts' shape of @p g.
  [[nodiscard]] static expert_ffn_shape of(const moe_geometry& g) noexcept {
    return {.hidden = g.hidden_size(), .intermediate = g.intermediate_size(), .group_size = g.group_size()};
  }
  /// @throws expage::invalid_argument naming the first dimension out of its range, after
  /// "@p caller: ".
  void validate(std::string_view caller = "expert_ffn_shape") const;
};

/// The raw version_record of an expert whose tensors are stored at @p gate_up and @p down, each
/// in @p format's byte layout: 16-bit values for bf16 and fp16, or the group_quant layout
/// (codes, then fp16 scales, then fp16 zeros; expage/format/group_quant.hpp) with
/// shape.group_size for int8, int4 and int2, whose scales and zeros then point into each tensor,
/// or for fp8 one e4m3 byte per weight followed by one fp16 scale per group (no zeros). The one
/// owner of these layouts: transition_manager builds its records with it too. expert_ffn() reads
/// every format but fp8. Sets data, scales, zeros, format and bytes (both tensors, as
/// moe_geometry::tensor_bytes counts them); the handle table sets the rest.
///
/// @code
/// std::vector<std::byte> gu = expage::quantize_groups(w_gate_up, gate_up_layout);   // int4
/// std::vector<std::byte> dn = expage::quantize_groups(w_down, down_layout);
/// expage::version_record r = expage::packed_version_record(expage::precision::int4, gu.data(), dn.data(), shape);
/// @endcode
/// @throws expage::invalid_argument when @p shape or @p format is out of range.
[[nodiscard]] version_record packed_version_record(precision format, std::byte* gate_up, std::byte* down,
                                                   const expert_ffn_shape& shape);

/// The bytes of a version of @p shape in @p format's packed layout: the `bytes`
/// packed_version_record() sets (both tensors, as moe_geometry::tensor_bytes counts them).
/// @throws expage::invalid_argument when @p shape or @p format is out of range, the message
/// beginning with @p caller.
[[nodiscard]] std::uint64_t packed_version_bytes(precision format, const expert_ffn_shape& shape,
                                                 std::string_view caller = "packed_version_bytes");

}  // namespace expage
