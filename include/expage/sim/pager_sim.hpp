/// @file
/// @brief simulate(): a deterministic discrete-event model of paged MoE decoding that measures
/// stall, not just misses.
///
/// What an engine pays for a miss is time, and whether a decision pays depends on
/// r = t_transfer / t_layer (hardware_profile.hpp). The simulator runs an access_stream (one
/// group per layer of each forward pass, routing known at the layer's start) against a slot
/// cache, a serial link per backend and a compute clock:
///
/// - at group g's start (time `now`) the link catches up: queued prefetches start only in idle
///   link time before `now`; a transfer in flight is never preempted (PreScope premise 3);
/// - every routed expert is pinned; a resident one is a hit; one whose prefetch is in flight is
///   a *late prefetch* (wait for it); a queued prefetch is promoted to a demand load; any other is
///   a demand miss, loaded at once on the link that finishes it first, ahead of every queued
///   prefetch (demand before prefetch);
/// - the layer computes when its last expert is ready, for the roofline time of its group
///   (cost_model); its stall is (ready − now), attributed to the critical expert's cause;
/// - then the prefetcher (if any) proposes experts for later layers; admitted ones take a slot at
///   once (reserved through a budget_tracker account, so the budget holds at every instant, in-flight
///   copies included) and queue behind the demand loads.
///
/// Exactness: with compute free (calibration 0), one link without setup and no prefetcher the miss
/// counts equal replay()'s for every policy and the stall equals replay()'s model
/// (bytes / bandwidth / tokens), cell for cell (tests/sim/pager_sim_test.cpp).
#pragma once

#include "expage/cache/replay.hpp"
#include "expage/cache/slot_cache.hpp"
#include "expage/core/expert_id.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/core/precision.hpp"
#include "expage/core/units.hpp"
#include "expage/predict/expert_predictor.hpp"
#include "expage/sim/hardware_profile.hpp"

#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace expage {

/// Why a layer waited.
enum class stall_cause : std::uint8_t {
  demand_miss,             ///< Loading experts that were neither resident nor on their way.
  late_prefetch,           ///< A prefetch of a needed expert was still in flight.
  queued_behind_prefetch,  ///< A demand load waited for a prefetch transfer occupying its link.
  /// A resize barrier waited for the transfers in flight to land (simulate()); in tier_simulate()
  /// also the drains of its burst barriers. (Waits behind the hi set's background transfers are
  /// the tier simulator's late_prefetch and queued_behind_prefetch.)
  resize,
};
/// The number of stall causes.
inline constexpr std::size_t stall_cause_count = 4;
/// "demand-miss", "late-prefetch", "queued-behind-prefetch", "resize".
[[nodiscard]] std::string_view to_string(stall_cause c) noexcept;

/// @brief One expert a prefetcher wants brought in ahead of use.
struct prefetch_request {
  std::uint32_t layer = 0;          ///< Its layer.
  expert_index expert = 0;          ///< Its index in the layer.
  std::uint64_t use_group = never;  ///< The group (access_stream index) it is predicted for; `never`: unknown.
  float probability = 1.0F;         ///< The predictor's confidence, for admission rules.
};

/// @brief What proposes prefetches: predictors plug in here (docs/simulator.md).
///
/// propose() is called once per group, after the group's routing is known and its demand loads
/// are issued. An online predictor may read the stream up to and including group @p g (the
/// routing seen so far); only oracles (which exist to bound what prediction can buy) read beyond.
class prefetcher {
 public:
  virtual ~prefetcher() = default;
  /// A short name for reports.
  [[nodiscard]] virtual std::string name() const = 0;
  /// Restarts for a new run (simulate() calls it first).
  virtual void reset() = 0;
  /// Appends to @p out the experts to prefetch after group @p g, most wanted first.
  virtual void propose(const access_stream& stream, std::size_t g, std::vector<prefetch_request>& out) = 0;
  /// Optional: after propose() for a group, writes into @p probability (experts_per_layer
  /// entries) the probability that each expert of @p layer, a later layer of the same pass, is
  /// routed there; returns false when it forecasts nothing for that layer (the default). The
  /// simulator's prefetch-aware eviction reads it (sim_options::forecast_eviction).
  /// The two prefetchers here throw expage::invalid_argument when they forecast @p layer and
  /// @p probability does not have experts_per_layer entries.
  [[nodiscard]] virtual bool forecast(std::uint32_t layer, std::span<float> probability) const {
    static_cast<void>(layer);
    static_cast<void>(probability);
    return false;
  }
};

