/// @file
/// @brief The expert/KV split measured by the simulator: a static split, a schedule of splits,
/// the exhaustive grid (the oracle) and the online MV-WSA controller (WiSP §3.3–3.5, App. B/D),
/// each charged by the same event model rather than by the controller's own cost model.
///
/// A split_workload pairs an expert access stream (per-layer slots, as WiSP pages them) with a
/// KV block stream (kv_sessions.hpp; step i is forward pass i) under one budget B. A split is
/// the per-layer expert cap c; the KV pool takes every remaining byte (WiSP Eq. 10 [R]):
/// n = ⌊(B − c·S_E)/S_b⌋ blocks, S_E = N·s_e the bytes of one slot in every layer, S_b the bytes
/// of one block. Time is cut into bursts of `burst_passes` passes; splits change only at their
/// drained barriers, the losing pool shrinking first (WiSP §3.5), both pools held by one
/// budget_tracker so that the budget holds at every instant.
///
/// What a run costs (seconds over the workload):
/// - expert stall: simulate() of the expert stream with the caps as its capacity schedule
///   (demand loading; the stall of every pass, a resize's drain included);
/// - KV recompute: every read of a block the pool evicted earlier re-prefills its tokens,
///   block_tokens × cost_model::recompute_seconds_per_token (simulate_kv_pool()).
/// First reads of a block cost nothing extra at any split (the step writes that KV anyway).
#pragma once

#include "expage/cache/replay.hpp"
#include "expage/control/split_allocator.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/sim/kv_sessions.hpp"
#include "expage/sim/pager_sim.hpp"

#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace expage {

/// @brief What is split, and how time is charged.
struct split_workload {
  const access_stream* experts = nullptr;  ///< Grouped expert stream; its group limit ≤ the smallest cap.
  const kv_block_stream* kv = nullptr;     ///< KV references, one step per pass of `experts`.
  moe_geometry geometry = moe_geometry::mixtral_8x7b();  ///< The model.
  /// Hardware, precision and dense bytes of the expert side (layout, capacity, schedule and
  /// prefetcher are set by the split runs).
  sim_options expert_options{};
  policy_kind policy = policy_kind::lru;  ///< Expert eviction policy (online).
  std::uint64_t budget_bytes = 0;         ///< B: bytes for expert slots and KV blocks together, [1, max_bytes].
  std::uint64_t kv_floor_bytes = 0;       ///< B_KV^min (WiSP Eq. 6): the KV pool never gets less.
  /// KV bytes of one token over all layers, ≥ 1, with a block's bytes (× block_tokens) in 64 bits.
  std::uint64_t kv_bytes_per_token = 0;
  std::uint64_t burst_passes = 16;  ///< Passes between drained barriers, ≥ 1.
  /// Bursts run (the controllers decide, the pools fill) but not charged: a service runs for
  /// hours, and a split is judged on its steady state, not on the minutes after a cold start
  /// when nothing has been reused yet (a session's first return comes a think time after the
  /// start). Applied alike to every run, the grid's included. < the workload's bursts.
  std::uint64_t warmup_bursts = 0;
  /// The KV pool drops a conversation's blocks when it closes (simulate_kv_pool()'s
  /// release_closed), every run's alike, and the controllers' KV reuse distances and open depths
  /// no longer count them. False: vLLM's prefix cache, which keeps them until LRU evicts them.
  bool kv_release_closed = false;
};

/// @brief The split_model (WiSP Eq. 1, 4, 6 [R]) of a workload: S_E, S_b, the floor and the
/// seconds of an expert miss (the fastest link's transfer) and of a KV-block miss (its recompute).
/// @throws expage::invalid_argument as check_split_workload().
[[nodiscard]] split_model make_split_model(const split_workload& workload);

/// The caps a workload admits: from the expert stream's group limit up to E, with c·S_E ≤ B − floor.
/// @throws expage::invalid_argument as check_split_workload(), or when no cap is admissible (the
///         budget leaves the experts no room above the KV floor), naming the bytes.
[[nodiscard]] std::vector<std::uint32_t> admissible_caps(const split_workload& workload);

/// Validates a workload: streams present and paired (same passes as steps), the geometry's, an
/// expert group limit of at most E, a budget in [1, max_bytes], KV bytes per token whose block
/// fits 64 bits, a burst ≥ 1 pass; throws expage::invalid_argument naming the value and its range.
void check_split_workload(const split_workload& workload);

/// @brief One burst of a split run.
struct split_burst {
  std::uint64_t first_pass = 0;       ///< Its first pass.
  std::uint32_t expert_cap = 0;       ///< Slots per layer in force.
  std::uint64_t kv_blocks = 0;        ///< KV blocks in force.
  double expert_stall_seconds = 0.0;  ///< Stall waiting for experts (a barrier's drain included).
  double kv_recompute_seconds = 0.0;  ///< Prefill recompute of evicted KV blocks.
  /// The burst's cost: expert stall + KV recompute, seconds (split_run::cost() sums it).
  [[nodiscard]] double cost() const noexcept { return expert_stall_seconds + kv_recompute_seconds; }
  /// Online runs: what the controller decided at this burst's end (for the next burst): the
  /// grid's minimiser, and the predicted cost (Eq. 4 over the decayed histograms, seconds over
  /// their window) of the cap in force and of that target. 0 for other runs and the last burst.
  std::uint32_t target_cap = 0;
  double predicted_cost = 0.0;         ///< Of the cap in force.
  double predicted_target_cost = 0.0;  ///< Of target_cap.
};

