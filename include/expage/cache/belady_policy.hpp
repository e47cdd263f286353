/// @file
/// @brief belady_policy: Belady's MIN, the offline optimum.
#pragma once

#include "expage/cache/eviction_policy.hpp"

#include <cstdint>
#include <set>
#include <utility>
#include <vector>

namespace expage {

/// @brief Belady's MIN: evicts the resident, unpinned key whose next access is
/// farthest in the future (never-again keys first; among those, the largest
/// key). Needs the whole future: access_context::next_use, which the replay
/// engine computes from the trace. With demand paging and pinned working sets
/// it is the lower bound on misses for any policy at the same capacity.
/// O(log capacity) per access.
///
/// @code
/// expage::slot_cache<expage::belady_policy> cache(geometry, {.capacity = 4});
/// cache.access(layer, routed, {.time = step, .next_use = next_uses});  // replay() computes these
/// @endcode
/// @threadsafety thread-compatible.
class belady_policy {
 public:
  /// A policy over the keys of @p space.
  explicit belady_policy(const key_space& space) : next_(space.size(), never) {}
  /// Records @p key's next use.
  void on_insert(std::uint32_t key, const access_context& ctx) {
    resident_.emplace(ctx.next_use, key);  // first: it may throw bad_alloc, and then nothing changed
    next_[key] = ctx.next_use;
  }
  /// Updates @p key's next use.
  void on_hit(std::uint32_t key, const access_context& ctx) noexcept {
    // The key's node is reused: a hit never allocates, so it cannot fail halfway.
    auto node = resident_.extract({next_[key], key});
    next_[key] = ctx.next_use;
    if (node.empty()) {  // its insert failed while the cache kept it resident: ranked now
      try {
        resident_.emplace(ctx.next_use, key);
      } catch (...) {  // unranked until its next hit, as before it
      }
      return;
    }
    node.value().first = ctx.next_use;
    resident_.insert(std::move(node));
  }
  /// @p key left the cache.
  void on_evict(std::uint32_t key) noexcept { resident_.erase({next_[key], key}); }
  /// The unpinned key used farthest in the future.
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& /*ctx*/) const noexcept {
    for (auto it = resident_.rbegin(); it != resident_.rend(); ++it) {
      if (!pins(it->second)) return it->second;
    }
    return 0;
  }

 private:
  std::vector<std::uint64_t> next_;
  std::set<std::pair<std::uint64_t, std::uint32_t>> resident_;
};

static_assert(eviction_policy<belady_policy>);

}  // namespace expage
