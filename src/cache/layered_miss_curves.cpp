#include "expage/cache/layered_miss_curves.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <limits>

namespace expage {

namespace {

// Validates before any member is built, so a bad shape never allocates.
std::size_t checked_experts(std::size_t layers, std::size_t experts_per_layer) {
  constexpr std::size_t max_layers = reuse_distance_tracker::max_key_count;  // one expert each at least
  if (layers == 0 || layers > max_layers) {
    throw invalid_argument(fmt::format("layered_miss_curves: layers {} out of range [1, {}]", layers, max_layers));
  }
  const std::size_t max_experts = reuse_distance_tracker::max_key_count / layers;
  if (experts_per_layer == 0 || experts_per_layer > max_experts) {
    throw invalid_argument(fmt::format("layered_miss_curves: experts_per_layer {} out of range [1, {}] for {} layers",
                                       experts_per_layer, max_experts, layers));
  }
  return experts_per_layer;
}

}  // namespace

layered_miss_curves::layered_miss_curves(std::size_t layers, std::size_t experts_per_layer)
    : experts_per_layer_(checked_experts(layers, experts_per_layer)),
      layers_(layers, miss_curve_builder(experts_per_layer)),
      global_(layers * experts_per_layer) {}

const miss_curve_builder& layered_miss_curves::layer(std::size_t layer) const {
  if (layer >= layers_.size()) {
    throw invalid_argument(fmt::format("layered_miss_curves: layer {} out of range [0, {})", layer, layers_.size()));
  }
  return layers_[layer];
}

miss_ratio_curve layered_miss_curves::per_layer_curve() const {
  std::vector<std::uint64_t> sum(experts_per_layer_, 0);
  std::uint64_t cold = 0;
  for (const auto& b : layers_) {
    const auto h = b.warm_histogram();
    std::transform(sum.begin(), sum.end(), h.begin(), sum.begin(), std::plus<>{});
    cold += b.compulsory_misses();
  }
  return miss_ratio_curve(sum, cold);
}

void layered_miss_curves::reset() noexcept {
  for (auto& b : layers_) b.reset();
  global_.reset();
}

void layered_miss_curves::throw_out_of_range(expert_id id) const {
  if (id.layer >= layers_.size()) {
    throw invalid_argument(
        fmt::format("layer {} out of range [0, {}) of layered_miss_curves", id.layer, layers_.size()));
  }
  throw invalid_argument(fmt::format("expert {} out of range [0, {}) in layer {} of layered_miss_curves", id.expert,
                                     experts_per_layer_, id.layer));
}

void layered_miss_curves::access_group(std::uint32_t layer, std::span<const expert_index> experts) {
  if (layer >= layers_.size()) throw_out_of_range({layer, 0});  // checked even for an empty group
  for (std::size_t i = 0; i < experts.size(); ++i) {
    if (!contains({layer, experts[i]})) throw_out_of_range({layer, experts[i]});
    for (std::size_t j = 0; j < i; ++j) {
      if (experts[j] == experts[i]) {
        throw invalid_argument(fmt::format(
            "layered_miss_curves::access_group: expert {} repeated in one group of layer {}", experts[i], layer));
      }
    }
  }
  group_distances_.clear();
  for (const std::uint32_t e : experts) {
    group_distances_.push_back({.layer = layers_[layer].tracker().distance(e),
                                .global = global_.tracker().distance(std::size_t{layer} * experts_per_layer_ + e)});
  }
  for (std::size_t i = 0; i < experts.size(); ++i) {
    layers_[layer].record_unchecked(experts[i], group_distances_[i].layer);
    global_.record_unchecked(std::size_t{layer} * experts_per_layer_ + experts[i], group_distances_[i].global);
  }
}

}  // namespace expage
