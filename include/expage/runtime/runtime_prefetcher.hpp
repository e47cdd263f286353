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
///   were for this layer or were re-predicted now);
/// - **a byte guard with a shadow cache** (runtime_prefetch_options::max_overhead): beside the
///   runtime it keeps a key-only LRU cache of the runtime's capacity (its demand tier's), fed the
///   routing on_routed() sees, which counts what plain LRU demand loading would have loaded.
///   While the runtime's loads (demand loads + prefetches issued) exceed (1 + share) × the
///   shadow's plus one expert, it requests nothing, and resumes once demand loading would have
///   loaded as much. Unlike counting wasted prefetches, this also charges the demand misses on
///   experts a prefetch evicted (the refaults), as the simulator's guard does
///   (within_prefetch_overhead(), sim/pager_sim.hpp). After a resize the shadow starts again at
///   the new capacity, empty (its misses so far kept).
/// - **the eviction duel** (runtime_prefetch_options::duel_passes, the simulator's guard 6): a
///   second key-only shadow ranked by the runtime's own policy beside the LRU one; while LRU's has
///   missed more than `duel_margin` fewer experts over the last `duel_passes` passes
///   (eviction_duel), the runtime takes its victims in LRU order (expert_runtime::set_lru_victims(),
///   which needs expert_runtime_options::lru_order). A policy that predicts well on most traffic
///   (next_turn) still trails LRU over stretches of it; prefetches then run on LRU's order.
///
/// Threading: one thread (the engine's, which calls acquire()) calls on_routed(); the runtime it
/// drives may be used by other threads meanwhile (prefetch(), resize() and statistics() lock).
/// The shadow is the prefetcher's own.
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
#include <span>
#include <utility>
#include <vector>

namespace expage {

/// @brief Parameters of a runtime_prefetcher.
struct runtime_prefetch_options {
  std::uint32_t distance = 1;   ///< Layers ahead of the routed one to request for, [1, 64].
  float threshold = 0.0F;       ///< Request only experts predicted with at least this probability, [0, 1].
  std::uint32_t per_layer = 0;  ///< At most this many per target layer; 0: the geometry's top-k.
  /// The byte guard: request nothing while the runtime's loads (demand loads + prefetches)
  /// exceed (1 + this) × those of a key-only LRU shadow cache of the same capacity, plus one
  /// expert. +∞ turns it off (and the shadow with it, unless the duel needs it). [0, +∞].
  double max_overhead = 0.05;
  /// The eviction duel's window in forward passes; 0 turns it off. The runtime must keep an LRU
  /// order (expert_runtime_options::lru_order). [0, eviction_duel::max_passes].
  std::uint32_t duel_passes = 0;
  /// Misses by which LRU's shadow must lead (or trail) to change sides. [0, +∞).
  double duel_margin = 2.0;
};

/// @brief What a runtime_prefetcher did.
struct runtime_prefetch_statistics {
  std::uint64_t passes = 0;         ///< Forward passes seen (a layer not after the previous one starts one).
  std::uint64_t layers = 0;         ///< on_routed() calls.
  std::uint64_t requested = 0;      ///< Experts requested through prefetch() (the runtime ignores resident ones).
  std::uint64_t paused = 0;         ///< on_routed() calls that requested nothing because of the byte guard.
  std::uint64_t cancelled = 0;      ///< Stale requests cancelled before the runtime issued them.
  std::uint64_t shadow_misses = 0;  ///< What the LRU shadow loaded on demand (0 with the guard and the duel off).
  std::uint64_t policy_shadow_misses =
      0;                              ///< What the duel's shadow of the runtime's policy loaded (0 without the duel).
  std::uint64_t duel_lru_layers = 0;  ///< on_routed() calls after which the runtime evicted in LRU order.
  std::uint64_t duel_switches = 0;    ///< Times the duel changed sides.
};

/// @brief Drives @p Runtime's prefetch() from an expert_predictor. @p Runtime is an
/// expert_runtime (anything with its geometry(), prefetch(), cancel_prefetches(), totals(),
/// capacity(), demand_tier(), policy_type, keeps_lru_order() and set_lru_victims()).
template <class Runtime>
class runtime_prefetcher {
 public:
  /// @throws expage::invalid_argument for a null predictor, options out of range, or a runtime
  ///         without a prefetch stream (detected at the first request).
  runtime_prefetcher(Runtime& runtime, std::unique_ptr<expert_predictor> predictor,
                     runtime_prefetch_options options = {})
      : runtime_(runtime), predictor_(std::move(predictor)), options_(options) {
    if (!predictor_) throw invalid_argument("runtime_prefetcher: the predictor is null");
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
    if (options.per_layer > g.experts_per_layer()) {
      throw invalid_argument(fmt::format("runtime_prefetcher: per_layer {} out of range [0, {}]", options.per_layer,
                                         g.experts_per_layer()));
    }
    per_layer_ = options.per_layer != 0 ? options.per_layer : g.top_k();
    probability_.resize(g.experts_per_layer());
    if (options.duel_passes > eviction_duel::max_passes) {
      throw invalid_argument(fmt::format("runtime_prefetcher: duel_passes {} out of range [0, {}]", options.duel_passes,
                                         eviction_duel::max_passes));
    }
    if (!(options.duel_margin >= 0.0) || std::isinf(options.duel_margin)) {
      throw invalid_argument(
          fmt::format("runtime_prefetcher: duel_margin {} out of range [0, inf)", options.duel_margin));
    }
    if (options.duel_passes != 0) {
      if (!runtime_.keeps_lru_order()) {
        throw invalid_argument(
            "runtime_prefetcher: duel_passes needs a runtime that keeps an LRU order "
            "(expert_runtime_options::lru_order)");
      }
      duel_.emplace(options.duel_passes, options.duel_margin);
    }
  }