/// @brief A split run measured by the simulator.
struct split_run {
  std::string controller;               ///< "static:c", "online", "live", ...
  std::vector<split_burst> bursts;      ///< Per burst, in order.
  double expert_stall_seconds = 0.0;    ///< Σ over the bursts after the warm-up.
  double kv_recompute_seconds = 0.0;    ///< Σ over the bursts after the warm-up.
  std::uint64_t tokens = 0;             ///< Tokens charged (after the warm-up bursts).
  std::uint64_t moves = 0;              ///< Barriers at which the split changed.
  std::uint64_t reversals = 0;          ///< Moves opposite to the previous move (A→B→A counts one).
  std::uint64_t failed_resizes = 0;     ///< Moves refused (the previous split stayed, WiSP D3).
  std::uint64_t mix_changes = 0;        ///< Session-mix changes the online controller detected.
  std::uint64_t budget_peak_bytes = 0;  ///< High-water mark of expert + KV bytes, transients included.
  /// Resizes the budget refused though the barrier's order (shrink first) allowed them: 0 in a
  /// correct run (the budget refuses past its capacity, so budget_peak_bytes alone cannot show one).
  std::uint64_t invariant_violations = 0;
  std::uint64_t min_kv_bytes = 0;     ///< The least KV pool in force (≥ the floor).
  std::uint64_t converged_burst = 0;  ///< The first burst from which the cap never changes.

  /// The modelled cost: expert stall + KV recompute, seconds.
  [[nodiscard]] double cost() const noexcept { return expert_stall_seconds + kv_recompute_seconds; }
  /// cost() per token.
  [[nodiscard]] double cost_per_token() const noexcept { return per_token(cost()); }
  /// Expert stall per token.
  [[nodiscard]] double expert_stall_per_token() const noexcept { return per_token(expert_stall_seconds); }
  /// KV recompute per token.
  [[nodiscard]] double kv_recompute_per_token() const noexcept { return per_token(kv_recompute_seconds); }

 private:
  [[nodiscard]] double per_token(double seconds) const noexcept {
    return tokens == 0 ? 0.0 : seconds / static_cast<double>(tokens);
  }
};

/// Runs @p caps (one per burst; the last repeats when fewer) through the simulator.
/// @throws expage::invalid_argument as check_split_workload(), or for an empty or inadmissible cap.
[[nodiscard]] split_run evaluate_split_schedule(const split_workload& workload, std::span<const std::uint32_t> caps,
                                                std::string controller = "schedule");

/// The exhaustive grid: every admissible static cap, each run by the simulator, in cap order. The
/// least cost() is the oracle (the best static split with hindsight, WiSP's per-workflow oracle
/// on a stationary workload and its global oracle on a phase shift).
[[nodiscard]] std::vector<split_run> split_grid(const split_workload& workload);

/// The bursts of a workload: ⌈passes / burst_passes⌉, the last one shorter when burst_passes does
/// not divide the passes. @pre the workload passes check_split_workload().
[[nodiscard]] std::uint64_t workload_bursts(const split_workload& workload) noexcept;

/// The first burst of each phase of the workload's KV stream (kv_block_stream::phase()), ascending
/// from 0: a burst belongs to the phase of its first pass, so a phase that starts no burst (one
/// shorter than a burst) has none.
/// @throws expage::invalid_argument as check_split_workload().
[[nodiscard]] std::vector<std::uint64_t> phase_first_bursts(const split_workload& workload);

/// @brief What hindsight_phase_oracle() found.
struct phase_oracle {
  double cost = 0.0;               ///< Σ over the phases of the cheapest eligible run's cost there.
  std::vector<std::size_t> best;   ///< Per phase, the index of that run (ties: the lowest index).
  std::vector<double> phase_cost;  ///< Per phase, its cost.
};

