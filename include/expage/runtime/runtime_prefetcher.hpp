/// @file
/// @brief runtime_prefetcher: an expert_predictor driving an expert_runtime's prefetch() entry
/// point (docs/prefetch.md, "In the runtime").
///
/// The engine tells it each layer's routing right after that layer's acquire(); it tells the
/// predictor, asks it for the next `distance` layers of the same forward pass, and requests the
/// most probable experts there through expert_runtime::prefetch(), one request per layer, most
/// probable first, at the priority of the layer's most probable one. The runtime does the rest as
/// it does for any prefetch: on its own stream, never ahead of a demand load, into a free slot or
/// in place of an idle expert, never waiting.
///
/// What keeps it from hurting in the runtime:
/// - **stale requests are dropped:** each call first cancels the requests not yet issued (they
///   were for this layer or are re-predicted now; while a guard pauses, nothing is requested
///   again, and the cancelled guesses for later layers are counted in `cancelled` too);
/// - **a byte guard with a shadow cache** (runtime_prefetch_options::max_overhead): beside the
///   runtime it keeps a key-only LRU cache of the runtime's capacity (its demand tier's), fed the
///   routing on_routed() sees, which counts what plain LRU demand loading would have loaded, in
///   bytes: each shadow miss at one load of the demand tier in force then. The runtime is charged
///   alike: its demand misses at that load's bytes, plus the bytes of the prefetches it issued
///   (`charged_bytes`). While that exceeds (1 + share) × the shadow's plus one load, it requests
///   nothing, and resumes once demand loading would have loaded as much. (Bytes, not experts: on
///   a two-tier runtime whose demand tier changes, a hi load and a lo one are not the same cost.
///   A demand miss is charged at the demand tier's size even when it loads the other tier, as a
///   hot-set target's miss does with `targets_load_hi`: that choice is the controller's, not the
///   prefetcher's, and the shadow makes it too.) Unlike counting wasted prefetches, this also
///   charges the demand misses on experts a prefetch evicted (the refaults), as the simulator's
///   guard does
///   (within_prefetch_overhead(), sim/pager_sim.hpp). After a resize the shadow starts again at
///   the new capacity, empty (its misses so far kept).
/// - **a stall guard** (runtime_prefetch_options::stall_passes, stall_margin): while the
///   runtime's demand misses over the last `stall_passes` forward passes and the current one
///   exceed those of the same LRU shadow by more than `stall_margin`, it requests nothing. A
///   demand miss is the runtime's stall (the compute stream waits on its load; a prefetch uses
///   idle link time), so this is the simulator's stall guard (sim_options::stall_guard,
///   docs/prefetch.md guard 5) with demand misses for its modelled stall, over a window: paused,
///   an LRU runtime misses in step with its shadow, so a guard over all the misses so far would
///   never reopen after one bad stretch (a cold predictor's, say), where the window forgets it.
///   The byte guard alone lets a prefetcher spend its whole share on refaults: with LRU at a
///   capacity of one pass's experts, every prefetch evicts an expert of the pass under way (on
///   the Mixtral trace at 64 slots co-activation moved 1.05× LRU's loads, as allowed, with 4.3%
///   more demand misses).
///
/// - **an eviction duel** (runtime_prefetch_options::duel_passes), for a runtime whose policy is
///   a duel_policy (next_turn_policy wrapped, say): beside the LRU shadow it keeps a key-only
///   shadow of the runtime's own policy, both demand-only over the same routing, and feeds their
///   misses to an eviction_duel. While LRU's shadow has missed more than `duel_margin` fewer
///   experts over the last `duel_passes` passes and the current one, the runtime evicts in LRU
///   order (expert_runtime::rank_by_lru()), and back once it no longer leads. A predicting
///   policy that trails LRU for a stretch of traffic (next-turn early in a problem) then costs
///   no more than LRU there, prefetches and their refaults included (the simulator's
///   sim_options::eviction_duel_passes, the same rule). The duel owns the switch: its prefetcher
///   sets the policy's side at construction, and leaves the order as it is when destroyed.
///   Other policies: no duel.
///
/// Threading: one thread (the engine's, which calls acquire()) calls on_routed(); the runtime it
/// drives may be used by other threads meanwhile (prefetch(), resize() and statistics() lock).
/// The shadows are the prefetcher's own.
///
/// @code
/// expage::runtime_prefetcher prefetcher(runtime, expage::make_predictor("coactivation", 32, 8, 2));
/// for (std::uint32_t layer = 0; layer < 32; ++layer) {
///   auto lease = runtime.acquire(layer, routed[layer]);
///   prefetcher.on_routed(layer, routed[layer]);
///   launch(layer, lease);
/// }
/// @endcode
/// @threadsafety single-owner (on_routed() from the engine's thread).
#pragma once

