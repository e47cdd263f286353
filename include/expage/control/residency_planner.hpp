/// @file
/// @brief residency_planner: FluxMoE's budget-aware residency planner (§4.3, Algorithm 2, Eq. 9–13)
/// with τ_load taken from exact LRU miss curves, staggered one-expert-per-layer moves and the
/// budget-after-KV constraint (Eq. 12) enforced at every step.
#pragma once

#include "expage/cache/miss_ratio_curve.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace expage {

/// @brief The parameters of a residency_planner.
struct residency_planner_config {
  std::uint32_t layers = 0;             ///< MoE layers N, ≥ 1.
  std::uint32_t experts_per_layer = 0;  ///< Experts per layer E, ≥ 1.
  /// τ_comp(theory): profiled seconds of one iteration with everything resident (FluxMoE §4.3), > 0.
  double compute_time = 0.0;
  double bandwidth = 0.0;            ///< Bytes per second of the streaming backend (host link), > 0.
  std::uint64_t expert_bytes = 0;    ///< GPU bytes of one resident expert (dense or compressed), ≥ 1.
  std::uint64_t streamed_bytes = 0;  ///< Bytes moved per miss; 0: expert_bytes.
  std::uint64_t gpu_bytes = 0;       ///< C_gpu: bytes shared by resident experts and the KV cache.
  /// θ: lower edge of the dead zone [θ, 1] (FluxMoE default 0.9), in (0, 1].
  double theta = 0.9;
};

/// What one residency_planner::step() decided.
struct residency_step {
  double rho = 0.0;        ///< ρ = τ_comp/τ_load before the step (Eq. 11); +inf when τ_load = 0.
  double load_time = 0.0;  ///< τ_load before the step, seconds per iteration (Eq. 10).
  /// Change of every layer's resident experts; releases (negative) are to be applied before grows.
  std::vector<std::int32_t> delta;
  std::uint32_t released = 0;  ///< Experts released this step (Σ of negative deltas).
  std::uint32_t added = 0;     ///< Experts added this step.
  /// True when Eq. 12 forced releases (the KV cache grew past the slack); these may exceed one per layer.
  bool forced = false;
};

/// @brief FluxMoE's residency planner over exact miss curves.
///
/// State: c_i resident experts in every layer i; α = Σ c_i / (N·E). τ_load is the aggregate I/O
/// time of one iteration (Eq. 9–10 for a single streaming backend): τ_load = Σ_i M_i(c_i)·s/(B·I),
/// with M_i the exact LRU miss curve of layer i (WiSP Eq. 3; layered_miss_curves::layer_curve)
/// measured over I iterations, without its compulsory misses (miss_ratio_curve::warm_misses(): a
/// first sight is paid once whatever α, and at α = 1 τ_load is zero, FluxMoE §4.3), and s the
/// bytes moved per miss. FluxMoE profiles τ_load; expage computes it from the curves, so the knee
/// of Eq. 13 is where the curves put it rather than a guess.
///
/// step(kv_bytes), once per period (Algorithm 2):
/// 1. ρ = τ_comp / τ_load (Eq. 11).
/// 2. ρ > 1: release experts, at most one per layer, least valuable first (the smallest
///    M_i(c_i − 1) − M_i(c_i)), as long as the new ρ stays ≥ θ: memory goes back to the KV cache
///    without crossing the dead zone.
/// 3. ρ < θ: add experts, at most one per layer, most valuable first, while ρ < θ and the budget of
///    Eq. 12 admits them.
/// 4. θ ≤ ρ ≤ 1: nothing (the dead zone).
/// 5. Eq. 12, C_exp(α) ≤ C_gpu − C_kv, checked after the update (Algorithm 2, line 9): while the
///    resident bytes exceed it, the least valuable expert of any layer is released, round by round
///    with at most one per layer per round (so a sudden KV surge still spreads its releases), and the
///    step is marked forced.
/// Releases are listed before additions, so applying the deltas in order never exceeds the budget.
/// A release never undoes an addition that was needed to reach θ, and an addition never undoes a
/// release that kept ρ ≥ θ, so under stationary curves and KV the planner does not oscillate:
/// Δα changes sign at most once (tests/control/residency_planner_test.cpp).
///
/// Costs: step() O(N log N + N·E), and O(E·N log N) at most when Eq. 12 forces releases (up to E
/// rounds, each sorting the N layers). Memory O(N·E).
///
/// @code
/// expage::residency_planner planner(
///     {.layers = 32, .experts_per_layer = 8, .compute_time = 0.030, .bandwidth = 25e9,
///      .expert_bytes = g.expert_bytes(expage::precision::bf16), .gpu_bytes = 60_GiB},
///     curves_per_layer, iterations_measured);
/// const auto s = planner.step(kv_bytes_now);   // every period
/// runtime.resize(planner.resident_bytes());  // expert_runtime keeps one pool: its byte target
/// // planner.capacity(l): how many of them layer l should keep (a per-layer cache's slots)
/// @endcode
/// @threadsafety single-owner.
class residency_planner {
 public:
  /// A planner with every layer at @p initial_capacity experts (clamped to E; default: all resident,
  /// α = 1, FluxMoE's starting point), over per-layer curves measured over @p iterations iterations.
  /// @throws expage::invalid_argument naming a field out of range, a curve count other than N, a
  ///         curve whose key count is not E, or iterations of 0.
  residency_planner(const residency_planner_config& config, std::vector<miss_ratio_curve> curves,
                    std::uint64_t iterations, std::uint32_t initial_capacity = UINT32_MAX);

  /// Replaces the curves (a live system re-measures them); the capacities stay.
  /// @throws expage::invalid_argument as the constructor; nothing changes then.
  void set_curves(std::vector<miss_ratio_curve> curves, std::uint64_t iterations);
  /// Replaces τ_comp(theory) (FluxMoE re-profiles when batch size or context shifts).
  /// @throws expage::invalid_argument when @p seconds is not finite and > 0; nothing changes then.
  void set_compute_time(double seconds);

  /// One period of Algorithm 2 with the KV cache now holding @p kv_bytes.
  [[nodiscard]] residency_step step(std::uint64_t kv_bytes);

  /// c_i. @pre layer < layers.
  [[nodiscard]] std::uint32_t capacity(std::uint32_t layer) const noexcept { return capacity_[layer]; }
  /// All c_i.
  [[nodiscard]] std::span<const std::uint32_t> capacities() const noexcept { return capacity_; }
  /// α = Σ c_i / (N·E).
  [[nodiscard]] double alpha() const noexcept;
  /// Bytes the resident experts take: Σ c_i · expert_bytes.
  [[nodiscard]] std::uint64_t resident_bytes() const noexcept;
  /// τ_load at the current capacities (Eq. 10), seconds per iteration.
  [[nodiscard]] double load_time() const noexcept;
  /// The configuration in force.
  [[nodiscard]] const residency_planner_config& config() const noexcept { return config_; }

 private:
  [[nodiscard]] double layer_time(std::uint32_t layer, std::uint32_t capacity) const noexcept;

  residency_planner_config config_;
  std::vector<miss_ratio_curve> curves_;
  std::uint64_t iterations_ = 1;
  std::vector<std::uint32_t> capacity_;
};

}  // namespace expage