  /// Layer @p layer of the current forward pass was routed to @p experts (call after its
  /// acquire(); layers of a pass in increasing order, a layer not after the previous one starts
  /// a new pass). Cancels the stale requests, then requests the next layers' likely experts.
  /// expert_runtime::cancel_prefetches() drops every queued request, so one runtime_prefetcher
  /// should be the only source of prefetch requests on its runtime.
  /// @throws expage::invalid_argument for a layer or expert out of range (nothing is requested).
  void on_routed(std::uint32_t layer, std::span<const std::uint32_t> experts) {
    on_routed(layer, layer_routing{.experts = experts});
  }
  /// The same with the router's probabilities and a hidden-state sketch where the engine has them
  /// (the predictor sees them through expert_predictor::observe_routing(); fMoE's maps use them).
  /// @throws expage::invalid_argument for a layer or expert out of range (nothing is requested),
  ///         or what the predictor refuses.
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
    const bool new_pass = stats_.layers == 0 || layer <= last_layer_;
    if (new_pass) predictor_->begin_pass();
    predictor_->observe_routing(layer, routing);
    if (new_pass) ++stats_.passes;
    last_layer_ = layer;
    ++stats_.layers;
    if (!std::isinf(options_.max_overhead) || duel_) {
      const std::uint64_t lru = shadow_access(shadow_, shadow_base_, layer, experts);
      stats_.shadow_misses = shadow_base_ + shadow_->statistics().misses;
      if (duel_) {
        const std::uint64_t own = shadow_access(policy_shadow_, policy_shadow_base_, layer, experts);
        stats_.policy_shadow_misses = policy_shadow_base_ + policy_shadow_->statistics().misses;
        if (new_pass) duel_->begin_pass();
        duel_->add(own, lru);
        const bool leads = duel_->decide();
        if (leads != runtime_lru_) {
          runtime_.set_lru_victims(leads);  // the next acquire's evictions
          runtime_lru_ = leads;
          ++stats_.duel_switches;
        }
        if (leads) ++stats_.duel_lru_layers;
      }
    }
    stats_.cancelled += runtime_.cancel_prefetches();
    if (layer + 1 >= g.layers()) return;  // the pass ends here
    if (!within_overhead()) {
      ++stats_.paused;
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
  [[nodiscard]] bool within_overhead() const {
    if (std::isinf(options_.max_overhead)) return true;
    // In experts (demand loads and prefetches load the demand tier's versions, all one size).
    const auto t = runtime_.totals();
    return within_prefetch_overhead(static_cast<double>(t.misses + t.prefetches),
                                    static_cast<double>(stats_.shadow_misses), options_.max_overhead);
  }

  // A shadow: demand loading of the routing with its policy, at the runtime's capacity now (a
  // resize starts it again, empty, its misses so far kept in @p base). Returns this call's misses.
  template <class Policy>
  std::uint64_t shadow_access(std::optional<slot_cache<Policy>>& shadow, std::uint64_t& base, std::uint32_t layer,
                              std::span<const std::uint32_t> experts) {
    const std::uint32_t capacity = runtime_.capacity(runtime_.demand_tier());
    if (!shadow || shadow->options().capacity != capacity) {
      if (shadow) base += shadow->statistics().misses;
      shadow.emplace(runtime_.geometry(), slot_cache_options{.layout = cache_layout::global, .capacity = capacity});
    }
    // A group larger than the shadow (the runtime could not acquire it either) in parts.
    std::uint64_t misses = 0;
    for (std::size_t i = 0; i < experts.size(); i += capacity) {
      misses += shadow->access(layer, experts.subspan(i, std::min<std::size_t>(capacity, experts.size() - i))).misses;
    }
    return misses;
  }

  Runtime& runtime_;
  std::unique_ptr<expert_predictor> predictor_;
  runtime_prefetch_options options_;
  std::uint32_t per_layer_ = 0;
  std::uint32_t last_layer_ = 0;
  runtime_prefetch_statistics stats_;
  std::vector<float> probability_;
  std::vector<std::pair<float, expert_index>> ranked_;
  std::vector<std::uint32_t> request_;
  std::optional<slot_cache<lru_policy>> shadow_;
  std::uint64_t shadow_base_ = 0;  // misses of the shadows before the last resize
  std::optional<slot_cache<typename Runtime::policy_type>> policy_shadow_;  // the duel's
  std::uint64_t policy_shadow_base_ = 0;
  std::optional<eviction_duel> duel_;
  bool runtime_lru_ = false;  // what this prefetcher last told the runtime
};

}  // namespace expage
