/// @file
/// @brief s3fifo_policy: S3-FIFO, a small probation FIFO, a main FIFO and a ghost FIFO (Yang et al., SOSP'23).
#pragma once

#include "expage/cache/detail/key_list.hpp"
#include "expage/cache/eviction_policy.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace expage {

/// @brief S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23):
/// three FIFO queues and a 2-bit access counter per resident key.
///
/// - A new key enters the **small** queue (10% of the slots), unless the **ghost** queue
///   remembers it, in which case it enters the **main** queue; its counter starts at 0. While
///   the cache first fills, keys beyond the small queue's share go to the main queue. A hit adds
///   1 to the counter, saturating at 3; nothing moves.
/// - Eviction reads from the main queue when it holds more than its share (the slots minus the
///   small queue's ⌊0.1·c⌋) or the small queue is empty, else from the small queue:
///   - small: the oldest key moves to the main queue (counter reset to 0) if it was hit at least
///     twice since it entered, and the next oldest is examined; otherwise it is the victim, and
///     once evicted it enters the ghost queue;
///   - main: the oldest key, if its counter is non-zero, is reinserted at the new end with the
///     counter decreased by one (a 2-bit CLOCK); otherwise it is the victim (no ghost).
/// - The ghost queue holds keys only, at most ⌊0.9·c⌋, the oldest forgotten first; a key leaves
///   it when it is inserted again.
///
/// The sizes, the threshold of two hits, the first fill and the order of the checks are those of
/// libCacheSim's `S3FIFO.c`, the authors' implementation (docs/caches.md lists where this
/// differs from libCacheSim).
///
/// The slot count c is learned, not configured: it is the number of residents when victim() is
/// called (the cache is full then); until the first call there are no ghosts, and keys evicted
/// before it leave no ghost. At the first call the keys inserted beyond the small queue's share
/// move to the main queue, as if c had been known from the start.
///
/// Pins: a pinned key is passed over where it stands, in either queue: it is not moved, its
/// counter is not changed, and the key behind it is examined instead; if one queue holds only
/// pinned keys the other is used. A key evicted from the small queue while older pinned ones
/// were passed still enters the ghost queue, like any small-queue victim. Ghosts are never
/// pinned (they are not resident). victim() performs the moves it examines (promotions and
/// reinsertions are part of the eviction decision); a caller that then evicts another key, or
/// none, keeps them.
///
/// Cost: O(1) per hit and insertion; an eviction is O(1) amortized (each key is promoted once
/// and reinserted at most three times per hit credit), plus one step per pinned key passed. No
/// allocation after construction.
///
/// @code
/// expage::slot_cache<expage::s3fifo_policy> cache(geometry,
///                                                 {.layout = expage::cache_layout::global, .capacity = 128});
/// @endcode
/// @threadsafety thread-compatible.
class s3fifo_policy {
 public:
  /// Where a key is.
  enum class queue : std::uint8_t {
    none,   ///< Neither resident nor remembered.
    small,  ///< Resident, in the small (probation) queue.
    main,   ///< Resident, in the main queue.
    ghost,  ///< Evicted from the small queue and remembered.
  };

  /// Hits a small-queue key needs to be promoted to the main queue instead of evicted.
  static constexpr std::uint8_t move_to_main_threshold = 2;
  /// The counter's ceiling (2 bits).
  static constexpr std::uint8_t max_frequency = 3;

  /// A policy over the keys of @p space.
  explicit s3fifo_policy(const key_space& space)
      : small_(space.size()),
        main_(space.size()),
        ghost_(space.size()),
        where_(space.size(), queue::none),
        frequency_(space.size(), 0) {}

