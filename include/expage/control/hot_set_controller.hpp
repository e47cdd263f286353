/// @file
/// @brief hot_set_controller: EMA hotness and a per-layer top-n high-precision set with hysteresis
/// (DynaExq §3.5), and evaluate_hot_set(), which replays a routing trace through it.
#pragma once

#include "expage/core/expert_id.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/residency/residency_state.hpp"

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <span>
#include <vector>

namespace expage {

class routing_trace;

/// @brief The parameters of a hot_set_controller.
///
/// DynaExq gives no value for any of them. The defaults of decay and margin are the values tuned on
/// problem 0 of the Mixtral HumanEval trace with an interval of 2 forward passes (docs/control.md):
/// δ = 0.375 is κ = 0.75 of the mean per-expert count per interval (2 passes · top-2 / 8 experts);
/// rescale δ with the interval length and k/E for other models.
struct hot_set_config {
  std::uint32_t layers = 0;             ///< MoE layers, ≥ 1.
  std::uint32_t experts_per_layer = 0;  ///< Experts per layer, ≥ 1.
  std::uint32_t hi_per_layer =
      0;  ///< n_hi: the hi set's size in every layer, in [1, experts_per_layer] (resize() may set 0).
  /// α of the EMA S ← α·S + (1 − α)·c, in [0, 1) (DynaExq §3.5; no value given in the paper).
  double decay = 0.8;
  /// δ: additive hysteresis margin in score units (routed activations per interval), ≥ 0. A challenger
  /// replaces the weakest member only when its score exceeds the member's by more than δ.
  double margin = 0.375;
  /// Rank slack, in [0, experts_per_layer − hi_per_layer]: a member is demoted only once its rank
  /// (0 = hottest) reaches hi_per_layer + rank_slack, i.e. it must leave a wider candidate set first.
  std::uint32_t rank_slack = 0;
  /// Staggering: most promotions per layer per interval, ≥ 1 (DynaExq bounds transition interference;
  /// FluxMoE Exp#3 moves one expert per layer per period).
  std::uint32_t max_promotions_per_layer = 1;
  /// Bytes one hi version costs; charged with try_reserve on the budget account given to end_interval().
  std::size_t hi_bytes = 0;
};

/// What end_interval() decided. Demotions are listed before promotions: a slot is freed before
/// the budget is asked for the bytes of its successor.
struct hot_set_plan {
  std::vector<expert_id> demotions;   ///< Leave the hi set now (their reservations were released).
  std::vector<expert_id> promotions;  ///< Enter the hi set now (their bytes are reserved).
  std::vector<expert_id> deferred;    ///< Chosen but refused by the budget; asked again next interval.
};

/// @brief The plan as transition targets in priority order, demotions (to resident_lo) before
/// promotions (to resident_hi), for `transition_manager::update_targets()` or
/// `expert_runtime::update_targets()`: pass the manager's nested `target` type (or
/// `residency_target`) as @p Target. A plan lists only what changed in its interval, so hand it to
/// update_targets(), which keeps the earlier plans' requests still queued; set_targets() would
/// cancel them (a promotion waiting for budget dropped while the controller counts its expert hi).
///
/// The controller's budget account is a planning account: the transition manager charges the real
/// bytes of each hi version on its own pool account, so give the controller a separate account of
/// the hi pool's size (or none) rather than the pool's.
/// @tparam Target an aggregate of an expert_id `expert` and a residency_state `state`.
template <class Target>
[[nodiscard]] std::vector<Target> to_transition_targets(const hot_set_plan& plan) {
  std::vector<Target> out;
  out.reserve(plan.demotions.size() + plan.promotions.size());
  for (const expert_id id : plan.demotions) out.push_back(Target{id, residency_state::resident_lo});
  for (const expert_id id : plan.promotions) out.push_back(Target{id, residency_state::resident_hi});
  return out;
}

/// Totals of a hot_set_controller since construction.
struct hot_set_statistics {
  std::uint64_t intervals = 0;   ///< end_interval() calls.
  std::uint64_t promotions = 0;  ///< Experts promoted.
  std::uint64_t demotions = 0;   ///< Experts demoted.
  std::uint64_t deferred = 0;    ///< Promotions the budget refused.
  /// Largest number of promotions in one layer in one interval (≤ max_promotions_per_layer).
  std::uint32_t max_promotions_in_layer = 0;
  /// Writes every counter as one JSON object: `{"intervals":…,"promotions":…,"demotions":…,
  /// "deferred":…,"max_promotions_in_layer":…}`.
  void write_json(std::ostream& out) const;
};

/// @brief DynaExq's online tiering policy (§3.5) as a pure decision object.
///
/// Per (layer, expert) a counter c counts router selections during the current interval; at the
/// interval's end the hotness becomes S ← α·S + (1 − α)·c and the counters reset (DynaExq §3.5,
/// "Hotness Estimation", unnumbered). The target hi set of a layer is TopN({S}, n_hi) (§3.5,
/// "Budget-feasible Selection"), reached with hysteresis ("Hysteresis for Stability"): the hottest
/// non-member x replaces the coldest member h only when
///
///     S_x > S_h + δ            (additive margin; the same δ serves promotion and demotion)
///     rank(h) ≥ n_hi + slack   (rank slack: h must drop out of a wider candidate set)
///
/// and at most max_promotions_per_layer such swaps happen per layer per interval (staggering).
/// An empty slot (at start, or after a deferred promotion) is filled by the hottest non-member with
/// a positive score. Every promotion is admitted through `budget_account::try_reserve(hi_bytes)`; a
/// refusal defers it (DynaExq §3.3: backpressure, never an over-commit) and the slot stays free.
/// The controller holds one reservation per member and releases it on demotion, so the account never
/// holds more than the members' bytes. With δ = 0 and slack = 0 it is the naive top-n rule (ties keep
/// the incumbent).
///
/// Costs: record() O(k); end_interval() O(layers · E log E). Memory O(layers · E).
///
/// @code
/// expage::budget_tracker budget(64_GiB);
/// auto& hi = budget.add_account("experts_hi", 16 * hi_bytes);
/// expage::hot_set_controller c({.layers = 32, .experts_per_layer = 8, .hi_per_layer = 2,
///                               .decay = 0.8, .margin = 0.375, .hi_bytes = hi_bytes});
/// for (const auto& e : step_events) c.record(e.layer, e.experts);
/// if (step % 2 == 1) {
///   auto plan = c.end_interval(&hi);
///   manager.update_targets(expage::to_transition_targets<decltype(manager)::target>(plan));  // demotions first
/// }
/// @endcode
/// @threadsafety single-owner.
class hot_set_controller {
 public:
  /// A controller whose hi sets start empty.
  /// @throws expage::invalid_argument naming the first field out of range and its allowed range.
  explicit hot_set_controller(const hot_set_config& config);

