/// @file
/// @brief shuffle_tokens(): the shuffled-order control for predictors (docs/prefetch.md).
///
/// A predictor that looks good may only be exploiting what any token shares with any other (the
/// per-layer popularity of experts, the co-activation of experts within one token). Run it again
/// on the same trace with each sequence's decode tokens in a random order: what it still buys
/// there comes from within-token structure and popularity; what it loses came from the order of
/// tokens (temporal locality). Predictors are reported beside this control, not only against a
/// uniform baseline.
#pragma once

#include "expage/trace/routing_trace.hpp"

#include <cstdint>

namespace expage {

/// Returns @p trace with the decode tokens of every sequence permuted: each sequence's decode
/// steps are shuffled among themselves (a uniformly random permutation from @p seed and the
/// sequence id, so a sequence's permutation does not depend on which other sequences are present),
/// and every event of a token moves with it, so each token's layers stay together and in order.
/// Prefill tokens, the set of steps of each sequence (gaps included), the batch size and all
/// other fields are unchanged; the result is in execution order. Deterministic per seed.
[[nodiscard]] routing_trace shuffle_tokens(const routing_trace& trace, std::uint64_t seed);

}  // namespace expage
