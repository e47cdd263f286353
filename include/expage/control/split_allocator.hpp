/// @file
/// @brief MV-WSA: the expert/KV memory split of WiSP (§3.3–3.5, App. B, App. D): the offline
/// configurator over exact miss curves, the live closed-form rule, and the online controller step
/// over decayed reuse histograms, as pure functions of their inputs (plus split_controller, which
/// keeps the state of the online rule between bursts and falls back when a resize fails).
///
/// WiSP's extracted text lost nearly every symbol of Eq. 1–10 and every default of App. B/D (γ, the
/// gate, the rate limit, the dead zones, the headroom h, the grid). The forms below are reconstructed
/// from the surrounding prose ([R] in docs/control.md); the defaults are expage's own, untuned.
#pragma once

#include "expage/cache/decayed_reuse_histogram.hpp"
#include "expage/cache/miss_ratio_curve.hpp"
#include "expage/control/session_mix_detector.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace expage {

/// @brief The budget and the costs of the split (WiSP Eq. 1 and Eq. 4) [R].
struct split_model {
  std::uint64_t budget_bytes = 0;       ///< B = B_E + B_KV: pageable bytes after fixed costs (Eq. 1).
  std::uint32_t experts_per_layer = 0;  ///< E: the per-layer expert cap ranges over [0, E], E ≥ 1.
  std::uint64_t slot_bytes = 0;         ///< S_E: GPU bytes of one more slot in every layer (N·s_e), ≥ 1.
  std::uint64_t block_bytes = 0;        ///< S_b: bytes of one KV block summed over layers, ≥ 1.
  std::uint64_t kv_floor_bytes = 0;     ///< B_KV^min, the admission floor (Eq. 6; see kv_admission_floor()).
  double expert_miss_seconds = 0.0;     ///< β·s_e: seconds one expert miss costs (a transfer), ≥ 0.
  double kv_miss_seconds = 0.0;         ///< τ_r·b: seconds one KV-block miss costs (a recompute), ≥ 0.
  /// The least cap a step can run with (its largest group of routed experts; 0: no limit). Every
  /// split chosen lies in [min_expert_cap, E]; the budget must admit it above the KV floor.
  std::uint32_t min_expert_cap = 0;
};

/// The KV floor as a pool of whole blocks sees it: ⌈floor_bytes/S_b⌉·S_b. The pool a split leaves
/// holds ⌊kv_bytes/S_b⌋ blocks, so a floor of F bytes is met only when the pool keeps ⌈F/S_b⌉ blocks;
/// every admission rule compares against this, not against F. Saturates at 2^64 − 1; the models'
/// checks compare in blocks (kv_floor_fits()), so such a floor is refused, never admitted.
/// @pre block_bytes ≥ 1.
[[nodiscard]] std::uint64_t kv_floor_block_bytes(std::uint64_t floor_bytes, std::uint64_t block_bytes) noexcept;

/// True when a budget of @p budget_bytes holds the KV floor in whole blocks: ⌊B/S_b⌋ ≥ ⌈F/S_b⌉.
/// @pre block_bytes ≥ 1.
[[nodiscard]] bool kv_floor_fits(std::uint64_t budget_bytes, std::uint64_t floor_bytes,
                                 std::uint64_t block_bytes) noexcept;

/// The largest cap the budget admits above the KV floor (Eq. 6): min(E, ⌊(B − F_b)/S_E⌋) with F_b
/// the floor in whole blocks (kv_floor_block_bytes()).
/// @pre budget_bytes ≥ F_b, slot_bytes ≥ 1 and block_bytes ≥ 1.
[[nodiscard]] std::uint32_t max_expert_cap(const split_model& model) noexcept;

/// The KV blocks a cap leaves (Eq. 10 [R], in blocks): ⌊(B − c·S_E)/S_b⌋.
/// @pre c·S_E ≤ budget_bytes and block_bytes ≥ 1.
[[nodiscard]] std::uint64_t kv_blocks(const split_model& model, std::uint32_t expert_cap) noexcept;

/// @brief The decayed histogram of a KV block stream whose pool holds at most @p budget_blocks
/// blocks: capacities [0, min(budget_blocks, reuse_distance_tracker::max_key_count)] (at least 1),
/// one block per bin (exact) up to 2^22 blocks with @p bins = 0, else about @p bins bins (2^22 for
/// 0), so that a pool of billions of tiny blocks does not allocate a bin each; decay @p decay.
/// Coarse bins blur the cliff at a step's working set, where the near mode of KV reuse sits.
[[nodiscard]] decayed_reuse_histogram::config kv_histogram_config(std::uint64_t budget_blocks, std::uint32_t bins,
                                                                  double decay) noexcept;