#include "expage/cache/duel_policy.hpp"
#include "expage/cache/lru_policy.hpp"
#include "expage/cache/slot_cache.hpp"
#include "expage/core/error.hpp"
#include "expage/predict/eviction_duel.hpp"
#include "expage/predict/expert_predictor.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <utility>
#include <vector>

namespace expage {

namespace detail {
// The policy a runtime_prefetcher's duel shadows: a duel_policy's inner one (LRU elsewhere, unused).
template <class P>
struct duel_inner {
  using type = lru_policy;
};
template <lru_switchable_policy P>
struct duel_inner<P> {
  using type = typename P::inner_policy;
};
template <class P>
using duel_inner_t = typename duel_inner<P>::type;

// A key-only cache of @p P, demand loading of the routing on_routed() sees at the runtime's
// demand capacity now: after a resize it starts again at the new capacity, empty, its misses
// so far kept. Outside runtime_prefetcher: as its member template it crashed clang 14.
template <eviction_policy P>
struct shadow_cache {
  std::optional<slot_cache<P>> cache;
  std::uint64_t base = 0;    // misses of the caches before the last resize
  std::uint64_t misses = 0;  // over every capacity
  // Returns the misses of this group.
  std::uint64_t access(const moe_geometry& geometry, std::uint32_t capacity, std::uint32_t layer,
                       std::span<const std::uint32_t> experts) {
    if (!cache || cache->options().capacity != capacity) {
      if (cache) base += cache->statistics().misses;
      cache.emplace(geometry, slot_cache_options{.layout = cache_layout::global, .capacity = capacity});
    }
    // A group larger than the shadow (the runtime could not acquire it either) in parts.
    for (std::size_t i = 0; i < experts.size(); i += capacity) {
      static_cast<void>(cache->access(layer, experts.subspan(i, std::min<std::size_t>(capacity, experts.size() - i))));
    }
    const std::uint64_t before = misses;
    misses = base + cache->statistics().misses;
    return misses - before;
  }
};
}  // namespace detail

/// @brief Parameters of a runtime_prefetcher.
struct runtime_prefetch_options {
  std::uint32_t distance = 1;   ///< Layers ahead of the routed one to request for, [1, 64].
  float threshold = 0.0F;       ///< Request only experts predicted with at least this probability, [0, 1].
  std::uint32_t per_layer = 0;  ///< At most this many per target layer; 0: the geometry's top-k.
  /// The byte guard: request nothing while the runtime's loads (demand misses at the demand
  /// tier's load size, plus prefetch bytes) exceed (1 + this) × those of a key-only LRU shadow
  /// cache of the same capacity, plus one load of the demand tier. +∞ turns it off (and the
  /// shadow with it, when the stall guard is off too and no duel runs). [0, +∞].
  double max_overhead = 0.05;
  /// The stall guard's window in forward passes: request nothing while over the last this many
  /// passes and the current one the runtime's demand misses exceed the LRU shadow's by more than
  /// `stall_margin`; 0 turns it off. [0, eviction_duel::max_passes].
  std::uint32_t stall_passes = 64;
  /// The demand misses the runtime may exceed the LRU shadow's by over the stall guard's window.
  /// [0, +∞).
  double stall_margin = 1.0;
  /// The eviction duel's window in forward passes, for a runtime whose policy is a duel_policy
  /// (checked, but unused, for other policies); 0 turns it off. [0, eviction_duel::max_passes].
  std::uint32_t duel_passes = 16;
  /// The misses LRU's shadow must lead by to take the eviction order, and may trail by while it
  /// keeps it (eviction_duel's margin). [0, +∞).
  double duel_margin = 2.0;
};

/// @brief What a runtime_prefetcher did.
struct runtime_prefetch_statistics {
  std::uint64_t passes = 0;        ///< Forward passes seen (a layer before the previous one starts one).
  std::uint64_t layers = 0;        ///< on_routed() calls.
  std::uint64_t requested = 0;     ///< Experts requested through prefetch() (the runtime ignores resident ones).
  std::uint64_t paused = 0;        ///< on_routed() calls that requested nothing because of a guard.
  std::uint64_t stall_paused = 0;  ///< Of those, the calls the byte guard allowed and the stall guard did not.
  /// The stall guard's window: the runtime's demand misses less the LRU shadow's over the last
  /// stall_passes passes and the current one (0 with the guard off).
  std::int64_t stall_difference = 0;
  std::uint64_t cancelled = 0;  ///< Requests cancelled before the runtime issued them (stale, or dropped by a pause).
  std::uint64_t shadow_misses = 0;  ///< What the LRU shadow loaded on demand (0 with no guard and no duel).
  /// Their bytes: each miss at one load of the demand tier in force when it happened
  /// (runtime_demand::load_bytes, as the runtime's `bytes_loaded` counts its own).
  std::uint64_t shadow_bytes = 0;
  /// The runtime's side of the byte guard: its demand misses, each at one load of the demand
  /// tier in force at the on_routed() that saw it, plus its prefetch bytes, since this began.
  std::uint64_t charged_bytes = 0;
  std::uint64_t policy_shadow_misses = 0;  ///< What the duel's shadow of the runtime's policy loaded (0: no duel).
  std::uint64_t duel_switches = 0;         ///< Changes of the runtime's eviction order by the duel.
  std::uint64_t lru_layers = 0;            ///< on_routed() calls after which LRU ranked the victims.
  /// The duel's window: the policy shadow's misses less the LRU shadow's over the last
  /// duel_passes forward passes and the current one so far (positive: LRU missed fewer; 0: no duel).
  std::int64_t duel_difference = 0;

