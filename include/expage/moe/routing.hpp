/// @file
/// @brief Host references of the routing step of an MoE layer: router top-k with its per-expert
/// histogram, the remap of logical experts to slots through an `expert_map`, and the grouping of
/// (token, k) pairs by expert. The CUDA kernels (expage/cuda/moe_routing.hpp) produce the same ids,
/// slots, counts and permutations.
///
/// A *pair* is one (token, k) selection; pair p = token·top_k + k indexes every per-pair array
/// (`topk_ids`, `topk_weights`, slots). Layouts and the calling sequence: docs/kernels.md.
///
/// Expert ids here are std::int32_t, not expage::expert_index: they are the engine's tensors at
/// the kernel ABI (torch.topk's ids as fused-MoE kernels take them, vLLM's int32 `expert_map`, −1
/// for an absent expert or slot), passed to the CUDA kernels unchanged. Each non-negative id is
/// an expert_index within the layer; entry e of `expert_counts` counts expert_index e.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

namespace expage {

/// The most routed experts a layer may have for the routing step and the FFN (host and CUDA):
/// `expert_counts` and the per-expert offsets are indexed by expert.
inline constexpr std::uint32_t max_routed_experts = 65536;
/// One more than the most (token, k) pairs one call may carry: pair indices are std::int32_t in the
/// kernels' permutations.
inline constexpr std::uint64_t max_routed_pairs = std::uint64_t{1} << 31U;

/// @brief How the router's logits become gating weights (both select by logit, so the chosen
/// experts are the same; only the weights differ).
enum class router_gating : std::uint8_t {
  /// Softmax over all experts, then the top-k probabilities as they are: they sum to less than 1
  /// (Qwen3 with `norm_topk_prob = false`, DeepSeek-V2).
  softmax,
  /// Softmax, top-k, then the k probabilities renormalized to sum to 1, i.e. a softmax over the k
  /// chosen logits (Mixtral; Qwen3 with `norm_topk_prob = true`).
  softmax_renormalized,
};

/// True when @p g is one of the enumerators (the router functions refuse any other value, which
/// the host and the device would otherwise read differently).
[[nodiscard]] constexpr bool is_valid(router_gating g) noexcept {
  return g == router_gating::softmax || g == router_gating::softmax_renormalized;
}

/// The lowercase name of @p g: "softmax", "softmax_renormalized", or "invalid".
[[nodiscard]] constexpr std::string_view to_string(router_gating g) noexcept {
  return g == router_gating::softmax                ? "softmax"
         : g == router_gating::softmax_renormalized ? "softmax_renormalized"
                                                    : "invalid";
}

/// @brief The sizes of one router call: logits are [tokens × experts], selections [tokens × top_k].
struct router_shape {
  std::uint32_t tokens = 0;   ///< Tokens in the batch (0 allowed: nothing to do).
  std::uint32_t experts = 0;  ///< Routed experts of the layer, in [1, 65536].
  std::uint32_t top_k = 0;    ///< Experts per token, in [1, experts].
  /// tokens · top_k: the pairs the call selects.
  [[nodiscard]] constexpr std::uint64_t pairs() const noexcept { return std::uint64_t{tokens} * top_k; }
};

/// Selects the top_k experts of every token from fp32 @p logits ([tokens × experts], row-major)
/// and writes their ids and gating weights in rank order, plus how often each expert was chosen.
///
/// Ranking: larger logit first; **on equal logits the lower expert id wins**; a NaN logit ranks
/// as −∞. Weights: p_e = exp(l_e − max_j l_j) / Σ_j exp(l_j − max_j l_j), in fp32, for
/// router_gating::softmax; divided by the sum of the k chosen p for softmax_renormalized. A token
/// with m logits of +∞ (a router that overflowed) gets the softmax's limit: 1/m for each of them,
/// 0 for the rest (renormalized: over the chosen ones). A token whose logits are all −∞ or NaN
/// gets NaN weights (its ids are still well defined).
/// @p expert_counts is overwritten: entry e counts the pairs that chose e (the per-step input of
/// hotness estimation; add it to a running histogram). O(tokens · experts · log top_k).
///
/// @code
/// expage::router_top_k(logits, {.tokens = 16, .experts = 8, .top_k = 2}, expage::router_gating::softmax_renormalized,
///                      ids, weights, counts);   // Mixtral routing
/// @endcode
/// @throws expage::invalid_argument when a dimension is out of range or a span's size is not
/// tokens·experts, tokens·top_k, tokens·top_k and experts respectively.
void router_top_k(std::span<const float> logits, router_shape shape, router_gating gating,
                  std::span<std::int32_t> topk_ids, std::span<float> topk_weights,
                  std::span<std::uint32_t> expert_counts);

/// router_top_k() on bf16 logits (bit patterns, expage/format/float16.hpp), each widened
/// exactly to fp32 first.
/// @throws expage::invalid_argument as router_top_k().
void router_top_k_bf16(std::span<const std::uint16_t> logits, router_shape shape, router_gating gating,
                       std::span<std::int32_t> topk_ids, std::span<float> topk_weights,
                       std::span<std::uint32_t> expert_counts);

/// Maps every pair's logical expert id to its slot through @p expert_map (entry e: expert e's
/// slot, −1 when not resident; WiSP §3.2, vLLM's `expert_map`) and reports what is missing.
///
/// `slots[p]` becomes the slot, or −1 when the expert is not resident (any negative map entry)
/// or the id is outside [0, expert_map.size()). `missing_experts[e]` is overwritten with 1 when at
/// least one pair asked for expert e and it is not resident, 0 otherwise (out-of-range ids flag
/// nothing). Returns the number of pairs whose slot is −1. O(pairs + experts).
///
/// @code
/// std::uint32_t misses = expage::remap_experts(ids, cache.expert_map(layer), slots, missing);
/// if (misses != 0) load_or_fall_back(missing);
/// @endcode
/// @throws expage::invalid_argument when @p expert_map is empty or longer than 65536 entries,
/// there are 2^31 pairs or more, or @p slots / @p missing_experts do not have topk_ids.size() /
/// expert_map.size() entries.
[[nodiscard]] std::uint32_t remap_experts(std::span<const std::int32_t> topk_ids,
                                          std::span<const std::int32_t> expert_map, std::span<std::int32_t> slots,
                                          std::span<std::uint8_t> missing_experts);

/// Groups the pairs by expert with a stable counting sort: the input of a grouped expert FFN.
///
/// - `offsets[e]` (experts + 1 entries): the first position of expert e's pairs in @p order;
///   expert e < experts owns positions [offsets[e], offsets[e+1]), and
///   offsets[experts] is the number of pairs with a valid id; pairs whose id is outside
///   [0, experts) follow, in positions [offsets[experts], pairs).
/// - `order[i]`: the pair at position i, ascending pair index within each expert (stable), so a
///   pair's token is order[i] / top_k.
/// - `position[p]`: the inverse, where pair p went (to scatter per-pair results back).
///
/// O(pairs + experts).
/// @code
/// expage::group_by_expert(ids, 8, offsets, order, position);
/// for (std::uint32_t e = 0; e < 8; ++e)
///   for (std::uint32_t i = offsets[e]; i < offsets[e + 1]; ++i) run(e, order[i] / top_k);
/// @endcode
/// @throws expage::invalid_argument when @p experts is not in [1, 65536], there are 2^31 pairs or
/// more, or the outputs do not have experts + 1, pairs and pairs entries.
void group_by_expert(std::span<const std::int32_t> topk_ids, std::uint32_t experts, std::span<std::uint32_t> offsets,
                     std::span<std::uint32_t> order, std::span<std::uint32_t> position);

}  // namespace expage
