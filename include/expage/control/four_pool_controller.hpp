/// @file
/// @brief four_pool_controller: one controller over the hi-resident, lo-resident and host expert
/// tiers and the KV cache under one budget (issue 12; control-layer notes E7), at three time scales:
/// per layer the serve/load rule, per interval the hi set (hot_set_controller, DynaExq §3.5), per
/// burst the split of the budget across hi, lo and KV bytes (WiSP's MV-WSA, §3.3–3.5 and App. B,
/// extended from two pools to three). No seed paper has this controller; the composition is
/// expage's own and docs/control.md says which part comes from where.
#pragma once

#include "expage/cache/decayed_reuse_histogram.hpp"
#include "expage/control/hot_set_controller.hpp"
#include "expage/control/session_mix_detector.hpp"
#include "expage/core/expert_id.hpp"
#include "expage/residency/residency_state.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <limits>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace expage {

/// The three pools that share the budget (the fourth tier, host memory, holds every expert's
/// masters and costs link time, not budget).
enum class tier_pool : std::uint8_t {
  hi,  ///< High-precision expert versions.
  lo,  ///< Low-precision expert versions.
  kv,  ///< KV cache blocks.
};
/// "hi", "lo", "kv".
[[nodiscard]] std::string_view to_string(tier_pool p) noexcept;

/// @brief Restrictions of the splits a four_pool_model admits: the two-pool controllers are the
/// four-pool controller over a smaller space (docs/control.md, "the two-pool baselines").
struct four_pool_space {
  bool hi_only = true;  ///< Admit splits without a lo tier (the hi pool pages on demand, WiSP at hi precision).
  bool tiered = true;   ///< Admit splits with a lo tier (hi set + lo cache).
  /// Most hi slots per layer (0 with tiered only: every expert at lo, WiSP at lo precision).
  std::uint32_t max_hi_slots = std::numeric_limits<std::uint32_t>::max();
  /// A raised KV floor: the KV pool keeps at least this many bytes, ≤ the budget.
  std::uint64_t min_kv_bytes = 0;
  /// Tiered splits only with the most lo slots their hi count leaves above the KV floor (or every
  /// expert's): with min_kv_bytes, a fixed KV share that the expert tiers split between them, the
  /// hi+lo two-pool baseline (run_two_pool_baselines()).
  bool fill_lo = false;
};

/// @brief The budget, sizes and prices of the four-pool split (WiSP Eq. 1, 4, 6 [R], with a hi
/// and a lo expert tier and a quality price).
struct four_pool_model {
  std::uint64_t budget_bytes = 0;       ///< B: hi + lo + KV bytes never exceed it (Eq. 1).
  std::uint32_t layers = 0;             ///< N, ≥ 1: a slot is one expert version in every layer.
  std::uint32_t experts_per_layer = 0;  ///< E, ≥ 1.
  std::uint64_t hi_expert_bytes = 0;    ///< s_hi: one expert at the hi precision, ≥ 1.
  std::uint64_t lo_expert_bytes = 0;    ///< s_lo: one expert at the lo precision, in [1, s_hi].
  std::uint64_t block_bytes = 0;        ///< S_b: one KV block over all layers, ≥ 1.
  std::uint64_t kv_floor_bytes = 0;     ///< B_KV^min (Eq. 6); in whole blocks of S_b, ≤ B.
  double hi_miss_seconds = 0.0;         ///< One hi transfer over the link (β·s_hi), ≥ 0.
  double lo_miss_seconds = 0.0;         ///< One lo transfer (β·s_lo), ≥ 0.
  double kv_miss_seconds = 0.0;         ///< One KV block recompute (τ_r·b), ≥ 0.
  /// λ_q: the quality exchange rate, seconds charged for each activation served at the lo
  /// precision, ≥ 0 (0: quality is free, or priced by min_hi_coverage instead).
  double lo_activation_seconds = 0.0;
  /// q_min in [0, 1]: the share of activations that must be served at hi; splits predicted below
  /// it are not chosen (a constraint in place of, or beside, λ_q).
  double min_hi_coverage = 0.0;
  /// g ≥ 1: the most experts one layer-step routes; a pool that loads on demand needs ≥ g slots.
  std::uint32_t min_group = 1;
  /// The serve rule's choice for a hi-set member missing both versions: load hi (true), or the lo
  /// tier like any miss (false). decide_serve(); `expert_runtime_options::targets_load_hi` is the
  /// runtime's side of it.
  bool members_load_hi = true;
  four_pool_space space{};  ///< Which splits are admissible.
};

