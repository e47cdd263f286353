#include "expage/predict/expert_predictor.hpp"

#include "../trace/record_check.hpp"  // check_probabilities(), check_sketch(): the trace's rules
#include "expage/core/error.hpp"
#include "expage/detail/assert.hpp"
#include "expage/trace/routing_trace.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace expage {

void check_predictor_shape(std::string_view who, std::uint32_t layers, std::uint32_t experts, std::uint32_t top_k) {
  if (layers == 0 || experts == 0 || top_k == 0 || top_k > experts) {
    throw invalid_argument(
        fmt::format("{}: {} layers x {} experts, top-{} out of range (layers and experts >= 1, "
                    "top-k in [1, experts])",
                    who, layers, experts, top_k));
  }
  // Every predictor keeps dense per-(layer, expert) tables: refused before they are allocated.
  if (const std::uint64_t cells = saturating_product({layers, experts}); cells > max_dense_table_cells) {
    throw invalid_argument(
        fmt::format("{}: {} layers × {} experts = {} cells out of range [0, 2^28] (the tables are "
                    "dense)",
                    who, layers, experts, cells));
  }
}

namespace {

// observe()'s contract: the layer and every expert inside the predictor's shape (checked before
// anything is learned).
void check_routing(std::string_view who, std::uint32_t layer, std::uint32_t layers,
                   std::span<const expert_index> experts, std::uint32_t experts_per_layer) {
  if (layer >= layers) {
    throw invalid_argument(fmt::format("{}: layer {} out of range [0, {})", who, layer, layers));
  }
  for (const expert_index e : experts) {
    if (e >= experts_per_layer) {
      throw invalid_argument(
          fmt::format("{}: expert {} of layer {} out of range [0, {})", who, e, layer, experts_per_layer));
    }
  }
}

// predict()'s contract: a layer inside the shape and one probability per expert.
void check_target(std::string_view who, std::uint32_t layer, std::uint32_t layers, std::size_t size,
                  std::uint32_t experts_per_layer) {
  if (layer >= layers) {
    throw invalid_argument(fmt::format("{}: layer {} out of range [0, {})", who, layer, layers));
  }
  if (size != experts_per_layer) {
    throw invalid_argument(fmt::format("{}: a probability span of {} entries, expected experts_per_layer {}", who, size,
                                       experts_per_layer));
  }
}

}  // namespace

void expert_predictor::validate_routing(std::uint32_t layer, const layer_routing& routing) const {
  check_routing(name(), layer, layers(), routing.experts, experts_per_layer());
}

frequency_predictor::frequency_predictor(std::uint32_t layers, std::uint32_t experts_per_layer, std::uint32_t top_k)
    : layers_(layers), experts_(experts_per_layer), top_k_(top_k) {
  check_predictor_shape("frequency_predictor", layers, experts_per_layer, top_k);
  reset();
}

void frequency_predictor::reset() {
  count_.assign(std::size_t{layers_} * experts_, 0);
  passes_.assign(layers_, 0);
  counted_.assign(experts_, 0);
  last_layer_ = no_layer;
}

void frequency_predictor::observe(std::uint32_t layer, std::span<const expert_index> experts) {
  check_routing("frequency_predictor", layer, layers_, experts, experts_);
  if (layer != last_layer_) {  // else a split group: more experts of the same layer in this pass
    ++passes_[layer];
    last_layer_ = layer;
    std::fill(counted_.begin(), counted_.end(), 0);
  }
  for (const expert_index e : experts) {
    if (counted_[e] != 0) continue;
    counted_[e] = 1;
    ++count_[std::size_t{layer} * experts_ + e];
  }
}

void frequency_predictor::predict(std::uint32_t layer, std::span<float> probability) const {
  check_target("frequency_predictor", layer, layers_, probability.size(), experts_);
  const std::uint64_t n = passes_[layer];
  for (std::uint32_t e = 0; e < experts_; ++e) {
    probability[e] = n == 0 ? static_cast<float>(top_k_) / static_cast<float>(experts_)
                            : static_cast<float>(static_cast<double>(count_[std::size_t{layer} * experts_ + e]) /
                                                 static_cast<double>(n));
  }
}

