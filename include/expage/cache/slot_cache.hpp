/// @file
/// @brief slot_cache: which experts occupy the GPU's expert slots, as an expert_map.
#pragma once

#include "expage/cache/eviction_policy.hpp"
#include "expage/core/error.hpp"
#include "expage/core/expert_id.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/detail/assert.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace expage {

/// How slots are shared.
enum class cache_layout : std::uint8_t {
  per_layer,  ///< Each layer has `capacity` slots of its own (WiSP's per-layer scratch).
  global,     ///< One pool of `capacity` slots shared by every layer.
};

/// "per-layer" or "global".
[[nodiscard]] constexpr std::string_view to_string(cache_layout l) noexcept {
  return l == cache_layout::global ? "global" : "per-layer";
}

/// @brief Construction parameters of a slot_cache.
struct slot_cache_options {
  cache_layout layout = cache_layout::per_layer;  ///< Per-layer or global slots.
  std::uint32_t capacity = 0;  ///< Slots per layer (per_layer) or in all (global); ≥ 1 and ≤ the scope's experts.
};

/// @brief Optional knowledge about one access group, for policies that use it.
struct access_hints {
  std::uint64_t time = never;                 ///< The group's time; `never` means "the cache's own counter".
  std::span<const std::uint64_t> next_use{};  ///< Per requested expert: the time of its next access (Belady).
  std::span<const float> probability{};       ///< Per requested expert: router probability or gating weight.
};

/// @brief One expert the engine must copy into a slot before the step runs.
struct expert_load {
  expert_id expert{};     ///< The expert to load.
  std::int32_t slot = 0;  ///< Where: an index into the layer's slots (per_layer) or the global slots.
  bool evicts = false;    ///< True when the slot held another expert.
  expert_id evicted{};    ///< The expert that was in the slot (valid when `evicts`).
};

/// @brief What one access group did.
struct access_result {
  std::uint32_t hits = 0;              ///< Requested experts already resident.
  std::uint32_t misses = 0;            ///< Requested experts that had to be loaded.
  std::span<const expert_load> loads;  ///< The loads, valid until the next access().
};

/// @brief Counters of a slot_cache.
struct slot_cache_statistics {
  std::uint64_t groups = 0;     ///< access() calls.
  std::uint64_t accesses = 0;   ///< Experts requested.
  std::uint64_t hits = 0;       ///< Requests found resident.
  std::uint64_t misses = 0;     ///< Requests loaded.
  std::uint64_t evictions = 0;  ///< Misses that displaced another expert.
};

/// @brief Maps routed experts to a bounded set of GPU slots and keeps the
/// `expert_map` a fused-MoE kernel consumes (WiSP §3.2: logical expert id →
/// physical slot, −1 for an expert that is not resident; vLLM's `expert_map`
/// has the same meaning).
///
/// access() takes the experts one layer needs for one step (the union of the
/// top-k of the step's tokens), pins all of them for the duration of the call
/// so that none is evicted to make room for another, serves hits, and loads
/// misses into free slots or slots freed by the policy's victims. The returned
/// loads say which copies to issue and into which slot. A group larger than
/// the scope's capacity cannot be served at once: split its tokens first with
/// group_tokens() (WiSP §3.2) and call access() per group.
///
/// Exceptions: bad requests throw before anything changes. The only other
/// exception is std::bad_alloc from a policy that allocates a node when a key
/// is inserted (LFU, LFRU, fMoE, Belady; hits re-rank without allocating).
/// The caller then has no loads to issue, so none of the group's misses stays
/// in the map: the experts it had placed are absent again and their slots
/// free; the victims chosen so far stay evicted (their slots free too), hits
/// keep their re-ranking, policies that count accesses across evictions
/// (LFU, LFRU, fMoE) keep the undone misses counted, and the statistics count
/// those evictions and not the group (basic guarantee: consistent, and the
/// map claims no copy that was not issued).
///
/// @code
/// expage::slot_cache<expage::lru_policy> cache(expage::moe_geometry::mixtral_8x7b(),
///                                              {.layout = expage::cache_layout::per_layer, .capacity = 4});
/// const expage::expert_index routed[] = {6, 5};
/// auto r = cache.access(/*layer=*/0, routed);
/// for (const auto& load : r.loads) copy_expert(load.expert, load.slot);
/// fused_moe(hidden, routed_ids, cache.expert_map(0));   // -1: not resident
/// @endcode
/// @threadsafety thread-compatible.
template <eviction_policy Policy>
class slot_cache {
 public:
  /// A cache for @p geometry whose scopes use `Policy(space)`.
  /// @throws expage::invalid_argument for a layout that is neither per_layer nor global, a
  ///         capacity of 0 or above the scope's experts, or a global scope of more than
  ///         key_space::max_keys keys.
  slot_cache(const moe_geometry& geometry, slot_cache_options options)
      : slot_cache(geometry, options, [](const key_space& s) { return Policy(s); }) {}

