/// @file
/// @brief layer_decay_policy: frequency weighted by distance to the layer being executed.
#pragma once

#include "expage/cache/detail/ranking.hpp"
#include "expage/cache/detail/resident_set.hpp"
#include "expage/cache/eviction_policy.hpp"
#include "expage/core/error.hpp"

#include <cstdint>
#include <vector>

namespace expage {

/// @brief MoE-Infinity-style activation-aware eviction: an expert's value is
/// its access count scaled down by how far its layer is from the layer being
/// executed, in execution order:
///
///   priority(l, j) = count(l, j) · (1 − a(l) / L),  a(l) = (l − l_now − 1) mod L,
///
/// so the next layer's experts (a = 0) keep their full count and the experts
/// of the layer just executed (a = L − 1) keep 1/L of it. Evicts the smallest
/// priority; ties go to the older access, then the smaller key. In a per-layer
/// scope every key has the same a, and the policy is LFU. Because priorities
/// move with the current layer, victim selection scans the resident keys:
/// O(capacity) per eviction, O(1) per hit.
///
/// @code
/// expage::slot_cache<expage::layer_decay_policy> cache(geometry, {.layout = expage::cache_layout::global, .capacity =
/// 128});
/// @endcode
/// @threadsafety thread-compatible.
class layer_decay_policy {
 public:
  /// A policy over the keys of @p space.
  explicit layer_decay_policy(const key_space& space)
      : space_(space), count_(space.size(), 0), last_(space.size(), 0), resident_(space.size()) {}
  /// Counts the access.
  void on_insert(std::uint32_t key, const access_context& ctx) {
    touch(key, ctx);
    resident_.insert(key);
  }
  /// Counts the access.
  void on_hit(std::uint32_t key, const access_context& ctx) noexcept { touch(key, ctx); }
  /// @p key left the cache; its count is kept.
  void on_evict(std::uint32_t key) noexcept { resident_.erase(key); }
  /// The unpinned key with the smallest distance-weighted count.
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& ctx) const noexcept {
    return detail::scan_for_victim(resident_, pins, last_, [&](std::uint32_t k) {
      const std::uint32_t ahead = (space_.layer_of(k) + space_.layers - ctx.layer - 1) % space_.layers;
      // L · priority = count · (L − a), in integers: exact, so equal priorities tie and the tie
      // rule decides (in doubles a/L rounds when L is not a power of two, and the rounding did).
      // Smallest priority first: the largest complement. Saturates only past 2^64 / L accesses.
      return UINT64_MAX - saturating_product({count_[k], std::uint64_t{space_.layers} - ahead});
    });
  }

 private:
  void touch(std::uint32_t key, const access_context& ctx) noexcept {
    ++count_[key];
    last_[key] = ctx.time;
  }

  key_space space_;
  std::vector<std::uint64_t> count_;
  std::vector<std::uint64_t> last_;
  detail::resident_set resident_;
};

static_assert(eviction_policy<layer_decay_policy>);

}  // namespace expage
