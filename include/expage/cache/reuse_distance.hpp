/// @file
/// @brief reuse_distance_tracker: exact LRU stack distance of every access in O(log n).
///
/// The quantity behind WiSP's exact LRU analysis (WiSP §3.2, "Why LRU, and why
/// it is exact"): the reuse distance d_t of the access at time t to key x is the
/// number of distinct keys referenced since x was last referenced, d_t = ∞ on
/// first sight, and an LRU cache of capacity c hits exactly when d_t < c.
/// (The symbols d_t, x, c and ∞ were lost in the text extraction of the paper;
/// they are reconstructed here from the surrounding definitions.)
#pragma once

#include "expage/detail/assert.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace expage {

namespace detail {
/// Throws expage::invalid_argument: "key 300 out of range [0, 256) of reuse_distance_tracker".
[[noreturn]] void throw_key_out_of_range(std::size_t key, std::size_t key_count, const char* owner);
}  // namespace detail

/// @brief Computes the exact LRU stack distance of every access to keys in [0, key_count).
///
/// A key is any dense integer id: an expert's flat index (moe_geometry::flat_index)
/// for a global cache, or its index within a layer for a per-layer cache.
/// access() returns how many *distinct other* keys were accessed since the
/// previous access to the same key, or `cold` on its first access (a compulsory
/// miss). An LRU cache of capacity c therefore hits that access iff the result
/// is < c; a repeated access to the same key has distance 0.
///
/// How: every access gets a timestamp (a position in a window of `window()`
/// slots). A Fenwick (binary indexed) tree over the window holds one mark per
/// key, at the timestamp of that key's most recent access, and `last_[key]`
/// remembers that timestamp. The distance of an access is the number of marks
/// after the key's previous timestamp: distinct keys, because each key keeps only
/// its latest mark. Timestamps only grow, so the tree is maintained only below
/// the next timestamp (a node is built from its children when first reached).
/// When the window fills, compaction renumbers the ≤ key_count live marks to
/// 1..m in order (a key's new timestamp is its mark's rank, one prefix query)
/// and rebuilds m tree nodes.
///
/// Complexity: access() is O(log window) (one prefix query and one removal
/// path, the new mark O(1) amortized), plus compaction amortized
/// O(key_count·log window / (window − key_count)); with the default window of
/// 8·key_count that is O(log key_count) in total. Memory: 4·key_count (last
/// access) + 4·window (tree) bytes, allocated at construction; access() never
/// allocates.
///
/// @code
/// expage::reuse_distance_tracker rd(4);
/// rd.access(0);  // reuse_distance_tracker::cold (first sight)
/// rd.access(1);  // cold
/// rd.access(1);  // 0: an LRU cache of capacity ≥ 1 hits
/// rd.access(0);  // 1: key 1 was accessed in between; capacity ≥ 2 hits
/// @endcode
/// @threadsafety thread-compatible: const members concurrently, access(), forget() and reset() by
/// one thread at a time.
class reuse_distance_tracker {
 public:
  /// The distance of a first access (compulsory miss): larger than every real distance.
  static constexpr std::size_t cold = std::numeric_limits<std::size_t>::max();
  /// The largest key_count accepted (timestamps are 32-bit).
  static constexpr std::size_t max_key_count = std::size_t{1} << 30;
  /// The largest window accepted.
  static constexpr std::size_t max_window = std::size_t{1} << 31;

  /// A tracker over keys [0, @p key_count) with no access recorded.
  /// @param key_count the number of keys, in [1, max_key_count].
  /// @param window timestamps between compactions, in [key_count + 1, max_window];
  ///        0 (the default) picks max(8·key_count, 1024) clamped to max_window.
  ///        Small windows compact often (tests use key_count + 1 to force it).
  /// @throws expage::invalid_argument naming the bad value and its allowed range.
  explicit reuse_distance_tracker(std::size_t key_count, std::size_t window = 0);

  /// Records an access to @p key and returns its reuse distance, in
  /// [0, distinct_keys()) or `cold`.
  /// @throws expage::invalid_argument when @p key is not in [0, key_count()); nothing is recorded.
  [[nodiscard]] std::size_t access(std::size_t key) {
    if (key >= last_.size()) {
      detail::throw_key_out_of_range(key, last_.size(), "reuse_distance_tracker");
    }
    return access_unchecked(key);
  }

  /// Non-throwing twin of access().
  /// @return the reuse distance (possibly `cold`), or std::nullopt, with nothing
  ///         recorded, when @p key is not in [0, key_count()).
  [[nodiscard]] std::optional<std::size_t> try_access(std::size_t key) noexcept {
    if (key >= last_.size()) {
      return std::nullopt;
    }
    return access_unchecked(key);
  }

