/// @file
/// @brief version_tier (the runtime's hi and lo tiers) and expert_map_hook: told of every change of
/// an expert_runtime's `expert_map`, so that a device copy can follow it in stream order.
#pragma once

#include "expage/residency/residency_state.hpp"

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace expage {

/// @brief The two tiers of versions an expert_runtime holds (DynaExq §3.2: a high- and a
/// low-precision version per expert). A runtime built from one source has only `hi`, whatever
/// that source's precision; one built from a tiered_source has both.
enum class version_tier : std::uint8_t {
  hi = 0,  ///< The first source's versions (bf16, say).
  lo = 1,  ///< The second source's versions (int4, say): cheaper to hold and to move.
};
/// Tiers a runtime can have.
inline constexpr std::size_t version_tier_count = 2;
/// "hi" or "lo".
[[nodiscard]] constexpr std::string_view to_string(version_tier t) noexcept {
  return t == version_tier::hi ? "hi" : "lo";
}
/// The residency_state a handle publishes when @p t's version becomes active: resident_hi or resident_lo.
[[nodiscard]] constexpr residency_state resident_state(version_tier t) noexcept {
  return t == version_tier::hi ? residency_state::resident_hi : residency_state::resident_lo;
}

/// @brief Told of every change of an expert_runtime's `expert_map` (view b): entry @p index
/// (moe_geometry::flat_index) of tier @p tier's map becomes @p slot (−1: the expert's active
/// version is not in that tier). `cuda::device_expert_map` implements it with copies on the
/// compute stream.
///
/// The runtime calls update() under its lock, in the order of the changes, where its own state is
/// already committed: update() must not throw. An entry changes only while no lease holds the
/// expert and no kernel that read it is pending (a load is published before the compute stream's
/// wait on it, an eviction or a switch waits for the last kernel), so a copy enqueued on the
/// compute stream is seen by every later kernel and by no earlier one that needs the entry.
/// @threadsafety called by one runtime under its lock.
class expert_map_hook {
 public:
  expert_map_hook() = default;
  expert_map_hook(const expert_map_hook&) = delete;
  expert_map_hook& operator=(const expert_map_hook&) = delete;
  expert_map_hook(expert_map_hook&&) = delete;
  expert_map_hook& operator=(expert_map_hook&&) = delete;
  /// Destroys the hook.
  virtual ~expert_map_hook() = default;

  /// Entry @p index of tier @p tier's map becomes @p slot.
  virtual void update(version_tier tier, std::size_t index, std::int32_t slot) noexcept = 0;
};

}  // namespace expage
