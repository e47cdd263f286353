/// @file
/// @brief The hi/lo/host expert tiers plus the KV cache under one budget, run by a discrete-event
/// model that measures time: the harness the four-pool controller (control/four_pool_controller.hpp)
/// is judged in, with its exhaustive (hi, lo, KV) grid oracle and the two-pool baselines.
///
/// A tier_workload is a split_workload (the expert access stream, the KV block stream, the model,
/// the hardware and the hi precision, the budget B and the KV floor, the bursts) plus a lo
/// precision, the quality price λ_q of an activation served at lo (or a minimum hi coverage) and
/// the hot set's interval. Per layer-step (group), at its start `now` (routing known):
///
/// - the links catch up: queued background transfers (the hi set's promotions and demotions)
///   start in idle link time before `now`, in order, each when its pool has room; a transfer in
///   flight is never preempted (PreScope premise 3); each link is a serial queue;
/// - every routed expert is pinned and served by decide_serve(): hi if resident; else its resident
///   lo version (no stall, λ_q charged); else wait for a version in flight; else a demand load,
///   ahead of every queued transfer, on the link that finishes it first: hi without a lo tier (or
///   for a hi-set member, with members_load_hi), lo otherwise (into the lo pool's LRU);
/// - the layer computes once its last expert is ready, for the roofline time of what it reads
///   (dense bytes plus each expert at the precision it is served at); its stall is ready − now.
///
/// Pools: per layer, H hi slots and L lo slots (four_pool_split). Without a lo tier (L = 0) the hi
/// pool is an LRU cache that loads on demand (WiSP's pager at hi precision); with one, the hi pool
/// holds the hi set (members pinned, promoted in the background, kept until their lo version lands
/// when demoted: publish-then-switch) and the lo pool is an LRU cache. An expert has at most one
/// active version. Every version resident or in flight holds a reservation of its bytes on its
/// pool's account of one budget_tracker (root B), taken when its transfer starts; the KV pool holds
/// one reservation of its bytes; so B holds at every instant, in-flight transfers included
/// (tier_run::budget_peak_bytes is the root's high-water mark).
///
/// Splits change only at burst barriers, drained (every transfer in flight lands, the wait is
/// resize stall; queued transfers are dropped): the hi set's members beyond the new n_hi are
/// dropped, the shrinking pools evict (LRU) and shrink first, then the others grow (shrink before
/// grow across three pools, WiSP §3.5). The KV side is simulate_kv_pool() resized at the same
/// barriers; a read of a block evicted earlier costs its recompute.
///
/// Cost of a run = expert stall + KV recompute + λ_q × activations served at lo (seconds); modelled
/// time per token = (compute + stall + recompute) / tokens. Both are reported.
#pragma once