previous_pass_predictor::previous_pass_predictor(std::uint32_t layers, std::uint32_t experts_per_layer)
    : layers_(layers), experts_(experts_per_layer) {
  check_predictor_shape("previous_pass_predictor", layers, experts_per_layer, 1);
  reset();
}

void previous_pass_predictor::reset() {
  last_.assign(std::size_t{layers_} * experts_, 0);
  last_layer_ = no_layer;
}

void previous_pass_predictor::observe(std::uint32_t layer, std::span<const expert_index> experts) {
  check_routing("previous_pass_predictor", layer, layers_, experts, experts_);
  if (layer != last_layer_) {  // else a split group: more experts of the same layer in this pass
    std::fill_n(last_.begin() + static_cast<std::ptrdiff_t>(std::size_t{layer} * experts_), experts_, 0);
    last_layer_ = layer;
  }
  for (const expert_index e : experts) last_[std::size_t{layer} * experts_ + e] = 1;
}

void previous_pass_predictor::predict(std::uint32_t layer, std::span<float> probability) const {
  check_target("previous_pass_predictor", layer, layers_, probability.size(), experts_);
  for (std::uint32_t e = 0; e < experts_; ++e) probability[e] = last_[std::size_t{layer} * experts_ + e];
}

std::string_view to_string(coactivation_pooling pooling) noexcept {
  return pooling == coactivation_pooling::mean ? "mean" : "log-odds";
}

coactivation_pooling parse_coactivation_pooling(std::string_view name) {
  for (const auto pooling : {coactivation_pooling::mean, coactivation_pooling::log_odds}) {
    if (to_string(pooling) == name) return pooling;
  }
  throw invalid_argument(fmt::format("unknown pooling '{}': expected one of mean, log-odds", name));
}

coactivation_predictor::coactivation_predictor(std::uint32_t layers, std::uint32_t experts_per_layer,
                                               std::uint32_t top_k, std::uint32_t window, double decay,
                                               coactivation_pooling pooling)
    : layers_(layers),
      experts_(experts_per_layer),
      window_(window),
      decay_(decay),
      pooling_(pooling),
      prior_((check_predictor_shape("coactivation_predictor", layers, experts_per_layer, top_k), layers),
             experts_per_layer, top_k) {
  if (window == 0 || window > 64) {
    throw invalid_argument(fmt::format("coactivation_predictor: window {} out of range [1, 64]", window));
  }
  if (!(decay > 0.0 && decay <= 1.0)) {
    throw invalid_argument(fmt::format("coactivation_predictor: decay {} out of range (0, 1]", decay));
  }
  // The pair counts are dense: refused before they are allocated.
  if (const std::uint64_t cells = pair_cells(layers, window, experts_per_layer); cells > max_dense_table_cells) {
    throw invalid_argument(fmt::format(
        "coactivation_predictor: {} layers × window {} × {}^2 experts = {} pair cells out of range [0, 2^28] (the "
        "table is dense)",
        layers, window, experts_per_layer, cells));
  }
  reset();
}

void coactivation_predictor::reset() {
  prior_.reset();
  pair_.assign(std::size_t{layers_} * window_ * experts_ * experts_, 0);
  fired_.assign(std::size_t{layers_} * experts_, 0);
  routed_.assign(layers_, {});
  seen_.assign(layers_, 0);
}

void coactivation_predictor::begin_pass() {
  prior_.begin_pass();
  std::fill(seen_.begin(), seen_.end(), 0);
  for (auto& r : routed_) r.clear();
}

