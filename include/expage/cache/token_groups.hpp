/// @file
/// @brief group_tokens: split a step's tokens so each group's expert union fits the slots.
#pragma once

#include "expage/core/expert_id.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace expage {

/// @brief Tokens of one layer-step split into groups whose expert unions fit a capacity.
struct token_grouping {
  std::vector<std::vector<std::uint32_t>> tokens;  ///< Per group: indices of its tokens, ascending.
  std::vector<std::vector<expert_index>> experts;  ///< Per group: the union of its tokens' experts, first-seen order.
  std::size_t lower_bound = 0;  ///< ⌈|union of all experts| / capacity⌉: no split has fewer groups.
  bool proven_minimal = false;  ///< True when no split into fewer groups exists.
  /// True when the split has the fewest groups possible.
  [[nodiscard]] bool minimal() const noexcept { return proven_minimal; }
};

/// Nodes group_tokens() may explore looking for fewer groups than first-fit found. A replay calls
/// it for every layer-step whose union exceeds the slots: on a batch of 32 Qwen3-30B-A3B tokens
/// 1,000 nodes cost about 0.8 ms per step against 0.03 ms for first-fit alone, and find 0.6–3.4%
/// fewer groups (at 16 to 64 slots); 100,000 nodes (the default until 2026-11-30) cost 66 ms.
inline constexpr std::size_t default_grouping_search_budget = 1'000;

/// Splits tokens into groups whose per-group expert union has at most
/// @p capacity experts (WiSP §3.2: when a batch's expert union exceeds the
/// cap, each group runs as its own kernel call and the outputs are
/// reassembled in token order — safe because a token's output at one MoE
/// layer depends only on its own activations and experts).
///
/// Finding the fewest groups is a set-union packing problem (NP-hard in
/// general). First-fit (each token joins the first group it fits) runs first;
/// when it uses more groups than the lower bound ⌈|union|/capacity⌉, an exact
/// depth-first search looks for one group fewer, then one fewer again, down to
/// the bound (tokens with the most experts first, interchangeable empty groups
/// pruned), within @p search_budget nodes in all, and keeps the last packing it
/// found. minimal() is true when the result is proven to have the fewest groups
/// (the next count was shown impossible, or the bound is reached): small steps
/// are settled so, while large batches (32 tokens of top-8 at 16 slots, say)
/// exhaust the budget and return the fewest groups found, unproven. Tokens stay
/// in ascending order within a group, and groups are ordered by their first token.
///
/// @code
/// std::vector<std::span<const expage::expert_index>> routed = {t0_experts, t1_experts, t2_experts};
/// auto split = expage::group_tokens(routed, cache.group_limit());
/// for (std::size_t g = 0; g < split.tokens.size(); ++g) cache.access(layer, split.experts[g]);
/// @endcode
/// @throws expage::invalid_argument when @p capacity is 0 or one token alone needs more than @p capacity experts.
[[nodiscard]] token_grouping group_tokens(std::span<const std::span<const expert_index>> token_experts,
                                          std::size_t capacity,
                                          std::size_t search_budget = default_grouping_search_budget);

}  // namespace expage
