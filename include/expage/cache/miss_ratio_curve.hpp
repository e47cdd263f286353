/// @file
/// @brief miss_ratio_curve and miss_curve_builder: the exact LRU miss curve at every capacity, in one pass.
///
/// WiSP Eq. 3 (§3.2): for a reference stream with reuse distances d_t (d_t = ∞
/// on first sight), the misses of an LRU cache of capacity c are
///
///     M(c) = Σ_t 1[d_t ≥ c] = cold + Σ_{d ≥ c} hist[d],
///
/// exact and non-increasing in c. (The equation body was lost in the text
/// extraction of the paper; it is reconstructed from the sentence before it,
/// "a reference hits at cap c exactly when d_t < c".) One histogram of reuse
/// distances, collected by a reuse_distance_tracker in one pass over the stream,
/// therefore gives the miss count of every capacity at once.
#pragma once

#include "expage/cache/reuse_distance.hpp"
#include "expage/detail/assert.hpp"

#include <fmt/format.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace expage {

namespace detail {
/// The key types a miss curve takes: the integers std::cmp_less compares (bool and the character
/// types are not among them).
template <class T>
concept curve_key =
    std::integral<T> && !std::same_as<std::remove_cv_t<T>, bool> && !std::same_as<std::remove_cv_t<T>, char> &&
    !std::same_as<std::remove_cv_t<T>, wchar_t> && !std::same_as<std::remove_cv_t<T>, char8_t> &&
    !std::same_as<std::remove_cv_t<T>, char16_t> && !std::same_as<std::remove_cv_t<T>, char32_t>;
}  // namespace detail

/// @brief The exact LRU miss count of one access stream at every capacity in [0, key_count].
///
/// An immutable value built from a histogram of warm reuse distances (index d
/// counts the accesses whose distance was d, for d in [0, key_count)) and the
/// number of compulsory (cold) misses. Construction is O(key_count) and stores
/// the cumulative curve, so every query is O(1). Compulsory misses are part of
/// misses(c) at every capacity and are also reported on their own; warm_misses()
/// excludes them.
///
/// @code
/// auto curve = expage::lru_miss_ratio_curve(256, trace_flat_indices);
/// for (std::size_t c : {64, 128, 192})
///   fmt::print("cap {}: miss ratio {:.3f} ({} compulsory)\n", c, curve.miss_ratio(c), curve.compulsory_misses());
/// @endcode
/// @threadsafety thread-compatible (immutable after construction).
class miss_ratio_curve {
 public:
  /// A curve from a warm reuse-distance histogram and a compulsory-miss count.
  /// @param warm_histogram entry d counts accesses with reuse distance d; its size is the key count.
  /// @param compulsory_misses first accesses (distance `cold`).
  /// @throws expage::invalid_argument when @p warm_histogram is empty, or when
  ///         the total number of accesses would overflow 64 bits.
  miss_ratio_curve(std::span<const std::uint64_t> warm_histogram, std::uint64_t compulsory_misses);

  /// The number of keys: capacities range over [0, key_count()].
  [[nodiscard]] std::size_t key_count() const noexcept { return histogram_.size(); }
  /// All accesses of the stream: misses(0).
  [[nodiscard]] std::uint64_t accesses() const noexcept { return misses_.front(); }
  /// First accesses of each key: misses at every capacity, including key_count().
  [[nodiscard]] std::uint64_t compulsory_misses() const noexcept { return misses_.back(); }
  /// The warm reuse-distance histogram the curve was built from (size key_count()).
  [[nodiscard]] std::span<const std::uint64_t> warm_histogram() const noexcept { return histogram_; }

  /// Misses of an LRU cache of @p capacity slots: compulsory + warm accesses with distance ≥ capacity.
  /// @throws expage::invalid_argument when @p capacity is not in [0, key_count()].
  [[nodiscard]] std::uint64_t misses(std::size_t capacity) const {
    check_capacity(capacity);
    return misses_[capacity];
  }
  /// Hits of an LRU cache of @p capacity slots: accesses() − misses(capacity).
  /// @throws expage::invalid_argument when @p capacity is not in [0, key_count()].
  [[nodiscard]] std::uint64_t hits(std::size_t capacity) const { return accesses() - misses(capacity); }
  /// Misses at @p capacity excluding compulsory ones (the part a bigger cache can remove).
  /// @throws expage::invalid_argument when @p capacity is not in [0, key_count()].
  [[nodiscard]] std::uint64_t warm_misses(std::size_t capacity) const { return misses(capacity) - compulsory_misses(); }
  /// misses(capacity) / accesses(); 0 for an empty stream.
  /// @throws expage::invalid_argument when @p capacity is not in [0, key_count()].
  [[nodiscard]] double miss_ratio(std::size_t capacity) const {
    const std::uint64_t m = misses(capacity);
    return accesses() == 0 ? 0.0 : static_cast<double>(m) / static_cast<double>(accesses());
  }

  /// Misses at every capacity 0..key_count() (size key_count() + 1, non-increasing).
  [[nodiscard]] std::span<const std::uint64_t> miss_counts() const noexcept { return misses_; }
  /// Miss ratios at every capacity 0..key_count() (size key_count() + 1); all 0 for an empty stream.
  [[nodiscard]] std::vector<double> miss_ratios() const;

 private:
  void check_capacity(std::size_t capacity) const {
    if (capacity > histogram_.size()) throw_capacity_out_of_range(capacity);
  }
  [[noreturn]] void throw_capacity_out_of_range(std::size_t capacity) const;

