// The one validation of a routing record, shared by routing_trace::append and every reader, so
// each rule has one owner and one message. Not API.
#pragma once

#include "expage/trace/routing_trace.hpp"

#include <cstdint>
#include <optional>
#include <span>
#include <string>

namespace expage::detail {

/// The field a record_problem is about (readers map it to the name the input used).
enum class record_field : std::uint8_t { step, layer, phase, experts, weights, probabilities, sketch };

/// What is wrong with a record, e.g. {experts, "expert 9 out of range [0, 8) in layer 3"}.
struct record_problem {
  record_field field;
  std::string message;
};

/// The canonical name of @p f ("layer", "phase", "experts", "weights", "probabilities", "sketch").
[[nodiscard]] std::string_view to_string(record_field f) noexcept;

/// The optional fields @p event itself carries (what the first event of an undeclared trace sets).
[[nodiscard]] trace_fields fields_of(const routing_event& event) noexcept;

/// The first rule @p event breaks for a trace of @p layers × @p experts_per_layer routing
/// @p top_k per token whose records carry @p fields, or nothing when it is valid: layer in
/// [0, layers), a known phase, exactly top_k distinct experts in [0, experts_per_layer), as many
/// weights (finite, ≥ 0) as experts, then the optional fields: present exactly when @p fields
/// says (a trace has each on every record or on none), probabilities as check_probabilities(),
/// a sketch as check_sketch().
[[nodiscard]] std::optional<record_problem> check_record(const routing_event& event, std::uint32_t layers,
                                                         std::uint32_t experts_per_layer, std::uint32_t top_k,
                                                         const trace_fields& fields);

/// The first problem of the router probability vector @p p: experts_per_layer values, each
/// finite and in [0, 1], summing to 1 ± probability_sum_tolerance (in double).
[[nodiscard]] std::optional<record_problem> check_probabilities(std::span<const float> p,
                                                                std::uint32_t experts_per_layer);

/// The first problem of the hidden-state sketch @p s: sketch_dims (≤ max_sketch_dims) finite values.
[[nodiscard]] std::optional<record_problem> check_sketch(std::span<const float> s, std::uint32_t sketch_dims);

}  // namespace expage::detail
