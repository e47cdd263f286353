/// @file
/// @brief visit_policy: from a run-time policy_kind to the policy type, in one place.
#pragma once

#include "expage/cache/arc_policy.hpp"
#include "expage/cache/belady_policy.hpp"
#include "expage/cache/fmoe_priority_policy.hpp"
#include "expage/cache/layer_decay_policy.hpp"
#include "expage/cache/lfru_policy.hpp"
#include "expage/cache/lfu_policy.hpp"
#include "expage/cache/lru_policy.hpp"
#include "expage/cache/next_turn_policy.hpp"
#include "expage/cache/replay.hpp"
#include "expage/cache/s3fifo_policy.hpp"
#include "expage/cache/sieve_policy.hpp"
#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <type_traits>

namespace expage {

/// The type tag visit_policy() passes; its member alias `type` is the policy.
template <eviction_policy Policy>
struct policy_tag {
  using type = Policy;  ///< The policy type.
};

/// Calls `f(policy_tag<P>{})` with the policy type @p kind names and returns what it returns.
/// Every component that runs a policy chosen at run time (replay, the simulator, the tools)
/// dispatches through this one switch, so a new policy is added in one place.
///
/// @code
/// auto misses = expage::visit_policy(kind, [&](auto tag) {
///   expage::slot_cache<typename decltype(tag)::type> cache(geometry, options);
///   ...
/// });
/// @endcode
/// @throws expage::invalid_argument when @p kind is not a declared enumerator.
template <class F>
decltype(auto) visit_policy(policy_kind kind, F&& f) {
  switch (kind) {
    case policy_kind::lru: return std::forward<F>(f)(policy_tag<lru_policy>{});
    case policy_kind::fifo: return std::forward<F>(f)(policy_tag<fifo_policy>{});
    case policy_kind::lfu: return std::forward<F>(f)(policy_tag<lfu_policy>{});
    case policy_kind::fmoe: return std::forward<F>(f)(policy_tag<fmoe_priority_policy>{});
    case policy_kind::layer_decay: return std::forward<F>(f)(policy_tag<layer_decay_policy>{});
    case policy_kind::next_turn: return std::forward<F>(f)(policy_tag<next_turn_policy>{});
    case policy_kind::belady: return std::forward<F>(f)(policy_tag<belady_policy>{});
    case policy_kind::arc: return std::forward<F>(f)(policy_tag<arc_policy>{});
    case policy_kind::s3fifo: return std::forward<F>(f)(policy_tag<s3fifo_policy>{});
    case policy_kind::sieve: return std::forward<F>(f)(policy_tag<sieve_policy>{});
    case policy_kind::lfru: return std::forward<F>(f)(policy_tag<lfru_policy>{});
  }
  throw invalid_argument(fmt::format("visit_policy: policy {} out of range [0, {})", static_cast<unsigned>(kind),
                                     all_policy_kinds().size()));
}

}  // namespace expage
