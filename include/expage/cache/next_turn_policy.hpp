/// @file
/// @brief next_turn_policy: expage's predicted-next-use eviction for layer-sequential execution.
#pragma once

#include "expage/cache/detail/ranking.hpp"
#include "expage/cache/detail/resident_set.hpp"
#include "expage/cache/eviction_policy.hpp"
#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace expage {

/// @brief Evicts the expert whose next use is predicted farthest away,
/// exploiting that MoE layers execute in a fixed cycle.
///
/// An expert of layer l cannot be used before layer l's next turn, which is
/// δ(l) = ((l − l_now − 1) mod L) + 1 layer-steps away (the layer just executed
/// is L steps away, the next one 1). Whether it is used at that turn is a
/// coin flip with the expert's selection rate r(l, j): the fraction of layer
/// l's recent turns that used it, from counts decayed by γ per turn of the
/// layer (so the rate follows workload shifts). The number of turns until its
/// next use is then geometric with mean 1/r, and the predicted distance is
///
///   next(l, j) = δ(l) + L · (1/r(l, j) − 1)        (in layer-steps).
///
/// This is Belady's rule with the unknown future replaced by that estimate.
/// Plain LRU does the opposite on a layer cycle: the least recently used
/// expert belongs to the layer that runs next. Evicts the largest next(l, j);
/// ties go to the older access, then the smaller key. A key never seen has
/// r = 0 (never inserted before it is seen, so only as a formality). In a
/// per-layer scope δ is constant and the policy is a decayed LFU. O(capacity)
/// per eviction, O(1) per hit.
///
/// @code
/// expage::slot_cache<expage::next_turn_policy> cache(geometry, {.layout = expage::cache_layout::global, .capacity =
/// 128},
///     [](const expage::key_space& s) { return expage::next_turn_policy(s, {.decay = 0.95}); });
/// @endcode
/// @threadsafety thread-compatible.
class next_turn_policy {
 public:
  /// Tuning.
  struct options {
    double decay = 0.9;  ///< γ in (0, 1]: the weight of a turn one turn older; 1 counts all history equally.
  };

  /// A policy over the keys of @p space with the default options.
  explicit next_turn_policy(const key_space& space) : next_turn_policy(space, options{}) {}
  /// A policy over the keys of @p space.
  /// @throws expage::invalid_argument when the decay is not in (0, 1].
  next_turn_policy(const key_space& space, options opts)
      : space_(space),
        gamma_(opts.decay),
        turns_(space.global ? space.layers : 1, 0),
        turn_time_(space.global ? space.layers : 1, never),
        count_(space.size(), 0.0),
        stamp_(space.size(), 0),
        last_(space.size(), 0),
        resident_(space.size()) {
    if (!(opts.decay > 0.0 && opts.decay <= 1.0)) {
      throw invalid_argument(fmt::format("next_turn_policy: decay {} out of range (0, 1]", opts.decay));
    }
    // γ^d for the ages victim() meets most: a table lookup instead of a pow per candidate.
    powers_.resize(power_table_size);
    double p = 1.0;
    for (double& v : powers_) {
      v = p;
      p *= gamma_;
    }
  }
  /// Counts the access.
  void on_insert(std::uint32_t key, const access_context& ctx) {
    touch(key, ctx);
    resident_.insert(key);
  }
  /// Counts the access.
  void on_hit(std::uint32_t key, const access_context& ctx) noexcept { touch(key, ctx); }
  /// @p key left the cache; its history is kept.
  void on_evict(std::uint32_t key) noexcept { resident_.erase(key); }
  /// The unpinned key whose predicted next use is farthest.
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& ctx) const noexcept {
    const auto layers = static_cast<double>(space_.layers);
    return detail::scan_for_victim(resident_, pins, last_, [&](std::uint32_t k) {
      const std::uint32_t l = space_.layer_of(k);
      const double until_turn =
          space_.global ? static_cast<double>((l + space_.layers - ctx.layer - 1) % space_.layers + 1) : 0.0;
      return until_turn + layers * (1.0 / rate(k) - 1.0);
    });
  }

  /// The selection rate of @p key: its decayed count over its layer's decayed number of turns.
  [[nodiscard]] double rate(std::uint32_t key) const noexcept {
    const std::size_t s = scope_of(key);
    const std::uint64_t now = turns_[s];
    if (now == 0) return 1e-9;
    const double aged = count_[key] * power(now - stamp_[key]);
    const double turns = gamma_ == 1.0 ? static_cast<double>(now) : (1.0 - power(now)) / (1.0 - gamma_);
    // Clamped to (0, 1]: a rate above 1 (a caller reusing a group's time for
    // several groups counts a turn once but its experts twice) is meaningless.
    return std::clamp(aged / turns, 1e-9, 1.0);
  }

 private:
  static constexpr std::size_t power_table_size = 1024;

  [[nodiscard]] std::size_t scope_of(std::uint32_t key) const noexcept {
    return space_.global ? space_.layer_of(key) : 0;
  }
  [[nodiscard]] double power(std::uint64_t age) const noexcept {
    return age < power_table_size ? powers_[age] : std::pow(gamma_, static_cast<double>(age));
  }

  void touch(std::uint32_t key, const access_context& ctx) noexcept {
    const std::size_t s = scope_of(key);
    if (turn_time_[s] != ctx.time) {  // the first access of a new access group at this layer: a new turn
      turn_time_[s] = ctx.time;
      ++turns_[s];
    }
    // Decayed count as of this turn, then this turn's use. Counts are kept
    // "as of stamp_" and aged lazily: one pow per read instead of a pass over
    // the layer's experts per turn.
    count_[key] = count_[key] * power(turns_[s] - stamp_[key]) + 1.0;
    stamp_[key] = turns_[s];
    last_[key] = ctx.time;
  }

  key_space space_;
  double gamma_;
  std::vector<std::uint64_t> turns_;      // per layer (global scope) or 1: turns seen
  std::vector<std::uint64_t> turn_time_;  // the access-group time of each scope's latest turn
  std::vector<double> count_;
  std::vector<std::uint64_t> stamp_;
  std::vector<std::uint64_t> last_;
  detail::resident_set resident_;
  std::vector<double> powers_;  // powers_[d] = γ^d
};

static_assert(eviction_policy<next_turn_policy>);

}  // namespace expage