/// @brief The (noisy) oracle: the experts of the next `distance` groups, each kept with
/// probability `recall` and otherwise replaced by a random expert of the same layer that is not
/// routed there (a false positive of the same layer, so precision = recall on average; higher
/// where a layer's routed union leaves fewer unrouted experts than it has misses, as lockstep
/// batches can: no false positive is drawn where none is left).
///
/// Recall 1 is the perfect predictor: what perfect prediction buys under the admission rule
/// and eviction policy it runs with, not a lower bound on stall. An admitted prefetch reserves
/// its slot and evicts its victim when it is queued, so where transfers are slow (high r) queued
/// prefetches shrink the demand cache, and Belady with perfect prefetch can stall more than
/// Belady demand loading (a review saw it in 1,714 of 7,723 random cells, up to 3.7×; at r = 30
/// one case made 129 loads against 62). Recall 0.8–0.97 stands for hidden-state predictors of
/// published quality (control-layer notes, E5 and B1).
class oracle_prefetcher final : public prefetcher {
 public:
  /// @throws expage::invalid_argument when @p distance is 0 or above 64, or @p recall is not in [0, 1].
  oracle_prefetcher(std::uint32_t distance, double recall, std::uint64_t seed = 1);
  [[nodiscard]] std::string name() const override;
  void reset() override;
  void propose(const access_stream& stream, std::size_t g, std::vector<prefetch_request>& out) override;
  /// Its proposals for @p layer at probability `recall`, the other experts sharing the routed
  /// ones it missed: (1 − recall) · n / (E − n) each, for n proposed of E.
  [[nodiscard]] bool forecast(std::uint32_t layer, std::span<float> probability) const override;

 private:
  std::uint32_t distance_;
  double recall_;
  std::uint64_t seed_;
  // The distinct experts of every group of h's layer-step (cached for the last step asked).
  std::span<const expert_index> step_experts(const access_stream& stream, std::size_t h);

  std::vector<std::uint8_t> routed_;            // scratch: experts routed in (or proposed for) the target step
  const access_stream* step_stream_ = nullptr;  // step_experts()'s cache: its stream, step and experts
  std::pair<std::size_t, std::size_t> step_events_{};
  std::vector<expert_index> step_experts_;
  // The last propose()'s targets: their layers and proposed experts.
  std::vector<std::uint32_t> target_layers_;
  std::vector<std::vector<expert_index>> target_experts_;
};

/// @brief Parameters of a predictive_prefetcher.
struct predictive_prefetch_options {
  std::uint32_t distance = 1;   ///< Layers ahead of the current one to prefetch for, [1, 64].
  float threshold = 0.5F;       ///< Admit only experts predicted with at least this probability, [0, 1].
  std::uint32_t per_layer = 0;  ///< At most this many per target layer; 0: the geometry's top-k.
  /// Layers ahead it forecasts for prefetch-aware eviction (prefetcher::forecast()); 0: `distance`.
  /// A forecast of the next layer alone is used up before that layer's demand loads, so it ranks
  /// prefetch victims only; a longer one also ranks demand victims. [0, 64], at least `distance`.
  std::uint32_t forecast_distance = 0;
  /// The trace the stream was built from, when it carries router probabilities or sketches
  /// (trace_fields): the predictor then sees them (expert_predictor::observe_routing()), for a
  /// lockstep batch the mean of the step's vectors. Null: the experts only. Not owned; propose()
  /// throws expage::invalid_argument when a group's events lie beyond it (another trace).
  const routing_trace* trace = nullptr;
};