  /// Writes every counter as one JSON object.
  void write_json(std::ostream& out) const {
    out << fmt::format(
        R"({{"passes":{},"layers":{},"requested":{},"paused":{},"stall_paused":{},"stall_difference":{},"cancelled":{},)"
        R"("shadow_misses":{},"shadow_bytes":{},"charged_bytes":{},"policy_shadow_misses":{},"duel_switches":{},)"
        R"("lru_layers":{},"duel_difference":{}}})",
        passes, layers, requested, paused, stall_paused, stall_difference, cancelled, shadow_misses, shadow_bytes,
        charged_bytes, policy_shadow_misses, duel_switches, lru_layers, duel_difference);
  }
};

/// @brief Drives @p Runtime's prefetch() from an expert_predictor. @p Runtime is an
/// expert_runtime (anything with its policy_type, geometry(), has_prefetch_stream(),
/// demand(), prefetch(), cancel_prefetches(), totals(), and rank_by_lru() for a duel_policy).
template <class Runtime>
class runtime_prefetcher {
 public:
  /// @throws expage::invalid_argument for a null predictor, a predictor built for another shape
  ///         than the runtime's geometry, options out of range, or a runtime without a prefetch
  ///         stream.
  runtime_prefetcher(Runtime& runtime, std::unique_ptr<expert_predictor> predictor,
                     runtime_prefetch_options options = {})
      : runtime_(runtime), predictor_(std::move(predictor)), options_(options) {
    if (!predictor_) throw invalid_argument("runtime_prefetcher: the predictor is null");
    // Here, not at the first request: by then on_routed() has fed the predictor and its guards.
    if (!runtime_.has_prefetch_stream()) {
      throw invalid_argument("runtime_prefetcher: the runtime has no prefetch stream (its prefetch() needs one)");
    }
    if (options.distance == 0 || options.distance > 64) {
      throw invalid_argument(fmt::format("runtime_prefetcher: distance {} out of range [1, 64]", options.distance));
    }
    if (!(options.threshold >= 0.0F && options.threshold <= 1.0F)) {
      throw invalid_argument(fmt::format("runtime_prefetcher: threshold {} out of range [0, 1]", options.threshold));
    }
    if (!(options.max_overhead >= 0.0)) {
      throw invalid_argument(
          fmt::format("runtime_prefetcher: max_overhead {} out of range [0, inf]", options.max_overhead));
    }
    const auto& g = runtime_.geometry();
    if (predictor_->layers() != g.layers() || predictor_->experts_per_layer() != g.experts_per_layer()) {
      throw invalid_argument(fmt::format(
          "runtime_prefetcher: the predictor \"{}\" is built for {} layers × {} experts, the runtime's geometry has "
          "{} × {}",
          predictor_->name(), predictor_->layers(), predictor_->experts_per_layer(), g.layers(),
          g.experts_per_layer()));
    }
    if (options.per_layer > g.experts_per_layer()) {
      throw invalid_argument(fmt::format("runtime_prefetcher: per_layer {} out of range [0, {}]", options.per_layer,
                                         g.experts_per_layer()));
    }
    per_layer_ = options.per_layer != 0 ? options.per_layer : g.top_k();
    probability_.resize(g.experts_per_layer());
    routed_.assign(g.experts_per_layer(), 0);
    const auto t = runtime_.totals();
    misses_seen_ = t.misses;
    prefetch_bytes_seen_ = t.prefetch_bytes;
    eviction_duel::check(options.duel_passes, options.duel_margin, "runtime_prefetcher", "duel_");
    eviction_duel::check(options.stall_passes, options.stall_margin, "runtime_prefetcher", "stall_");
    // The stall guard's window of two miss series (the runtime's, the LRU shadow's) is the duel's
    // window, whose side it never asks for: it pauses while the sum is above the margin.
    if (options.stall_passes != 0) stall_.emplace(options.stall_passes, options.stall_margin);
    if constexpr (duels) {
      if (options.duel_passes != 0) {
        duel_.emplace(options.duel_passes, options.duel_margin);
        runtime_.rank_by_lru(false);  // the duel starts on the policy's side, and so does the runtime
      }
    }
  }