/// @throws expage::invalid_argument naming the first field out of range and its allowed range.
void check_four_pool_model(const four_pool_model& model);

/// @brief A split of the budget: per-layer slots of both expert tiers, the KV pool the rest.
///
/// With lo_slots = 0 (hi-only) the hi pool is an LRU cache that loads hi versions on demand (WiSP's
/// pager at the hi precision). With lo_slots ≥ g (tiered) the hi pool holds the hi set, n_hi =
/// hi_slots members per layer chosen by the hysteresis controller, and the lo pool is an LRU cache
/// of lo versions that demand misses load. An expert has at most one active version.
struct four_pool_split {
  std::uint32_t hi_slots = 0;  ///< H: hi versions per layer.
  std::uint32_t lo_slots = 0;  ///< L: lo versions per layer; 0 = no lo tier.
  std::uint64_t kv_bytes = 0;  ///< The KV pool: B − H·N·s_hi − L·N·s_lo (the remainder, Eq. 10 [R]).
  /// True with a lo tier.
  [[nodiscard]] bool tiered() const noexcept { return lo_slots != 0; }
  /// Equal when every field is.
  friend bool operator==(const four_pool_split&, const four_pool_split&) = default;
};

/// H·N·s_hi: the hi pool's bytes.
[[nodiscard]] std::uint64_t hi_pool_bytes(const four_pool_model& model, const four_pool_split& split) noexcept;
/// L·N·s_lo: the lo pool's bytes.
[[nodiscard]] std::uint64_t lo_pool_bytes(const four_pool_model& model, const four_pool_split& split) noexcept;
/// The least KV pool a split may leave: max(B_KV^min, the space's min_kv_bytes) in whole blocks
/// (kv_floor_block_bytes()), since the pool holds ⌊kv_bytes / S_b⌋ blocks.
[[nodiscard]] std::uint64_t kv_pool_floor_bytes(const four_pool_model& model) noexcept;
/// The KV blocks of a split: ⌊kv_bytes / S_b⌋.
[[nodiscard]] std::uint64_t kv_pool_blocks(const four_pool_model& model, const four_pool_split& split) noexcept;

/// True when @p split is in the model's space: hi-only with H ∈ [g, E], or tiered with L ≥ g and
/// H + L ≤ E; H within the space's max_hi_slots; kv_bytes the remainder and at least
/// kv_pool_floor_bytes() (the floor and the space's min_kv_bytes, in whole blocks); with the
/// space's fill_lo, a tiered L the most that fit (H + L = E, or one lo slot more would cross the floor).
[[nodiscard]] bool admissible(const four_pool_model& model, const four_pool_split& split) noexcept;

/// The split with @p hi_slots and @p lo_slots and the KV pool taking the rest.
/// @throws expage::invalid_argument when it is not admissible, naming the slots, the bytes and the range.
[[nodiscard]] four_pool_split make_four_pool_split(const four_pool_model& model, std::uint32_t hi_slots,
                                                   std::uint32_t lo_slots);

