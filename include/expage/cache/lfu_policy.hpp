/// @file
/// @brief lfu_policy: evict the least frequently used expert.
#pragma once

#include "expage/cache/detail/ranking.hpp"
#include "expage/cache/eviction_policy.hpp"

#include <compare>
#include <cstdint>
#include <vector>

namespace expage {

/// @brief Least frequently used, counting every access over the whole history
/// (counts survive eviction, as MoE-Infinity's activation counts do).
///
/// Tie-breaking: among equal counts the key accessed least recently goes first;
/// among equal counts and times (only possible within one access group) the
/// smaller key goes first. O(log capacity) per access.
///
/// @code
/// expage::slot_cache<expage::lfu_policy> cache(geometry, {.layout = expage::cache_layout::global, .capacity = 128});
/// @endcode
/// @threadsafety thread-compatible.
class lfu_policy {
 public:
  /// A policy over the keys of @p space.
  explicit lfu_policy(const key_space& space) : count_(space.size(), 0), last_(space.size(), 0) {}
  /// Counts the access and ranks @p key.
  void on_insert(std::uint32_t key, const access_context& ctx) {
    const auto count = count_[key];
    const auto last = last_[key];
    ++count_[key];
    last_[key] = ctx.time;
    try {
      resident_.insert(rank_of(key));
    } catch (...) {  // bad_alloc: the access is not counted (strong guarantee)
      count_[key] = count;
      last_[key] = last;
      throw;
    }
  }
  /// Counts the access and re-ranks @p key.
  void on_hit(std::uint32_t key, const access_context& ctx) noexcept {
    const auto old = rank_of(key);
    ++count_[key];
    last_[key] = ctx.time;
    resident_.rerank(old, rank_of(key));
  }
  /// A prefetch made @p key resident: ranked by the accesses it had, none counted (a guess is not
  /// a use; its first use counts, through on_hit()). Strong guarantee.
  void on_prefetch(std::uint32_t key, const access_context& /*ctx*/) { resident_.insert(rank_of(key)); }
  /// @p key left the cache; its count is kept.
  void on_evict(std::uint32_t key) noexcept { resident_.erase(rank_of(key)); }
  /// The unpinned key with the fewest accesses (then the oldest, then the smallest).
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& /*ctx*/) const noexcept {
    return resident_.first_unpinned(pins);
  }
  /// Accesses of @p key so far.
  [[nodiscard]] std::uint64_t count(std::uint32_t key) const noexcept { return count_[key]; }

 private:
  struct rank {
    std::uint64_t count;
    std::uint64_t last;
    std::uint32_t key;
    friend auto operator<=>(const rank&, const rank&) = default;
  };
  [[nodiscard]] rank rank_of(std::uint32_t key) const noexcept { return {count_[key], last_[key], key}; }

  std::vector<std::uint64_t> count_;
  std::vector<std::uint64_t> last_;
  detail::ranked_residents<rank> resident_;
};

static_assert(eviction_policy<lfu_policy>);

}  // namespace expage
