#include "expage/sim/plan.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <string>

namespace expage {
namespace {

void check(const plan_options& o) {
  if (o.budget_bytes == 0) throw invalid_argument("plan_memory: budget_bytes 0 out of range [1, 2^64)");
  if (o.kv_floor_bytes >= o.budget_bytes) {
    throw invalid_argument(fmt::format("plan_memory: kv_floor_bytes {} out of range [0, {}) (below the budget)",
                                       o.kv_floor_bytes, o.budget_bytes));
  }
  if (o.precisions.empty() || o.precisions.size() > 8) {
    throw invalid_argument(fmt::format("plan_memory: {} precisions, out of range [1, 8]", o.precisions.size()));
  }
  if (o.policy == policy_kind::belady) {
    throw invalid_argument("plan_memory: policy belady is not an online policy (it is printed beside each option)");
  }
  if (o.points < 2 || o.points > 64) {
    throw invalid_argument(fmt::format("plan_memory: points {} out of range [2, 64]", o.points));
  }
  if (!(o.tolerance >= 0.0 && o.tolerance <= 10.0)) {
    throw invalid_argument(fmt::format("plan_memory: tolerance {} out of range [0, 10]", o.tolerance));
  }
}

}  // namespace

plan_result plan_memory(const routing_trace& trace, const moe_geometry& geometry, const plan_options& options) {
  check(options);
  const bool global = options.layout == cache_layout::global;
  const std::uint64_t keys = global ? geometry.expert_count() : geometry.experts_per_layer();
  const std::uint64_t scopes = global ? 1 : geometry.layers();
  const std::uint64_t room = options.budget_bytes - options.kv_floor_bytes;
  const std::uint32_t least = geometry.top_k();  // a step's experts must fit (larger groups are split)
  plan_result plan;
  for (const precision p : options.precisions) {
    const cost_model cost =
        make_cost_model(geometry, options.hardware, p, options.dense_bytes_per_layer, options.transfer_compute_ratio);
    const std::uint64_t per_slot = cost.expert_bytes * scopes;
    const std::uint64_t most = std::min(keys, room / per_slot);
    if (most < least) {
      plan.no_room.push_back(fmt::format("{}: {} slots of {} bytes", to_string(p), most, per_slot));
      continue;
    }
    std::vector<std::uint32_t> capacities;
    for (std::uint32_t i = 0; i < options.points; ++i) {
      const double at = static_cast<double>(least) + static_cast<double>(most - least) * static_cast<double>(i) /
                                                         static_cast<double>(options.points - 1);
      const auto c = static_cast<std::uint32_t>(std::llround(at));
      if (capacities.empty() || capacities.back() != c) capacities.push_back(c);
    }
    for (const std::uint32_t c : capacities) {
      const access_stream stream(trace, c);
      const sim_options so{.layout = options.layout,
                           .capacity = c,
                           .format = p,
                           .hardware = options.hardware,
                           .transfer_compute_ratio = options.transfer_compute_ratio,
                           .dense_bytes_per_layer = options.dense_bytes_per_layer};
      plan_option o;
      o.format = p;
      o.slots = c;
      o.expert_bytes = per_slot * c;
      o.kv_bytes = options.budget_bytes - o.expert_bytes;
      o.result = simulate(stream, geometry, options.policy, so);
      o.belady_stall_per_token = simulate(stream, geometry, policy_kind::belady, so).stall_seconds_per_token();
      plan.options.push_back(std::move(o));
    }
  }
  if (plan.options.empty()) {
    throw invalid_argument(fmt::format(
        "plan_memory: the budget of {} bytes leaves {} above the KV floor of {}, less than one step's {} experts at "
        "every precision ({}): raise the budget or lower the KV floor",
        options.budget_bytes, room, options.kv_floor_bytes, least, fmt::join(plan.no_room, "; ")));
  }
  const auto time = [&](std::size_t i) { return plan.options[i].result.seconds_per_token(); };
  for (std::size_t i = 1; i < plan.options.size(); ++i) {
    if (time(i) < time(plan.best)) plan.best = i;
  }
  const double bar = (1.0 + options.tolerance) * time(plan.best);
  plan.recommended = plan.best;
  for (std::size_t i = 0; i < plan.options.size(); ++i) {
    const auto& a = plan.options[i];
    const auto& r = plan.options[plan.recommended];
    if (time(i) <= bar &&
        (a.expert_bytes < r.expert_bytes || (a.expert_bytes == r.expert_bytes && time(i) < time(plan.recommended)))) {
      plan.recommended = i;
    }
  }
  return plan;
}

}  // namespace expage
