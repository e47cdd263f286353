/// @file
/// @brief sieve_policy: SIEVE, a FIFO queue with a visited bit and a moving hand (Zhang et al., NSDI'24).
#pragma once

#include "expage/cache/detail/key_list.hpp"
#include "expage/cache/eviction_policy.hpp"

#include <cstdint>
#include <vector>

namespace expage {

/// @brief SIEVE (Zhang et al., "SIEVE is Simpler than LRU", NSDI'24): keys sit in one FIFO queue
/// in insertion order and never move; a hit only sets the key's visited bit. To evict, a hand
/// walks from where it last stopped toward newer keys (from the oldest on the first eviction, and
/// again after passing the newest), clearing the visited bits it passes, and evicts the first
/// unvisited key; the hand then rests on the key after the victim.
///
/// Pins: the hand passes pinned keys without touching them (their visited bit is kept and they
/// are never evicted), so a pinned expert neither loses the credit of a hit in the current step
/// nor blocks the sweep. victim() moves the hand and clears bits (the sweep is the eviction
/// decision); a caller that then evicts another key, or none, leaves the hand where the sweep
/// stopped. The hand is placed past the victim by victim() itself, because slot_cache inserts
/// the newcomer before it evicts: were the hand set on eviction instead, it would rest on the
/// newcomer whenever the victim was the newest key (libCacheSim's Sieve.c evicts first and
/// inserts after, which this reproduces).
///
/// Cost: O(1) per hit and insertion; an eviction is O(1) amortized (each pass over a key clears
/// its bit, and only hits set it again), plus one step per pinned key passed. No allocation after
/// construction.
///
/// @code
/// expage::slot_cache<expage::sieve_policy> cache(geometry, {.layout = expage::cache_layout::global, .capacity = 128});
/// @endcode
/// @threadsafety thread-compatible.
class sieve_policy {
 public:
  /// A policy over the keys of @p space.
  explicit sieve_policy(const key_space& space) : queue_(space.size()), visited_(space.size(), 0) {}
  /// @p key became resident: it joins the queue's new end, unvisited.
  void on_insert(std::uint32_t key, const access_context& /*ctx*/) noexcept {
    queue_.push_front(key);
    visited_[key] = 0;
  }
  /// @p key was used: it is marked visited; nothing moves.
  void on_hit(std::uint32_t key, const access_context& /*ctx*/) noexcept { visited_[key] = 1; }
  /// @p key left the cache; a hand resting on it moves to the next newer key.
  void on_evict(std::uint32_t key) noexcept {
    if (hand_ == key) hand_ = queue_.newer(key);
    queue_.unlink(key);
  }
  /// Sweeps from the hand toward newer keys, clearing visited bits of the unpinned keys it
  /// passes, and returns the first unpinned, unvisited key; the hand moves past it.
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& /*ctx*/) noexcept {
    std::uint32_t k = hand_ == none ? queue_.oldest() : hand_;
    // Two passes clear every unpinned bit, so a third cannot be needed; the bound only
    // guards the precondition (some unpinned key exists).
    for (std::uint64_t steps = 0; steps <= 2 * std::uint64_t{queue_.size()} + 1; ++steps) {
      if (k == none) k = queue_.oldest();  // past the newest: wrap to the oldest
      if (!pins(k)) {
        if (visited_[k] == 0) {
          hand_ = queue_.newer(k);
          return k;
        }
        visited_[k] = 0;
      }
      k = queue_.newer(k);
    }
    return queue_.oldest();  // unreachable while an unpinned key is resident
  }
  /// True when @p key's visited bit is set.
  [[nodiscard]] bool visited(std::uint32_t key) const noexcept { return visited_[key] != 0; }

 private:
  static constexpr std::uint32_t none = detail::key_list::none;
  detail::key_list queue_;  // front: newest insertion
  std::vector<std::uint8_t> visited_;
  std::uint32_t hand_ = none;  // where the next sweep starts; none: at the oldest
};

static_assert(eviction_policy<sieve_policy>);

}  // namespace expage
