// The one validation of a routing record, shared by routing_trace::append and every reader, so
// each rule has one owner and one message. Not API.
#pragma once

#include "expage/trace/routing_trace.hpp"

#include <cstdint>
#include <optional>
#include <string>

namespace expage::detail {

/// The field a record_problem is about (readers map it to the name the input used).
enum class record_field : std::uint8_t { layer, phase, experts, weights, probabilities };

/// What is wrong with a record, e.g. {experts, "expert 9 out of range [0, 8) in layer 3"}.
struct record_problem {
  record_field field;
  std::string message;
};

/// The canonical name of @p f ("layer", "phase", "experts", "weights", "probabilities").
[[nodiscard]] std::string_view to_string(record_field f) noexcept;

/// The first rule @p event breaks for a trace of @p layers × @p experts_per_layer routing
/// @p top_k per token, or nothing when it is valid: layer in [0, layers), a known phase, exactly
/// top_k distinct experts in [0, experts_per_layer), as many weights (finite, ≥ 0) as experts,
/// probabilities empty or experts_per_layer finite non-negative floats.
[[nodiscard]] std::optional<record_problem> check_record(const routing_event& event, std::uint32_t layers,
                                                         std::uint32_t experts_per_layer, std::uint32_t top_k);

}  // namespace expage::detail