  std::vector<std::uint64_t> histogram_;
  std::vector<std::uint64_t> misses_;  // misses_[c] = compulsory + Σ_{d ≥ c} histogram_[d]
};

/// @brief Builds a miss_ratio_curve from an access stream in one pass: a
/// reuse_distance_tracker feeding a histogram of warm distances.
///
/// access() is O(log key_count) amortized (see reuse_distance_tracker) plus one
/// histogram increment; curve() is O(key_count) and may be called at any point of
/// the stream to get the curve of the accesses so far.
///
/// @code
/// expage::miss_curve_builder b(geometry.expert_count());
/// for (const auto& e : trace) b.access(geometry.flat_index(e));
/// expage::miss_ratio_curve global = b.curve();
/// @endcode
/// @threadsafety thread-compatible: const members concurrently, access() by one thread at a time.
class miss_curve_builder {
 public:
  /// A builder over keys [0, @p key_count); @p window as in reuse_distance_tracker.
  /// @throws expage::invalid_argument naming a bad key_count or window and its range.
  explicit miss_curve_builder(std::size_t key_count, std::size_t window = 0)
      : tracker_(key_count, window), histogram_(key_count, 0) {}

  /// Records an access to @p key; returns its reuse distance (or reuse_distance_tracker::cold).
  /// @throws expage::invalid_argument when @p key is not in [0, key_count()); nothing is recorded.
  std::size_t access(std::size_t key) {
    if (key >= histogram_.size()) {
      detail::throw_key_out_of_range(key, histogram_.size(), "miss_curve_builder");
    }
    return access_unchecked(key);
  }
  /// Non-throwing twin of access(): std::nullopt, with nothing recorded, for a key out of range.
  [[nodiscard]] std::optional<std::size_t> try_access(std::size_t key) noexcept {
    if (key >= histogram_.size()) {
      return std::nullopt;
    }
    return access_unchecked(key);
  }
  /// access() without the range check.
  /// @pre @p key < key_count() (asserted in debug builds).
  std::size_t access_unchecked(std::size_t key) noexcept {
    const std::size_t d = tracker_.access_unchecked(key);
    if (d != reuse_distance_tracker::cold) {
      ++histogram_[d];  // d < distinct keys ≤ key_count
    }
    return d;
  }

  /// Records an access to @p key whose distance the caller measured earlier
  /// with tracker().distance(): how a group served at once is recorded, every
  /// member's distance taken before any member is recorded
  /// (layered_miss_curves::access_group).
  /// @pre @p key < key_count(), and @p distance is tracker().distance(key) as of
  ///      the group's start (asserted in debug builds for range only).
  void record_unchecked(std::size_t key, std::size_t distance) noexcept {
    (void)tracker_.access_unchecked(key);
    if (distance != reuse_distance_tracker::cold) {
      ++histogram_[distance];
    }
  }

  /// Records every key of @p keys in order.
  /// @throws expage::invalid_argument naming the first key out of range (and its
  ///         position); all keys are checked first, so nothing is recorded then.
  template <std::ranges::forward_range Keys>
  requires detail::curve_key<std::ranges::range_value_t<Keys>>
  void access_all(Keys&& keys) {
    std::size_t position = 0;
    for (const auto key : keys) {
      if (std::cmp_less(key, 0) || std::cmp_greater_equal(key, histogram_.size())) {
        throw_stream_key_out_of_range(fmt::to_string(key), position);
      }
      ++position;
    }
    for (const auto key : keys) (void)access_unchecked(static_cast<std::size_t>(key));
  }

  /// The number of keys.
  [[nodiscard]] std::size_t key_count() const noexcept { return histogram_.size(); }
  /// Accesses recorded.
  [[nodiscard]] std::uint64_t accesses() const noexcept { return tracker_.accesses(); }
  /// Compulsory misses so far: the number of distinct keys seen.
  [[nodiscard]] std::uint64_t compulsory_misses() const noexcept { return tracker_.distinct_keys(); }
  /// Warm reuse distances so far: entry d counts accesses at distance d.
  [[nodiscard]] std::span<const std::uint64_t> warm_histogram() const noexcept { return histogram_; }
  /// The underlying tracker.
  [[nodiscard]] const reuse_distance_tracker& tracker() const noexcept { return tracker_; }

  /// The exact LRU miss curve of the accesses so far. O(key_count).
  [[nodiscard]] miss_ratio_curve curve() const { return miss_ratio_curve(histogram_, compulsory_misses()); }

  /// Forgets every access; keeps the allocations.
  void reset() noexcept;

 private:
  [[noreturn]] void throw_stream_key_out_of_range(const std::string& key, std::size_t position) const;

  reuse_distance_tracker tracker_;
  std::vector<std::uint64_t> histogram_;
};

/// The exact LRU miss curve of @p keys over [0, @p key_count) (WiSP Eq. 3), in one pass.
/// @throws expage::invalid_argument for a bad key_count, or naming the first key out of range.
template <std::ranges::forward_range Keys>
requires detail::curve_key<std::ranges::range_value_t<Keys>>
[[nodiscard]] miss_ratio_curve lru_miss_ratio_curve(std::size_t key_count, Keys&& keys) {
  miss_curve_builder builder(key_count);
  builder.access_all(keys);
  return builder.curve();
}

}  // namespace expage