  /// Counts one routing decision: the experts @p experts selected at layer @p layer.
  /// @throws expage::invalid_argument naming a layer or expert out of range; nothing is counted then.
  void record(std::uint32_t layer, std::span<const std::uint32_t> experts);

  /// Ends the interval: EMA update, then per layer at most max_promotions_per_layer swaps.
  /// @param budget charged with hi_bytes per promotion (nullptr: admit every promotion).
  /// @return the transitions decided, demotions first.
  [[nodiscard]] hot_set_plan end_interval(budget_account* budget = nullptr);

  /// @brief Changes n_hi, the hi set's size in every layer, to @p hi_per_layer (a resize of the hi pool).
  ///
  /// Shrinking demotes each layer's coldest members (lowest S, ties to the higher index) until n_hi
  /// remain, releasing their reservations; growing demotes nothing, and the free slots fill at the
  /// following end_interval() calls (still at most max_promotions_per_layer per layer per interval).
  /// 0 empties the hi tier; the scores keep updating. When n_hi + rank_slack exceeds the experts per
  /// layer, the slack in force is experts_per_layer − n_hi.
  /// @return the demotions, in layer order (no promotions or deferrals).
  /// @throws expage::invalid_argument when @p hi_per_layer exceeds experts_per_layer; nothing changes then.
  hot_set_plan resize(std::uint32_t hi_per_layer);