/// @brief A prefetcher driven by an expert_predictor: after each group it tells the predictor
/// the group's routing and proposes, for each of the next `distance` layers of the same pass,
/// the most probable experts whose probability reaches the threshold, most probable first.
///
/// It reads of the stream only the routing up to the current group and the *layer sequence* of
/// the pass (which group computes which layer), never later routing.
class predictive_prefetcher final : public prefetcher {
 public:
  /// @throws expage::invalid_argument for a null predictor or options out of range.
  predictive_prefetcher(std::unique_ptr<expert_predictor> predictor, predictive_prefetch_options options);
  [[nodiscard]] std::string name() const override;
  void reset() override;
  /// @throws expage::invalid_argument at the first group of a pass when the predictor is built
  ///         for another shape (layers × experts per layer) than @p stream's.
  void propose(const access_stream& stream, std::size_t g, std::vector<prefetch_request>& out) override;
  /// The predictor's probabilities for @p layer when it is one of the last propose()'s targets.
  [[nodiscard]] bool forecast(std::uint32_t layer, std::span<float> probability) const override;

 private:
  std::unique_ptr<expert_predictor> predictor_;
  predictive_prefetch_options options_;
  std::vector<float> probability_;  // [target][expert] of the last propose()
  std::vector<std::uint32_t> target_layers_;
  std::vector<float> mean_probabilities_, mean_sketch_;  // a lockstep step's fields
  std::vector<double> mean_sum_;                         // their sums
  std::vector<std::pair<float, expert_index>> ranked_;
};

/// How the simulator admits a proposed prefetch (after the slot, cap and victim-value checks).
enum class prefetch_admission : std::uint8_t {
  all,           ///< Every proposal (the ungated baseline).
  cost_benefit,  ///< PreScope's test (Eq. 6–7): issue only when the expected time saved exceeds the expected delay.
};

/// @brief A change of the slot count at a drained barrier (sim_options::capacity_schedule).
struct slot_resize {
  std::uint64_t pass = 0;      ///< The forward pass before whose first layer it applies.
  std::uint32_t capacity = 0;  ///< Slots per layer or in all from then on.
};

