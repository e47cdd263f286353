/// @file
/// @brief expert_id: which expert of which MoE layer.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>

namespace expage {

/// @brief Names one routed expert: its MoE layer and its index within the layer.
///
/// Both indices are zero-based; layer counts MoE layers only (a model whose
/// first decoder layer is dense, like DeepSeek-V2-Lite, has MoE layer 0 at
/// decoder layer 1). Validate against a model with moe_geometry::validate().
///
/// @code
/// expage::expert_id id{.layer = 7, .expert = 3};
/// geometry.validate(id);                       // throws if out of range
/// std::size_t slot = geometry.flat_index(id);  // layer-major: 7 * experts + 3
/// fmt::print("{}\n", id);                      // "L7.E3" (with expage/formatters.hpp)
/// @endcode
/// @threadsafety thread-compatible.
struct expert_id {
  std::uint32_t layer = 0;   ///< MoE layer, in [0, moe_geometry::layers()).
  std::uint32_t expert = 0;  ///< Routed expert, in [0, moe_geometry::experts_per_layer()).

  /// Layer-major ordering: all experts of layer 0 first.
  friend constexpr auto operator<=>(const expert_id&, const expert_id&) noexcept = default;
};

}  // namespace expage

/// Hashes an expert_id (layer and expert packed into one 64-bit value).
template <>
struct std::hash<expage::expert_id> {
  /// The hash of @p id.
  std::size_t operator()(const expage::expert_id& id) const noexcept {
    return std::hash<std::uint64_t>{}((std::uint64_t{id.layer} << 32) | id.expert);
  }
};