/// Every admissible split (KV the remainder, so the exhaustive grid over (hi, lo, KV) bytes at the
/// total: giving KV less than the rest never lowers an LRU pool's misses): hi-only by H ascending,
/// then tiered by H, then L. @p step > 1 keeps every step-th H and, for each, every step-th L,
/// and the largest admissible H and L (so the coarse grid still holds the splits that give the
/// experts the most the budget allows).
/// @throws expage::invalid_argument for a bad model, a step of 0, or a budget that admits no split
///         (named with the bytes: the engine must not start there).
[[nodiscard]] std::vector<four_pool_split> admissible_splits(const four_pool_model& model, std::uint32_t step = 1);

/// @brief What the runtime should do with one routed expert (the per-layer time scale).
enum class serve_action : std::uint8_t {
  serve_hi,  ///< Its hi version is resident: use it.
  serve_lo,  ///< Its lo version is resident: use it now, no stall, at the quality price λ_q.
  wait,      ///< A version is on its way: wait for it.
  load_hi,   ///< Load the hi version on demand (a hi-set member, or a split without a lo tier).
  load_lo,   ///< Load the lo version on demand into the lo cache.
};
/// "serve-hi", "serve-lo", "wait", "load-hi", "load-lo".
[[nodiscard]] std::string_view to_string(serve_action a) noexcept;

/// What the runtime knows of one expert when a layer routes it.
struct expert_residency {
  bool hi_ready = false;   ///< The hi version is resident and complete.
  bool lo_ready = false;   ///< The lo version is resident and complete.
  bool in_flight = false;  ///< A transfer of one of its versions has started and not landed.
  bool member = false;     ///< It is in its layer's hi set (the controller wants it hi).
};

/// @brief The per-layer rule (issue 12: "serve a hi miss from a resident lo version or load lo"):
/// hi if resident; else the resident lo version (no stall, quality price); else wait for a
/// version in flight; else load on demand: hi when there is no lo tier, or for a hi-set member
/// (its promotion has not landed: "load hi by a rule") when @p members_load_hi, lo otherwise.
/// `expert_runtime` follows it: it serves a resident version of either tier, loads its demand tier
/// (hi for a split without a lo tier), and with `targets_load_hi` loads hi for a hi target.
[[nodiscard]] constexpr serve_action decide_serve(const expert_residency& s, bool lo_tier,
                                                  bool members_load_hi = true) noexcept {
  if (s.hi_ready) return serve_action::serve_hi;
  if (s.lo_ready) return serve_action::serve_lo;
  if (s.in_flight) return serve_action::wait;
  return !lo_tier || (s.member && members_load_hi) ? serve_action::load_hi : serve_action::load_lo;
}

/// One resize step of a burst decision: set @p pool to @p bytes.
struct pool_resize {
  tier_pool pool = tier_pool::hi;  ///< The pool.
  std::uint64_t bytes = 0;         ///< Its new size.
  /// Equal when both fields are.
  friend bool operator==(const pool_resize&, const pool_resize&) = default;
};

/// @brief What four_pool_controller::step() decided at a burst's drained barrier.
struct four_pool_decision {
  four_pool_split split;             ///< The split to apply now (the current one when nothing moves).
  four_pool_split target;            ///< The predicted-cost minimiser over the admissible splits.
  double current_cost = 0.0;         ///< Predicted cost of the current split, seconds over the window.
  double target_cost = 0.0;          ///< Predicted cost of the target.
  double current_hi_coverage = 1.0;  ///< Predicted share of activations served hi, current split.
  double target_hi_coverage = 1.0;   ///< The same for the target.
  /// Seconds saved per byte by one more slot (block) of each pool at the current split, the others
  /// fixed, indexed by tier_pool: the one unit in which the equimarginal rule compares the pools.
  std::array<double, 3> marginal_seconds_per_byte{};
  bool moved = false;  ///< True when split differs from the current split.
  /// Hi-set members a hi shrink drops, coldest first: hand them to the runtime as `absent`
  /// targets before the resize (to_targets()).
  std::vector<expert_id> hi_evictions;
  /// The resizes in order (WiSP §3.5 extended to three pools): every shrinking pool first, so the
  /// transient footprint never exceeds B, then the growing pools, most valuable per byte first.
  std::vector<pool_resize> steps;
  /// hi_evictions as `absent` targets (`expert_runtime::target` is residency_target).
  [[nodiscard]] std::vector<residency_target> to_targets() const;
};

