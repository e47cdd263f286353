/// @file
/// @brief layered_miss_curves: exact LRU miss curves of an MoE routing stream, per layer and global.
#pragma once

#include "expage/cache/miss_ratio_curve.hpp"
#include "expage/core/expert_id.hpp"
#include "expage/core/moe_geometry.hpp"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace expage {

/// The reuse distances of one routed-expert access in both cache layouts.
struct layered_distance {
  std::size_t layer = 0;   ///< Among the experts of its layer (per-layer cache), or reuse_distance_tracker::cold.
  std::size_t global = 0;  ///< Among all experts of the model (global cache), or reuse_distance_tracker::cold.
};

/// @brief Exact LRU miss curves (WiSP Eq. 3) of (layer, expert) accesses, for
/// both cache layouts at once.
///
/// Keeps one miss_curve_builder per layer, keyed by the expert's index in its
/// layer (a per-layer cache of c slots for each layer, WiSP §3.2 and Algorithm 1),
/// and one global builder keyed by the layer-major flat index
/// layer·experts_per_layer + expert (one pool of c slots over all layers).
/// per_layer_curve() sums the per-layer histograms: with c slots in *every*
/// layer, total misses are Σ_l M_l(c) = Σ_l cold_l + Σ_{d ≥ c} Σ_l hist_l[d],
/// itself a miss_ratio_curve over experts_per_layer keys.
///
/// Complexity: access() is O(log experts_per_layer + log expert_count) amortized;
/// memory is O(expert_count).
///
/// @code
/// expage::layered_miss_curves curves(expage::moe_geometry::mixtral_8x7b());
/// for (const auto& r : trace) curves.access({.layer = r.layer, .expert = r.expert});
/// curves.per_layer_curve().miss_ratio(4);   // 4 slots in every layer
/// curves.global_curve().miss_ratio(128);    // one pool of 128 slots
/// curves.layer_curve(7).miss_ratio(4);      // layer 7 alone
/// @endcode
/// @threadsafety thread-compatible: const members concurrently, access() by one thread at a time.
class layered_miss_curves {
 public:
  /// Curves for @p layers layers of @p experts_per_layer experts each.
  /// @throws expage::invalid_argument when either is 0, or when their product
  ///         exceeds reuse_distance_tracker::max_key_count.
  layered_miss_curves(std::size_t layers, std::size_t experts_per_layer);
  /// Curves for the layers × experts of @p geometry.
  /// @throws expage::invalid_argument when the geometry's expert count exceeds reuse_distance_tracker::max_key_count.
  explicit layered_miss_curves(const moe_geometry& geometry)
      : layered_miss_curves(geometry.layers(), geometry.experts_per_layer()) {}

  /// Records an access to expert @p id; returns its per-layer and global reuse distances.
  /// @throws expage::invalid_argument naming the layer or expert out of range; nothing is recorded.
  layered_distance access(expert_id id) {
    if (!contains(id)) throw_out_of_range(id);
    return access_unchecked(id);
  }
  /// Non-throwing twin of access(): std::nullopt, with nothing recorded, when @p id is out of range.
  [[nodiscard]] std::optional<layered_distance> try_access(expert_id id) noexcept {
    if (!contains(id)) return std::nullopt;
    return access_unchecked(id);
  }
  /// access() without the range check.
  /// @pre contains(@p id) (asserted in debug builds).
  layered_distance access_unchecked(expert_id id) noexcept {
    EXPAGE_ASSERT(contains(id), "layered_miss_curves: expert out of range");
    return {.layer = layers_[id.layer].access_unchecked(id.expert),
            .global = global_.access_unchecked(std::size_t{id.layer} * experts_per_layer_ + id.expert)};
  }

  /// Records the distinct experts @p experts of layer @p layer as one group
  /// served together: the step's routed set, resident at once and pinned, as
  /// slot_cache serves it. Each distance is measured against the recency stack
  /// as it stood before the group, so group-mates do not count against each
  /// other; a cache of c ≥ |group| slots that pins the group hits an expert
  /// exactly when its distance is below c (the cache holds the c most recent
  /// keys at the group's start, and evicts only keys outside the group). Eq. 3
  /// of WiSP is stated for single accesses; this is its exact form for pinned
  /// groups. All distances are measured first, then the accesses recorded in
  /// the given order, which fixes the group-mates' recency order as a slot
  /// cache serving the experts in that order leaves it.
  /// @throws expage::invalid_argument for a layer or expert out of range or a
  ///         repeated expert; nothing is recorded then.
  void access_group(std::uint32_t layer, std::span<const expert_index> experts);

  /// True when @p id is in [0, layers()) × [0, experts_per_layer()).
  [[nodiscard]] bool contains(expert_id id) const noexcept {
    return id.layer < layers_.size() && id.expert < experts_per_layer_;
  }
  /// MoE layers.
  [[nodiscard]] std::size_t layers() const noexcept { return layers_.size(); }
  /// Experts in each layer.
  [[nodiscard]] std::size_t experts_per_layer() const noexcept { return experts_per_layer_; }
  /// Accesses recorded (over all layers).
  [[nodiscard]] std::uint64_t accesses() const noexcept { return global_.accesses(); }

  /// The builder of layer @p layer (keys: expert index in the layer).
  /// @throws expage::invalid_argument when @p layer is not in [0, layers()).
  [[nodiscard]] const miss_curve_builder& layer(std::size_t layer) const;
  /// The global builder (keys: layer-major flat index).
  [[nodiscard]] const miss_curve_builder& global() const noexcept { return global_; }

  /// The miss curve of layer @p layer alone, capacities [0, experts_per_layer()].
  /// @throws expage::invalid_argument when @p layer is not in [0, layers()).
  [[nodiscard]] miss_ratio_curve layer_curve(std::size_t layer) const { return this->layer(layer).curve(); }
  /// Total misses with the same number of slots in every layer, capacities [0, experts_per_layer()].
  [[nodiscard]] miss_ratio_curve per_layer_curve() const;
  /// The miss curve of one global pool, capacities [0, layers()·experts_per_layer()].
  [[nodiscard]] miss_ratio_curve global_curve() const { return global_.curve(); }

  /// Forgets every access; keeps the allocations.
  void reset() noexcept;

 private:
  [[noreturn]] void throw_out_of_range(expert_id id) const;

  std::size_t experts_per_layer_;
  std::vector<miss_curve_builder> layers_;
  miss_curve_builder global_;
  std::vector<layered_distance> group_distances_;  // access_group()'s scratch, reused across calls
};

}  // namespace expage
