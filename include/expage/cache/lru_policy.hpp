/// @file
/// @brief lru_policy and fifo_policy: recency- and insertion-ordered eviction.
#pragma once

#include "expage/cache/detail/key_list.hpp"
#include "expage/cache/eviction_policy.hpp"

#include <cstdint>

namespace expage {

/// @brief Least recently used: evicts the resident, unpinned key whose last
/// access is oldest (WiSP Algorithm 1's per-slot LRU ticks, as a list).
///
/// O(1) per hit, insertion and eviction (plus one step per pinned key skipped,
/// at most the step's working set).
///
/// @code
/// expage::slot_cache<expage::lru_policy> cache(geometry, {.layout = expage::cache_layout::per_layer, .capacity = 4});
/// @endcode
/// @threadsafety thread-compatible.
class lru_policy {
 public:
  /// A policy over the keys of @p space.
  explicit lru_policy(const key_space& space) : order_(space.size()) {}
  /// @p key became resident: it is the most recent.
  void on_insert(std::uint32_t key, const access_context& /*ctx*/) noexcept { order_.push_front(key); }
  /// @p key was used: it is the most recent.
  void on_hit(std::uint32_t key, const access_context& /*ctx*/) noexcept { order_.move_to_front(key); }
  /// @p key left the cache.
  void on_evict(std::uint32_t key) noexcept { order_.unlink(key); }
  /// The least recently used unpinned key.
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& /*ctx*/) const noexcept {
    return order_.oldest_unpinned(pins);
  }

 private:
  detail::key_list order_;
};

/// @brief First in, first out: evicts the unpinned key that became resident
/// earliest; hits do not change the order.
///
/// @code
/// expage::slot_cache<expage::fifo_policy> cache(geometry, {.capacity = 4});
/// @endcode
/// @threadsafety thread-compatible.
class fifo_policy {
 public:
  /// A policy over the keys of @p space.
  explicit fifo_policy(const key_space& space) : order_(space.size()) {}
  /// @p key became resident: it is the newest.
  void on_insert(std::uint32_t key, const access_context& /*ctx*/) noexcept { order_.push_front(key); }
  /// Hits do not reorder.
  void on_hit(std::uint32_t /*key*/, const access_context& /*ctx*/) noexcept {}
  /// @p key left the cache.
  void on_evict(std::uint32_t key) noexcept { order_.unlink(key); }
  /// The earliest-inserted unpinned key.
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& /*ctx*/) const noexcept {
    return order_.oldest_unpinned(pins);
  }

 private:
  detail::key_list order_;
};

static_assert(eviction_policy<lru_policy>);
static_assert(eviction_policy<fifo_policy>);

}  // namespace expage
