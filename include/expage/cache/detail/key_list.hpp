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

  void push_front(std::uint32_t k) noexcept {
    ++size_;
    prev_[k] = none;
    next_[k] = head_;
    if (head_ != none) prev_[head_] = k;
    head_ = k;
    if (tail_ == none) tail_ = k;
  }
  void unlink(std::uint32_t k) noexcept {
    --size_;
    if (prev_[k] != none)
      next_[prev_[k]] = next_[k];
    else
      head_ = next_[k];
    if (next_[k] != none)
      prev_[next_[k]] = prev_[k];
    else
      tail_ = prev_[k];
    prev_[k] = next_[k] = none;
  }
  void move_to_front(std::uint32_t k) noexcept {
    if (head_ != k) {
      unlink(k);
      push_front(k);
    }
  }
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
  std::vector<std::uint32_t> prev_;
  std::vector<std::uint32_t> next_;
  std::uint32_t head_ = none;
  std::uint32_t tail_ = none;
  std::uint32_t size_ = 0;
};

}  // namespace expage::detail