/// @brief The knobs of the four-pool controller.
///
/// The burst-level defaults are those tuned for the two-pool online split (split_sim.hpp's
/// online_split_options) and checked on problem 0 of the Mixtral trace (docs/control.md); the hot
/// set's are hot_set_config's.
struct four_pool_config {
  /// The hi set's hysteresis (decay, margin, rank slack, promotions per layer per interval); its
  /// dimensions, hi_per_layer and hi_bytes are set by the controller from the model and split.
  hot_set_config hot{};
  double decay = 0.8;  ///< γ of the expert histograms (the hi set's rank, the lo pool's), per burst, (0, 1].
  /// γ_KV of the KV histogram and of the change detector's average, per burst, (0, 1]. With
  /// γ_KV = γ = 0.8 the KV histogram forgot the idle long-context sessions' far reuses within a
  /// quiet stretch of a few bursts, and the controller moved their KV to the experts just before
  /// they returned (two reversals on problem 0's long-context at floor + 3 slots; every γ_KV from
  /// 0.85 to 0.95 gives the same figures there). Not the split controller's 0.9: the decayed sums
  /// of histograms with different γ cover windows of different lengths (1/(1 − γ) bursts), so the
  /// further γ_KV is from γ the more the KV sum weighs against the expert ones; at 0.9 a
  /// synthetic stationary input reverses once (docs/control.md).
  double kv_decay = 0.85;
  double gate = 0.05;           ///< Move only when the predicted gain exceeds this share of the current cost, [0, 1).
  double reversal_gate = 0.30;  ///< The gate of a move against the previous one, [gate, 1).
  /// Noise gate z, [0, ∞): a move also needs its predicted gain above z standard deviations of
  /// the gain's estimate, the decayed counts read as Poisson (online_split_config::noise_gate,
  /// the same rule; terms of two different histograms count whole, their shared events twice).
  /// A move made on a few bursts' counts sets the direction the reversal gate then defends: with
  /// defaults and no noise gate, 1 of 400 stationary synthetic runs returned to a split it had
  /// left, none with z = 3 (docs/control.md). Where the target is not significant, a rate-limited
  /// step whose own gain is still goes. On the Mixtral trace the counts are large: z = 3 delayed
  /// the first move by a burst in two runs, and moved no other figure. 0: off.
  double noise_gate = 3.0;
  /// Most slots per layer each expert pool moves per burst, ≥ grid_step (a mode change goes at once).
  std::uint32_t rate_limit = std::numeric_limits<std::uint32_t>::max();
  std::uint32_t dead_zone = 1;  ///< Never move toward a target within this many slots in both pools, ≥ 1.
  std::uint32_t grid_step = 1;  ///< Candidate H and L every grid_step slots (admissible_splits()), ≥ 1.
  /// Bursts the histograms see before the first move. Estimates from one or two bursts swing, and
  /// a move made on them sets the direction the reversal gate then defends; but on the Mixtral
  /// trace waiting costs more than it saves (3 bursts: +2 points over the grid on problem 0), so
  /// the default moves at once.
  std::uint32_t settle_bursts = 0;
  /// KV histogram bins over the budget's blocks; 0: exact (one block per bin) up to 2^22 blocks.
  std::uint32_t kv_bins = 0;
  /// A static split: the hi set still follows the traffic per interval, but no curves are kept and
  /// step() never moves (the grid oracle's points run through this).
  bool frozen = false;
  /// The session-mix change detector's ratio (session_mix_detector, as online_split_config's):
  /// when the open sessions' KV footprint given to set_kv_open_depths() falls below its decayed
  /// average over it, the KV histogram keeps change_keep of its history and moves are tentative
  /// (set no direction) for ⌈1/(1 − γ_KV)⌉ bursts. 0: off; else > 1. With 3 (the split
  /// controller's), problem 0's phase shifts cost 3–5 points less against the best static split
  /// and its stationary figures are unchanged (docs/control.md).
  double change_ratio = 3.0;
  double change_keep = 0.0;  ///< Share of the KV histogram kept at a detected change, [0, 1].
};