void coactivation_predictor::observe(std::uint32_t layer, std::span<const expert_index> experts) {
  check_routing("coactivation_predictor", layer, layers_, experts, experts_);
  prior_.observe(layer, experts);
  if (seen_[layer] == 0) {
    seen_[layer] = 1;
    routed_[layer].clear();
  }
  // Only experts new to the layer in this pass count (a split group observes a layer again).
  fresh_.clear();
  for (const expert_index e : experts) {
    if (std::find(routed_[layer].begin(), routed_[layer].end(), e) == routed_[layer].end()) {
      routed_[layer].push_back(e);
      fresh_.push_back(e);
    }
  }
  for (const expert_index e : fresh_) ++fired_[std::size_t{layer} * experts_ + e];
  // Pairs with the earlier layers of this pass within the window.
  for (std::uint32_t d = 1; d <= window_ && d <= layer; ++d) {
    const std::uint32_t from = layer - d;
    if (seen_[from] == 0) continue;
    for (const expert_index i : routed_[from]) {
      for (const expert_index j : fresh_) ++pair_[cell(from, d, i, j)];
    }
  }
}

void coactivation_predictor::predict(std::uint32_t layer, std::span<float> probability) const {
  check_target("coactivation_predictor", layer, layers_, probability.size(), experts_);
  // The counts of a layer already observed include this pass in its pairs but not in N: its
  // "probabilities" would exceed 1.
  if (seen_[layer] != 0) {
    throw invalid_argument(fmt::format(
        "coactivation_predictor: layer {} was already observed in this pass; predict a later one (or begin_pass())",
        layer));
  }
  if (pooling_ == coactivation_pooling::log_odds) {
    predict_log_odds(layer, probability);
    return;
  }
  std::vector<double>& score = conditional_;  // the scratch the log-odds path also uses
  score.assign(experts_, 0.0);
  // The per-layer frequency, in `probability` until the end: the conditional of an expert never
  // seen at its layer before this pass (it has no pairs), and the answer when no earlier layer of
  // the window has been observed. (An unseen expert once added nothing and still counted in its
  // layer's mean, pulling every prediction towards 0.)
  prior_.predict(layer, probability);
  double weights = 0.0;
  // decay^(d − d0), d0 the nearest observed layer's distance: a factor common to every term of
  // the mean. With decay^(d − 1) itself a far nearest layer's weight was subnormal, its shares
  // rounded coarsely, and the mean came out above 1 (decay 1e-320 at distance 2: 1.0005).
  double w = 1.0;
  bool started = false;
  for (std::uint32_t d = 1; d <= window_ && d <= layer; ++d) {
    if (started) w *= decay_;
    const std::uint32_t from = layer - d;
    if (seen_[from] == 0 || routed_[from].empty()) continue;
    started = true;
    const double share = w / static_cast<double>(routed_[from].size());
    for (const expert_index i : routed_[from]) {
      // Passes before this one in which i fired at `from`: the current pass has not reached the
      // target layer yet, so counting it would bias every conditional down by n / (n + 1).
      const std::uint32_t n = fired_[std::size_t{from} * experts_ + i] - 1;
      for (std::uint32_t j = 0; j < experts_; ++j) {
        score[j] += share * (n == 0 ? static_cast<double>(probability[j])
                                    : static_cast<double>(pair_[cell(from, d, i, j)]) / static_cast<double>(n));
      }
    }
    weights += w;
  }
  if (weights == 0.0) return;  // nothing observed within the window yet: the per-layer frequency
  for (std::uint32_t j = 0; j < experts_; ++j) probability[j] = static_cast<float>(score[j] / weights);
}

