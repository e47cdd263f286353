/// @file
/// @brief plan_memory(): how much of a GPU's pageable memory the experts need for a traffic, and
/// at which precision, with the rest left to the KV cache (expage-plan; docs/simulator.md).
///
/// For every precision asked for, it simulates (simulate(), the same model expage-sim uses)
/// `points` expert capacities from the smallest a step allows up to what the budget holds above
/// the KV floor, and reports each with its modelled stall and time per token and Belady's stall
/// beside it. The recommendation is the *knee*: the smallest expert memory whose time per token
/// is within `tolerance` of the best option's, so that every byte the experts do not need goes to
/// the KV cache, where it buys batch size or context. A budget that leaves the experts no room
/// above the KV floor is refused (WiSP Table 3: an engine must not start there).
///
/// Here the KV side is a floor and a remainder; its own misses (KV recompute weighed against
/// expert stall, the MV-WSA split) are split_sim.hpp's, which `expage-plan --sessions` adds. The
/// quality cost of lower precisions is not modelled (the tool reports each precision; choosing one
/// is a quality decision).
#pragma once

#include "expage/cache/replay.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/core/precision.hpp"
#include "expage/sim/hardware_profile.hpp"
#include "expage/sim/pager_sim.hpp"
#include "expage/trace/routing_trace.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace expage {

/// @brief What plan_memory() is asked.
struct plan_options {
  std::uint64_t budget_bytes = 0;    ///< Pageable bytes for experts and KV together, > 0.
  std::uint64_t kv_floor_bytes = 0;  ///< Bytes the KV cache needs at least (kv_admission_floor()), < budget.
  std::vector<precision> precisions{precision::bf16};             ///< Precisions of the paged experts, 1 to 8.
  policy_kind policy = policy_kind::lru;                          ///< Eviction policy (online; not Belady).
  cache_layout layout = cache_layout::global;                     ///< Slots per layer or shared.
  hardware_profile hardware = hardware_profile::preset("pcie4");  ///< Links, bandwidth, calibration.
  std::optional<double> transfer_compute_ratio{};                 ///< r: rescale the links (make_cost_model).
  std::optional<std::uint64_t> dense_bytes_per_layer{};           ///< Non-expert bytes per layer; unset: estimated.
  std::uint32_t points = 8;  ///< Capacities simulated per precision, [2, 64], evenly spread.
  double tolerance = 0.05;   ///< The knee: within (1 + tolerance)× the best time per token, [0, 10].
};

/// @brief One expert capacity at one precision.
struct plan_option {
  precision format = precision::bf16;  ///< Precision of the paged experts.
  std::uint32_t slots = 0;             ///< Expert slots (per layer in the per-layer layout, else in all).
  std::uint64_t expert_bytes = 0;      ///< Bytes the slots take.
  std::uint64_t kv_bytes = 0;          ///< Bytes left to the KV cache: budget − expert_bytes (≥ the floor).
  sim_result result;                   ///< The simulation (stall, misses, bytes, time per token).
  double belady_stall_per_token = 0;   ///< Belady's stall at the same capacity: what no policy beats.
};

/// @brief What plan_memory() recommends.
struct plan_result {
  std::vector<plan_option> options;  ///< By precision (in the order asked), then capacity ascending.
  std::size_t best = 0;              ///< The least time per token.
  std::size_t recommended = 0;       ///< The knee: least expert memory within the tolerance of the best.
  /// The precisions asked for that have no room for one step's experts above the KV floor, each
  /// as "bf16: 1 slots of N bytes" (the slots the room holds; a per-layer slot is one per layer),
  /// in the order asked; empty when every precision has options.
  std::vector<std::string> no_room;
};

/// Plans the expert memory for @p trace (in execution order) on @p geometry.
/// @throws expage::invalid_argument for options out of range (naming the value and its range), a
///         geometry mismatch, or a budget that leaves no precision room for one step's experts
///         above the KV floor.
[[nodiscard]] plan_result plan_memory(const routing_trace& trace, const moe_geometry& geometry,
                                      const plan_options& options);

}  // namespace expage