  /// Layer @p layer of the current forward pass was routed to @p experts (call after its
  /// acquire(); layers of a pass in increasing order, a layer before the previous one starts a
  /// new pass, the same layer again is another part of a group split to fit, in the same pass). Cancels the stale
  /// requests, then requests the next layers' likely experts. expert_runtime::cancel_prefetches() drops every queued
  /// request, so one runtime_prefetcher should be the only source of prefetch requests on its runtime.
  /// @throws expage::invalid_argument for a layer or expert out of range or an expert given twice
  ///         (nothing changes).
  void on_routed(std::uint32_t layer, std::span<const std::uint32_t> experts) {
    on_routed(layer, layer_routing{.experts = experts});
  }
  /// The same with the router's probabilities and a hidden-state sketch where the engine has them
  /// (the predictor sees them through expert_predictor::observe_routing(); fMoE's maps use them).
  /// @throws expage::invalid_argument for a layer or expert out of range, an expert given twice,
  ///         or what the predictor refuses (expert_predictor::validate_routing(): fmoe_map_predictor
  ///         refuses probabilities that are not a softmax over the layer's experts): nothing changes.
  void on_routed(std::uint32_t layer, const layer_routing& routing) {
    const std::span<const std::uint32_t> experts = routing.experts;
    const auto& g = runtime_.geometry();
    if (layer >= g.layers()) {
      throw invalid_argument(fmt::format("runtime_prefetcher: layer {} out of range [0, {})", layer, g.layers()));
    }
    for (const std::uint32_t e : experts) {
      if (e >= g.experts_per_layer()) {
        throw invalid_argument(
            fmt::format("runtime_prefetcher: expert {} out of range [0, {})", e, g.experts_per_layer()));
      }
    }
    // A duplicate is refused before anything changes (acquire() refuses it as well).
    std::optional<std::uint32_t> duplicate;
    for (const std::uint32_t e : experts) {
      if (std::exchange(routed_[e], std::uint8_t{1}) != 0 && !duplicate) duplicate = e;
    }
    for (const std::uint32_t e : experts) routed_[e] = 0;
    if (duplicate) {
      throw invalid_argument(
          fmt::format("runtime_prefetcher: layer {} routed expert {} twice in one group", layer, *duplicate));
    }
    // A layer before the previous one starts a new pass; the same layer again is the next part of
    // a group split to fit (group_tokens()), the same pass (one-layer models aside).
    const bool new_pass = stats_.layers == 0 || layer < last_layer_ || (layer == last_layer_ && g.layers() == 1);
    predictor_->validate_routing(layer, routing);  // before begin_pass(): a refused call changes nothing
    if (new_pass) predictor_->begin_pass();
    predictor_->observe_routing(layer, routing);
    if (new_pass) ++stats_.passes;
    last_layer_ = layer;
    ++stats_.layers;
    // The guards' one read of the runtime's counters in this call (it locks and sums the layers).
    const auto totals = guarded() ? runtime_.totals() : decltype(runtime_.totals()){};
    runtime_demand demand{};  // read with the shadows: the byte guard's unit in this call
    if (guarded() || duel_) {
      // Both shadows at the one capacity read here (a resize from another thread between two
      // reads would restart them a group apart); the policy's first, so that a failure leaves
      // the two in step.
      demand = runtime_.demand();
      const std::uint32_t capacity = demand.capacity;
      std::uint64_t policy_misses = 0;
      if constexpr (duels) {
        if (duel_) {
          policy_misses = policy_shadow_.access(runtime_.geometry(), capacity, layer, experts);
          stats_.policy_shadow_misses = policy_shadow_.misses;
        }
      }
      const std::uint64_t lru_misses = lru_shadow_.access(runtime_.geometry(), capacity, layer, experts);
      stats_.shadow_misses = lru_shadow_.misses;
      stats_.shadow_bytes += lru_misses * demand.load_bytes;
      // The runtime's demand misses since the last call: this group's (one engine thread acquires),
      // charged at the load the shadow's are.
      const std::uint64_t runtime_misses = totals.misses - std::exchange(misses_seen_, totals.misses);
      stats_.charged_bytes += runtime_misses * demand.load_bytes +
                              (totals.prefetch_bytes - std::exchange(prefetch_bytes_seen_, totals.prefetch_bytes));
      step_windows(new_pass, layer + 1 == g.layers(), policy_misses, lru_misses, runtime_misses);
      if (stall_) stats_.stall_difference = stall_->difference();
      if constexpr (duels) {
        if (duel_) duel_decide();
      }
    }
    stats_.cancelled += runtime_.cancel_prefetches();
    if (layer + 1 >= g.layers()) return;  // the pass ends here
    if (const guard verdict = within_guards(demand.load_bytes); verdict != guard::none) {
      ++stats_.paused;
      if (verdict == guard::stall) ++stats_.stall_paused;
      return;
    }
    const std::uint32_t last = std::min<std::uint32_t>(g.layers() - 1, layer + options_.distance);
    for (std::uint32_t target = layer + 1; target <= last; ++target) {
      predictor_->predict(target, probability_);
      most_probable(probability_, options_.threshold, per_layer_, ranked_);
      if (ranked_.empty()) continue;
      // One request per layer, most probable first (the runtime keeps a request's order among
      // equal priorities), at the priority of its most probable expert.
      request_.clear();
      for (const auto& [p, e] : ranked_) request_.push_back(e);
      runtime_.prefetch(target, request_, ranked_.front().first);
      stats_.requested += request_.size();
    }
  }