void coactivation_predictor::predict_log_odds(std::uint32_t layer, std::span<float> probability) const {
  // Probabilities are kept inside [ε, 1 − ε] so that a frequency of 0 or 1 has finite log-odds.
  // The sum of log-odds is kept as a product of odds (no logarithm per term; a power only where
  // the weight is not 1), held inside [1e-200, 1e200] so that no window can overflow it.
  const auto clamp = [](double p) { return std::clamp(p, 1e-3, 1.0 - 1e-3); };
  const auto odds_of = [](double p) { return p / (1.0 - p); };
  prior_.predict(layer, probability);
  base_.resize(experts_);
  odds_.resize(experts_);
  inverse_base_odds_.resize(experts_);
  conditional_.resize(experts_);
  for (std::uint32_t j = 0; j < experts_; ++j) {
    base_[j] = clamp(static_cast<double>(probability[j]));
    odds_[j] = odds_of(base_[j]);
    inverse_base_odds_[j] = 1.0 / odds_[j];
  }
  double w = 1.0;
  for (std::uint32_t d = 1; d <= window_ && d <= layer; ++d, w *= decay_) {
    const std::uint32_t from = layer - d;
    if (seen_[from] == 0 || routed_[from].empty()) continue;
    std::fill(conditional_.begin(), conditional_.end(), 0.0);
    for (const expert_index i : routed_[from]) {
      // As in the mean: the passes before this one in which i fired at `from`.
      const double n = static_cast<double>(fired_[std::size_t{from} * experts_ + i] - 1);
      const double share = 1.0 / ((n + 1.0) * static_cast<double>(routed_[from].size()));
      const std::uint32_t* pairs = &pair_[cell(from, d, i, 0)];
      for (std::uint32_t j = 0; j < experts_; ++j) {
        conditional_[j] += (static_cast<double>(pairs[j]) + base_[j]) * share;
      }
    }
    for (std::uint32_t j = 0; j < experts_; ++j) {
      const double lift = odds_of(clamp(conditional_[j])) * inverse_base_odds_[j];
      odds_[j] = std::clamp(odds_[j] * (w == 1.0 ? lift : std::pow(lift, w)), 1e-200, 1e200);
    }
  }
  for (std::uint32_t j = 0; j < experts_; ++j) probability[j] = static_cast<float>(odds_[j] / (1.0 + odds_[j]));
}

fmoe_map_predictor::fmoe_map_predictor(std::uint32_t layers, std::uint32_t experts_per_layer, std::uint32_t top_k,
                                       std::uint32_t capacity, std::optional<std::uint32_t> semantic_layers)
    : layers_(layers),
      experts_(experts_per_layer),
      top_k_(top_k),
      capacity_(capacity),
      semantic_layers_(semantic_layers.value_or(std::min(default_semantic_layers, layers))) {
  check_predictor_shape("fmoe_map_predictor", layers, experts_per_layer, top_k);
  if (capacity == 0 || capacity > 65536) {
    throw invalid_argument(fmt::format("fmoe_map_predictor: capacity {} out of range [1, 65536]", capacity));
  }
  // The store holds up to capacity maps of layers × experts probabilities.
  if (const std::uint64_t cells = saturating_product({capacity, layers, experts_per_layer});
      cells > max_dense_table_cells) {
    throw invalid_argument(
        fmt::format("fmoe_map_predictor: capacity {} × {} layers × {} experts = {} stored cells out of range [0, 2^28]",
                    capacity, layers, experts_per_layer, cells));
  }
  if (semantic_layers_ > layers) {
    throw invalid_argument(
        fmt::format("fmoe_map_predictor: semantic_layers {} out of range [0, {}]", semantic_layers_, layers));
  }
  reset();
}

void fmoe_map_predictor::reset() {
  store_.clear();
  norm_map_.clear();
  count_ = 0;
  current_.assign(std::size_t{layers_} * experts_, 0.0F);
  seen_.assign(layers_, 0);
  observed_ = 0;
  dot_.clear();
  norm_old_.clear();
  norm_new_ = 0.0;
  best_ = 0;
  score_ = 0.0;
  semantic_ = false;
  sketch_dims_ = 0;
  semantic_store_.clear();
  semantic_norm_.clear();
  semantic_now_.clear();
  semantic_now_norm_ = 0.0;
}

double fmoe_map_predictor::semantic_similarity(std::size_t y) const noexcept {
  if (semantic_now_norm_ == 0.0 || semantic_norm_[y] == 0.0) return 0.0;
  const float* old = semantic_store_.data() + y * sketch_dims_;
  double d = 0.0;
  for (std::size_t i = 0; i < sketch_dims_; ++i)
    d += static_cast<double>(semantic_now_[i]) * static_cast<double>(old[i]);
  return d / std::sqrt(semantic_now_norm_ * semantic_norm_[y]);
}

