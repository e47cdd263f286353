#include "expage/moe/routing.hpp"

#include "expage/core/error.hpp"
#include "expage/format/float16.hpp"
#include "expage/moe/detail/routing_element.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

namespace expage {
namespace {

void check_size(const char* what, const char* name, std::size_t got, std::uint64_t want) {
  if (got != want) throw invalid_argument(fmt::format("{}: {} has {} entries, expected {}", what, name, got, want));
}

void check_router_shape(router_shape shape) {
  if (shape.experts < 1 || shape.experts > max_routed_experts) {
    throw invalid_argument(
        fmt::format("router_top_k: experts {} out of range [1, {}]", shape.experts, max_routed_experts));
  }
  if (shape.top_k < 1 || shape.top_k > shape.experts) {
    throw invalid_argument(fmt::format("router_top_k: top_k {} out of range [1, {}]", shape.top_k, shape.experts));
  }
}

template <class Logit, class Widen>
void select_top_k(std::span<const Logit> logits, router_shape shape, router_gating gating,
                  std::span<std::int32_t> topk_ids, std::span<float> topk_weights,
                  std::span<std::uint32_t> expert_counts, Widen widen) {
  check_router_shape(shape);
  if (!is_valid(gating)) {
    throw invalid_argument(fmt::format("router_top_k: gating {} out of range [0, 1] (softmax, softmax_renormalized)",
                                       static_cast<unsigned>(gating)));
  }
  check_size("router_top_k", "logits", logits.size(), std::uint64_t{shape.tokens} * shape.experts);
  check_size("router_top_k", "topk_ids", topk_ids.size(), shape.pairs());
  check_size("router_top_k", "topk_weights", topk_weights.size(), shape.pairs());
  check_size("router_top_k", "expert_counts", expert_counts.size(), shape.experts);
  std::vector<float> keys(shape.experts);  // allocated before the first write to the outputs
  std::vector<std::uint32_t> ids(shape.experts);
  std::fill(expert_counts.begin(), expert_counts.end(), 0U);
  for (std::size_t t = 0; t < shape.tokens; ++t) {
    for (std::uint32_t e = 0; e < shape.experts; ++e)
      keys[e] = detail::router_key(widen(logits[t * shape.experts + e]));
    std::iota(ids.begin(), ids.end(), 0U);
    std::partial_sort(ids.begin(), ids.begin() + shape.top_k, ids.end(), [&](std::uint32_t a, std::uint32_t b) {
      return detail::router_ranks_before(keys[a], a, keys[b], b);
    });
    // The top-1 key is the maximum: exp(l − max) ≤ 1 never overflows; a +∞ maximum takes the
    // softmax's limit instead (the +∞ experts share the weight).
    const float max = keys[ids[0]];
    const bool infinite = detail::router_max_is_infinite(max);
    const auto term = [&](float k) { return infinite ? detail::router_limit_term(k) : std::exp(k - max); };
    // The sum in double, rounded once (the device kernel's too): summed in float, 65,536 equal
    // terms drifted 4e-4 from the exact softmax (7,000 ulp), and apart from the device's lanes.
    double sum = 0.0;
    if (gating == router_gating::softmax) {
      for (const float k : keys) sum += static_cast<double>(term(k));
    } else {
      for (std::uint32_t j = 0; j < shape.top_k; ++j) sum += static_cast<double>(term(keys[ids[j]]));
    }
    const auto denominator = static_cast<float>(sum);
    for (std::uint32_t j = 0; j < shape.top_k; ++j) {
      const std::size_t p = t * shape.top_k + j;
      topk_ids[p] = static_cast<std::int32_t>(ids[j]);
      topk_weights[p] = term(keys[ids[j]]) / denominator;
      ++expert_counts[ids[j]];
    }
  }
}

}  // namespace

void router_top_k(std::span<const float> logits, router_shape shape, router_gating gating,
                  std::span<std::int32_t> topk_ids, std::span<float> topk_weights,
                  std::span<std::uint32_t> expert_counts) {
  select_top_k(logits, shape, gating, topk_ids, topk_weights, expert_counts, [](float l) { return l; });
}

void router_top_k_bf16(std::span<const std::uint16_t> logits, router_shape shape, router_gating gating,
                       std::span<std::int32_t> topk_ids, std::span<float> topk_weights,
                       std::span<std::uint32_t> expert_counts) {
  select_top_k(logits, shape, gating, topk_ids, topk_weights, expert_counts,
               [](std::uint16_t l) { return bf16_to_float(l); });
}

std::uint32_t remap_experts(std::span<const std::int32_t> topk_ids, std::span<const std::int32_t> expert_map,
                            std::span<std::int32_t> slots, std::span<std::uint8_t> missing_experts) {
  if (expert_map.empty() || expert_map.size() > max_routed_experts) {
    throw invalid_argument(fmt::format("remap_experts: expert_map has {} entries, out of range [1, {}]",
                                       expert_map.size(), max_routed_experts));
  }
  if (topk_ids.size() >= max_routed_pairs) {
    throw invalid_argument(
        fmt::format("remap_experts: {} pairs out of range [0, {})", topk_ids.size(), max_routed_pairs));
  }
  check_size("remap_experts", "slots", slots.size(), topk_ids.size());
  check_size("remap_experts", "missing_experts", missing_experts.size(), expert_map.size());
  const auto experts = static_cast<std::uint32_t>(expert_map.size());
  std::fill(missing_experts.begin(), missing_experts.end(), std::uint8_t{0});
  std::uint32_t missing_pairs = 0;
  for (std::size_t p = 0; p < topk_ids.size(); ++p) {
    slots[p] = detail::remap_slot(topk_ids[p], expert_map.data(), experts);
    if (slots[p] >= 0) continue;
    ++missing_pairs;
    if (detail::group_bucket(topk_ids[p], experts) < experts)
      missing_experts[static_cast<std::size_t>(topk_ids[p])] = 1;
  }
  return missing_pairs;
}

void group_by_expert(std::span<const std::int32_t> topk_ids, std::uint32_t experts, std::span<std::uint32_t> offsets,
                     std::span<std::uint32_t> order, std::span<std::uint32_t> position) {
  if (experts < 1 || experts > max_routed_experts) {
    throw invalid_argument(
        fmt::format("group_by_expert: experts {} out of range [1, {}]", experts, max_routed_experts));
  }
  if (topk_ids.size() >= max_routed_pairs) {
    throw invalid_argument(
        fmt::format("group_by_expert: {} pairs out of range [0, {})", topk_ids.size(), max_routed_pairs));
  }
  check_size("group_by_expert", "offsets", offsets.size(), std::uint64_t{experts} + 1);
  check_size("group_by_expert", "order", order.size(), topk_ids.size());
  check_size("group_by_expert", "position", position.size(), topk_ids.size());
  // Counting sort: count each bucket (experts + 1 of them, the last for invalid ids), exclusive
  // scan, then place pairs in index order, which keeps the sort stable.
  std::vector<std::uint32_t> next(std::size_t{experts} + 1, 0U);
  for (const std::int32_t id : topk_ids) ++next[detail::group_bucket(id, experts)];
  std::exclusive_scan(next.begin(), next.end(), next.begin(), 0U);
  std::copy_n(next.begin(), offsets.size(), offsets.begin());
  for (std::size_t p = 0; p < topk_ids.size(); ++p) {
    const std::uint32_t i = next[detail::group_bucket(topk_ids[p], experts)]++;
    order[i] = static_cast<std::uint32_t>(p);
    position[p] = i;
  }
}

}  // namespace expage
