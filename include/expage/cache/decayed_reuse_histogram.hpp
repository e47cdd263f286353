/// @file
/// @brief decayed_reuse_histogram: an online, exponentially decayed estimate of an LRU miss curve.
///
/// The estimator of WiSP's MV-WSA online controller (WiSP App. B, design
/// decisions 1 and 2; Algorithm 2): per burst, each stream's reuse distances
/// are binned into fixed bins, the old counts being decayed by a factor γ
/// before the new ones are added, h ← γ·h + counts(burst); the tail sum of the
/// bins above a capacity c is the predicted (warm) miss curve M̂(c), and its
/// finite difference M̂(c) − M̂(c+1) is the marginal value of one more slot that
/// enters the equimarginal condition (WiSP Eq. 5). First-sight (compulsory)
/// accesses are dropped: they are constant in c, and counting them biases the
/// controller toward whichever pool has been seen less (App. B, decision 2).
/// (The bin set, the decay symbol γ and the tail-sum expression were lost in
/// the text extraction of the paper and are reconstructed from the prose.)
#pragma once

#include "expage/cache/reuse_distance.hpp"

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <ranges>
#include <span>
#include <vector>

namespace expage {

/// @brief A decayed histogram of warm reuse distances, read as a predicted LRU miss curve.
///
/// **Binning.** Capacities of interest are [0, C] with C = max_capacity (for one
/// stream's cache, usually its key count). Distances are put in B = ⌈C / w⌉ fixed
/// linear bins of width w = bin_width: bin b holds distances [b·w, min((b+1)·w, C))
/// (the last bin is narrower when w does not divide C), plus one tail bin for
/// distances ≥ C, which miss at every capacity of interest. `cold` distances are
/// not binned (only counted, in cold_ignored()).
///
/// **Prediction.** Distances are assumed uniform within a bin, so the predicted
/// warm misses at capacity c are
///
///     M̂(c) = tail + Σ_{b: lo_b ≥ c} h_b + h_{b(c)} · (hi_{b(c)} − c) / (hi_{b(c)} − lo_{b(c)}),
///
/// the last term for the bin b(c) with lo < c < hi. M̂ is piecewise linear and
/// non-increasing, exact at bin edges, and exact everywhere when w = 1 (with
/// γ = 1 it is then the exact warm LRU miss curve: miss_ratio_curve::warm_misses()).
/// The marginal m(c) = M̂(c) − M̂(c+1) = h_{b(c)} / width(b(c)) ≥ 0 is the decayed
/// number of misses the (c+1)-th slot would save.
///
/// **Decay.** new_burst() multiplies every bin by γ ∈ (0, 1] (γ = 1: no
/// forgetting); record() then adds weight 1. A burst's counts thus weigh γ^k
/// after k more bursts. Bins that decay below the smallest normal double are
/// flushed to 0 so an idle stream never computes with subnormals.
///
/// Complexity: record() O(1); new_burst() O(B); predicted_misses() O(B);
/// marginal() O(1); predicted_curve() and marginals() O(C + B). Memory O(B).
///
/// @code
/// expage::reuse_distance_tracker rd(128);                                 // one layer's experts
/// expage::decayed_reuse_histogram h({.max_capacity = 128, .bin_width = 4, .decay = 0.9});
/// for (const auto& burst : bursts) {
///   h.new_burst();
///   for (auto expert : burst) h.record(rd.access(expert));
///   auto gain = h.marginal(current_slots);  // misses saved by one more slot
/// }
/// @endcode
/// @threadsafety thread-compatible: const members concurrently, record()/new_burst() by one thread at a time.
class decayed_reuse_histogram {
 public:
  /// What a histogram is built from.
  struct config {
    std::size_t max_capacity =
        0;  ///< C: the curve covers capacities [0, C]; in [1, reuse_distance_tracker::max_key_count].
    std::size_t bin_width = 1;  ///< w: distances per bin, in [1, C].
    double decay = 1.0;         ///< γ: factor applied to old counts per burst, in (0, 1].
  };

  /// An empty histogram.
  /// @throws expage::invalid_argument naming the first field out of range and its allowed range.
  explicit decayed_reuse_histogram(config cfg);

  /// Starts a burst: multiplies every count by γ. O(bins).
  void new_burst() noexcept;

  /// Adds one warm reuse at @p distance to the current burst; `cold` is ignored
  /// (counted in cold_ignored()), distances ≥ max_capacity() go to the tail bin.
  void record(std::size_t distance) noexcept {
    if (distance == reuse_distance_tracker::cold) {
      ++cold_ignored_;
      return;
    }
    const std::size_t bin = distance >= capacity_ ? bins_.size() - 1 : distance / width_;
    bins_[bin] += 1.0;
    squares_[bin] += 1.0;
    total_ += 1.0;
    ++warm_records_;
  }

  /// Multiplies every count by @p keep, in [0, 1]: forgets a share of the history at once (after
  /// a change point: 0 starts over). O(bins).
  /// @throws expage::invalid_argument when @p keep is not in [0, 1].
  void scale(double keep);
  /// new_burst(), then record() every distance of @p distances.
  template <std::ranges::input_range Distances>
  requires std::unsigned_integral<std::ranges::range_value_t<Distances>>
  void add_burst(Distances&& distances) {
    new_burst();
    for (const auto d : distances) record(static_cast<std::size_t>(d));
  }