/// @brief Simulation parameters.
struct sim_options {
  cache_layout layout = cache_layout::global;                     ///< Per-layer or global slots.
  std::uint32_t capacity = 0;                                     ///< Slots per layer or in all.
  precision format = precision::bf16;                             ///< Precision of the paged experts (bytes, roofline).
  hardware_profile hardware = hardware_profile::preset("pcie4");  ///< Links, bandwidth, calibration.
  std::optional<double> transfer_compute_ratio{};                 ///< r: rescale the links to it (make_cost_model).
  std::optional<std::uint64_t> dense_bytes_per_layer{};           ///< Non-expert bytes per layer; unset: estimated.
  prefetcher* prefetch = nullptr;                                 ///< Null: demand loading only.
  /// The admission rule for proposals. cost_benefit (PreScope Eq. 6–7, with f rounded up): with
  /// f = (idle link time before the expert is needed) / (its transfer time), estimated at issue as
  /// (groups until its use × nominal layer time − prefetch work queued ahead) / transfer time (the
  /// current layer's demand loads delay the use as much as the link), and p the
  /// predictor's probability, issue iff ξ = p·(f − ⌈f⌉ + 1) − (1 − p)·(⌈f⌉ − f) exceeds the
  /// victim's value, ξ being Eq. 7's price of the critical (last) transfer of a batch of ⌈f⌉.
  /// Each proposal is judged alone, with the work queued ahead taken from its gap, so it is the
  /// critical transfer only when it does not fit (f < 1, the bandwidth-bound regime: ⌈f⌉ = 1,
  /// issue only if p > 1 − f); one that fits (f ≥ 1) is among the ⌈f⌉ − 1 Eq. 7 issues whatever
  /// p, ξ = p. ⌈f⌉ rather than round(f): Eq. 7's terms are the fraction of the last transfer that
  /// fits and the fraction that does not, which needs ⌈f⌉ ≥ f (the paper's text says "nearest
  /// integer", which would make the first term exceed 1 or go negative).
  prefetch_admission admission = prefetch_admission::cost_benefit;
  /// The byte guard of cost_benefit admission: bytes moved (queued prefetches counted as if
  /// wasted; one in flight counts once, as moved) may exceed those of demand loading with `guard_baseline` by at most
  /// this share (plus one transfer), measured as the run goes against a shadow of that demand-only cache up to the
  /// current group (what a key-only shadow cache beside the real one knows online). Admission
  /// pauses while the bound would be crossed. +∞ turns it off. [0, +∞].
  double max_prefetch_overhead = 0.05;
  /// The stall guard of cost_benefit admission: pause prefetching while the stall so far exceeds
  /// the demand-only shadow's. With both guards a prefetcher cannot lose more than one transfer of
  /// bytes or one group of stall to demand loading before it is silenced, and resumes once demand
  /// loading would have lost as much.
  bool stall_guard = true;
  /// What the guards compare against: demand loading with this online policy (not Belady). LRU,
  /// the default, makes "never hurts" mean "never worse than plain LRU demand paging", so an
  /// eviction policy better than LRU (next_turn) earns credit the prefetcher may spend.
  policy_kind guard_baseline = policy_kind::lru;
  /// The eviction duel, a guard of cost_benefit admission for an eviction policy other than LRU:
  /// beside the real cache, demand-only shadows of the policy and of LRU count their misses; while
  /// LRU's shadow leads over the window (the last this-many forward passes and the current one so
  /// far; 0 turns the duel off), the real cache's victims are ranked in LRU order instead of by the
  /// policy, sparing the experts the prefetcher forecasts (forecast_eviction) at least
  /// `eviction_duel_protect` of being routed at their next turn. A policy that predicts well most
  /// of the time (next_turn) can still trail LRU over a stretch of the traffic; the stall and byte
  /// guards judge the prefetches, this one the eviction order they run on, so that "never worse
  /// than LRU demand loading" holds for both. Set dueling after DIP (Qureshi et al., ISCA 2007),
  /// with whole shadow caches instead of sampled sets. The rule is eviction_duel's
  /// (predict/eviction_duel.hpp). [0, eviction_duel::max_passes].
  std::uint32_t eviction_duel_passes = 0;
  /// LRU takes over when its shadow missed more than this many fewer expert loads than the
  /// policy's over the window, and hands back when it misses more than this many more. [0, +∞).
  double eviction_duel_margin = 2.0;
  /// While LRU ranks, experts forecast at least this likely to be routed at their next turn are
  /// kept (while another unpinned expert is left). [0, +∞]; above 1 spares none.
  double eviction_duel_protect = 0.5;
  /// Prefetch-aware eviction: while the prefetcher forecasts the layers ahead
  /// (prefetcher::forecast()), a policy that can rank by a forecast (next_turn_policy) ranks each
  /// forecast expert by its predicted next use given the forecast (next_turn_policy::next_use),
  /// for demand and prefetch evictions alike, so experts predicted for the layers about to run
  /// are kept and those predicted unused there go first; and the victim-value check also refuses
  /// a prefetch whose victim's predicted next use is no later than the newcomer's. Off: the
  /// policy ranks by its own history and the check looks only at prefetched experts.
  bool forecast_eviction = true;
  /// PreScope's hot-expert table (hot_expert_table()): flat expert indices (layer · E + expert),
  /// hottest first, made resident before the first layer, as many as each scope has slots, the
  /// hottest most recently inserted. Loaded before decoding starts: no stall, and their bytes are
  /// reported apart (sim_result::preload_bytes), not in bytes_moved(). The guards' shadow runs
  /// without it (the baseline is plain demand loading). Each index below layers × experts.
  std::vector<std::uint64_t> initial_residency{};
  /// Most prefetches queued or in flight at once; 0: capacity − the stream's largest group (the
  /// most that still leaves a whole group room to load on demand: a prefetch never takes the slot
  /// a demand load needs).
  std::uint32_t max_outstanding_prefetches = 0;
  /// Resizes of the slot pool, in increasing pass order (the expert side of an MV-WSA split,
  /// WiSP §3.5). Each fires at a drained barrier before its pass: the layer waits until every
  /// transfer in flight has landed (stall charged to stall_cause::resize), queued prefetches are
  /// cancelled, a shrink evicts the policy's victims until each scope fits (a re-page from the
  /// host master later, no transfer now) and the budget accounts follow, shrunk after the
  /// evictions and grown before the new slots are used, so the budget holds at every instant.
  /// Every capacity obeys the same range as `capacity`.
  std::vector<slot_resize> capacity_schedule{};
};