  /// A cache whose scopes use the policies @p make(space) returns (to pass policy options).
  /// @throws expage::invalid_argument as the constructor above.
  template <class Factory>
  slot_cache(const moe_geometry& geometry, slot_cache_options options, Factory make)
      : geometry_(geometry), layers_(geometry.layers()), experts_(geometry.experts_per_layer()), options_(options) {
    if (options.layout != cache_layout::per_layer && options.layout != cache_layout::global) {
      throw invalid_argument(fmt::format("slot_cache: layout {} out of range [0, 2) (per_layer or global)",
                                         static_cast<int>(options.layout)));
    }
    const bool global = options.layout == cache_layout::global;
    const key_space whole{.layers = layers_, .experts_per_layer = experts_, .global = global};
    const std::uint64_t scope_keys = whole.key_count();
    if (scope_keys > key_space::max_keys) {
      throw invalid_argument(fmt::format(
          "slot_cache: a global cache of {} needs {} keys ({} layers × {} experts), out of range [1, {}] (keys are "
          "32-bit; use the per-layer layout)",
          geometry.name(), scope_keys, layers_, experts_, key_space::max_keys));
    }
    if (options.capacity == 0 || options.capacity > scope_keys) {
      throw invalid_argument(fmt::format("slot_cache: capacity {} out of range [1, {}] for a {} cache of {}",
                                         options.capacity, scope_keys, to_string(options.layout), geometry.name()));
    }
    const std::uint32_t scopes = global ? 1 : layers_;
    scopes_.reserve(scopes);
    for (std::uint32_t s = 0; s < scopes; ++s) {
      key_space space = whole;
      space.layer = s;
      scopes_.push_back(scope{make(space), space, std::vector<std::uint8_t>(space.size(), 0), {}});
      auto& free = scopes_.back().free_slots;
      for (std::uint32_t slot = options.capacity; slot-- > 0;) free.push_back(slot);
    }
    map_.assign(static_cast<std::size_t>(geometry.expert_count()), -1);
    loads_.reserve(options.capacity);
  }

  [[nodiscard]] const slot_cache_options& options() const noexcept { return options_; }      ///< The options.
  [[nodiscard]] const slot_cache_statistics& statistics() const noexcept { return stats_; }  ///< The counters.

  /// The whole model's map, layer-major: entry layer·E + e is expert e's slot or −1.
  [[nodiscard]] std::span<const std::int32_t> expert_map() const noexcept { return map_; }
  /// Layer @p layer's part of expert_map(): what a fused-MoE kernel for that layer takes.
  /// @pre layer < layers.
  [[nodiscard]] std::span<const std::int32_t> expert_map(std::uint32_t layer) const noexcept {
    EXPAGE_ASSERT(layer < layers_, "slot_cache::expert_map: layer out of range");
    return std::span<const std::int32_t>(map_).subspan(flat(layer, 0), experts_);
  }
  /// True when @p id occupies a slot. @pre the id is valid for the geometry.
  [[nodiscard]] bool resident(expert_id id) const noexcept {
    EXPAGE_ASSERT(id.layer < layers_ && id.expert < experts_, "slot_cache::resident: expert out of range");
    return map_[flat(id.layer, id.expert)] >= 0;
  }

  /// The slots one access group may occupy: capacity (per layer) or capacity (global).
  [[nodiscard]] std::uint32_t group_limit() const noexcept { return options_.capacity; }

  /// Serves the experts @p experts of layer @p layer for one step.
  /// @throws expage::invalid_argument for a bad layer, an expert out of range, a
  ///         repeated expert, more experts than group_limit(), or hints whose
  ///         lengths differ from the request's; nothing changes then.
  access_result access(std::uint32_t layer, std::span<const expert_index> experts, const access_hints& hints = {}) {
    validate_and_pin(layer, experts, hints);  // on success every requested expert is pinned
    scope& sc = scope_for(layer);
    struct unpin_on_exit {  // also when a policy throws (std::bad_alloc from a node-based policy)
      scope& sc;
      std::uint32_t layer;
      std::span<const expert_index> experts;
      ~unpin_on_exit() {
        for (const expert_index e : experts) sc.pinned[sc.space.key_of(layer, e)] = 0;
      }
    } const unpin{sc, layer, experts};
    const std::uint64_t time = hints.time == never ? stats_.groups : hints.time;
    loads_.clear();
    access_result result;
    try {
      serve(sc, layer, experts, hints, time, result);
    } catch (...) {
      // on_insert() threw (std::bad_alloc): undo this call's loads, which no caller will issue.
      for (auto it = loads_.rbegin(); it != loads_.rend(); ++it) {
        map_[flat(it->expert.layer, it->expert.expert)] = -1;
        sc.policy.on_evict(sc.space.key_of(it->expert.layer, it->expert.expert));
        sc.free_slots.push_back(static_cast<std::uint32_t>(it->slot));  // within its capacity: no allocation
      }
      loads_.clear();
      throw;
    }
    ++stats_.groups;
    stats_.accesses += experts.size();
    stats_.hits += result.hits;
    stats_.misses += result.misses;
    result.loads = loads_;
    return result;
  }

