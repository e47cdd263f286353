#include "expage/cache/reuse_distance.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace expage {

namespace detail {
void throw_key_out_of_range(std::size_t key, std::size_t key_count, const char* owner) {
  throw invalid_argument(fmt::format("key {} out of range [0, {}) of {}", key, key_count, owner));
}
}  // namespace detail

namespace {

std::size_t checked_window(std::size_t key_count, std::size_t window) {
  if (key_count == 0 || key_count > reuse_distance_tracker::max_key_count) {
    throw invalid_argument(fmt::format("reuse_distance_tracker: key_count {} out of range [1, {}]", key_count,
                                       reuse_distance_tracker::max_key_count));
  }
  if (window == 0) {
    return std::min(std::max(8 * key_count, std::size_t{1024}), reuse_distance_tracker::max_window);
  }
  // key_count + 1 slots at least: after a compaction the ≤ key_count live marks
  // must leave one free timestamp for the access that triggered it.
  if (window <= key_count || window > reuse_distance_tracker::max_window) {
    throw invalid_argument(fmt::format("reuse_distance_tracker: window {} out of range [{}, {}] for key_count {}",
                                       window, key_count + 1, reuse_distance_tracker::max_window, key_count));
  }
  return window;
}

}  // namespace

reuse_distance_tracker::reuse_distance_tracker(std::size_t key_count, std::size_t window)
    : window_(checked_window(key_count, window)) {
  last_.assign(key_count, 0);
  tree_.assign(window_ + 1, 0);
}

void reuse_distance_tracker::reset() noexcept {
  std::fill(last_.begin(), last_.end(), std::uint32_t{0});  // tree_ is valid below next_ only: nothing to clear
  next_ = 1;
  live_ = 0;
  accesses_ = 0;
  compactions_ = 0;
}

void reuse_distance_tracker::compact() noexcept {
  ++compactions_;
  // A key's new timestamp is the rank of its old one among the live marks,
  // which the tree answers directly: prefix(last) counts the marks at or before
  // it, its own included. Renumbering by rank keeps the order of the marks,
  // which is all a distance depends on. Every query reads the old tree, and
  // none reads last_, so the ranks can overwrite last_ in place: no sort, no
  // scratch memory. O(key_count · log window).
  std::size_t m = 0;
  for (auto& last : last_) {
    if (last != 0) {
      last = static_cast<std::uint32_t>(prefix(last));
      ++m;
    }
  }
  EXPAGE_ASSERT(m == live_, "reuse_distance_tracker: live mark count out of sync");
  // Marks now occupy exactly [1, m], so node i ≤ m, covering (i − lowbit(i), i],
  // counts lowbit(i); nodes above m are built as the frontier reaches them. O(m).
  for (std::size_t i = 1; i <= m; ++i) tree_[i] = static_cast<std::uint32_t>(i & (~i + 1));
  next_ = m + 1;
}

}  // namespace expage