/// @brief Per-layer figures of a simulation.
struct layer_sim_statistics {
  std::uint64_t accesses = 0;  ///< Expert requests at the layer.
  std::uint64_t hits = 0;      ///< Resident, or a prefetch already on its way.
  std::uint64_t misses = 0;    ///< Demand loads.
  double stall_seconds = 0.0;  ///< Time the layer waited for experts.
};

/// @brief Distribution of stall per forward pass (per token at batch 1).
struct stall_distribution {
  double mean = 0.0;  ///< Seconds.
  double p50 = 0.0;   ///< Seconds.
  double p99 = 0.0;   ///< Seconds.
};

/// @brief What a simulation measured.
struct sim_result {
  policy_kind policy = policy_kind::lru;       ///< Eviction policy.
  std::string prefetcher = "none";             ///< The prefetcher's name.
  cache_layout layout = cache_layout::global;  ///< Per-layer or global slots.
  std::uint32_t capacity = 0;                  ///< Slots per layer or in all.
  precision format = precision::bf16;          ///< Precision of the paged experts.
  std::string hardware;                        ///< Profile name.
  double transfer_seconds = 0;                 ///< One expert over the fastest link.
  double layer_seconds = 0;                    ///< Nominal layer compute time (top-k experts).
  double ratio = 0;                            ///< transfer_seconds / layer_seconds (∞ when compute is free).
  std::uint64_t expert_bytes = 0;              ///< Bytes of one paged expert.

  std::uint64_t tokens = 0;         ///< Distinct (sequence, step) pairs.
  std::uint64_t passes = 0;         ///< Forward passes.
  std::uint64_t groups = 0;         ///< Access groups (layer-steps, split ones counted per part).
  std::uint64_t accesses = 0;       ///< Expert requests.
  std::uint64_t hits = 0;           ///< Requests found resident or in flight.
  std::uint64_t demand_misses = 0;  ///< Requests loaded on demand (compulsory included).
  std::uint64_t compulsory = 0;     ///< Distinct experts requested.
  std::uint64_t evictions = 0;      ///< Loads (demand or prefetch) that displaced an expert.

  std::uint64_t prefetches_issued = 0;         ///< Admitted prefetches (a slot reserved).
  std::uint64_t prefetches_used = 0;           ///< Prefetched experts requested before eviction.
  std::uint64_t prefetches_late = 0;           ///< Of those, requested while still in flight.
  std::uint64_t prefetches_promoted = 0;       ///< Queued prefetches turned into demand loads before starting.
  std::uint64_t prefetches_wasted = 0;         ///< Transferred, then evicted unused.
  std::uint64_t prefetches_cancelled = 0;      ///< Dropped from the queue unstarted (stale).
  std::uint64_t prefetches_refused = 0;        ///< Proposals refused (no slot, cap, or a more valuable victim).
  std::uint64_t prefetch_victim_refaults = 0;  ///< Demand misses on experts a prefetch evicted less than a pass before.
  std::uint64_t duel_lru_groups = 0;           ///< Groups in which the eviction duel ranked victims in LRU order.
  std::uint64_t duel_switches = 0;             ///< Times the eviction duel changed sides.
  /// The longest a demand load waited for its link behind prefetch work, seconds: at most the
  /// rest of one transfer (a prefetch starts only in idle link time and is never preempted; a
  /// queued one never goes ahead of a demand load).
  double longest_wait_behind_prefetch = 0.0;

