#include "expage/cuda/moe_routing.hpp"

#include "moe_routing_launch.hpp"

#include "expage/core/error.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/moe/routing.hpp"

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>

namespace expage::cuda {
namespace {

void require(bool ok, const char* what, const char* message) {
  if (!ok) throw invalid_argument(fmt::format("{}: {}", what, message));
}

void check_experts(const char* what, std::uint32_t experts) {
  if (experts < 1 || experts > max_routed_experts) {
    throw invalid_argument(fmt::format("{}: experts {} out of range [1, {}]", what, experts, max_routed_experts));
  }
}

void check_pairs(const char* what, std::uint64_t pairs) {
  if (pairs >= max_routed_pairs)
    throw invalid_argument(fmt::format("{}: {} pairs out of range [0, {})", what, pairs, max_routed_pairs));
}

void launch_router(const void* logits, bool bf16, router_shape shape, router_gating gating, std::int32_t* topk_ids,
                   float* topk_weights, std::uint32_t* expert_counts, cudaStream_t stream) {
  const char* what = bf16 ? "router_top_k_bf16_async" : "router_top_k_async";
  check_experts(what, shape.experts);
  if (shape.top_k < 1 || shape.top_k > shape.experts) {
    throw invalid_argument(fmt::format("{}: top_k {} out of range [1, {}]", what, shape.top_k, shape.experts));
  }
  check_pairs(what, shape.pairs());
  if (!is_valid(gating)) {
    throw invalid_argument(fmt::format("{}: gating {} out of range [0, 1] (softmax, softmax_renormalized)", what,
                                       static_cast<unsigned>(gating)));
  }
  require(expert_counts != nullptr, what, "expert_counts must be a non-null device pointer");
  require(shape.tokens == 0 || (logits != nullptr && topk_ids != nullptr && topk_weights != nullptr), what,
          "logits, topk_ids and topk_weights must be non-null device pointers");
  const detail::router_args args{.logits = logits,
                                 .ids = topk_ids,
                                 .weights = topk_weights,
                                 .counts = expert_counts,
                                 .tokens = shape.tokens,
                                 .experts = shape.experts,
                                 .top_k = shape.top_k,
                                 .bf16 = bf16,
                                 .renormalize = gating == router_gating::softmax_renormalized};
  check(detail::launch_router_top_k(args, stream), what);
}

}  // namespace

void router_top_k_async(const float* logits, router_shape shape, router_gating gating, std::int32_t* topk_ids,
                        float* topk_weights, std::uint32_t* expert_counts, cudaStream_t stream) {
  launch_router(logits, false, shape, gating, topk_ids, topk_weights, expert_counts, stream);
}

void router_top_k_bf16_async(const std::uint16_t* logits, router_shape shape, router_gating gating,
                             std::int32_t* topk_ids, float* topk_weights, std::uint32_t* expert_counts,
                             cudaStream_t stream) {
  launch_router(logits, true, shape, gating, topk_ids, topk_weights, expert_counts, stream);
}

void remap_experts_async(const std::int32_t* topk_ids, std::uint32_t pairs, const std::int32_t* expert_map,
                         std::uint32_t experts, std::int32_t* slots, std::uint8_t* missing_experts,
                         std::uint32_t* missing_pairs, cudaStream_t stream) {
  constexpr const char* what = "remap_experts_async";
  check_experts(what, experts);
  check_pairs(what, pairs);
  require(expert_map != nullptr && missing_experts != nullptr && missing_pairs != nullptr, what,
          "expert_map, missing_experts and missing_pairs must be non-null device pointers");
  require(pairs == 0 || (topk_ids != nullptr && slots != nullptr), what,
          "topk_ids and slots must be non-null device pointers");
  check(detail::launch_remap(topk_ids, pairs, expert_map, experts, slots, missing_experts, missing_pairs, stream),
        what);
}

std::size_t group_by_expert_workspace_bytes(std::uint32_t pairs, std::uint32_t experts) {
  constexpr const char* what = "group_by_expert_workspace_bytes";
  check_experts(what, experts);
  check_pairs(what, pairs);
  std::size_t bytes = 0;
  check(detail::group_workspace_bytes(pairs, experts, &bytes), what);
  return bytes;
}

void group_by_expert_async(const std::int32_t* topk_ids, std::uint32_t pairs, std::uint32_t experts, void* workspace,
                           std::size_t workspace_bytes, std::uint32_t* offsets, std::uint32_t* order,
                           std::uint32_t* position, cudaStream_t stream) {
  constexpr const char* what = "group_by_expert_async";
  check_experts(what, experts);
  check_pairs(what, pairs);
  require(workspace != nullptr && offsets != nullptr, what, "workspace and offsets must be non-null device pointers");
  require(pairs == 0 || (topk_ids != nullptr && order != nullptr && position != nullptr), what,
          "topk_ids, order and position must be non-null device pointers");
  if (reinterpret_cast<std::uintptr_t>(workspace) % 256 != 0) {
    throw invalid_argument(fmt::format("{}: workspace {} is not 256-byte aligned", what, workspace));
  }
  const std::size_t needed = group_by_expert_workspace_bytes(pairs, experts);
  if (workspace_bytes < needed) {
    throw invalid_argument(fmt::format("{}: workspace of {} bytes, at least {} needed for {} pairs and {} experts",
                                       what, workspace_bytes, needed, pairs, experts));
  }
  check(detail::launch_group_by_expert(topk_ids, pairs, experts, workspace, workspace_bytes, offsets, order, position,
                                       stream),
        what);
}

}  // namespace expage::cuda