  /// access() without the range check.
  /// @pre @p key < key_count() (asserted in debug builds).
  [[nodiscard]] std::size_t access_unchecked(std::size_t key) noexcept {
    EXPAGE_ASSERT(key < last_.size(), "reuse_distance_tracker: key out of range");
    if (next_ > window_) [[unlikely]] {
      compact();  // the accessed key's mark is renumbered too, so read last_ afterwards
    }
    ++accesses_;
    const std::uint32_t previous = last_[key];
    std::size_t distance = cold;
    if (previous == 0) {
      ++live_;
    } else {
      // Marks after `previous` = all marks − marks at or before it (its own included).
      distance = live_ - prefix(previous);
      remove(previous);
    }
    append(next_);
    last_[key] = static_cast<std::uint32_t>(next_);  // ≤ max_window < 2^32
    ++next_;
    return distance;
  }

  /// The reuse distance an access to @p key would have now (or `cold`), without
  /// recording anything. O(log window).
  /// @pre @p key < key_count() (asserted in debug builds).
  [[nodiscard]] std::size_t distance(std::size_t key) const noexcept {
    EXPAGE_ASSERT(key < last_.size(), "reuse_distance_tracker: key out of range");
    const std::uint32_t previous = last_[key];
    return previous == 0 ? cold : live_ - prefix(previous);
  }

  /// The number of keys: accepted keys are [0, key_count()).
  [[nodiscard]] std::size_t key_count() const noexcept { return last_.size(); }
  /// Timestamps between compactions.
  [[nodiscard]] std::size_t window() const noexcept { return window_; }
  /// Accesses recorded since construction or reset().
  [[nodiscard]] std::uint64_t accesses() const noexcept { return accesses_; }
  /// Distinct keys seen and not forgotten (without forget(), the number of `cold` results so far).
  [[nodiscard]] std::size_t distinct_keys() const noexcept { return live_; }
  /// Compactions performed since construction or reset().
  [[nodiscard]] std::uint64_t compactions() const noexcept { return compactions_; }
  /// True when @p key has been accessed and not forgotten since (false for keys out of range).
  [[nodiscard]] bool seen(std::size_t key) const noexcept { return key < last_.size() && last_[key] != 0; }

  /// Forgets @p key's last access, as if it had never been accessed: the keys behind it come one
  /// position nearer, and its next access (if any) is `cold`. For a cache that drops a key no
  /// access will ask for again (a KV block of a closed conversation). O(log window).
  /// @pre @p key < key_count() (asserted in debug builds).
  void forget(std::size_t key) noexcept {
    EXPAGE_ASSERT(key < last_.size(), "reuse_distance_tracker: key out of range");
    if (last_[key] == 0) return;
    remove(last_[key]);
    last_[key] = 0;
    --live_;
  }

  /// Forgets every access; keeps the allocation. O(key_count).
  void reset() noexcept;

 private:
  // Fenwick tree over 1-based timestamps, kept only below the frontier: for every
  // i < next_, tree_[i] counts the marks in (i − lowbit(i), i]; nodes ≥ next_
  // hold stale values. A prefix query at p < next_ reads only nodes ≤ p, and a
  // node is built from its children at the moment the frontier reaches it, so
  // appending a mark is O(1) amortized instead of O(log window), a removal stops
  // at the frontier, and a compaction rebuilds only the nodes below it.
  [[nodiscard]] std::size_t prefix(std::size_t position) const noexcept {
    std::size_t sum = 0;
    for (std::size_t i = position; i != 0; i &= i - 1) sum += tree_[i];
    return sum;
  }
  // Appends the mark at the frontier n = next_: node n covers (n − lowbit(n), n],
  // which is n itself plus its children n − k covering (n − 2k, n − k] for
  // k = 1, 2, 4, …, lowbit(n)/2 (one child on average).
  void append(std::size_t n) noexcept {
    std::uint32_t count = 1;
    const std::size_t low = n & (~n + 1);
    for (std::size_t k = 1; k < low; k <<= 1) count += tree_[n - k];
    tree_[n] = count;
  }
  void remove(std::size_t position) noexcept {
    for (std::size_t i = position; i < next_; i += i & (~i + 1)) --tree_[i];
  }
  // Renumbers the live marks 1..live_ in timestamp order and rebuilds the tree (slow path).
  void compact() noexcept;

  std::vector<std::uint32_t> last_;  // per key: its latest timestamp in [1, window_], 0 = never accessed
  std::vector<std::uint32_t> tree_;  // Fenwick counts, size window_ + 1; valid below next_
  std::size_t window_ = 0;
  std::size_t next_ = 1;  // the next timestamp, in [1, window_ + 1]
  std::size_t live_ = 0;  // marks in the tree = distinct keys seen and not forgotten
  std::uint64_t accesses_ = 0;
  std::uint64_t compactions_ = 0;
};

}  // namespace expage