  std::uint64_t preload_bytes = 0;                        ///< Bytes of sim_options::initial_residency, before decoding.
  std::uint64_t demand_bytes = 0;                         ///< Bytes moved by demand loads.
  std::uint64_t prefetch_bytes = 0;                       ///< Bytes moved by prefetches (started ones).
  std::array<double, stall_cause_count> stall_seconds{};  ///< Total stall by cause.
  double compute_seconds = 0;                             ///< Total compute time.
  double elapsed_seconds = 0;                             ///< Modelled time from the first layer to the last one's end.
  stall_distribution per_pass;                            ///< Stall per forward pass.
  std::uint64_t budget_peak_bytes = 0;  ///< High-water mark of the slot budget (in-flight loads included).
  /// Loads the slot budget refused though the slot count allowed them: 0 in a correct run (the
  /// budget refuses past its capacity, so budget_peak_bytes alone cannot show an over-commit).
  std::uint64_t invariant_violations = 0;
  std::uint64_t resizes = 0;                 ///< Capacity changes applied (sim_options::capacity_schedule).
  std::uint64_t resize_evictions = 0;        ///< Experts a shrink evicted.
  std::vector<double> pass_stalls;           ///< Stall of every forward pass, seconds, in order.
  std::vector<layer_sim_statistics> layers;  ///< Per MoE layer.

  /// Bytes moved by demand loads and prefetches.
  /// demand_bytes + prefetch_bytes. @throws expage::invalid_argument past 2^64 − 1 (add_bytes()).
  [[nodiscard]] std::uint64_t bytes_moved() const {
    return add_bytes(demand_bytes, prefetch_bytes, "pager_sim: bytes moved");
  }
  /// Total stall, all causes, seconds.
  [[nodiscard]] double stall_total() const noexcept {
    double s = 0;
    for (const double x : stall_seconds) s += x;
    return s;
  }
  /// demand_misses / accesses.
  [[nodiscard]] double miss_ratio() const noexcept {
    return accesses == 0 ? 0.0 : static_cast<double>(demand_misses) / static_cast<double>(accesses);
  }
  /// Total stall / tokens (replay()'s unit).
  [[nodiscard]] double stall_seconds_per_token() const noexcept {
    return tokens == 0 ? 0.0 : stall_total() / static_cast<double>(tokens);
  }
  /// (compute + stall) / tokens: the modelled time per output token of the MoE layers.
  [[nodiscard]] double seconds_per_token() const noexcept {
    return tokens == 0 ? 0.0 : (compute_seconds + stall_total()) / static_cast<double>(tokens);
  }
  /// Prefetch bytes moved per byte of prefetch that served a request (∞ when none did; 0 without prefetch).
  [[nodiscard]] double prefetch_bytes_per_useful_byte() const noexcept;
  /// Precision: used / issued prefetches (0 when none was issued).
  [[nodiscard]] double prefetch_precision() const noexcept {
    return prefetches_issued == 0 ? 0.0 : static_cast<double>(prefetches_used) / static_cast<double>(prefetches_issued);
  }
  /// Coverage (recall of the misses): used prefetches / (used prefetches + demand loads), the
  /// share of the transfers a request needed that a prefetch had started.
  [[nodiscard]] double prefetch_coverage() const noexcept {
    const std::uint64_t needed = prefetches_used + demand_misses;
    return needed == 0 ? 0.0 : static_cast<double>(prefetches_used) / static_cast<double>(needed);
  }
  /// Timeliness: the share of used prefetches that had landed when requested (0 when none was used).
  [[nodiscard]] double prefetch_timeliness() const noexcept {
    return prefetches_used == 0
               ? 0.0
               : static_cast<double>(prefetches_used - prefetches_late) / static_cast<double>(prefetches_used);
  }
};