  /// The members of layer @p layer that resize(@p hi_per_layer) would demote, coldest first, without
  /// changing anything. @pre layer < layers.
  [[nodiscard]] std::vector<expert_index> demotions_for(std::uint32_t layer, std::uint32_t hi_per_layer) const;

  /// True when @p id is in its layer's hi set. @pre id within the configured dimensions.
  [[nodiscard]] bool is_hot(expert_id id) const noexcept { return member_[index(id)] != 0; }
  /// The hotness S of @p id. @pre id within the configured dimensions.
  [[nodiscard]] double hotness(expert_id id) const noexcept { return score_[index(id)]; }
  /// The members of layer @p layer's hi set, ascending.
  /// @throws expage::invalid_argument when @p layer is out of range.
  [[nodiscard]] std::vector<expert_index> hot_set(std::uint32_t layer) const;
  /// The configuration in force.
  [[nodiscard]] const hot_set_config& config() const noexcept { return config_; }
  /// Totals since construction.
  [[nodiscard]] const hot_set_statistics& statistics() const noexcept { return stats_; }

 private:
  [[nodiscard]] std::size_t index(expert_id id) const noexcept {
    return std::size_t{id.layer} * config_.experts_per_layer + id.expert;
  }
  void update_layer(std::uint32_t layer, budget_account* budget, hot_set_plan& plan);

  hot_set_config config_;
  std::vector<double> score_;           // S, layer-major
  std::vector<std::uint32_t> count_;    // c of the current interval
  std::vector<std::uint8_t> member_;    // 1 when in the hi set
  std::vector<reservation> held_;       // the members' reservations (empty without a budget)
  std::vector<std::uint32_t> members_;  // per layer: current size of the hi set
  std::vector<std::uint32_t> rank_;     // scratch: rank by descending S within one layer
  std::vector<expert_index> order_;     // scratch
  hot_set_statistics stats_;
};

/// How evaluate_hot_set() clocks intervals.
struct hot_set_clock {
  /// Interval length in forward passes (decode steps), ≥ 1; used when seconds_per_pass is 0.
  std::uint32_t passes = 2;
  /// Modelled seconds of one forward pass; > 0 selects a time-based interval (DynaExq's T_u).
  double seconds_per_pass = 0.0;
  /// T_u in modelled seconds when seconds_per_pass > 0, at least seconds_per_pass (an interval
  /// closes at the first pass boundary at or after each multiple of T_u).
  double seconds = 0.0;
};

/// What evaluate_hot_set() measured.
struct hot_set_evaluation {
  std::uint64_t activations = 0;                        ///< Routed (token, layer, expert) activations replayed.
  std::uint64_t hi_hits = 0;                            ///< Of those, activations whose expert was in the hi set.
  std::uint64_t transitions = 0;                        ///< Promotions + demotions.
  std::uint64_t promotions = 0;                         ///< Promotions.
  std::uint64_t deferred = 0;                           ///< Promotions refused by the budget.
  std::uint64_t intervals = 0;                          ///< Intervals closed.
  std::uint32_t max_promotions_per_layer_interval = 0;  ///< Largest promotions in one layer in one interval.
  /// hi_hits / activations; 0 for an empty trace.
  [[nodiscard]] double coverage() const noexcept {
    return activations == 0 ? 0.0 : static_cast<double>(hi_hits) / static_cast<double>(activations);
  }
};

/// @brief Replays @p trace (execution order) through a fresh hot_set_controller.
///
/// A forward pass starts where the layer index drops (or repeats for a sequence already seen at it).
/// Decisions take effect at once at the interval's end (transitions are modelled as instant), so an
/// activation counts as a hi hit when its expert was a member when the activation happened. With a
/// @p budget account, promotions are admitted through it as in end_interval().
/// @throws expage::invalid_argument when the trace's dimensions differ from @p config's, or for a
///         bad config or clock (named with its allowed range).
[[nodiscard]] hot_set_evaluation evaluate_hot_set(const routing_trace& trace, const hot_set_config& config,
                                                  const hot_set_clock& clock, budget_account* budget = nullptr);

}  // namespace expage