/// @brief WiSP Eq. 6 [R]: B_KV^min = C·ℓ·κ, the KV bytes a continuous-batching scheduler needs to
/// hold the step's whole active set (served concurrency × context tokens per session × KV bytes per
/// token). Below it the engine preempts every step or refuses to start.
/// @throws expage::invalid_argument when the product overflows 64 bits.
[[nodiscard]] std::uint64_t kv_admission_floor(std::uint64_t concurrency, std::uint64_t context_tokens,
                                               std::uint64_t kv_bytes_per_token);

/// @brief A split of the budget and what the model predicts for it.
struct memory_split {
  std::uint32_t expert_cap = 0;    ///< c: expert slots per layer.
  std::uint64_t expert_bytes = 0;  ///< B_E = c·S_E.
  std::uint64_t kv_bytes = 0;      ///< B_KV = B − B_E (Eq. 7/Eq. 10: the remainder, never over-committed).
  /// T of Eq. 4 at this split, seconds over the curves' window (0 for live_split(), which has no curves).
  double predicted_cost = 0.0;
  /// Equal when cap and KV bytes match.
  friend bool operator==(const memory_split& a, const memory_split& b) noexcept {
    return a.expert_cap == b.expert_cap && a.kv_bytes == b.kv_bytes;
  }
};

/// @brief The split at expert cap @p cap: B_E = c·S_E, B_KV = B − B_E (Eq. 7/Eq. 10), with
/// @p cost as its predicted cost. @pre c·S_E ≤ B.
[[nodiscard]] memory_split make_split(const split_model& model, std::uint32_t cap, double cost = 0.0);

/// @brief T(c) of WiSP Eq. 4 [R] with exact curves: β·s_e·M_E(c) + τ_r·b·M_KV(n), n = ⌊(B − c·S_E)/S_b⌋
/// clamped to the KV curve's key count.
/// @param model the budget and costs. @param expert_cap c, in [0, E] with c·S_E ≤ B.
/// @param experts misses with c slots in every layer (layered_miss_curves::per_layer_curve()), E keys.
/// @param kv the KV block stream's curve (one key per block).
/// @throws expage::invalid_argument for a bad model, a curve of the wrong size, or a cap whose bytes
///         exceed the budget.
[[nodiscard]] double split_cost(const split_model& model, const miss_ratio_curve& experts, const miss_ratio_curve& kv,
                                std::uint32_t expert_cap);

/// @brief The offline configurator (WiSP §3.4, Eq. 7) [R]: the cap minimising Eq. 4 subject to the
/// floor B − c·S_E ≥ B_KV^min, the KV pool taking every remaining byte.
///
/// Eq. 5 (equal latency saved per byte in both pools) characterises an interior optimum of convex
/// curves; exact miss curves are often not convex (WiSP's bimodal reuse), so the configurator
/// evaluates Eq. 4 at every cap 0..E instead (E + 1 candidates; the KV side is then fixed), which is
/// exact for any curve shape. Ties go to the smaller cap (more KV).
/// @throws expage::invalid_argument for a bad model or curve, or a budget below the KV floor (named
///         with both values).
[[nodiscard]] memory_split configure_split(const split_model& model, const miss_ratio_curve& experts,
                                           const miss_ratio_curve& kv);

/// @brief The live closed-form rule (WiSP §3.5, App. D Eq. 8–10) [R].
///
///     B_KV^target = max(B_KV^min, (1 + h)·P·S_b)        (8)  floor as a continuous invariant
///     c^target    = min(E, ⌊(B − B_KV^target)/S_E⌋)      (9)  every remaining byte to experts
///     B_KV        = B − c^target·S_E                      (10) reclaims the clamp's slack
///
/// P is the burst's peak KV occupancy in blocks, h the headroom. A cap dead zone keeps
/// @p current_cap when the target differs from it by fewer than @p cap_dead_zone experts (but never
/// when keeping it would break Eq. 8).
/// @throws expage::invalid_argument for a bad model, a negative or non-finite headroom, or a budget
///         below the floor.
[[nodiscard]] memory_split live_split(const split_model& model, std::uint64_t peak_kv_blocks, double headroom,
                                      std::uint32_t current_cap, std::uint32_t cap_dead_zone = 0);