  /// What it did so far.
  [[nodiscard]] const runtime_prefetch_statistics& statistics() const noexcept { return stats_; }
  /// The predictor it drives.
  [[nodiscard]] const expert_predictor& predictor() const noexcept { return *predictor_; }

 private:
  // Whether the runtime's policy can be handed to LRU order (a duel_policy).
  static constexpr bool duels = lru_switchable_policy<typename Runtime::policy_type>;

  // Whether a guard needs the LRU shadow (as the simulator's: either guard runs it).
  [[nodiscard]] bool guarded() const noexcept { return !std::isinf(options_.max_overhead) || stall_.has_value(); }

  enum class guard : std::uint8_t { none, bytes, stall };  // which guard pauses the requests
  // From what this call counted (the shadows, the runtime's charge, the stall window); @p load:
  // one load of the demand tier read in this call, the byte guard's slack.
  [[nodiscard]] guard within_guards(std::uint64_t load) const {
    if (!std::isinf(options_.max_overhead)) {
      // In bytes since this prefetcher began, the runtime's charged as the shadow's are.
      if (!within_prefetch_overhead(static_cast<double>(stats_.charged_bytes), static_cast<double>(stats_.shadow_bytes),
                                    options_.max_overhead, static_cast<double>(load))) {
        return guard::bytes;
      }
    }
    return stall_ && static_cast<double>(stall_->difference()) > options_.stall_margin ? guard::stall : guard::none;
  }