void fmoe_map_predictor::finish_pass() {
  if (observed_ == 0) return;
  std::size_t slot = count_;
  if (count_ == capacity_) {
    // Replace the stored map most redundant with this one: fMoE's RDY, the whole-map cosine
    // weighted (L − d)/L and the semantic one d/L when this pass has a semantic vector. The rows
    // this pass did not observe are zero, so observe()'s running dot products are whole-map ones.
    const bool with_semantic = semantic_now_norm_ != 0.0;
    const double w = with_semantic ? static_cast<double>(semantic_layers_) / static_cast<double>(layers_) : 0.0;
    double most = -std::numeric_limits<double>::infinity();
    for (std::size_t y = 0; y < count_; ++y) {
      const double r = norm_map_[y] == 0.0 || norm_new_ == 0.0 ? 0.0 : dot_[y] / std::sqrt(norm_map_[y] * norm_new_);
      const double rdy = with_semantic ? w * semantic_similarity(y) + (1.0 - w) * r : r;
      if (rdy > most || slot == count_) {  // the first map at least, whatever a similarity is
        most = rdy;
        slot = y;
      }
    }
  } else {
    store_.resize(store_.size() + current_.size());
    norm_map_.push_back(0.0);
    semantic_store_.resize(semantic_store_.size() + sketch_dims_);
    semantic_norm_.push_back(0.0);
    ++count_;
  }
  std::ranges::copy(current_, store_.begin() + static_cast<std::ptrdiff_t>(slot * current_.size()));
  norm_map_[slot] = norm_new_;
  if (sketch_dims_ != 0) {
    const auto at = semantic_store_.begin() + static_cast<std::ptrdiff_t>(slot * sketch_dims_);
    if (semantic_now_norm_ != 0.0) {
      std::ranges::copy(semantic_now_, at);
    } else {
      std::fill_n(at, sketch_dims_, 0.0F);
    }
    semantic_norm_[slot] = semantic_now_norm_;
  }
}

void fmoe_map_predictor::begin_pass() {
  finish_pass();
  std::ranges::fill(current_, 0.0F);
  std::ranges::fill(seen_, std::uint8_t{0});
  observed_ = 0;
  dot_.assign(count_, 0.0);
  norm_old_.assign(count_, 0.0);
  norm_new_ = 0.0;
  score_ = 0.0;
  semantic_ = false;
  semantic_now_norm_ = 0.0;
}

void fmoe_map_predictor::add_row(std::uint32_t layer, double sign) {
  const std::span<const float> now(current_.data() + std::size_t{layer} * experts_, experts_);
  for (const float p : now) norm_new_ += sign * static_cast<double>(p) * static_cast<double>(p);
  for (std::size_t y = 0; y < count_; ++y) {
    const std::span<const float> old = row(y, layer);
    double d = 0.0, n = 0.0;
    for (std::uint32_t e = 0; e < experts_; ++e) {
      d += static_cast<double>(now[e]) * static_cast<double>(old[e]);
      n += static_cast<double>(old[e]) * static_cast<double>(old[e]);
    }
    dot_[y] += sign * d;
    norm_old_[y] += sign * n;
  }
}

void fmoe_map_predictor::observe(std::uint32_t layer, std::span<const expert_index> experts) {
  observe_routing(layer, {.experts = experts});
}

