#include "expage/cuda/expert_ffn.hpp"

#include "expert_ffn_launch.hpp"

#include "expage/core/error.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/moe/expert_ffn.hpp"
#include "expage/moe/routing.hpp"
#include "expage/residency/version_record.hpp"

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>

namespace expage::cuda {

namespace {

std::uint64_t checked_pairs(std::uint32_t tokens, std::uint32_t top_k, const expert_ffn_shape& shape) {
  shape.validate("expert_ffn_async");
  const std::uint64_t pairs = std::uint64_t{tokens} * top_k;
  if (top_k < 1 || pairs >= max_routed_pairs) {
    throw invalid_argument(
        fmt::format("expert_ffn_async: top_k {} (≥ 1) and {} tokens give {} pairs, out of range "
                    "[0, {})",
                    top_k, tokens, pairs, max_routed_pairs));
  }
  return pairs;
}

}  // namespace

std::size_t expert_ffn_workspace_bytes(std::uint32_t tokens, std::uint32_t top_k, const expert_ffn_shape& shape) {
  return checked_pairs(tokens, top_k, shape) * shape.intermediate * sizeof(float);
}

void expert_ffn_async(const expert_ffn_problem& problem, void* workspace, std::size_t workspace_bytes,
                      cudaStream_t stream) {
  constexpr const char* what = "expert_ffn_async";
  const std::size_t needed = expert_ffn_workspace_bytes(problem.tokens, problem.top_k, problem.shape);
  if (problem.experts < 1 || problem.experts > max_routed_experts) {
    throw invalid_argument(
        fmt::format("{}: experts {} out of range [1, {}]", what, problem.experts, max_routed_experts));
  }
  if (problem.out == nullptr || problem.offsets == nullptr || problem.records == nullptr ||
      (problem.tokens != 0 && (problem.x == nullptr || problem.order == nullptr || problem.topk_weights == nullptr))) {
    throw invalid_argument(
        fmt::format("{}: x, out, offsets, order, topk_weights and records must be non-null device pointers", what));
  }
  if (workspace_bytes < needed ||
      (needed != 0 && (workspace == nullptr || reinterpret_cast<std::uintptr_t>(workspace) % 16 != 0))) {
    throw invalid_argument(fmt::format("{}: workspace {} of {} bytes; {} bytes, 16-byte aligned, needed", what,
                                       workspace, workspace_bytes, needed));
  }
  const detail::ffn_args args{.x = problem.x,
                              .out = problem.out,
                              .offsets = problem.offsets,
                              .order = problem.order,
                              .topk_weights = problem.topk_weights,
                              .records = problem.records,
                              .activations = static_cast<float*>(workspace),
                              .hidden = problem.shape.hidden,
                              .intermediate = problem.shape.intermediate,
                              .group_size = problem.shape.group_size,
                              .tokens = problem.tokens,
                              .top_k = problem.top_k,
                              .experts = problem.experts};
  check(detail::launch_expert_ffn(args, stream), what);
}

}  // namespace expage::cuda