/// Totals of a four_pool_controller since construction.
struct four_pool_statistics {
  std::uint64_t bursts = 0;  ///< new_burst() calls.
  std::uint64_t moves = 0;   ///< Decisions committed as applied that changed the split.
  /// Of those, moves against the previous move's direction (last_move()): a move in the tentative
  /// period after a session-mix change is never one, nor is the first move after it.
  std::uint64_t reversals = 0;
  std::uint64_t failed_resizes = 0;  ///< Decisions committed as not applied (the previous split stayed).
  std::uint64_t mix_changes = 0;     ///< Session-mix changes detected (four_pool_config::change_ratio).
  /// Writes every counter as one JSON object: `{"bursts":…,"moves":…,"reversals":…,"failed_resizes":…,
  /// "mix_changes":…}`.
  void write_json(std::ostream& out) const;
};

/// @brief The four-pool controller as a pure decision object.
///
/// **Per layer** (serve(), decide_serve()): hi if resident, else a resident lo version, else wait
/// for one in flight, else load: hi for a hi-set member, lo otherwise (hi when the split has no lo
/// tier).
///
/// **Per interval** (end_interval()): the hi set of every layer is DynaExq's EMA top-n with
/// hysteresis (hot_set_controller, §3.5) with n_hi = H in a tiered split and 0 without a lo tier;
/// demotions go to the lo tier (resident_lo), promotions to resident_hi, in that order. The lo
/// tier's residency is the runtime's LRU over lo versions (demand-filled, and filled by demotions).
///
/// **Per burst** (step(), commit()): the split of B over hi, lo and KV bytes. The predicted cost of
/// an admissible split (WiSP Eq. 4 [R] with three pools and a quality term) is
///
///     hi-only:  T = t_hi·M̂_0(H)                          + τ_r·b·M̂_KV(n)
///     tiered:   T = t_lo·M̂_H(L) + λ_q·Â(H)               + τ_r·b·M̂_KV(n)
///
/// with n = ⌊(B − H·N·s_hi − L·N·s_lo)/S_b⌋ and, from decayed histograms (decay γ per burst for
/// the expert ones, γ_KV for the KV one; warm reuses only, WiSP App. B decisions 1–2):
/// - Â(H): activations whose expert ranks at or below H in its layer by the hot set's hotness S
///   when routed, i.e. those a top-H hi set serves at lo (the rank is the "distance" of a
///   decayed_reuse_histogram, so Â(H) = its predicted misses at H);
/// - M̂_H(L): warm lo-cache misses with L slots when the top-H experts are hi: the per-layer LRU
///   stack distance of each access counted over the experts that rank ≥ H only (an exact LRU miss
///   curve of the stream the lo cache sees, WiSP Eq. 3, one histogram per H; M̂_0 is the plain
///   per-layer curve the hi-only pager sees);
/// - M̂_KV(n): the KV block stream's warm LRU misses (fed by the caller through kv()).
/// The interior optimum equalises the seconds saved per byte of the three pools (Eq. 5 extended:
/// marginal_seconds_per_byte); like WiSP's online step (App. B decision 3, UCP's lookahead) the
/// controller evaluates T at every admissible split instead, which is exact for the non-convex
/// curves that bimodal reuse gives, and takes the minimiser subject to the KV floor (Eq. 6) and the
/// coverage constraint. It moves toward it only when the gain exceeds gate·T(current) (reversal_gate
/// against the previous direction, the direction being that of the KV pool, else of the hi pool), when
/// the target is at least dead_zone slots away, and by at most rate_limit slots per pool (a target
/// further away: of the admissible splits within the limit that move the target's way (its KV pool, and
/// nearer in slots), those that cost less than the current one first (when none does, a miss-curve
/// cliff lies between, and the step is taken all the same, as WiSP's rate limit only caps it), then one
/// that does not pass the target's KV pool, then the cheapest; none, no move; a change of mode goes at
/// once; rate_limit ≥ grid_step, so that a candidate lies within it). A step toward the target of the
/// last move goes on with that move: the plain gate, and no reversal, even when it comes back over the
/// target's KV pool (no step within the limit may reach the target without passing it). The resize
/// steps shrink every losing pool before any pool grows (WiSP §3.5, three pools), and a resize the
/// runtime refuses leaves the previous split in force (D3, commit(decision, false)).
///
/// Costs: record() O(E) per expert; step() O(candidates · E + KV bins); memory O(N·E + E² + KV bins).
///
/// @code
/// expage::four_pool_controller c(model, {}, expage::make_four_pool_split(model, 6, 0));
/// for (step ...) {
///   if (start_of_burst) c.new_burst();  // first: the burst's barrier then sees it (settle_bursts counts it)
///   for (layer ...) {
///     const auto action = c.serve({.hi_ready = rt.is_hi(id), .lo_ready = rt.is_lo(id), ...});
///     ...
///     c.record(layer, routed);
///   }
///   for (auto d : kv_reuse_distances) c.kv().record(d);
///   if (end_of_interval) rt.update_targets(c.end_interval());
///   if (end_of_burst) {                                 // a drained barrier
///     const auto d = c.step();
///     bool ok = true;
///     if (d.moved) {
///       // resize_tiers() and the KV pool's resize in order, the dropped members' evictions
///       // (d.to_targets()) just before the experts' resize; a refused step undoes the ones
///       // applied and hands those members back as resident_hi (four_pool_driver does all this)
///       ok = apply_in_order(d.steps, [&] { rt.update_targets(d.to_targets()); });
///       c.commit(d, ok);
///     }
///   }
/// }
/// @endcode
/// @threadsafety single-owner.
class four_pool_controller {
 public:
  /// A controller with the split @p initial in force, empty histograms and an empty hi set.
  /// @throws expage::invalid_argument for a bad model or config (naming the field and its range),
  ///         or an initial split that is not admissible.
  four_pool_controller(const four_pool_model& model, const four_pool_config& config, four_pool_split initial);