/// @brief The per-phase hindsight oracle: WiSP's per-workflow oracle (the best static split of a
/// stationary workload) applied to each phase of a shift. Each phase runs the run cheapest over
/// that phase's bursts, as if the split changed for free at the phase's first barrier with its
/// pools already warm for the new phase. It is the reference for how much switching splits at
/// the shifts can buy: a controller that holds one split per phase gains at most about this much
/// over the best static split (a transition's warm-up costs it more; changing within a phase could
/// gain more, and an online controller cannot know the best split in advance).
/// @param burst_costs one row per run: its cost in each burst (split_burst::cost(),
///        tier_burst::cost()), rows of equal length, at least one row.
/// @param first_bursts the phases' first bursts (phase_first_bursts()): ascending from 0, each
///        below the rows' length.
/// @param charged_from bursts before it are not charged (the workload's warmup_bursts).
/// @param eligible which runs a phase may choose (run, phase); empty: every run. A phase where
///        none is eligible may choose any.
/// @throws expage::invalid_argument for no rows, rows of unequal or zero length, a cost that is
///         negative or not finite, charged_from above the rows' length, or first_bursts not
///         ascending from 0 below the rows' length (naming the value).
[[nodiscard]] phase_oracle hindsight_phase_oracle(std::span<const std::vector<double>> burst_costs,
                                                  std::span<const std::uint64_t> first_bursts,
                                                  std::uint64_t charged_from = 0,
                                                  const std::function<bool(std::size_t, std::size_t)>& eligible = {});

/// The per-phase hindsight oracle of split runs of @p workload (split_grid()): burst costs
/// split_burst::cost(), phases phase_first_bursts(), charged from its warmup_bursts.
/// @throws expage::invalid_argument as hindsight_phase_oracle() (a run of another workload has
///         bursts of another count).
[[nodiscard]] phase_oracle split_phase_oracle(const split_workload& workload, std::span<const split_run> runs);

/// @brief The online controller's parameters (its knobs and its histograms').
///
/// The defaults were tuned on problem 0 of the Mixtral HumanEval trace with the session mixes of
/// docs/control.md (bursts of 16 passes) and frozen before problem 1 was measured: a long memory
/// (γ = 0.9, about ten bursts) because KV reuse is rare and bursty (a session's return rereads its
/// whole context at once), a 5% gate, a 30% reversal gate, and no rate limit (a move goes to the
/// target at once: a move that pays is large, and a rate limit only delays it). The KV histogram
/// has the same memory (γ_KV = 0.9): with the change detector below a shorter one no longer
/// speeds the return after a phase shift, and with a pool that drops closed conversations 0.85
/// (the value before the detector) let one recompute burst move the split, then reverse it; equal
/// γ also predicts both sides over windows of one length (docs/control.md). The change detector (change_ratio 3,
/// change_keep 0: the KV histogram starts over when the open sessions' footprint falls below a third of its average)
/// returns the controller to the tool-call split at the first barrier after a long-context phase; every ratio from 1.5
/// to 8 gives the same figures on problem 0. The detector needs kv_open_sessions (it watches the depths that option
/// passes).
struct online_split_options {
  /// The step's knobs (grid, gates, rate limit, dead zone).
  online_split_config controller{.grid_step = 1,
                                 .gate = 0.05,
                                 .rate_limit = std::numeric_limits<std::uint32_t>::max(),
                                 .dead_zone = 1,
                                 .reversal_gate = 0.30,
                                 .change_ratio = 3.0,
                                 .change_keep = 0.0};
  double decay = 0.9;     ///< γ of the expert histogram, per burst, (0, 1].
  double kv_decay = 0.9;  ///< γ_KV of the KV histogram, per burst, (0, 1].
  /// Bins of the KV histogram over the budget's blocks; 0 (the default): one per block, exact
  /// (up to 2^22 blocks; beyond, 2^22 bins).
  /// Coarse bins blur the cliff at the step's working set, where the near mode of the KV reuse
  /// distances sits (every decode step rereads its context), and predict misses that never happen.
  std::uint32_t kv_bins = 0;
  /// The cap before the first burst; 0: the largest admissible (what WiSP's live rule starts
  /// from before it has seen any KV occupancy: every byte above the floor to the experts).
  std::uint32_t initial_cap = 0;
  /// Fault injection: called with the burst index before each move; true refuses the resize
  /// (the previous split stays in force, WiSP D3). Empty: every resize succeeds.
  std::function<bool(std::uint64_t)> refuse_resize{};
  /// Tell the controller, at each barrier, the LRU depths of the KV blocks whose session is still
  /// open (open_block_depths(), split_controller::set_kv_open_depths(), kv_predicted_misses()):
  /// what a session-aware engine knows [not in WiSP]. False: WiSP's controller as written.
  bool kv_open_sessions = true;
};

/// The online MV-WSA controller (split_controller) driven by the workload: each burst's warm
/// reuse distances (per-layer expert distances, KV block distances, both measured over the whole
/// history so far) feed its histograms; at the barrier it decides the next burst's split from
/// what it has seen (never from later bursts); the resulting schedule is run by the simulator.
/// @throws expage::invalid_argument as split_controller and evaluate_split_schedule().
[[nodiscard]] split_run run_online_split(const split_workload& workload, const online_split_options& options);

/// WiSP's live rule (§3.5, App. D Eq. 8–10, live_split()) driven by the workload: at each barrier
/// P is the largest number of blocks one step of the last burst read, and the KV pool gets
/// max(floor, (1 + h)·P·S_b), the experts the rest.
[[nodiscard]] split_run run_live_split(const split_workload& workload, double headroom,
                                       std::uint32_t cap_dead_zone = 0);

}  // namespace expage