void fmoe_map_predictor::validate_routing(std::uint32_t layer, const layer_routing& routing) const {
  check_routing("fmoe_map_predictor", layer, layers_, routing.experts, experts_);
  // A value out of [0, 1] (logits) would weigh the maps by a vector that is not a distribution,
  // and a NaN or an infinity would make every similarity NaN (and no stored map the most redundant).
  if (!routing.probabilities.empty()) {
    if (const auto problem = detail::check_probabilities(routing.probabilities, experts_)) {
      throw invalid_argument(fmt::format("fmoe_map_predictor: {}", problem->message));
    }
  }
  if (routing.sketch.empty()) return;
  if (routing.sketch.size() > max_sketch_dims) {
    throw invalid_argument(fmt::format("fmoe_map_predictor: a sketch of {} values out of range [1, {}]",
                                       routing.sketch.size(), max_sketch_dims));
  }
  if (sketch_dims_ != 0 && routing.sketch.size() != sketch_dims_) {
    throw invalid_argument(fmt::format("fmoe_map_predictor: a sketch of {} values, expected {} (the first one's)",
                                       routing.sketch.size(), sketch_dims_));
  }
  if (const auto problem = detail::check_sketch(routing.sketch, static_cast<std::uint32_t>(routing.sketch.size()))) {
    throw invalid_argument(fmt::format("fmoe_map_predictor: {}", problem->message));
  }
}

void fmoe_map_predictor::observe_routing(std::uint32_t layer, const layer_routing& routing) {
  validate_routing(layer, routing);
  // The first sketch after reset() fixes the length, wherever it comes (a later layer's, or one
  // on a call that routes nothing): the length was fixed by a first layer's alone, so a sketch
  // of another length elsewhere passed.
  if (!routing.sketch.empty() && sketch_dims_ == 0) {
    sketch_dims_ = routing.sketch.size();
    semantic_store_.assign(count_ * sketch_dims_, 0.0F);
  }
  if (routing.experts.empty() && routing.probabilities.empty()) return;
  if (dot_.size() != count_) {  // the first pass after reset(): no begin_pass() yet
    dot_.assign(count_, 0.0);
    norm_old_.assign(count_, 0.0);
  }
  // The pass's semantic vector: the sketch of its first observed layer (fMoE embeds the
  // iteration's input once).
  if (observed_ == 0 && !routing.sketch.empty()) {
    semantic_now_.assign(routing.sketch.begin(), routing.sketch.end());
    semantic_now_norm_ = 0.0;
    for (const float v : semantic_now_) semantic_now_norm_ += static_cast<double>(v) * static_cast<double>(v);
  }
  const std::span<float> now(current_.data() + std::size_t{layer} * experts_, experts_);
  // seen_: 0 not observed in this pass, 1 observed (a sparse row), 2 observed with a router vector.
  constexpr std::uint8_t sparse_row = 1;
  constexpr std::uint8_t vector_row = 2;
  const std::uint8_t before = seen_[layer];
  if (before != 0) add_row(layer, -1.0);  // observed again in this pass: its old terms go
  if (!routing.probabilities.empty()) {
    std::ranges::copy(routing.probabilities, now.begin());
  } else if (before == vector_row) {
    // A part without a vector after one with it (an engine passing the router's vector with the
    // first part of a split group only): the vector stays, and weighs this part's experts too.
    // (The union's 1/n row had turned the softmax's support, every expert, into a uniform row.)
  } else {
    // A sparse router vector: 1/n on the n experts routed (the trace has no full probabilities).
    // A layer observed again in the same pass (a split group) takes the union.
    std::size_t routed = 0;
    if (seen_[layer] != 0) {
      for (float& p : now) p = p > 0.0F ? 1.0F : 0.0F;
    } else {
      std::ranges::fill(now, 0.0F);
    }
    for (const expert_index e : routing.experts) {
      now[e] = 1.0F;
    }
    for (const float p : now) routed += p > 0.0F ? 1U : 0U;
    for (float& p : now) p = p > 0.0F ? 1.0F / static_cast<float>(routed) : 0.0F;
  }
  if (before == 0) ++observed_;
  seen_[layer] = !routing.probabilities.empty() || before == vector_row ? vector_row : sparse_row;
  // Trajectory search (Eq. 5), incrementally: add this layer's terms to every stored map's sums.
  add_row(layer, 1.0);
  // Below every cosine, so that a stored sketch opposite to this pass's (cosine −1) is still
  // chosen when it is the only one (it was skipped, and best_ kept an earlier layer's choice).
  double best = -std::numeric_limits<double>::infinity();
  semantic_ = false;
  if (observed_ <= semantic_layers_ && semantic_now_norm_ != 0.0) {
    // Semantic search (Eq. 4) while the trajectory is shorter than d layers.
    for (std::size_t y = 0; y < count_; ++y) {
      const double c = semantic_similarity(y);
      if (semantic_norm_[y] != 0.0 && c > best) {  // ties: the lower slot
        best = c;
        best_ = y;
        semantic_ = true;
      }
    }
  }
  if (!semantic_) {
    for (std::size_t y = 0; y < count_; ++y) {
      const double c = norm_old_[y] == 0.0 || norm_new_ == 0.0 ? 0.0 : dot_[y] / std::sqrt(norm_old_[y] * norm_new_);
      if (c > best) {  // ties: the lower slot
        best = c;
        best_ = y;
      }
    }
  }
  score_ = std::max(best, 0.0);
}