/// Whether @p kind's policy can rank its victims by a prefetcher's forecast, so that
/// sim_options::forecast_eviction changes its runs (next-turn; any policy in the duel's LRU turns).
/// @throws expage::invalid_argument when @p kind is not a declared enumerator.
[[nodiscard]] bool ranks_forecasts(policy_kind kind);
/// Whether the eviction duel (sim_options::eviction_duel_passes) runs for @p kind: every policy
/// but LRU, which it would duel against itself.
[[nodiscard]] bool duels(policy_kind kind) noexcept;

/// Simulates @p stream with eviction policy @p policy.
/// A stream that split steps keeps its group limit's groups at every capacity (the split and tier
/// simulators build one stream at their smallest cap and run it at every cap, so that the groups
/// fit all of them); replay() refuses such a stream at another capacity.
/// @throws expage::invalid_argument for a geometry mismatch, a capacity out of range or below the
///         stream's group limit, an invalid hardware profile or ratio (make_cost_model), or enum
///         values out of range. Nothing is half-done: the prefetcher is only reset.
[[nodiscard]] sim_result simulate(const access_stream& stream, const moe_geometry& geometry, policy_kind policy,
                                  const sim_options& options);

/// @brief The oracles and bounds printed beside every result (same stream, capacity and hardware).
struct sim_bounds {
  double belady_demand_stall_per_token = 0;  ///< Belady eviction, demand loading only.
  std::uint64_t belady_demand_misses = 0;    ///< Its misses: no policy at this capacity misses fewer.
  /// Belady eviction + perfect prefetch 2 groups ahead, every proposal admitted: an oracle, not
  /// a bound (oracle_prefetcher: at high r it can stall more than belady_demand_stall_per_token).
  double oracle_prefetch_stall_per_token = 0;
  /// Link-time bound: (Belady's bytes / Σ link bandwidth − total compute)⁺ / tokens. No schedule
  /// at this capacity stalls less: it must move at least Belady's bytes, and can at best hide the
  /// link behind all of the compute.
  double bandwidth_lower_bound_per_token = 0;
  /// Hindsight-static top-n: the n = capacity − largest group most requested experts of each
  /// scope (chosen knowing the whole stream) resident from the start and never evicted, every
  /// other request loaded on demand and dropped after its group. The best any fixed residency
  /// (DynaExq's or llama.cpp's `--n-cpu-moe` kind) can do; free of compulsory misses, so it can
  /// beat Belady at large capacities.
  double hindsight_static_stall_per_token = 0;
  std::uint64_t hindsight_static_misses = 0;  ///< Its demand loads.
};

/// PreScope's hot-expert table (PreScope §4, "hot-expert table"; control-layer notes E6): every
/// expert of @p profile's geometry as a flat index (layer · E + expert), ranked by the tokens
/// routed to it in @p profile (an offline profile, e.g. other requests of the same workload),
/// ties to the smaller index. At initialisation an engine loads the first ones into the memory
/// left for experts (sim_options::initial_residency).
[[nodiscard]] std::vector<std::uint64_t> hot_expert_table(const routing_trace& profile);

/// Computes the bounds for @p options from an empty cache (its prefetcher and its
/// initial_residency are ignored: a run that starts from a preload is not bounded by them).
[[nodiscard]] sim_bounds simulate_bounds(const access_stream& stream, const moe_geometry& geometry,
                                         const sim_options& options);

}  // namespace expage
