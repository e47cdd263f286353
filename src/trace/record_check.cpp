#include "record_check.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace expage::detail {

std::string_view to_string(record_field f) noexcept {
  switch (f) {
    case record_field::layer: return "layer";
    case record_field::phase: return "phase";
    case record_field::experts: return "experts";
    case record_field::weights: return "weights";
    case record_field::probabilities: return "probabilities";
  }
  return "record";
}

std::optional<record_problem> check_record(const routing_event& e, std::uint32_t layers,
                                           std::uint32_t experts_per_layer, std::uint32_t top_k) {
  if (e.layer >= layers) {
    return record_problem{record_field::layer, fmt::format("layer {} out of range [0, {})", e.layer, layers)};
  }
  if (e.phase != routing_phase::decode && e.phase != routing_phase::prefill) {
    return record_problem{record_field::phase,
                          fmt::format("phase {} out of range [0, 1]", static_cast<unsigned>(e.phase))};
  }
  if (e.experts.size() != top_k) {
    return record_problem{record_field::experts,
                          fmt::format("{} experts where the geometry's top_k is {}", e.experts.size(), top_k)};
  }
  for (std::size_t j = 0; j < e.experts.size(); ++j) {
    const std::uint32_t x = e.experts[j];
    if (x >= experts_per_layer) {
      return record_problem{record_field::experts,
                            fmt::format("expert {} out of range [0, {}) in layer {}", x, experts_per_layer, e.layer)};
    }
    if (std::find(e.experts.begin(), e.experts.begin() + static_cast<std::ptrdiff_t>(j), x) !=
        e.experts.begin() + static_cast<std::ptrdiff_t>(j)) {
      return record_problem{record_field::experts, fmt::format("expert {} appears twice in layer {}", x, e.layer)};
    }
  }
  if (e.weights.size() != e.experts.size()) {
    return record_problem{record_field::weights,
                          fmt::format("{} weights for {} experts", e.weights.size(), e.experts.size())};
  }
  for (const float w : e.weights) {
    if (!std::isfinite(w) || w < 0.0F) {
      return record_problem{record_field::weights, fmt::format("weight {} out of range [0, inf)", w)};
    }
  }
  if (!e.probabilities.empty()) {
    if (e.probabilities.size() != experts_per_layer) {
      return record_problem{record_field::probabilities, fmt::format("{} probabilities where experts_per_layer is {}",
                                                                     e.probabilities.size(), experts_per_layer)};
    }
    for (const float p : e.probabilities) {
      if (!std::isfinite(p) || p < 0.0F) {
        return record_problem{record_field::probabilities, fmt::format("probability {} out of range [0, inf)", p)};
      }
    }
  }
  return std::nullopt;
}

}  // namespace expage::detail
