/// @file
/// @brief The eviction_policy concept and what a policy is told about each access.
#pragma once

#include "expage/core/expert_id.hpp"

#include <concepts>
#include <cstdint>
#include <limits>
#include <span>

namespace expage {

/// @brief The keys one cache scope covers: one layer's experts (per-layer
/// layout) or every expert of the model (global layout, key = layer ·
/// experts_per_layer + expert).
///
/// Keys are 32-bit, so a scope holds at most max_keys of them; a global scope
/// of a model with 65536 layers of 65536 experts (2^32 keys, which
/// moe_geometry allows) does not fit, and slot_cache refuses it. key_count()
/// computes in 64 bits to tell.
struct key_space {
  std::uint32_t layers = 1;             ///< MoE layers of the model.
  std::uint32_t experts_per_layer = 1;  ///< Routed experts per layer.
  bool global = false;                  ///< True: keys span all layers; false: one layer's experts.
  std::uint32_t layer = 0;              ///< The layer a per-layer scope covers.

  /// The most keys a scope may have: keys are std::uint32_t values in [0, size()).
  static constexpr std::uint64_t max_keys = std::numeric_limits<std::uint32_t>::max();

  /// Number of distinct keys in the scope, without overflow (up to 2^32).
  [[nodiscard]] constexpr std::uint64_t key_count() const noexcept {
    return global ? std::uint64_t{layers} * experts_per_layer : experts_per_layer;
  }
  /// Number of distinct keys in the scope. @pre key_count() ≤ max_keys.
  [[nodiscard]] constexpr std::uint32_t size() const noexcept { return static_cast<std::uint32_t>(key_count()); }
  /// The key of expert @p expert of layer @p layer_index: layer_index · experts_per_layer + expert
  /// (global) or expert (per-layer, where @p layer_index is the scope's layer).
  /// @pre layer_index < layers, expert < experts_per_layer, key_count() ≤ max_keys.
  [[nodiscard]] constexpr std::uint32_t key_of(std::uint32_t layer_index, expert_index expert) const noexcept {
    return global ? layer_index * experts_per_layer + expert : expert;
  }
  /// The layer of @p key.
  [[nodiscard]] constexpr std::uint32_t layer_of(std::uint32_t key) const noexcept {
    return global ? key / experts_per_layer : layer;
  }
  /// The expert index (within its layer) of @p key.
  [[nodiscard]] constexpr expert_index expert_of(std::uint32_t key) const noexcept {
    return global ? key % experts_per_layer : key;
  }
};

/// "Never used again": the next_use of a key with no future access.
inline constexpr std::uint64_t never = std::numeric_limits<std::uint64_t>::max();

/// @brief What a policy learns about one access (a hit or an insertion).
struct access_context {
  std::uint64_t time = 0;          ///< Index of the access group (one layer of one step), monotone.
  std::uint32_t layer = 0;         ///< The layer being executed.
  expert_index expert = 0;         ///< The accessed expert, within its layer.
  std::uint64_t next_use = never;  ///< Offline knowledge: the time of this key's next access (replay fills it).
  float probability = 0.0F;        ///< The router's probability (or gating weight) for this expert, if known.
};

/// @brief The experts a cache must not evict now: those the current step needs.
struct pin_view {
  const std::uint8_t* flags = nullptr;  ///< One byte per key of the scope; non-zero means pinned.
  /// True when @p key is pinned.
  [[nodiscard]] bool operator()(std::uint32_t key) const noexcept { return flags[key] != 0; }
};

/// @brief A replacement policy over the keys of one cache scope.
///
/// The slot cache owns residency; the policy only ranks. Requirements on `P`:
/// - `P(space)`: a policy for the keys of @p space (`key_space`).
/// - `p.on_insert(key, ctx)`: @p key became resident (after a miss).
/// - `p.on_hit(key, ctx)`: @p key was accessed while resident.
/// - `p.on_evict(key)`: @p key left the cache.
/// - `p.victim(pins, ctx)`: a resident, unpinned key to evict; called only when
///   one exists. @p ctx describes the access that needs the slot.
/// A policy is told about every access, so frequency-based policies can keep
/// history across evictions.
template <class P>
concept eviction_policy = std::constructible_from<P, const key_space&> &&
    requires(P& p, std::uint32_t key, const access_context& ctx, pin_view pins) {
  p.on_insert(key, ctx);
  p.on_hit(key, ctx);
  p.on_evict(key);
  { p.victim(pins, ctx) } -> std::same_as<std::uint32_t>;
};

/// @brief A policy whose victim() is const: asking for a victim changes nothing (LRU, LFU,
/// next-turn). sieve_policy, arc_policy and s3fifo_policy move state when asked (the sweep's hand,
/// the pending answer, the keys promoted and reinserted on the way), so an owner that must undo a
/// failed eviction (expert_runtime's strong guarantee) saves them first.
template <class P>
concept const_victim = eviction_policy<P> && requires(const P& p, pin_view pins, const access_context& ctx) {
  { p.victim(pins, ctx) } -> std::same_as<std::uint32_t>;
};

}  // namespace expage
