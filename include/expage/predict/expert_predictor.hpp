/// @file
/// @brief Expert predictors: from the routing seen so far, the probability that each expert of a
/// later layer is routed for the current token.
///
/// One interface for every predictor (issue 14), used by the simulator's predictive prefetcher
/// (sim/pager_sim.hpp) and, through the runtime's prefetch() entry point, by engines. A predictor
/// sees the routing of the current forward pass layer by layer (observe()), and answers for any
/// later layer (predict()). Every predictor is online: it learns only from what it has observed.
#pragma once

#include "expage/core/error.hpp"
#include "expage/core/expert_id.hpp"

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace expage {

/// @brief One layer's routing as a predictor sees it: the routed experts and, where the trace or
/// the engine has them, the router's full probability vector and a hidden-state sketch
/// (docs/traces.md, "Optional fields").
struct layer_routing {
  std::span<const expert_index> experts{};  ///< The routed experts (for a lockstep batch, the union).
  std::span<const float> probabilities{};   ///< The router's probability over the layer's experts, or empty.
  std::span<const float> sketch{};          ///< A hidden-state sketch (fixed length per run), or empty.
};

/// @brief What every predictor implements.
///
/// @code
/// expage::coactivation_predictor p(32, 8, 2);
/// std::vector<float> probability(8);
/// p.begin_pass();
/// const expage::expert_index routed[] = {6, 5};
/// p.observe(0, routed);
/// p.predict(1, probability);  // P(expert e is routed at layer 1 in this pass)
/// @endcode
/// @threadsafety single-owner.
class expert_predictor {
 public:
  virtual ~expert_predictor() = default;
  /// A short name for reports ("coactivation", "frequency", ...).
  [[nodiscard]] virtual std::string name() const = 0;
  /// The layers of the model the predictor was built for (its layer indices are [0, layers())).
  /// The prefetchers compare it with their geometry at construction.
  [[nodiscard]] virtual std::uint32_t layers() const noexcept = 0;
  /// The experts per layer of that model.
  [[nodiscard]] virtual std::uint32_t experts_per_layer() const noexcept = 0;
  /// Forgets everything learned (a new run).
  virtual void reset() = 0;
  /// A new forward pass starts (a new token at batch 1).
  virtual void begin_pass() = 0;
  /// Layer @p layer of the current pass routed @p experts (for a lockstep batch, the union).
  /// Layers of one pass are observed in increasing order. A layer observed again right after
  /// itself in the same pass (a split group) counts once, as the union of its experts.
  /// @throws expage::invalid_argument for a layer or an expert out of the predictor's shape,
  ///         naming it and the range, with nothing learned.
  virtual void observe(std::uint32_t layer, std::span<const expert_index> experts) = 0;
  /// The same with the optional fields: a predictor that uses router probabilities or sketches
  /// (fmoe_map_predictor) overrides it; the others see the experts only (the default).
  /// @throws expage::invalid_argument where the predictor uses a field and its length is wrong
  ///         or a value is not finite.
  virtual void observe_routing(std::uint32_t layer, const layer_routing& routing) { observe(layer, routing.experts); }
  /// Throws what observe_routing() would refuse in these arguments, and learns nothing: a layer or
  /// an expert out of the predictor's shape (the default) and, in a predictor that uses the
  /// optional fields, a field it refuses. The prefetchers call it before begin_pass(), so that a
  /// call they refuse changes nothing.
  /// @throws expage::invalid_argument naming the value and its range.
  virtual void validate_routing(std::uint32_t layer, const layer_routing& routing) const;
  /// Writes into @p probability (experts_per_layer entries) the probability that each expert of
  /// @p layer (a layer after the last observed one) is routed in the current pass.
  /// @throws expage::invalid_argument for a layer out of the predictor's shape or a span of
  ///         another length.
  virtual void predict(std::uint32_t layer, std::span<float> probability) const = 0;
};

/// @brief Per-layer frequency so far: P(e@ℓ) = (times e was routed at ℓ) / passes, with a uniform
/// prior k/E before the first pass (the baseline every predictor is compared with).
class frequency_predictor final : public expert_predictor {
 public:
  /// A predictor for @p layers × @p experts_per_layer experts with top-@p top_k routing.
  /// @throws expage::invalid_argument for 0 layers or experts, top-k out of [1, experts], or
  ///         layers × experts above max_dense_table_cells.
  frequency_predictor(std::uint32_t layers, std::uint32_t experts_per_layer, std::uint32_t top_k);
  [[nodiscard]] std::string name() const override { return "frequency"; }
  [[nodiscard]] std::uint32_t layers() const noexcept override { return layers_; }
  [[nodiscard]] std::uint32_t experts_per_layer() const noexcept override { return experts_; }
  void reset() override;
  void begin_pass() override { last_layer_ = no_layer; }
  void observe(std::uint32_t layer, std::span<const expert_index> experts) override;
  void predict(std::uint32_t layer, std::span<float> probability) const override;

 private:
  static constexpr std::uint32_t no_layer = ~std::uint32_t{0};
  std::uint32_t layers_, experts_, top_k_;
  std::vector<std::uint64_t> count_;     // [layer][expert]
  std::vector<std::uint64_t> passes_;    // per layer: passes observed
  std::uint32_t last_layer_ = no_layer;  // the layer observed last in this pass
  std::vector<std::uint8_t> counted_;    // per expert: counted for last_layer_ in this pass
};

/// @brief Previous pass, same layer: the experts the layer routed last time have probability 1,
/// the others 0 (temporal locality; the notes' second baseline).
class previous_pass_predictor final : public expert_predictor {
 public:
  /// A predictor for @p layers × @p experts_per_layer experts.
  /// @throws expage::invalid_argument for 0 layers or experts, or layers × experts above
  ///         max_dense_table_cells.
  previous_pass_predictor(std::uint32_t layers, std::uint32_t experts_per_layer);
  [[nodiscard]] std::string name() const override { return "previous"; }
  [[nodiscard]] std::uint32_t layers() const noexcept override { return layers_; }
  [[nodiscard]] std::uint32_t experts_per_layer() const noexcept override { return experts_; }
  void reset() override;
  void begin_pass() override { last_layer_ = no_layer; }
  void observe(std::uint32_t layer, std::span<const expert_index> experts) override;
  void predict(std::uint32_t layer, std::span<float> probability) const override;

 private:
  static constexpr std::uint32_t no_layer = ~std::uint32_t{0};
  std::uint32_t layers_, experts_;
  std::vector<std::uint8_t> last_;       // [layer][expert]
  std::uint32_t last_layer_ = no_layer;  // the layer observed last in this pass
};

/// @brief How coactivation_predictor combines the evidence of several earlier layers.
enum class coactivation_pooling {
  /// A distance-weighted arithmetic mean of the layers' conditionals (WiSP App. C as written).
  mean,
  /// Log-odds pooling: each layer's conditional moves the per-layer frequency's log-odds by its
  /// lift, weighted by distance (naive Bayes over the earlier layers, tempered by the decay).
  log_odds,
};

/// The command-line name: "mean", "log-odds".
[[nodiscard]] std::string_view to_string(coactivation_pooling pooling) noexcept;
/// Parses a name produced by to_string(coactivation_pooling).
/// @throws expage::invalid_argument naming @p name and listing the accepted names.
[[nodiscard]] coactivation_pooling parse_coactivation_pooling(std::string_view name);

/// @brief Co-activation (WiSP App. C): an online table C[ℓ, i; ℓ', j] of the passes in which
/// expert i fired at layer ℓ and j at a later layer ℓ', with N[ℓ, i] the passes in which i fired
/// at ℓ. For target layer ℓ', with R_ℓ the experts routed at each earlier observed layer ℓ of the
/// current pass (at most `window` layers back), layer ℓ's conditional is
/// c_ℓ(j) = mean_{i ∈ R_ℓ} C[ℓ,i;ℓ',j] / N[ℓ,i], and w(δ) = decay^(δ−1) (WiSP leaves the form of
/// w open: "decreasing in distance"). The layers are pooled in one of two ways:
///
///     mean:      P(j@ℓ') = Σ_ℓ w(ℓ' − ℓ) · c_ℓ(j) / Σ_ℓ w(ℓ' − ℓ)
///     log_odds:  logit P(j@ℓ') = logit f(j) + Σ_ℓ w(ℓ' − ℓ) · (logit c̃_ℓ(j) − logit f(j))
///
/// with f(j) the per-layer frequency of j at ℓ' and c̃ the conditional shrunk towards f by one
/// pseudo-pass per i ((C + f) / (N + 1)), so an expert never seen at ℓ adds no lift. The mean
/// dilutes each layer's evidence by the number of layers and leaves every expert near its base
/// rate; log-odds adds it up. On the Mixtral trace, for the most probable expert not resident at
/// 64 slots, log-odds covers 11.0% of the misses at 5% wasted transfers against the mean's 7.2%
/// (problem 1; docs/prefetch.md, "Pooling the layers"). With mean pooling, an expert never seen at
/// ℓ before the pass (N = 0) contributes the per-layer frequency f(j) to its layer's mean, and f is
/// the answer while no earlier layer of the window has been observed. predict() refuses a layer
/// already observed in the pass. The defaults (log-odds, window 4, decay 1) are tuned on problem 0 of the
/// Mixtral trace; the mean's, WiSP's form, was decay 0.5. The table holds layers × window ×
/// experts² counters (Mixtral, window 4: 8,192 entries).
class coactivation_predictor final : public expert_predictor {
 public:
  /// Earlier layers pooled by default (tuned on problem 0 of the Mixtral trace).
  static constexpr std::uint32_t default_window = 4;
  /// The cells of the dense pair table for @p layers × @p window × @p experts_per_layer² (UINT64_MAX
  /// when the product overflows), which the constructor refuses above max_dense_table_cells: what
  /// a caller checks a window against before it builds one.
  [[nodiscard]] static constexpr std::uint64_t pair_cells(std::uint64_t layers, std::uint64_t window,
                                                          std::uint64_t experts_per_layer) noexcept {
    return saturating_product({layers, window, experts_per_layer, experts_per_layer});
  }
  /// The default weight of each layer further back (1: every layer of the window counts alike).
  static constexpr double default_decay = 1.0;
  /// The default pooling: log-odds (the mean's figures are in docs/prefetch.md).
  static constexpr coactivation_pooling default_pooling = coactivation_pooling::log_odds;
  /// The decay the mean was tuned with (the default before log-odds), for comparisons with it.
  static constexpr double mean_decay = 0.5;

  /// @throws expage::invalid_argument for 0 layers/experts, layers × experts or a pair table of
  ///         layers × window × E² cells above max_dense_table_cells, a window out of [1, 64], or a
  ///         decay out of (0, 1].
  coactivation_predictor(std::uint32_t layers, std::uint32_t experts_per_layer, std::uint32_t top_k,
                         std::uint32_t window = default_window, double decay = default_decay,
                         coactivation_pooling pooling = default_pooling);
  [[nodiscard]] std::string name() const override { return "coactivation"; }
  [[nodiscard]] std::uint32_t layers() const noexcept override { return layers_; }
  [[nodiscard]] std::uint32_t experts_per_layer() const noexcept override { return experts_; }
  void reset() override;
  void begin_pass() override;
  void observe(std::uint32_t layer, std::span<const expert_index> experts) override;
  void predict(std::uint32_t layer, std::span<float> probability) const override;

 private:
  void predict_log_odds(std::uint32_t layer, std::span<float> probability) const;
  [[nodiscard]] std::size_t cell(std::uint32_t from_layer, std::uint32_t distance, expert_index i,
                                 expert_index j) const noexcept {
    return ((std::size_t{from_layer} * window_ + (distance - 1)) * experts_ + i) * experts_ + j;
  }

  std::uint32_t layers_, experts_, window_;  // top-k lives in prior_
  double decay_;
  coactivation_pooling pooling_;
  frequency_predictor prior_;
  std::vector<std::uint32_t> pair_;   // C: [from layer][distance − 1][i][j]
  std::vector<std::uint32_t> fired_;  // N: [layer][i]
  // The current pass: which layers were observed and their experts.
  std::vector<std::uint8_t> seen_;
  std::vector<std::vector<expert_index>> routed_;
  std::vector<expert_index> fresh_;  // observe()'s scratch: experts new to their layer in this pass
  // predict()'s scratch (no allocation per call): per expert the clamped frequency, the running
  // odds, 1 / the frequency's odds and one layer's conditional (log-odds); the mean's scores in
  // conditional_.
  mutable std::vector<double> base_, odds_, inverse_base_odds_, conditional_;
};

/// @brief fMoE's expert-map store with semantic and trajectory search (fMoE §4, Eq. 4–8;
/// control-layer notes E5).
///
/// An *expert map* is one forward pass's router probability vectors, one per layer. The store
/// keeps up to `capacity` maps of past passes. After the current pass has observed layers
/// 0..ℓ, trajectory search (Eq. 5) picks the stored map y whose first ℓ + 1 rows are most similar
/// (cosine of the concatenated rows) to the current pass's; for a later layer ℓ' it predicts that
/// map's row P_ℓ'. The threshold δ = clip(1 − score, 0, 1) sets how many experts (Eq. 6–8): the
/// smallest set, by descending p, whose mass reaches δ, and at least top-k of them, so a map that
/// matches less well prefetches more. Those experts get probability score · p_j / max p (the best
/// one the similarity itself), the others 0.
///
/// **Semantic search** (Eq. 4): with hidden-state sketches (observe_routing()), a pass's
/// semantic vector is the sketch of its first observed layer, stored with its map. While the
/// current pass has observed at most `semantic_layers` layers (fMoE's prefetch distance d, where
/// a trajectory is too short to tell maps apart) and has a sketch, the map is the one whose
/// semantic vector is most similar (cosine), and that similarity is the score. When the store is
/// full a finished pass replaces the stored map most redundant with it: the highest
/// RDY = (d/L) · semantic similarity + ((L − d)/L) · whole-map similarity (fMoE's dedup; the
/// map term alone without sketches).
///
/// Rows are the router's probability vectors where observe_routing() passes them; otherwise
/// (the Mixtral trace records only the top-2) each routed expert gets 1/n, n the experts routed
/// at the layer (k, or a lockstep batch's union: a sparse map of mass 1, as the notes prescribe).
/// Before any layer is observed, and with an empty store, the prediction is uniform k/E. A layer
/// observed twice in a pass (a split group) counts as the union of its experts; with
/// probabilities, the latest vector (a part without one keeps the vector an earlier part
/// brought). Per observed layer the search costs O(capacity · E) (running dot products), and
/// semantic search O(capacity · sketch) on each of the first d observed layers; a finished pass
/// O(capacity), its redundancy check reusing those sums.
///
/// @code
/// expage::fmoe_map_predictor p(32, 8, 2);
/// p.begin_pass();
/// p.observe_routing(0, {.experts = routed, .probabilities = router_softmax, .sketch = hidden_sketch});
/// p.predict(1, probability);
/// @endcode
/// @threadsafety single-owner.
class fmoe_map_predictor final : public expert_predictor {
 public:
  /// The store's default capacity (fMoE §4: 1K maps).
  static constexpr std::uint32_t default_capacity = 1024;
  /// The default semantic_layers (fMoE's prefetch distance d = 3), or every layer of a model of
  /// fewer.
  static constexpr std::uint32_t default_semantic_layers = 3;

  /// @p semantic_layers unset: min(default_semantic_layers, layers).
  /// @throws expage::invalid_argument for 0 layers/experts, top-k out of [1, experts], a
  ///         capacity out of [1, 65536], a store of capacity × layers × experts cells above
  ///         max_dense_table_cells, or semantic_layers out of [0, layers].
  fmoe_map_predictor(std::uint32_t layers, std::uint32_t experts_per_layer, std::uint32_t top_k,
                     std::uint32_t capacity = default_capacity,
                     std::optional<std::uint32_t> semantic_layers = std::nullopt);
  [[nodiscard]] std::string name() const override { return "fmoe"; }
  [[nodiscard]] std::uint32_t layers() const noexcept override { return layers_; }
  [[nodiscard]] std::uint32_t experts_per_layer() const noexcept override { return experts_; }
  void reset() override;
  void begin_pass() override;
  void observe(std::uint32_t layer, std::span<const expert_index> experts) override;
  /// @throws expage::invalid_argument as validate_routing(), with nothing learned.
  void observe_routing(std::uint32_t layer, const layer_routing& routing) override;
  /// Besides the layer and the experts: a probability vector must be the router's softmax over
  /// the layer's experts, as a trace's (experts_per_layer values in [0, 1] summing to 1 ±
  /// probability_sum_tolerance: logits or a top-k slice are refused), and a sketch at most
  /// max_sketch_dims finite values, as long as the first one seen since reset().
  /// @throws expage::invalid_argument naming the value and its range.
  void validate_routing(std::uint32_t layer, const layer_routing& routing) const override;
  void predict(std::uint32_t layer, std::span<float> probability) const override;
  /// Maps stored now.
  [[nodiscard]] std::size_t stored() const noexcept { return count_; }
  /// True when the last observed layer's map was chosen by semantic search.
  [[nodiscard]] bool semantic() const noexcept { return semantic_; }

 private:
  [[nodiscard]] std::span<const float> row(std::size_t map, std::uint32_t layer) const noexcept {
    return {store_.data() + (map * layers_ + layer) * experts_, experts_};
  }
  void finish_pass();
  // Adds (sign +1) or removes (−1) the current pass's row of @p layer in the running sums.
  void add_row(std::uint32_t layer, double sign);
  // cos(the current pass's semantic vector, stored map y's); 0 where either has none.
  [[nodiscard]] double semantic_similarity(std::size_t y) const noexcept;

  std::uint32_t layers_, experts_, top_k_, capacity_, semantic_layers_;
  std::vector<float> store_;      // [map][layer][expert]
  std::vector<double> norm_map_;  // per stored map: |map|² over all its rows
  std::size_t count_ = 0;
  std::vector<float> current_;      // [layer][expert] of this pass (zero rows not observed)
  std::vector<std::uint8_t> seen_;  // per layer: observed in this pass
  std::uint32_t observed_ = 0;      // distinct layers of this pass observed
  std::vector<double> dot_;         // per stored map: Σ over observed layers of P_new · P_old
  std::vector<double> norm_old_;    // per stored map: Σ over observed layers of |P_old|²
  double norm_new_ = 0.0;           // Σ over observed layers of |P_new|²
  std::size_t best_ = 0;            // the search winner after the last observed layer
  double score_ = 0.0;              // its similarity
  bool semantic_ = false;           // the winner came from semantic search
  // Semantic vectors: the sketch length (0 until one is seen), per stored map its vector and
  // |v|² (0: none), and the current pass's.
  std::size_t sketch_dims_ = 0;
  std::vector<float> semantic_store_;  // [map][sketch_dims_]
  std::vector<double> semantic_norm_;
  std::vector<float> semantic_now_;
  double semantic_now_norm_ = 0.0;
  mutable std::vector<std::pair<float, expert_index>> ranked_;  // predict()'s scratch (no allocation per call)
};

/// Writes into @p out the experts whose @p probability is at least @p threshold (and above 0),
/// most probable first (ties: the smaller index), at most @p most of them: what a prefetcher
/// requests for one layer.
void most_probable(std::span<const float> probability, float threshold, std::size_t most,
                   std::vector<std::pair<float, expert_index>>& out);

/// The byte guard of prefetching (docs/prefetch.md), the one rule the simulator's admission and
/// the runtime's prefetcher share: true while @p moved (demand loads and prefetches so far, the
/// simulator also counting those queued or in flight) stays within (1 + @p share) × the
/// @p baseline's (a key-only shadow of LRU demand loading over the same routing) plus one
/// transfer of @p unit. The simulator counts transfers (unit 1: every expert one size), the
/// runtime's prefetcher bytes (unit: one version of its demand tier). @p share = +∞ turns it off.
[[nodiscard]] inline bool within_prefetch_overhead(double moved, double baseline, double share,
                                                   double unit = 1.0) noexcept {
  return std::isinf(share) || moved <= (1.0 + share) * baseline + unit;
}

/// The shape every predictor takes: layers and experts ≥ 1, top-k in [1, experts], and its dense
/// per-(layer, expert) tables within max_dense_table_cells (each constructor checks it first; a
/// tool checks it before building any). @throws expage::invalid_argument naming @p who and the
/// value out of range.
void check_predictor_shape(std::string_view who, std::uint32_t layers, std::uint32_t experts_per_layer,
                           std::uint32_t top_k);

/// A predictor by name: "frequency", "previous", "coactivation", "fmoe" (its default capacity, cut
/// for a model whose capacity × layers × experts would pass max_dense_table_cells).
/// @throws expage::invalid_argument for another name, listing the accepted ones.
[[nodiscard]] std::unique_ptr<expert_predictor> make_predictor(std::string_view name, std::uint32_t layers,
                                                               std::uint32_t experts_per_layer, std::uint32_t top_k);

}  // namespace expage
