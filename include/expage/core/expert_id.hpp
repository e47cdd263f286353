/// @file
/// @brief expert_id: which expert of which MoE layer.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>

namespace expage {

/// @brief An expert's index within its MoE layer, in [0, moe_geometry::experts_per_layer()).
///
/// The one spelling of an in-layer expert in the cache (slot_cache::access, access_context,
/// key_space, layered_miss_curves, replay, group_tokens) and in residency (expert_id::expert);
/// expert_id pairs it with its layer wherever the layer is not implied. A layer holds at most
/// 65536 experts, so 32 bits suffice and layer-major products are formed in 64 bits.
///
/// At the routing and kernel ABI (moe/routing.hpp, cuda/moe_routing.hpp, expert_map) ids stay
/// std::int32_t on purpose: they are the engine's tensors passed unchanged (torch.topk's ids as
/// fused-MoE kernels take them, vLLM's int32 `expert_map`), and −1 marks an absent expert or
/// slot. Every non-negative such id is an expert_index.
using expert_index = std::uint32_t;

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
  std::uint32_t layer = 0;  ///< MoE layer, in [0, moe_geometry::layers()).
  expert_index expert = 0;  ///< Routed expert, in [0, moe_geometry::experts_per_layer()).

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