 private:
  struct scope {
    Policy policy;
    key_space space;                        // the keys policy ranks
    std::vector<std::uint8_t> pinned;       // per key: part of the current group
    std::vector<std::uint32_t> free_slots;  // slots holding no expert
  };

  // access()'s pass over the group, the group pinned: hits re-ranked, misses placed into loads_.
  // Inlined: as a call it cost the hit path 2 ns (BM_SlotCache_HitPath 14.4 → 16.2 ns).
  [[gnu::always_inline]] void serve(scope& sc, std::uint32_t layer, std::span<const expert_index> experts,
                                    const access_hints& hints, std::uint64_t time, access_result& result) {
    const pin_view pins{sc.pinned.data()};
    for (std::size_t i = 0; i < experts.size(); ++i) {
      const expert_index e = experts[i];
      const std::uint32_t k = sc.space.key_of(layer, e);
      const access_context ctx{.time = time,
                               .layer = layer,
                               .expert = e,
                               .next_use = hints.next_use.empty() ? never : hints.next_use[i],
                               .probability = hints.probability.empty() ? 0.0F : hints.probability[i]};
      std::int32_t& slot = map_[flat(layer, e)];
      if (slot >= 0) {
        ++result.hits;
        sc.policy.on_hit(k, ctx);
        continue;
      }
      // Choose the slot, tell the policy about the newcomer (the one step that
      // may throw), and only then evict: a throwing policy leaves the map,
      // the slots and the policy consistent, for access() to undo the loads.
      expert_load load{.expert = {layer, e}, .slot = 0, .evicts = false, .evicted = {}};
      std::uint32_t victim = 0;
      if (!sc.free_slots.empty()) {
        load.slot = static_cast<std::int32_t>(sc.free_slots.back());
      } else {
        victim = sc.policy.victim(pins, ctx);
        load.evicts = true;
        load.evicted = {sc.space.layer_of(victim), sc.space.expert_of(victim)};
        load.slot = map_[flat(load.evicted.layer, load.evicted.expert)];
        EXPAGE_ASSERT(load.slot >= 0 && !pins(victim), "slot_cache: the policy chose a victim that is not evictable");
      }
      loads_.reserve(loads_.size() + 1);
      sc.policy.on_insert(k, ctx);
      if (load.evicts) {
        map_[flat(load.evicted.layer, load.evicted.expert)] = -1;
        sc.policy.on_evict(victim);
        ++stats_.evictions;
      } else {
        sc.free_slots.pop_back();
      }
      slot = load.slot;
      ++result.misses;
      loads_.push_back(load);
    }
  }

  // The expert_map index of (layer, e): moe_geometry's layer-major index, in 64 bits.
  [[nodiscard]] std::size_t flat(std::uint32_t layer, expert_index e) const noexcept {
    return static_cast<std::size_t>(geometry_.flat_index({.layer = layer, .expert = e}));
  }
  [[nodiscard]] scope& scope_for(std::uint32_t layer) noexcept {
    return scopes_[options_.layout == cache_layout::global ? 0 : layer];
  }

  // Checks the request and pins its experts (the pin bytes double as the
  // duplicate check); on failure unpins what it pinned and throws.
  void validate_and_pin(std::uint32_t layer, std::span<const expert_index> experts, const access_hints& hints) {
    if (layer >= layers_) {
      throw invalid_argument(fmt::format("slot_cache::access: layer {} out of range [0, {})", layer, layers_));
    }
    if (experts.size() > options_.capacity) {
      throw invalid_argument(fmt::format(
          "slot_cache::access: {} experts requested at layer {} but a group may hold at most {} (split the tokens "
          "with group_tokens)",
          experts.size(), layer, options_.capacity));
    }
    if ((!hints.next_use.empty() && hints.next_use.size() != experts.size()) ||
        (!hints.probability.empty() && hints.probability.size() != experts.size())) {
      throw invalid_argument(fmt::format("slot_cache::access: hints for {} and {} experts, request of {}",
                                         hints.next_use.size(), hints.probability.size(), experts.size()));
    }
    scope& sc = scope_for(layer);
    std::size_t i = 0;
    for (; i < experts.size(); ++i) {
      const expert_index e = experts[i];
      if (e >= experts_) {
        break;
      }
      std::uint8_t& seen = sc.pinned[sc.space.key_of(layer, e)];
      if (seen != 0) {
        break;
      }
      seen = 1;
    }
    if (i < experts.size()) {
      for (std::size_t j = 0; j < i; ++j) sc.pinned[sc.space.key_of(layer, experts[j])] = 0;
      if (experts[i] >= experts_) {
        throw invalid_argument(
            fmt::format("slot_cache::access: expert {} out of range [0, {}) in layer {}", experts[i], experts_, layer));
      }
      throw invalid_argument(
          fmt::format("slot_cache::access: expert {} requested twice in one group at layer {}", experts[i], layer));
    }
  }

  moe_geometry geometry_;
  std::uint32_t layers_;
  std::uint32_t experts_;
  slot_cache_options options_;
  std::vector<scope> scopes_;
  std::vector<std::int32_t> map_;
  std::vector<expert_load> loads_;
  slot_cache_statistics stats_;
};

}  // namespace expage