void fmoe_map_predictor::predict(std::uint32_t layer, std::span<float> probability) const {
  check_target("fmoe_map_predictor", layer, layers_, probability.size(), experts_);
  if (count_ == 0 || observed_ == 0) {
    std::ranges::fill(probability, static_cast<float>(top_k_) / static_cast<float>(experts_));
    return;
  }
  const std::span<const float> p = row(best_, layer);
  // Eq. 6–8: the smallest set by descending p whose mass reaches δ = clip(1 − score, 0, 1), ≥ k
  // (experts with p = 0 add no mass and would get probability 0: most_probable() leaves them out).
  most_probable(p, 0.0F, experts_, ranked_);
  const double delta = std::clamp(1.0 - score_, 0.0, 1.0);
  std::ranges::fill(probability, 0.0F);
  if (ranked_.empty()) return;
  const auto top = static_cast<double>(ranked_.front().first);
  double mass = 0.0;
  for (std::size_t i = 0; i < ranked_.size(); ++i) {
    if (i >= top_k_ && mass >= delta) break;
    const auto [pe, e] = ranked_[i];
    mass += static_cast<double>(pe);
    probability[e] = static_cast<float>(score_ * static_cast<double>(pe) / top);
  }
}

void most_probable(std::span<const float> probability, float threshold, std::size_t most,
                   std::vector<std::pair<float, expert_index>>& out) {
  out.clear();
  for (std::size_t e = 0; e < probability.size(); ++e) {
    if (probability[e] >= threshold && probability[e] > 0.0F)
      out.emplace_back(probability[e], static_cast<expert_index>(e));
  }
  const std::size_t keep = std::min(out.size(), most);
  std::partial_sort(
      out.begin(), out.begin() + static_cast<std::ptrdiff_t>(keep), out.end(),
      [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
  out.resize(keep);
}

std::unique_ptr<expert_predictor> make_predictor(std::string_view name, std::uint32_t layers,
                                                 std::uint32_t experts_per_layer, std::uint32_t top_k) {
  if (name == "frequency") return std::make_unique<frequency_predictor>(layers, experts_per_layer, top_k);
  if (name == "previous") return std::make_unique<previous_pass_predictor>(layers, experts_per_layer);
  if (name == "coactivation") return std::make_unique<coactivation_predictor>(layers, experts_per_layer, top_k);
  if (name == "fmoe") {
    // The default capacity, cut for a wide model to the maps the dense-table bound holds (at
    // least one; a shape above the bound is refused by the constructor, as by every predictor).
    const std::uint64_t cells = std::max<std::uint64_t>(saturating_product({layers, experts_per_layer}), 1);
    const auto capacity = static_cast<std::uint32_t>(
        std::clamp<std::uint64_t>(max_dense_table_cells / cells, 1, fmoe_map_predictor::default_capacity));
    return std::make_unique<fmoe_map_predictor>(layers, experts_per_layer, top_k, capacity);
  }
  throw invalid_argument(
      fmt::format("unknown predictor '{}': expected one of frequency, previous, coactivation, fmoe", name));
}

}  // namespace expage