  // The windows of the duel (its two shadows' misses) and of the stall guard (the runtime's and
  // the LRU shadow's) hear this group's misses. As in the simulator's duel_step(), a pass's first
  // evictions are ranked after the window has dropped its oldest pass: that happens when the
  // previous pass ends (its last layer), or at the start of a pass that did not end so. A further
  // part of a last layer split to fit comes after that: its misses go to the pass that ended, and
  // the window is not moved again (one pass, one slot, however its groups are split).
  void step_windows(bool new_pass, bool pass_ends, std::uint64_t policy_misses, std::uint64_t lru_misses,
                    std::uint64_t runtime_misses) {
    const bool to_previous = pass_begun_ && !new_pass;
    const auto step = [&](eviction_duel& window, std::uint64_t a, std::uint64_t b) {
      if (to_previous) {
        window.add_to_previous(a, b);
        return;
      }
      if (new_pass && !pass_begun_) window.begin_pass();
      window.add(a, b);
      if (pass_ends) window.begin_pass();
    };
    if (duel_) step(*duel_, policy_misses, lru_misses);
    if (stall_) step(*stall_, runtime_misses, lru_misses);
    if (!to_previous) pass_begun_ = pass_ends;
  }

  // The duel hands the runtime's victims to the side that leads (eviction_duel).
  void duel_decide() {
    stats_.duel_difference = duel_->difference();
    const bool was = duel_->lru_leads();
    const bool lru = duel_->decide();
    if (lru != was) {
      runtime_.rank_by_lru(lru);
      ++stats_.duel_switches;
    }
    if (lru) ++stats_.lru_layers;
  }

  Runtime& runtime_;
  std::unique_ptr<expert_predictor> predictor_;
  runtime_prefetch_options options_;
  std::uint32_t per_layer_ = 0;
  std::uint32_t last_layer_ = 0;
  runtime_prefetch_statistics stats_;
  std::vector<float> probability_;
  std::vector<std::uint8_t> routed_;       // on_routed()'s duplicate check, all 0 between calls
  std::uint64_t misses_seen_ = 0;          // the runtime's demand misses at the last on_routed()
  std::uint64_t prefetch_bytes_seen_ = 0;  // the runtime's prefetch bytes at the last on_routed()
  std::vector<std::pair<float, expert_index>> ranked_;
  std::vector<std::uint32_t> request_;
  detail::shadow_cache<lru_policy> lru_shadow_;  // the guards' and the duel's
  detail::shadow_cache<detail::duel_inner_t<typename Runtime::policy_type>> policy_shadow_;  // the duel's
  std::optional<eviction_duel> duel_;
  std::optional<eviction_duel> stall_;  // the stall guard's window: the runtime's misses against the LRU shadow's
  bool pass_begun_ = false;             // the windows already started the next pass (the last one ended)
};

}  // namespace expage