/// @brief The knobs of the online controller (WiSP App. B; every value lost in the paper's text).
struct online_split_config {
  std::uint32_t grid_step = 1;  ///< Candidate caps 0, g, 2g, … and E, g ≥ 1.
  /// Gate: move only when the predicted gain exceeds this share of the current predicted cost, [0, 1).
  double gate = 0.02;
  std::uint32_t rate_limit = 1;  ///< Most experts per layer the cap moves per burst, ≥ 1.
  std::uint32_t dead_zone = 1;   ///< Never move toward a target closer than this many experts, ≥ 1.
  /// Reversal gate: a move opposite to the previous one needs a predicted gain above this share
  /// of the current predicted cost, [gate, 1). Under stationary input the estimates still jitter
  /// from burst to burst, by more than any fixed share where the counts are few: noise_gate is
  /// what holds a move until the counts say its gain is real.
  double reversal_gate = 0.10;
  /// The session-mix change detector's ratio r [not in WiSP]: split_controller feeds the open
  /// sessions' KV footprint (the number of depths given to set_kv_open_depths()) to a
  /// session_mix_detector(r, the KV histogram's γ); when it falls below its decayed average over
  /// r, the KV histogram keeps only change_keep of its history and for ⌈1/(1 − γ)⌉ bursts moves
  /// set no direction for the reversal gate to defend. 0: off (WiSP as written); else r > 1.
  double change_ratio = 0.0;
  double change_keep = 0.0;  ///< Share of the KV histogram kept at a detected change, [0, 1].
  /// Noise gate z [not in WiSP], [0, ∞): a move also needs its predicted gain above z standard
  /// deviations of the gain's estimate, the decayed counts read as Poisson
  /// (decayed_reuse_histogram::predicted_difference_variance() of the two caps' predicted misses,
  /// in each stream). A relative gate alone is beaten by the jitter of a few decayed counts, so a
  /// controller moved, under stationary input, between caps whose costs differ by noise, and back
  /// (A→B→A); with z the move waits until the counts say the gain is real. Where the gain to the
  /// target is not significant, a rate-limited step whose own gain is still goes (a step onto
  /// known open KV blocks, say). 0: off.
  double noise_gate = 3.0;
};

/// @brief The KV misses a pool of @p blocks is predicted to take: the decayed histogram's warm
/// misses (WiSP App. B), or, when more, the blocks of sessions still open that the pool
/// cannot hold (@p open_depths, their LRU stack depths ascending, 0 = most recently read): each is
/// recomputed when its session returns. The histogram sees a session's far reuse only after it
/// happened (and was recomputed); the open blocks are known as soon as the context is written, by
/// an engine that knows which conversations are open [not in WiSP; docs/control.md].
/// @param kv the KV stream's histogram.
/// @param blocks the pool's size in blocks; beyond the histogram's max_capacity it reads the value there.
/// @param open_depths the LRU stack depths of the open sessions' blocks, ascending (those never
///        read below the deepest open one read: open_block_depths()).
[[nodiscard]] double kv_predicted_misses(const decayed_reuse_histogram& kv, std::uint64_t blocks,
                                         std::span<const std::uint64_t> open_depths) noexcept;

namespace detail {
/// Whether two predicted costs are equal up to rounding, |a − b| ≤ 10⁻⁹·max(|a|, |b|): the
/// controllers' ties (which keep the current split) and gains (a move needs more) use it. Costs
/// summed in different orders from decayed histograms differ in their last bits, which must not
/// decide a move: with a gate of 0 two caps of equal cost took turns as the target.
[[nodiscard]] inline bool same_cost(double a, double b) noexcept {
  const double d = a > b ? a - b : b - a;
  return d <= 1e-9 * std::max(a < 0 ? -a : a, b < 0 ? -b : b);
}
/// Refuses a noise gate z (online_split_config::noise_gate, four_pool_config::noise_gate) outside
/// [0, ∞), naming @p who.
/// @throws expage::invalid_argument naming the value and the range.
void check_noise_gate(double z, std::string_view who);
}  // namespace detail

/// @brief What online_split_step() decided.
struct online_split_decision {
  memory_split split;            ///< The split to apply now (the current one when nothing moves).
  std::uint32_t target_cap = 0;  ///< The predicted-cost minimiser on the grid.
  double current_cost = 0.0;     ///< Predicted cost of the current cap.
  double target_cost = 0.0;      ///< Predicted cost of the target.
  bool moved = false;            ///< True when split.expert_cap differs from the current cap.
  /// The order of the two resizes (WiSP §3.5): the losing pool shrinks first, so the transient
  /// footprint is the maximum of the two splits, never their sum.
  bool shrink_kv_first = false;
};

