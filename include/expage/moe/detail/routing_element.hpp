// Per-element code of the router top-k and the expert remap, shared by the host reference
// (src/moe/routing.cpp) and the CUDA kernels (kernels/moe_routing.cu) so both select the same
// experts. Not API.
#pragma once

#include "expage/detail/host_device.hpp"
#include "expage/format/float16.hpp"

#include <cstdint>

namespace expage::detail {

/// The key a logit is ranked by: the logit itself, NaN as −∞ (a NaN never wins over a number).
[[nodiscard]] EXPAGE_HOST_DEVICE inline float router_key(float logit) noexcept {
  return logit != logit ? float_from_bits(0xFF800000U) : logit;  // −∞
}

/// True when expert @p a with key @p ka ranks before expert @p b with key @p kb: a larger key
/// first, the lower expert id on equal keys. A total order over distinct ids.
[[nodiscard]] EXPAGE_HOST_DEVICE inline bool router_ranks_before(float ka, std::uint32_t a, float kb,
                                                                 std::uint32_t b) noexcept {
  return ka > kb || (ka == kb && a < b);
}

/// True when the softmax's shift, the top key @p max, is +∞ (a router whose logits overflowed):
/// exp(key − max) is then NaN or 0, and the softmax's limit gives each +∞ key an equal share and
/// the rest nothing, which router_limit_term() stands for.
[[nodiscard]] EXPAGE_HOST_DEVICE inline bool router_max_is_infinite(float max) noexcept {
  return max == float_from_bits(0x7F800000U);
}

/// The unnormalized softmax term of @p key when the maximum is +∞: 1 for a +∞ key, 0 otherwise.
[[nodiscard]] EXPAGE_HOST_DEVICE inline float router_limit_term(float key) noexcept {
  return key == float_from_bits(0x7F800000U) ? 1.0F : 0.0F;
}

/// The slot of logical expert @p id through @p expert_map (@p experts entries), or −1 when the
/// id is outside [0, experts) or the map holds a negative value (not resident).
[[nodiscard]] EXPAGE_HOST_DEVICE inline std::int32_t remap_slot(std::int32_t id, const std::int32_t* expert_map,
                                                                std::uint32_t experts) noexcept {
  if (id < 0 || static_cast<std::uint32_t>(id) >= experts) return -1;
  const std::int32_t slot = expert_map[id];
  return slot < 0 ? -1 : slot;
}

/// The bucket pair with expert id @p id is grouped into: the id, or @p experts (the trailing
/// bucket of ids outside [0, experts)).
[[nodiscard]] EXPAGE_HOST_DEVICE inline std::uint32_t group_bucket(std::int32_t id, std::uint32_t experts) noexcept {
  return id < 0 || static_cast<std::uint32_t>(id) >= experts ? experts : static_cast<std::uint32_t>(id);
}

}  // namespace expage::detail