  /// C: capacities range over [0, max_capacity()].
  [[nodiscard]] std::size_t max_capacity() const noexcept { return capacity_; }
  /// w: distances per bin.
  [[nodiscard]] std::size_t bin_width() const noexcept { return width_; }
  /// γ: the per-burst decay factor.
  [[nodiscard]] double decay() const noexcept { return decay_; }
  /// B: the number of in-range bins (the tail bin excluded).
  [[nodiscard]] std::size_t bin_count() const noexcept { return bins_.size() - 1; }
  /// The smallest distance of bin @p bin (b·w); bin_count() names the tail bin, starting at C.
  /// @pre @p bin ≤ bin_count().
  [[nodiscard]] std::size_t bin_lower(std::size_t bin) const noexcept {
    return bin >= bin_count() ? capacity_ : bin * width_;
  }
  /// The decayed counts: B in-range bins, then the tail bin.
  [[nodiscard]] std::span<const double> counts() const noexcept { return bins_; }
  /// The decayed mass of every bin: M̂(0).
  [[nodiscard]] double total_mass() const noexcept { return total_; }
  /// Bursts started (new_burst() calls).
  [[nodiscard]] std::uint64_t bursts() const noexcept { return bursts_; }
  /// Warm distances recorded, undecayed.
  [[nodiscard]] std::uint64_t warm_records() const noexcept { return warm_records_; }
  /// `cold` distances passed to record() and ignored.
  [[nodiscard]] std::uint64_t cold_ignored() const noexcept { return cold_ignored_; }

  /// M̂(@p capacity): the decayed warm accesses predicted to miss with @p capacity slots. O(bins).
  /// @throws expage::invalid_argument when @p capacity is not in [0, max_capacity()].
  [[nodiscard]] double predicted_misses(std::size_t capacity) const;
  /// An estimate of the variance of M̂(@p capacity), reading the counts as Poisson: the same sum
  /// over the squared weights, Σ_k γ^{2k}·n_k for the n_k distances recorded k bursts ago
  /// (Var[Σ_k γ^k·n_k] when each n_k is Poisson), the bin straddling @p capacity by its share
  /// squared (M̂ holds that share of its count). O(bins).
  /// @throws expage::invalid_argument when @p capacity is not in [0, max_capacity()].
  [[nodiscard]] double predicted_misses_variance(std::size_t capacity) const;
  /// The variance of M̂(@p a) − M̂(@p b), the same reading: Σ over the bins between the two
  /// capacities of (s_b(a) − s_b(b))²·(squared-weight count of b), s_b(c) being the share of bin b
  /// at or above c (1 above c, 0 below, a fraction for the bin straddling c). With unit bins, the
  /// squared-weight count of the distances in [min(a, b), max(a, b)). What the noise gate asks of
  /// a move's gain (a difference of two tails of one histogram). O(bins between).
  /// @throws expage::invalid_argument when @p a or @p b is not in [0, max_capacity()].
  [[nodiscard]] double predicted_difference_variance(std::size_t a, std::size_t b) const;
  /// M̂(@p capacity) / M̂(0); 0 while the histogram is empty.
  /// @throws expage::invalid_argument when @p capacity is not in [0, max_capacity()].
  [[nodiscard]] double predicted_miss_ratio(std::size_t capacity) const;
  /// M̂ at every capacity 0..max_capacity() (size max_capacity() + 1, non-increasing).
  [[nodiscard]] std::vector<double> predicted_curve() const;

  /// m(@p capacity) = M̂(capacity) − M̂(capacity + 1) ≥ 0: the decayed misses one
  /// more slot would save, for a cache of @p capacity slots. O(1).
  /// @throws expage::invalid_argument when @p capacity is not in [0, max_capacity()).
  [[nodiscard]] double marginal(std::size_t capacity) const {
    if (capacity >= capacity_) throw_marginal_out_of_range(capacity);
    const std::size_t bin = capacity / width_;
    return bins_[bin] / static_cast<double>(bin_upper(bin) - bin * width_);
  }
  /// m at every capacity 0..max_capacity() − 1 (size max_capacity()).
  [[nodiscard]] std::vector<double> marginals() const;

  /// Forgets every count (the configuration stays).
  void reset() noexcept;

 private:
  [[nodiscard]] std::size_t bin_upper(std::size_t bin) const noexcept {
    return bin * width_ + width_ < capacity_ ? bin * width_ + width_ : capacity_;
  }
  [[noreturn]] void throw_marginal_out_of_range(std::size_t capacity) const;
  void check_capacity(std::size_t capacity) const;

  std::size_t capacity_;
  std::size_t width_;
  double decay_;
  // The tail sum of @p bins above @p capacity (predicted_misses() of bins_, of squares_: the
  // share of the bin straddling @p capacity squared, @p squared_share).
  [[nodiscard]] double tail_sum(const std::vector<double>& bins, std::size_t capacity, bool squared_share) const;

  std::vector<double> bins_;     // B in-range bins, then the tail
  std::vector<double> squares_;  // the same bins with squared weights: decayed by γ² (the variance's)
  double total_ = 0.0;
  std::uint64_t bursts_ = 0;
  std::uint64_t warm_records_ = 0;
  std::uint64_t cold_ignored_ = 0;
};

}  // namespace expage
