#include "record_check.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace expage::detail {

std::string_view to_string(record_field f) noexcept {
  switch (f) {
    case record_field::step: return "step";
    case record_field::layer: return "layer";
    case record_field::phase: return "phase";
    case record_field::experts: return "experts";
    case record_field::weights: return "weights";
    case record_field::probabilities: return "probabilities";
    case record_field::sketch: return "sketch";
  }
  return "record";
}

trace_fields fields_of(const routing_event& e) noexcept {
  return {.probabilities = !e.probabilities.empty(), .sketch_dims = static_cast<std::uint32_t>(e.sketch.size())};
}

std::optional<record_problem> check_probabilities(std::span<const float> p, std::uint32_t experts_per_layer) {
  if (p.size() != experts_per_layer) {
    return record_problem{record_field::probabilities,
                          fmt::format("{} probabilities where experts_per_layer is {}", p.size(), experts_per_layer)};
  }
  double sum = 0.0;
  for (std::size_t j = 0; j < p.size(); ++j) {
    if (!std::isfinite(p[j]) || p[j] < 0.0F || p[j] > 1.0F) {
      return record_problem{record_field::probabilities,
                            fmt::format("probability {} of expert {} out of range [0, 1]", p[j], j)};
    }
    sum += static_cast<double>(p[j]);
  }
  if (std::abs(sum - 1.0) > probability_sum_tolerance) {
    return record_problem{record_field::probabilities,
                          fmt::format("probabilities sum to {} out of range [{}, {}] (1 ± probability_sum_tolerance; "
                                      "a softmax over all experts, not logits or a top-k slice)",
                                      sum, 1.0 - probability_sum_tolerance, 1.0 + probability_sum_tolerance)};
  }
  return std::nullopt;
}

std::optional<record_problem> check_sketch(std::span<const float> s, std::uint32_t sketch_dims) {
  if (s.size() != sketch_dims) {
    return record_problem{record_field::sketch,
                          fmt::format("{} sketch values where the trace's sketch_dims is {}", s.size(), sketch_dims)};
  }
  for (std::size_t j = 0; j < s.size(); ++j) {
    if (!std::isfinite(s[j])) {
      return record_problem{
          record_field::sketch,
          fmt::format("sketch value {} at dimension {} out of range (-inf, inf): not finite", s[j], j)};
    }
  }
  return std::nullopt;
}

std::optional<record_problem> check_record(const routing_event& e, std::uint32_t layers,
                                           std::uint32_t experts_per_layer, std::uint32_t top_k,
                                           const trace_fields& fields) {
  if (e.layer >= layers) {
    return record_problem{record_field::layer, fmt::format("layer {} out of range [0, {})", e.layer, layers)};
  }
  if (e.phase != routing_phase::decode && e.phase != routing_phase::prefill) {
    return record_problem{record_field::phase,
                          fmt::format("phase {} out of range [0, 1]", static_cast<unsigned>(e.phase))};
  }
  if (e.phase == routing_phase::prefill && e.step == std::numeric_limits<std::uint32_t>::max()) {
    return record_problem{record_field::step,
                          fmt::format("{} out of range [0, {}] for a prefill record (the prefill's length, step + 1, "
                                      "is 32 bits)",
                                      e.step, std::numeric_limits<std::uint32_t>::max() - 1)};
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
  // A trace carries each optional field on every record or on none: a record that differs is
  // refused here, where the caller names it, rather than stored as a hole a consumer must test for.
  if (e.probabilities.empty() == fields.probabilities) {
    return record_problem{record_field::probabilities,
                          fields.probabilities
                              ? std::string("missing where the trace's records carry probability vectors (a trace has "
                                            "the field on every record or on none)")
                              : std::string("present where the trace's records carry none (a trace has the field on "
                                            "every record or on none)")};
  }
  if (fields.probabilities) {
    if (auto problem = check_probabilities(e.probabilities, experts_per_layer)) return problem;
  }
  if (e.sketch.size() > max_sketch_dims) {
    return record_problem{record_field::sketch, fmt::format("{} sketch values out of range [1, {}] (max_sketch_dims)",
                                                            e.sketch.size(), max_sketch_dims)};
  }
  if (e.sketch.empty() != (fields.sketch_dims == 0)) {
    return record_problem{record_field::sketch,
                          fields.sketch_dims > 0
                              ? fmt::format("missing where the trace's records carry a sketch of {} values (a trace "
                                            "has the field on every record or on none)",
                                            fields.sketch_dims)
                              : std::string("present where the trace's records carry none (a trace has the field on "
                                            "every record or on none)")};
  }
  if (fields.sketch_dims > 0) {
    if (auto problem = check_sketch(e.sketch, fields.sketch_dims)) return problem;
  }
  return std::nullopt;
}

}  // namespace expage::detail