/// @brief One burst of the online controller (WiSP App. B, "Algorithm 2") [R], pure.
///
/// The decayed reuse histograms (decayed_reuse_histogram: decay γ per burst, warm reuses only, App. B
/// decisions 1–2) predict warm misses M̂_E(c) and M̂_KV(n); the predicted cost of a cap is Eq. 4 with
/// them. Decision 3: because both streams' reuse distances are bimodal, a point marginal evaluated in
/// the gap reads 0 and stalls; the controller instead evaluates the predicted cost at every cap of a
/// grid (a lookahead over every move length, as UCP's lookahead allocation does) and takes the
/// minimiser, within the floor, as its target. It moves toward it by at most rate_limit experts, and
/// only when the target is at least dead_zone away and the predicted gain cost(current) − cost(target)
/// exceeds gate·cost(current). With stationary histograms the target is fixed, so the cap moves
/// monotonically to it and never reverses.
/// @param model the budget and costs. @param config the knobs. @param current_cap the cap in force.
/// @param experts histogram of per-layer expert reuse distances, max_capacity E.
/// @param kv histogram of KV block reuse distances; caps whose KV blocks exceed its max_capacity read
///        its value there.
/// @param previous_move the direction of the last move made (−1 down, +1 up, 0 none): a move the
///        other way needs a gain above config.reversal_gate instead of config.gate.
/// @throws expage::invalid_argument for a bad model or config, a histogram of the wrong size, a budget
///         below the floor, or a current cap out of [min_expert_cap, E] or below the floor.
/// @param kv_open_depths the LRU stack depths, ascending, of the KV blocks whose session is
///        still open (kv_predicted_misses(); empty: unknown, WiSP's controller as written).
[[nodiscard]] online_split_decision online_split_step(const split_model& model, const online_split_config& config,
                                                      const decayed_reuse_histogram& experts,
                                                      const decayed_reuse_histogram& kv, std::uint32_t current_cap,
                                                      int previous_move = 0,
                                                      std::span<const std::uint64_t> kv_open_depths = {});

/// @brief The online controller's state between bursts: its two histograms and the split in force,
/// with WiSP's fail-safe (D3): a resize that fails leaves the previous split in force.
///
/// @code
/// expage::split_controller c(model, {.gate = 0.02}, {.max_capacity = 8, .bin_width = 1, .decay = 0.9},
///                            {.max_capacity = 4096, .bin_width = 16, .decay = 0.9}, initial_cap);
/// c.new_burst();
/// for (auto d : expert_distances) c.experts().record(d);
/// for (auto d : kv_distances) c.kv().record(d);
/// const auto plan = c.step();
/// if (plan.moved) c.commit(plan, resize_both(plan.split, plan.shrink_kv_first));  // at a drained barrier
/// @endcode
/// @threadsafety single-owner.
class split_controller {
 public:
  /// A controller at @p initial_cap with empty histograms.
  /// @throws expage::invalid_argument as online_split_step() for the model, config and cap, or as
  ///         decayed_reuse_histogram for the histogram configs.
  split_controller(const split_model& model, const online_split_config& config, decayed_reuse_histogram::config experts,
                   decayed_reuse_histogram::config kv, std::uint32_t initial_cap);

  /// Starts a burst: decays both histograms.
  void new_burst() noexcept {
    experts_.new_burst();
    kv_.new_burst();
    mix_.new_burst();
  }
  /// The expert stream's histogram (record distances into it).
  [[nodiscard]] decayed_reuse_histogram& experts() noexcept { return experts_; }
  /// The KV stream's histogram.
  [[nodiscard]] decayed_reuse_histogram& kv() noexcept { return kv_; }
  /// The LRU stack depths (0 = most recently read) of the KV blocks whose session is still
  /// open (kv_predicted_misses(), open_block_depths()); kept until the next call; empty: unknown. Call once per burst,
  /// after the burst's reuses are recorded: their number drives the change detector
  /// (online_split_config::change_ratio).
  /// @throws expage::invalid_argument when @p depths is not sorted ascending.
  void set_kv_open_depths(std::vector<std::uint64_t> depths);
  /// Decides the burst's move (pure: nothing changes until commit()).
  [[nodiscard]] online_split_decision step() const;
  /// Records the outcome of applying @p decision: on success its split is in force; on failure the
  /// previous split stays (D3) and the failure is counted.
  /// @throws expage::invalid_argument when @p applied and the split is not one of this model's
  ///         (its cap outside [min_expert_cap, max_expert_cap()], or its bytes not the cap's);
  ///         nothing changes.
  void commit(const online_split_decision& decision, bool applied);
  /// The split in force.
  [[nodiscard]] const memory_split& current() const noexcept { return current_; }
  /// Resizes that failed.
  [[nodiscard]] std::uint64_t failed_resizes() const noexcept { return failed_; }
  /// The direction of the last applied move: −1, +1, or 0 before any (or since a detected change).
  [[nodiscard]] int last_move() const noexcept { return last_move_; }
  /// Changes of the session mix detected (online_split_config::change_ratio).
  [[nodiscard]] std::uint64_t changes() const noexcept { return mix_.changes(); }

 private:
  split_model model_;
  online_split_config config_;
  decayed_reuse_histogram experts_;
  decayed_reuse_histogram kv_;
  memory_split current_;
  std::vector<std::uint64_t> kv_open_depths_;  // ascending
  std::uint64_t failed_ = 0;
  int last_move_ = 0;
  session_mix_detector mix_;
};

}  // namespace expage