  // ---- per layer -------------------------------------------------------------------------------

  /// decide_serve() with the split in force and the model's members_load_hi.
  [[nodiscard]] serve_action serve(const expert_residency& s) const noexcept {
    return decide_serve(s, current_.tiered(), model_.members_load_hi);
  }
  /// Counts one layer's routing: the hot set's counters, and (unless frozen) the expert curves.
  /// @throws expage::invalid_argument naming a layer or expert out of range; nothing is counted then.
  void record(std::uint32_t layer, std::span<const expert_index> experts);
  /// The KV block stream's histogram: record each warm KV block reuse distance into it.
  [[nodiscard]] decayed_reuse_histogram& kv() noexcept { return kv_; }
  /// @brief The LRU stack depths (0 = most recently read) of the KV blocks that belong to
  /// sessions still open, idle ones waiting on a tool included (empty: unknown); an open block
  /// never read counts below the deepest open one read (open_block_depths()).
  ///
  /// A session-aware engine knows them (which conversations are open, and each block's last read);
  /// each such block deeper than a pool of n blocks will be recomputed when its session returns, so
  /// the predicted KV misses at n become max(M̂_KV(n), #{depths ≥ n}). The decayed histogram sees a
  /// session's far reuse only after it happened (and was recomputed); this term sees it as soon as
  /// the context is written [not in WiSP; docs/control.md]. Kept until the next call.
  /// @throws expage::invalid_argument when @p depths is not sorted ascending.
  void set_kv_open_depths(std::vector<std::uint64_t> depths);

  // ---- per interval ----------------------------------------------------------------------------

