// An intrusive doubly-linked list over the keys [0, n) of a cache scope (not API).
#pragma once

#include "expage/cache/eviction_policy.hpp"

#include <cstdint>
#include <limits>
#include <vector>

namespace expage::detail {

/// Keys in recency (or insertion) order: front is newest, back is oldest. O(1)
/// push, move and unlink; no allocation after construction. Several lists may
/// partition one key space (ARC's four, S3-FIFO's three): each key is in at
/// most one of them, and size() counts this list's keys.
class key_list {
 public:
  static constexpr std::uint32_t none = std::numeric_limits<std::uint32_t>::max();

  explicit key_list(std::uint32_t keys) : prev_(keys, none), next_(keys, none) {}

  // Each operation reads the links it needs once into locals before it writes any: the links,
  // head_ and tail_ are all std::uint32_t, so after a store the compiler would reload them.
  void push_front(std::uint32_t k) noexcept {
    const std::uint32_t head = head_;
    prev_[k] = none;
    next_[k] = head;
    if (head != none) {
      prev_[head] = k;
    } else {
      tail_ = k;
    }
    head_ = k;
    ++size_;
  }
  void unlink(std::uint32_t k) noexcept {
    bridge(prev_[k], next_[k]);
    prev_[k] = none;
    next_[k] = none;
    --size_;
  }
  // unlink() then push_front(), fused.
  void move_to_front(std::uint32_t k) noexcept {
    const std::uint32_t head = head_;
    if (head == k) return;
    bridge(prev_[k], next_[k]);  // k has a newer key (it is not the head), so the head stays
    prev_[k] = none;
    next_[k] = head;
    prev_[head] = k;
    head_ = k;
  }
  /// True when @p k is in this list.
  [[nodiscard]] bool contains(std::uint32_t k) const noexcept { return head_ == k || prev_[k] != none; }
  [[nodiscard]] std::uint32_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  /// The oldest key; none when the list is empty.
  [[nodiscard]] std::uint32_t oldest() const noexcept { return tail_; }
  /// The key inserted just after @p k (toward the front); none when @p k is the newest.
  [[nodiscard]] std::uint32_t newer(std::uint32_t k) const noexcept { return prev_[k]; }
  /// The oldest key that is not pinned; none when every listed key is pinned.
  [[nodiscard]] std::uint32_t oldest_unpinned(pin_view pins) const noexcept {
    std::uint32_t k = tail_;
    while (k != none && pins(k)) k = prev_[k];
    return k;
  }

 private:
  // Links the keys around a leaving key to each other: @p before (newer, or none at the head)
  // and @p after (older, or none at the tail).
  void bridge(std::uint32_t before, std::uint32_t after) noexcept {
    if (before != none) {
      next_[before] = after;
    } else {
      head_ = after;
    }
    if (after != none) {
      prev_[after] = before;
    } else {
      tail_ = before;
    }
  }

  std::vector<std::uint32_t> prev_;
  std::vector<std::uint32_t> next_;
  std::uint32_t head_ = none;
  std::uint32_t tail_ = none;
  std::uint32_t size_ = 0;
};

}  // namespace expage::detail
