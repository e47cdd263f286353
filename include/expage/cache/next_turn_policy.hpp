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
#include <span>
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
///   selection rate by κ pseudo-turns (`prior`) and averaged over S. T and N
///   are decayed by γ_T per turn of the layer (`transition_decay`, 0.99: about
///   a hundred turns of memory, ten times f's, since E² counts need more
///   turns to fill than E rates), so they follow workload shifts too.
///
/// Routing is a per-token decision, but consecutive tokens of a sequence reuse
/// experts more than the marginal rates say, and which ones depends on the
/// experts just used. On the real Mixtral-8x7B trace the transition estimate
/// lowers the global 128-slot miss ratio from 0.377 to 0.344 (docs/caches.md).
/// A key never seen has r = 0 (never inserted before it is seen, so only as a
/// formality). In a per-layer scope δ is constant and the policy ranks by r
/// alone. Costs O(|S| · capacity) per eviction, O(|S|) per access and O(|S| · E)
/// per turn (aging the rows); the transition counts take 8 · E² bytes per
/// layer of the scope (E experts: 16 KiB for Mixtral, 30 MiB for 58 layers of 256).
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
    double decay = 0.9;       ///< γ in (0, 1]: the weight of a turn one turn older in f; 1 weighs all turns alike.
    bool transitions = true;  ///< Condition r on the experts of the layer's latest turn (see above).
    double prior = 4.0;       ///< κ > 0: pseudo-turns of the selection rate behind each transition estimate.
    double transition_decay = 0.99;  ///< γ_T in (0, 1]: the same for the transition counts T and N.
  };

  /// A policy over the keys of @p space with the default options.
  explicit next_turn_policy(const key_space& space) : next_turn_policy(space, options{}) {}
  /// Cells of the dense transition table over @p space (options::transitions): one E × E table
  /// per layer of a global scope, one for a per-layer scope; saturated at 2^64 − 1. The
  /// constructor refuses more than max_dense_table_cells, as a tool may ask first.
  [[nodiscard]] static std::uint64_t transition_cells(const key_space& space) noexcept {
    const std::size_t e = space.experts_per_layer;
    return saturating_product({scopes(space), e, e});
  }
  /// A policy over the keys of @p space.
  /// @throws expage::invalid_argument when a decay is not in (0, 1], the
  /// prior is not positive and finite, or (with transitions) the dense
  /// transition table of scopes × E² cells exceeds max_dense_table_cells.
  next_turn_policy(const key_space& space, options opts)
      : space_(space),
        gamma_(opts.decay),
        transitions_(opts.transitions),
        prior_(opts.prior),
        gamma_t_(opts.transition_decay),
        turns_(scopes(space), 0),
        decayed_turns_(scopes(space), 0.0),
        turn_time_(scopes(space), never),
        count_(space.size(), 0.0),
        stamp_(space.size(), 0),
        last_(space.size(), 0),
        resident_(space.size()) {
    if (!(opts.decay > 0.0 && opts.decay <= 1.0)) {
      throw invalid_argument(fmt::format("next_turn_policy: decay {} out of range (0, 1]", opts.decay));
    }
    if (!(opts.prior > 0.0 && std::isfinite(opts.prior))) {
      throw invalid_argument(fmt::format("next_turn_policy: prior {} out of range (0, inf)", opts.prior));
    }
    if (!(opts.transition_decay > 0.0 && opts.transition_decay <= 1.0)) {
      throw invalid_argument(
          fmt::format("next_turn_policy: transition_decay {} out of range (0, 1]", opts.transition_decay));
    }
    powers_ = power_table(gamma_);
    if (transitions_) {
      const std::size_t e = space.experts_per_layer;
      if (const std::uint64_t cells = transition_cells(space); cells > max_dense_table_cells) {
        throw invalid_argument(
            fmt::format("next_turn_policy: {} scopes × {}^2 experts = {} transition cells out of range [0, 2^28] (the "
                        "table is dense; options::transitions = false needs none)",
                        scopes(space), e, cells));
      }
      transition_powers_ = power_table(gamma_t_);
      transitions_to_.assign(scopes(space) * e * e, 0.0);
      follows_.assign(space.size(), 0.0);
      row_turn_.assign(space.size(), 0);
      // Two lists of at most E keys per scope (a turn's distinct keys), sized
      // once: touch() never allocates, also in a copy of the policy.
      lists_.resize(scopes(space) * 2 * e);
      list_size_.assign(scopes(space) * 2, 0);
      latest_list_.assign(scopes(space), 0);
      weight_sum_.assign(scopes(space), 0.0);
    }
  }
  /// Counts the access.
  void on_insert(std::uint32_t key, const access_context& ctx) {
    touch(key, ctx);
    resident_.insert(key);
  }
  /// Counts the access.
  void on_hit(std::uint32_t key, const access_context& ctx) noexcept { touch(key, ctx); }
  /// @p key became resident ahead of use (a prefetch): it joins the residents without counting
  /// as a use, so guesses do not raise the rates they are judged by; its first real use
  /// (on_hit()) counts.
  void on_prefetch(std::uint32_t key, const access_context& /*ctx*/) { resident_.insert(key); }
  /// @p key left the cache; its history is kept.
  void on_evict(std::uint32_t key) noexcept { resident_.erase(key); }
  /// The unpinned key whose predicted next use is farthest.
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& ctx) const noexcept {
    return detail::scan_for_victim(resident_, pins, last_, [&](std::uint32_t k) { return next_use(k, ctx.layer); });
  }
  /// The same with a forecast: @p this_turn holds, per key of the scope, the probability that
  /// the key is used at its layer's next turn as an online predictor sees it (from the current
  /// token's earlier layers), or a negative value where there is none. A forecast key is ranked
  /// by next_use(key, layer, forecast), so an expert predicted for a layer about to run is kept
  /// and one predicted unused there goes before others of its rate ("prefetch-aware eviction",
  /// docs/prefetch.md).
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& ctx,
                                     std::span<const float> this_turn) const noexcept {
    return detail::scan_for_victim(resident_, pins, last_, [&](std::uint32_t k) {
      return this_turn[k] >= 0.0F ? next_use(k, ctx.layer, static_cast<double>(this_turn[k])) : next_use(k, ctx.layer);
    });
  }
  /// The predicted distance to the next use of @p key, in layer-steps, seen from layer
  /// @p now_layer (the layer being executed): next(l, j) = δ(l) + L · (1/r − 1) above.
  [[nodiscard]] double next_use(std::uint32_t key, std::uint32_t now_layer) const noexcept {
    return until_turn(key, now_layer) + static_cast<double>(space_.layers) * (1.0 / rate(key) - 1.0);
  }
  /// The same when the key's use at its layer's next turn has probability @p this_turn (a
  /// forecast) and the turns after it follow r: used there with probability p, else a turn
  /// later and then geometric with mean 1/r,
  ///
  ///     next(l, j | p) = δ(l) + (1 − p) · L / r(l, j),
  ///
  /// which is next(l, j) when p = r. The one owner of the estimate: victim() ranks by it and the
  /// simulator's victim-value check compares a victim's with a prefetched expert's.
  [[nodiscard]] double next_use(std::uint32_t key, std::uint32_t now_layer, double this_turn) const noexcept {
    return until_turn(key, now_layer) +
           (1.0 - std::clamp(this_turn, 0.0, 1.0)) * static_cast<double>(space_.layers) / rate(key);
  }

  /// The predicted probability that @p key is used at its layer's next turn:
  /// r above, in [1e-9, 1].
  [[nodiscard]] double rate(std::uint32_t key) const noexcept {
    const double f = selection_rate(key);
    if (!transitions_) return f;
    const std::size_t s = scope_of(key);
    const std::span<const predecessor> given = latest(s);
    if (given.empty()) return f;
    // Σ_a (g_a·T(a → j) + κf) / (g_a·N(a) + κ) = Σ_a T(a → j)·g_a·w_a + κf·Σ_a w_a, with
    // w_a = 1 / (g_a·N(a) + κ) and g_a the decay of a's counts since they were last aged.
    const std::uint32_t j = space_.expert_of(key);
    double sum = prior_ * f * weight_sum_[s];
    for (const predecessor& a : given) sum += transitions_to_[a.row + j] * a.count_weight;
    return std::clamp(sum / static_cast<double>(given.size()), 1e-9, 1.0);
  }

  /// The selection rate f of @p key: the decayed number of its layer's turns
  /// that used it over the decayed number of turns, in [1e-9, 1].
  [[nodiscard]] double selection_rate(std::uint32_t key) const noexcept {
    const std::size_t s = scope_of(key);
    const std::uint64_t now = turns_[s];
    if (now == 0) return 1e-9;
    const double used = count_[key] * power(powers_, gamma_, now - stamp_[key]);
    return std::clamp(used / decayed_turns_[s], 1e-9, 1.0);
  }

 private:
  static constexpr std::size_t power_table_size = 1024;

  struct predecessor {
    std::uint32_t key = 0;
    std::size_t row = 0;        // the start of T(key → ·)
    double count_weight = 0.0;  // g·w, w = 1 / (g·N(key) + κ): what a stored T(key → j) counts for
  };

  [[nodiscard]] static std::size_t scopes(const key_space& space) noexcept { return space.global ? space.layers : 1; }
  // δ(l): layer-steps until the next turn of key's layer seen from now_layer (0 in a per-layer scope).
  [[nodiscard]] double until_turn(std::uint32_t key, std::uint32_t now_layer) const noexcept {
    const std::uint32_t l = space_.layer_of(key);
    return space_.global ? static_cast<double>((l + space_.layers - now_layer - 1) % space_.layers + 1) : 0.0;
  }
  [[nodiscard]] std::size_t scope_of(std::uint32_t key) const noexcept {
    return space_.global ? space_.layer_of(key) : 0;
  }
  // γ^d for the ages victim() meets most: a table lookup instead of a pow per candidate.
  [[nodiscard]] static std::vector<double> power_table(double gamma) {
    std::vector<double> table(power_table_size);
    double p = 1.0;
    for (double& v : table) {
      v = p;
      p *= gamma;
    }
    return table;
  }
  [[nodiscard]] static double power(const std::vector<double>& table, double gamma, std::uint64_t age) noexcept {
    return age < power_table_size ? table[age] : std::pow(gamma, static_cast<double>(age));
  }

  // The predecessor lists of scope s: the latest turn's keys and the turn's before it.
  [[nodiscard]] std::size_t list_index(std::size_t s, bool latest_one) const noexcept {
    const std::size_t latest_one_index = latest_list_[s];
    return 2 * s + (latest_one ? latest_one_index : 1 - latest_one_index);
  }
  [[nodiscard]] std::span<const predecessor> latest(std::size_t s) const noexcept {
    const std::size_t i = list_index(s, true);
    return {lists_.data() + i * space_.experts_per_layer, list_size_[i]};
  }
  [[nodiscard]] std::span<const predecessor> before(std::size_t s) const noexcept {
    const std::size_t i = list_index(s, false);
    return {lists_.data() + i * space_.experts_per_layer, list_size_[i]};
  }

  void touch(std::uint32_t key, const access_context& ctx) noexcept {
    const std::size_t s = scope_of(key);
    if (turn_time_[s] != ctx.time) {  // the first access of a new access group at this layer: a new turn
      turn_time_[s] = ctx.time;
      ++turns_[s];
      decayed_turns_[s] = decayed_turns_[s] * gamma_ + 1.0;
      if (transitions_) start_turn(s);
    }
    if (stamp_[key] == turns_[s]) return;  // counted already in this turn (a caller reusing a group's time)
    if (transitions_) first_use_in_turn(s, key);
    // Decayed count as of this turn, then this turn's use. Counts are kept
    // "as of stamp_" and aged lazily: one pow per read instead of a pass over
    // the layer's experts per turn.
    count_[key] = count_[key] * power(powers_, gamma_, turns_[s] - stamp_[key]) + 1.0;
    stamp_[key] = turns_[s];
    last_[key] = ctx.time;
  }

  // The latest turn becomes the one before; each of its keys has one more
  // turn that followed it (N), its row aged to now first.
  void start_turn(std::size_t s) noexcept {
    latest_list_[s] = static_cast<std::uint8_t>(1U - latest_list_[s]);
    list_size_[list_index(s, true)] = 0;
    weight_sum_[s] = 0.0;
    const std::uint64_t now = turns_[s];
    const std::size_t e = space_.experts_per_layer;
    for (const predecessor& a : before(s)) {
      const double g = power(transition_powers_, gamma_t_, now - row_turn_[a.key]);
      if (g != 1.0) {
        follows_[a.key] *= g;
        for (std::size_t j = 0; j < e; ++j) transitions_to_[a.row + j] *= g;
      }
      row_turn_[a.key] = now;
      follows_[a.key] += 1.0;
    }
  }

  // T(a → key) for every a of the turn before; key joins the latest turn.
  void first_use_in_turn(std::size_t s, std::uint32_t key) noexcept {
    const std::uint32_t j = space_.expert_of(key);
    for (const predecessor& a : before(s)) transitions_to_[a.row + j] += 1.0;
    const double g = power(transition_powers_, gamma_t_, turns_[s] - row_turn_[key]);
    const double w = 1.0 / (g * follows_[key] + prior_);
    const std::size_t list = list_index(s, true);
    lists_[list * space_.experts_per_layer + list_size_[list]++] = {
        key, (s * space_.experts_per_layer + j) * space_.experts_per_layer, g * w};
    weight_sum_[s] += w;
  }

  key_space space_;
  double gamma_;
  bool transitions_;
  double prior_;
  double gamma_t_;
  std::vector<std::uint64_t> turns_;      // per layer (global scope) or 1: turns seen
  std::vector<double> decayed_turns_;     // the same, each turn weighted γ^age
  std::vector<std::uint64_t> turn_time_;  // the access-group time of each scope's latest turn
  std::vector<double> count_;             // per key: decayed turns that used it, as of stamp_
  std::vector<std::uint64_t> stamp_;      // per key: the turn count_ is current at (its latest use)
  std::vector<std::uint64_t> last_;
  detail::resident_set resident_;
  std::vector<double> powers_;  // powers_[d] = γ^d
  // Transitions (when on). Per key a: N(a) and its row T(a → ·), both as of
  // row_turn_[a] (aged lazily by γ_T per turn); per scope two lists of
  // predecessors, the latest turn's keys and the turn's before it.
  std::vector<double> transition_powers_;  // γ_T^d
  std::vector<double> transitions_to_;     // [scope][expert a][expert b]
  std::vector<double> follows_;
  std::vector<std::uint64_t> row_turn_;
  std::vector<predecessor> lists_;         // [scope][list 0/1][≤ E entries]
  std::vector<std::uint32_t> list_size_;   // [scope][list 0/1]
  std::vector<std::uint8_t> latest_list_;  // per scope: which list is the latest turn
  std::vector<double> weight_sum_;         // per scope: Σ weight over the latest list
};

static_assert(eviction_policy<next_turn_policy>);

}  // namespace expage