  /// Ends a hot-set interval (hot_set_controller::end_interval()) and returns the targets for
  /// `update_targets()`, in priority order: the interval's demotions (resident_lo), its promotions
  /// (resident_hi), then every other member of the hi set (resident_hi). Every member is listed,
  /// so the list also suits `set_targets()` for the hi set (a member already hi is a no-op);
  /// update_targets() also keeps an earlier interval's demotion that is still queued. None
  /// without a lo tier.
  [[nodiscard]] std::vector<residency_target> end_interval();

  // ---- per burst -------------------------------------------------------------------------------

  /// Starts a burst: decays every histogram by γ. Call it before the burst's records, so that the
  /// burst's barrier counts it (a step() after no new_burst() sees bursts() == 0 and never moves
  /// while settle_bursts, 0 by default, is not exceeded).
  void new_burst() noexcept;
  /// Decides the burst's split (pure: nothing changes until commit()).
  [[nodiscard]] four_pool_decision step() const;
  /// Records the outcome of applying @p decision: on success its split is in force (the hi set is
  /// resized to it); on failure the previous split stays (WiSP D3) and the failure is counted.
  /// @throws expage::invalid_argument when @p applied and the decision's split is not admissible
  ///         (nothing changes).
  void commit(const four_pool_decision& decision, bool applied);

  /// The predicted cost of @p split (seconds over the histograms' window). @pre admissible.
  [[nodiscard]] double predicted_cost(const four_pool_split& split) const;
  /// The predicted share of activations served hi with @p split (1 while nothing was recorded).
  [[nodiscard]] double predicted_hi_coverage(const four_pool_split& split) const;

  /// The split in force.
  [[nodiscard]] const four_pool_split& current() const noexcept { return current_; }
  /// The model.
  [[nodiscard]] const four_pool_model& model() const noexcept { return model_; }
  /// The admissible splits it chooses among.
  [[nodiscard]] std::span<const four_pool_split> candidates() const noexcept { return candidates_; }
  /// The hi-set controller.
  [[nodiscard]] const hot_set_controller& hot_set() const noexcept { return hot_; }
  /// Totals since construction.
  [[nodiscard]] const four_pool_statistics& statistics() const noexcept { return stats_; }
  /// The direction of the last applied move: +1 when the KV pool grew (or, KV unchanged, the hi
  /// pool grew), −1 when it shrank; 0 before any move, and after a detected session-mix change
  /// until the tentative period ends (its moves set no direction).
  [[nodiscard]] int last_move() const noexcept { return last_move_; }

 private:
  [[nodiscard]] double kv_cost(std::uint64_t blocks) const;
  [[nodiscard]] double expert_cost(std::uint32_t hi, std::uint32_t lo) const;
  // The variance of predicted_cost(a) − predicted_cost(b) (the noise gate's).
  [[nodiscard]] double gain_variance(const four_pool_split& a, const four_pool_split& b) const;

  four_pool_model model_;
  four_pool_config config_;
  std::vector<four_pool_split> candidates_;
  four_pool_split current_;
  hot_set_controller hot_;
  decayed_reuse_histogram rank_;                   // Â: the rank of each activation's expert
  std::vector<decayed_reuse_histogram> filtered_;  // M̂_H for H = 0..E: distances among experts of rank ≥ H
  decayed_reuse_histogram kv_;
  std::vector<expert_index> stacks_;           // per layer (E entries each), most recent first
  std::vector<std::uint32_t> depth_;           // per layer: entries of its stack in use
  std::vector<std::uint32_t> rank_of_;         // scratch: rank of every expert of one layer
  std::vector<std::uint32_t> above_;           // scratch: ranks above an access in its stack
  std::vector<std::uint64_t> kv_open_depths_;  // ascending
  four_pool_statistics stats_;
  int last_move_ = 0;
  std::optional<four_pool_split> heading_;  // the target of the last applied move
  session_mix_detector mix_;
};

}  // namespace expage
