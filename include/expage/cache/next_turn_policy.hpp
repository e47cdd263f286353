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
/// coin flip with probability r(l, j), and the number of turns until its next
/// use is then geometric with mean 1/r, so the predicted distance is
///
///   next(l, j) = δ(l) + L · (1/r(l, j) − 1)        (in layer-steps).
///
/// This is Belady's rule with the unknown future replaced by that estimate.
/// Plain LRU does the opposite on a layer cycle: the least recently used
/// expert belongs to the layer that runs next. Evicts the largest next(l, j);
/// ties go to the older access, then the smaller key.
///
/// r(l, j) is predicted from the layer's own history, in two parts:
///
/// - the selection rate f(l, j): the fraction of layer l's recent turns that
///   used j, from counts decayed by γ per turn of the layer (so it follows
///   workload shifts);
/// - with `transitions` on (the default), the layer's turn-to-turn transitions:
///   T(a → j), how many of the turns that followed a turn using a used j, out of
///   N(a) such turns. Given the set S of experts at the layer's latest turn,
///
///     r(l, j) = (1/|S|) Σ_{a ∈ S} (T(a → j) + κ f(l, j)) / (N(a) + κ),
///
///   a first-order Markov estimate per predecessor, smoothed toward the
///   selection rate by κ pseudo-turns (`prior`) and averaged over S.
///
/// Routing is a per-token decision, but consecutive tokens of a sequence reuse
/// experts more than the marginal rates say, and which ones depends on the
/// experts just used. On the real Mixtral-8x7B trace the transition estimate
/// lowers the global 128-slot miss ratio from 0.377 to 0.348 (docs/caches.md).
/// A key never seen has r = 0 (never inserted before it is seen, so only as a
/// formality). In a per-layer scope δ is constant and the policy ranks by r
/// alone. Costs O(|S| · capacity) per eviction and O(|S|) per access; the
/// transition counts take 4 · E² bytes per layer of the scope (E experts).
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
    double decay = 0.9;       ///< γ in (0, 1]: the weight of a turn one turn older; 1 counts all history equally.
    bool transitions = true;  ///< Condition r on the experts of the layer's latest turn (see above).
    double prior = 4.0;       ///< κ > 0: pseudo-turns of the selection rate behind each transition estimate.
  };

  /// A policy over the keys of @p space with the default options.
  explicit next_turn_policy(const key_space& space) : next_turn_policy(space, options{}) {}
  /// A policy over the keys of @p space.
  /// @throws expage::invalid_argument when the decay is not in (0, 1] or the
  /// prior is not positive and finite.
  next_turn_policy(const key_space& space, options opts)
      : space_(space),
        gamma_(opts.decay),
        transitions_(opts.transitions),
        prior_(opts.prior),
        turns_(scopes(space), 0),
        decayed_turns_(scopes(space), 0.0),
        turn_time_(scopes(space), never),
        count_(space.size(), 0.0),
        stamp_(space.size(), 0),
        last_(space.size(), 0),
        resident_(space.size()),
        latest_(scopes(space)),
        before_(scopes(space)),
        weight_sum_(scopes(space), 0.0) {
    if (!(opts.decay > 0.0 && opts.decay <= 1.0)) {
      throw invalid_argument(fmt::format("next_turn_policy: decay {} out of range (0, 1]", opts.decay));
    }
    if (!(opts.prior > 0.0 && std::isfinite(opts.prior))) {
      throw invalid_argument(fmt::format("next_turn_policy: prior {} out of range (0, inf)", opts.prior));
    }
    if (transitions_) {
      const std::size_t e = space.experts_per_layer;
      follows_.assign(space.size(), 0);
      transitions_to_.assign(scopes(space) * e * e, 0);
      // A turn holds at most E distinct keys: touch() never reallocates.
      for (auto& v : latest_) v.reserve(e);
      for (auto& v : before_) v.reserve(e);
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

  /// The predicted probability that @p key is used at its layer's next turn:
  /// r above, in [1e-9, 1].
  [[nodiscard]] double rate(std::uint32_t key) const noexcept {
    const double f = selection_rate(key);
    if (!transitions_) return f;
    const std::size_t s = scope_of(key);
    const std::vector<predecessor>& given = latest_[s];
    if (given.empty()) return f;
    // Σ_a (T(a → j) + κf) / (N(a) + κ) = Σ_a T(a → j)·w_a + κf·Σ_a w_a, w_a = 1 / (N(a) + κ).
    const std::uint32_t j = space_.expert_of(key);
    double sum = prior_ * f * weight_sum_[s];
    for (const predecessor& a : given) sum += transitions_to_[a.row + j] * a.weight;
    return std::clamp(sum / static_cast<double>(given.size()), 1e-9, 1.0);
  }

  /// The selection rate f of @p key: its decayed count over its layer's decayed
  /// number of turns, in [1e-9, 1].
  [[nodiscard]] double selection_rate(std::uint32_t key) const noexcept {
    const std::size_t s = scope_of(key);
    const std::uint64_t now = turns_[s];
    if (now == 0) return 1e-9;
    const double aged = count_[key] * power(now - stamp_[key]);
    const double turns = decayed_turns_[s];  // Σ_{t < now} γ^t, kept as turns arrive
    // Clamped to (0, 1]: a rate above 1 (a caller reusing a group's time for
    // several groups counts a turn once but its experts twice) is meaningless.
    return std::clamp(aged / turns, 1e-9, 1.0);
  }

 private:
  static constexpr std::size_t power_table_size = 1024;

  [[nodiscard]] static std::size_t scopes(const key_space& space) noexcept { return space.global ? space.layers : 1; }
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
      decayed_turns_[s] = decayed_turns_[s] * gamma_ + 1.0;
      if (transitions_) {
        before_[s].swap(latest_[s]);
        latest_[s].clear();
        weight_sum_[s] = 0.0;
        for (const predecessor& a : before_[s]) ++follows_[a.key];
      }
    }
    if (transitions_ && stamp_[key] != turns_[s]) {  // the key's first access in this turn
      const std::uint32_t j = space_.expert_of(key);
      for (const predecessor& a : before_[s]) ++transitions_to_[a.row + j];
      // N(key) stays put while the key is in the latest turn: it grows when the next one starts.
      const double w = 1.0 / (follows_[key] + prior_);
      latest_[s].push_back({key, (s * space_.experts_per_layer + j) * space_.experts_per_layer, w});
      weight_sum_[s] += w;
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
  bool transitions_;
  double prior_;
  std::vector<std::uint64_t> turns_;      // per layer (global scope) or 1: turns seen
  std::vector<double> decayed_turns_;     // the same, each turn weighted γ^age
  std::vector<std::uint64_t> turn_time_;  // the access-group time of each scope's latest turn
  std::vector<double> count_;
  std::vector<std::uint64_t> stamp_;
  std::vector<std::uint64_t> last_;
  detail::resident_set resident_;
  std::vector<double> powers_;  // powers_[d] = γ^d
  // Transitions (when on), per scope: the keys of the latest and the one before
  // it, N(a) per key, and T(a → b) as [scope][expert of a][expert of b].
  struct predecessor {
    std::uint32_t key;
    std::size_t row;  // the start of T(key → ·)
    double weight;    // 1 / (N(key) + κ) while the key is in the latest turn
  };
  std::vector<std::vector<predecessor>> latest_;
  std::vector<std::vector<predecessor>> before_;
  std::vector<double> weight_sum_;  // Σ weight over latest_, per scope
  std::vector<std::uint32_t> follows_;
  std::vector<std::uint32_t> transitions_to_;
};

static_assert(eviction_policy<next_turn_policy>);

}  // namespace expage