#include "expage/control/four_pool_controller.hpp"
#include "expage/core/precision.hpp"
#include "expage/sim/split_sim.hpp"

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace expage {

/// @brief What is split and how it is charged.
struct tier_workload {
  /// The streams, geometry, hardware (expert_options: hardware, dense bytes, ratio; its format is
  /// the hi precision), budget, KV floor, KV bytes per token, burst and warm-up. Its policy must
  /// be LRU (both expert pools page with LRU). A transfer/compute ratio rescales the links of each
  /// tier against that tier's own layer time (make_cost_model() per precision), so the two tiers
  /// then see different bandwidths on one link: a sweep knob for tests, not a model of a machine.
  /// To model one link for both tiers, give its bandwidth in the hardware profile and no ratio
  /// (expage-plan refuses `--r` with `--tiers` for this reason).
  split_workload base{};
  precision lo_format = precision::int4;  ///< The lo tier's precision: fewer bytes than the hi one.
  double lo_activation_seconds = 0.0;     ///< λ_q: seconds charged per activation served at lo, ≥ 0.
  double min_hi_coverage = 0.0;           ///< q_min in [0, 1]: the controller's coverage constraint.
  std::uint64_t interval_passes = 2;      ///< The hot set's interval, in passes, ≥ 1.
  /// The serve rule for a hi-set member missing both versions (four_pool_model::members_load_hi):
  /// true loads hi; false loads the lo tier like any miss, as `expert_runtime` with its demand tier lo.
  bool members_load_hi = true;
  /// The hot set's hysteresis (decay, margin, rank slack, promotions per layer per interval); its
  /// dimensions and n_hi come from the geometry and the split.
  hot_set_config hot{};
  /// Fault injection: called with the index of every transfer as it starts (demand and background,
  /// in start order); true makes it fail when it lands (its bytes are released, no version is
  /// published; a demand load is retried at once, a background one is dropped).
  std::function<bool(std::uint64_t)> fail_transfer{};
};

/// @brief The four_pool_model of a workload: sizes of both precisions (make_cost_model), the
/// fastest link's transfer time of each, the KV block's recompute, λ_q and q_min, the largest group.
/// @throws expage::invalid_argument as check_tier_workload().
[[nodiscard]] four_pool_model make_four_pool_model(const tier_workload& workload);

/// Validates a workload: check_split_workload(), an LRU policy, a lo precision smaller than the hi
/// one, λ_q and q_min in range, an interval ≥ 1; throws expage::invalid_argument naming the value
/// and its range.
void check_tier_workload(const tier_workload& workload);

/// @brief One burst of a tier run.
struct tier_burst {
  std::uint64_t first_pass = 0;        ///< Its first pass.
  four_pool_split split;               ///< The split in force.
  double expert_stall_seconds = 0.0;   ///< Stall waiting for experts (a barrier's drain included).
  double kv_recompute_seconds = 0.0;   ///< KV recompute.
  std::uint64_t activations = 0;       ///< Routed activations served.
  std::uint64_t lo_activations = 0;    ///< Of those, served at lo.
  four_pool_split target;              ///< Online runs: the controller's target at this burst's end.
  double predicted_cost = 0.0;         ///< Online runs: the predicted cost of the split in force.
  double predicted_target_cost = 0.0;  ///< Online runs: of the target.
  /// The burst's cost at a quality price λ_q: expert stall + KV recompute + λ_q × lo activations,
  /// seconds (tier_run::cost() sums it at the workload's λ_q).
  [[nodiscard]] double cost(double lo_activation_seconds) const noexcept {
    return expert_stall_seconds + kv_recompute_seconds + lo_activation_seconds * static_cast<double>(lo_activations);
  }
};

/// @brief A tier run measured by the simulator.
struct tier_run {
  std::string controller;              ///< "static:hi-only H", "static:H+L", "four-pool", ...
  std::vector<tier_burst> bursts;      ///< Per burst, in order.
  double expert_stall_seconds = 0.0;   ///< After the warm-up bursts.
  double kv_recompute_seconds = 0.0;   ///< After the warm-up.
  double compute_seconds = 0.0;        ///< After the warm-up.
  double lo_activation_seconds = 0.0;  ///< λ_q of the workload.
  std::uint64_t activations = 0;       ///< After the warm-up.
  std::uint64_t lo_activations = 0;    ///< Served at lo, after the warm-up.
  std::uint64_t tokens = 0;            ///< Tokens charged.
  /// Expert stall of the whole run (warm-up included) by cause: demand loads, waits for a hi-set
  /// transfer in flight (late_prefetch), demand loads queued behind one (queued_behind_prefetch:
  /// the hi set's promotions and demotions are this simulator's background transfers, as
  /// prefetches are simulate()'s), barrier drains (resize).
  std::array<double, stall_cause_count> stall_seconds{};
  std::uint64_t demand_hi_loads = 0;    ///< Hi versions loaded on demand (whole run).
  std::uint64_t demand_lo_loads = 0;    ///< Lo versions loaded on demand.
  std::uint64_t promotions = 0;         ///< Background hi transfers landed (the hi set's promotions).
  std::uint64_t demotions = 0;          ///< Background lo transfers landed (demotions to the lo tier).
  std::uint64_t dropped_transfers = 0;  ///< Queued background transfers dropped unstarted (a barrier, a demand).
  std::uint64_t failed_transfers = 0;   ///< Transfers that failed (fault injection).
  std::uint64_t bytes_moved = 0;        ///< Bytes of every transfer started.
  std::uint64_t moves = 0;              ///< Barriers at which the split changed.
  std::uint64_t reversals = 0;          ///< Moves against the previous one (four_pool_controller's direction).
  std::uint64_t failed_resizes = 0;     ///< Moves refused (the previous split stayed, WiSP D3).
  std::uint64_t mix_changes = 0;        ///< Session-mix changes the controller detected.
  std::uint64_t budget_peak_bytes = 0;  ///< High-water mark of hi + lo + KV bytes, transients included.
  std::uint64_t min_kv_bytes = 0;       ///< The least KV pool in force.
  /// Checks that failed (a pool over its slots, a pinned or in-flight version evicted, the budget
  /// refusing a reservation the slot counts allowed): 0 in a correct run.
  std::uint64_t invariant_violations = 0;
  std::uint64_t converged_burst = 0;  ///< The first burst from which the split never changes.
  /// The hi set of every layer at the end of the run (the members the hysteresis controller
  /// chose; empty without a lo tier), ascending.
  std::vector<std::vector<expert_index>> hi_sets;

  /// λ_q × lo activations, seconds.
  [[nodiscard]] double quality_seconds() const noexcept {
    return lo_activation_seconds * static_cast<double>(lo_activations);
  }
  /// Expert stall + KV recompute + quality, seconds.
  [[nodiscard]] double cost() const noexcept { return expert_stall_seconds + kv_recompute_seconds + quality_seconds(); }
  /// cost() per token.
  [[nodiscard]] double cost_per_token() const noexcept { return per_token(cost()); }
  /// (compute + stall + recompute) per token: the modelled time per output token (quality excluded).
  [[nodiscard]] double time_per_token() const noexcept {
    return per_token(compute_seconds + expert_stall_seconds + kv_recompute_seconds);
  }
  /// Expert stall per token.
  [[nodiscard]] double expert_stall_per_token() const noexcept { return per_token(expert_stall_seconds); }
  /// KV recompute per token.
  [[nodiscard]] double kv_recompute_per_token() const noexcept { return per_token(kv_recompute_seconds); }
  /// Share of activations served at hi (1 with none).
  [[nodiscard]] double hi_coverage() const noexcept {
    return activations == 0 ? 1.0 : 1.0 - static_cast<double>(lo_activations) / static_cast<double>(activations);
  }

 private:
  [[nodiscard]] double per_token(double seconds) const noexcept {
    return tokens == 0 ? 0.0 : seconds / static_cast<double>(tokens);
  }
};

/// What a barrier's fault injection does (four_pool_options::inject_resize_fault).
enum class resize_fault : std::uint8_t {
  none,                  ///< The resize goes through.
  refused,               ///< Refused before anything changes: the previous split stays (D3).
  refused_after_shrink,  ///< The shrinks happened (their evictions too), the grows were refused: the
                         ///< shrunk pools are grown back, so the previous split stays, emptier.
};

/// @brief Parameters of an online run.
struct four_pool_options {
  four_pool_config controller{};  ///< The controller's knobs (hot is taken from the workload).
  four_pool_space space{};        ///< The splits it may choose (the two-pool baselines restrict it).
  /// The split before the first burst; unset: the admissible split with the most expert bytes,
  /// hi-only first (WiSP's live rule starts from every byte above the floor to the experts).
  std::optional<four_pool_split> initial{};
  /// Tell the controller, at each barrier, the LRU depths of the blocks of sessions still
  /// open (open_block_depths(), four_pool_controller::set_kv_open_depths()): what a
  /// session-aware engine knows (an agent framework's open conversations, SGLang's sessions).
  /// False: the decayed histograms only (WiSP's signal).
  bool kv_open_sessions = true;
  /// Fault injection: called with the burst index before each move.
  std::function<resize_fault(std::uint64_t)> inject_resize_fault{};
};

/// Runs the static split @p split (the hi set following the traffic per interval) through the simulator.
/// @throws expage::invalid_argument as check_tier_workload(), or for a split that is not admissible.
[[nodiscard]] tier_run evaluate_tier_split(const tier_workload& workload, const four_pool_split& split);

/// The exhaustive grid: every admissible split (admissible_splits() with @p space), each run by
/// the simulator. The least cost() among those whose measured hi coverage meets q_min is the
/// oracle (the best static split with hindsight).
[[nodiscard]] std::vector<tier_run> tier_grid(const tier_workload& workload, const four_pool_space& space = {},
                                              std::uint32_t step = 1);
/// The index of the oracle in @p grid: the least cost() with hi_coverage() ≥ @p min_hi_coverage
/// (the cheapest of the most covering runs when none meets it). @pre grid not empty.
[[nodiscard]] std::size_t tier_oracle(const std::vector<tier_run>& grid, double min_hi_coverage = 0.0) noexcept;

/// The per-phase hindsight oracle (hindsight_phase_oracle()) of tier runs of @p workload
/// (tier_grid(), or a restricted space's grid for a two-pool oracle): burst costs
/// tier_burst::cost() at the workload's λ_q, phases phase_first_bursts(), charged from its
/// warmup_bursts. As tier_oracle(), a phase chooses among the runs whose hi coverage over the
/// phase's charged bursts meets the workload's q_min, the most covering ones when none does.
/// @throws expage::invalid_argument as hindsight_phase_oracle().
[[nodiscard]] phase_oracle tier_phase_oracle(const tier_workload& workload, std::span<const tier_run> runs);

/// The four-pool controller driven by the workload online: it sees each group's routing after
/// the group is served and each step's KV block reuse distances (a shadow LRU stack), ends a hot
/// set interval every interval_passes passes and decides at every burst barrier from what it has
/// seen; the simulator applies its targets and splits as they are made.
/// @throws expage::invalid_argument as check_tier_workload() and four_pool_controller.
[[nodiscard]] tier_run run_four_pool(const tier_workload& workload, const four_pool_options& options = {});

/// @brief The two-pool controllers, each the four-pool controller over a restricted space, run
/// by the same simulator:
/// - "hi+KV": no lo tier (WiSP's MV-WSA split at the hi precision);
/// - "lo+KV": every expert at lo (no hi slot; MV-WSA at the lo precision, λ_q on every activation);
/// - "hi+lo": the expert tiers split online within a fixed KV share (@p kv_share_bytes, e.g. the
///   grid oracle's KV pool: a share chosen with hindsight): tiered splits only, each hi count with
///   the most lo slots the share leaves it (four_pool_space::fill_lo).
/// @return the runs in that order (a space the budget cannot admit is skipped).
/// @throws expage::invalid_argument for a bad workload or @p kv_share_bytes above the budget.
[[nodiscard]] std::vector<tier_run> run_two_pool_baselines(const tier_workload& workload, std::uint64_t kv_share_bytes,
                                                           const four_pool_options& options = {});

}  // namespace expage