  /// @p key became resident: into the main queue if the ghost queue remembers it, else the small one.
  void on_insert(std::uint32_t key, const access_context& /*ctx*/) noexcept {
    if (where_[key] == queue::ghost) {
      ghost_.unlink(key);
      main_.push_front(key);
      where_[key] = queue::main;
    } else {
      small_.push_front(key);
      where_[key] = queue::small;
    }
    frequency_[key] = 0;
  }
  /// @p key was used: its counter grows, up to 3.
  void on_hit(std::uint32_t key, const access_context& /*ctx*/) noexcept {
    frequency_[key] = static_cast<std::uint8_t>(std::min<int>(frequency_[key] + 1, max_frequency));
  }
  /// @p key left the cache: from the small queue it is remembered in the ghost queue.
  void on_evict(std::uint32_t key) noexcept {
    if (where_[key] == queue::small) {
      small_.unlink(key);
      where_[key] = queue::none;
      if (ghost_capacity() > 0) {
        ghost_.push_front(key);
        where_[key] = queue::ghost;
        while (ghost_.size() > ghost_capacity()) {
          where_[ghost_.oldest()] = queue::none;
          ghost_.unlink(ghost_.oldest());
        }
      }
    } else if (where_[key] == queue::main) {
      main_.unlink(key);
      where_[key] = queue::none;
    }
  }
  /// The next victim (see the class comment); promotes and reinserts the keys it passes.
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& /*ctx*/) noexcept {
    slots_ = small_.size() + main_.size();
    if (!evicted_) split_the_first_fill();
    bool from_main = main_.size() > main_capacity() || small_.empty();
    // Each step promotes or reinserts a key (at most 1 + 3 steps per key between evictions)
    // or returns; the bound only guards the precondition (some unpinned key exists).
    for (std::uint64_t steps = 0; steps <= 8 * std::uint64_t{slots_} + 2; ++steps) {
      if (!from_main) {
        const std::uint32_t k = small_.oldest_unpinned(pins);
        if (k == none) {
          from_main = true;
          continue;
        }
        if (frequency_[k] < move_to_main_threshold) return k;
        small_.unlink(k);
        main_.push_front(k);
        where_[k] = queue::main;
        frequency_[k] = 0;
      } else {
        const std::uint32_t k = main_.oldest_unpinned(pins);
        if (k == none) {
          from_main = false;
          continue;
        }
        if (frequency_[k] == 0) return k;
        main_.move_to_front(k);
        --frequency_[k];
      }
    }
    return small_.empty() ? main_.oldest() : small_.oldest();  // unreachable with an unpinned resident
  }

  /// Where @p key is.
  [[nodiscard]] queue where(std::uint32_t key) const noexcept { return where_[key]; }
  /// @p key's access counter (0 to 3).
  [[nodiscard]] std::uint8_t frequency(std::uint32_t key) const noexcept { return frequency_[key]; }

 private:
  static constexpr std::uint32_t none = detail::key_list::none;
  // libCacheSim's sizes: ⌊c·0.1⌋ small, the rest main, ⌊c·0.9⌋ ghosts (truncated products).
  [[nodiscard]] std::uint32_t small_capacity() const noexcept {
    return static_cast<std::uint32_t>(static_cast<double>(slots_) * 0.1);
  }
  [[nodiscard]] std::uint32_t main_capacity() const noexcept { return slots_ - small_capacity(); }
  // libCacheSim's S3FIFO.c inserts into the main queue once the small queue is full, until the
  // first eviction. c is unknown until then, so every key went to the small queue; at the first
  // victim() the keys beyond the small queue's share move to the main queue, in their order:
  // the queues are then what S3FIFO.c would hold (hits reorder neither queue).
  void split_the_first_fill() noexcept {
    evicted_ = true;
    std::uint32_t k = small_.oldest();  // the oldest ⌊0.1·c⌋ stay; the newer ones move, oldest first
    for (std::uint32_t i = 0; i < small_capacity() && k != none; ++i) k = small_.newer(k);
    while (k != none) {
      const std::uint32_t next = small_.newer(k);
      small_.unlink(k);
      main_.push_front(k);
      where_[k] = queue::main;
      k = next;
    }
  }
  [[nodiscard]] std::uint32_t ghost_capacity() const noexcept {
    return static_cast<std::uint32_t>(static_cast<double>(slots_) * 0.9);
  }

  detail::key_list small_;  // front: newest
  detail::key_list main_;
  detail::key_list ghost_;
  std::vector<queue> where_;
  std::vector<std::uint8_t> frequency_;
  std::uint32_t slots_ = 0;  // c: residents at the latest victim() call
  bool evicted_ = false;     // victim() has been called
};

static_assert(eviction_policy<s3fifo_policy>);

}  // namespace expage
