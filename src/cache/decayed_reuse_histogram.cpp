#include "expage/cache/decayed_reuse_histogram.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace expage {

namespace {

decayed_reuse_histogram::config checked(decayed_reuse_histogram::config cfg) {
  constexpr std::size_t max_capacity = reuse_distance_tracker::max_key_count;
  if (cfg.max_capacity == 0 || cfg.max_capacity > max_capacity) {
    throw invalid_argument(
        fmt::format("decayed_reuse_histogram: max_capacity {} out of range [1, {}]", cfg.max_capacity, max_capacity));
  }
  if (cfg.bin_width == 0 || cfg.bin_width > cfg.max_capacity) {
    throw invalid_argument(fmt::format("decayed_reuse_histogram: bin_width {} out of range [1, {}] (max_capacity)",
                                       cfg.bin_width, cfg.max_capacity));
  }
  // Written so that NaN fails too.
  if (!(cfg.decay > 0.0 && cfg.decay <= 1.0)) {
    throw invalid_argument(fmt::format("decayed_reuse_histogram: decay {} out of range (0, 1]", cfg.decay));
  }
  return cfg;
}

}  // namespace

decayed_reuse_histogram::decayed_reuse_histogram(config cfg) {
  cfg = checked(cfg);
  capacity_ = cfg.max_capacity;
  width_ = cfg.bin_width;
  decay_ = cfg.decay;
  bins_.assign((capacity_ + width_ - 1) / width_ + 1, 0.0);
  squares_.assign(bins_.size(), 0.0);
}

namespace {
// Multiplies every count by @p factor, flushing what falls below the smallest normal double
// (no subnormals on idle streams); returns the new sum.
double scale_counts(std::vector<double>& bins, double factor) noexcept {
  double total = 0.0;
  for (double& h : bins) {
    h *= factor;
    if (h < std::numeric_limits<double>::min()) h = 0.0;
    total += h;
  }
  return total;
}
}  // namespace

void decayed_reuse_histogram::new_burst() noexcept {
  ++bursts_;
  if (decay_ == 1.0) return;
  total_ = scale_counts(bins_, decay_);  // re-summed, so total_mass() never drifts from the bins
  (void)scale_counts(squares_, decay_ * decay_);
}

void decayed_reuse_histogram::scale(double keep) {
  if (!(keep >= 0.0 && keep <= 1.0)) {
    throw invalid_argument(fmt::format("decayed_reuse_histogram::scale: keep {} out of range [0, 1]", keep));
  }
  total_ = scale_counts(bins_, keep);
  (void)scale_counts(squares_, keep * keep);
}

void decayed_reuse_histogram::check_capacity(std::size_t capacity) const {
  if (capacity > capacity_) {
    throw invalid_argument(
        fmt::format("decayed_reuse_histogram: capacity {} out of range [0, {}]", capacity, capacity_));
  }
}

void decayed_reuse_histogram::throw_marginal_out_of_range(std::size_t capacity) const {
  throw invalid_argument(
      fmt::format("decayed_reuse_histogram: marginal at capacity {} out of range [0, {})", capacity, capacity_));
}

double decayed_reuse_histogram::tail_sum(const std::vector<double>& bins, std::size_t capacity,
                                         bool squared_share) const {
  check_capacity(capacity);
  const std::size_t first = capacity / width_;  // the bin holding distance `capacity` (or the tail)
  // The tail, then the bins from the top down: every capacity adds the same terms in the same
  // order as the one above it, plus non-negative ones, so the curve never rises by a rounding.
  double sum = bins.back();
  for (std::size_t b = bin_count(); b-- > first + 1;) sum += bins[b];
  if (first < bin_count()) {
    // Uniform within the bin: the share s of its distances that are ≥ capacity. M̂ holds s·h_b, so
    // its variance holds s²·Var(h_b).
    const std::size_t lo = first * width_;
    const std::size_t hi = bin_upper(first);
    const double share = static_cast<double>(hi - capacity) / static_cast<double>(hi - lo);
    sum += bins[first] * (squared_share ? share * share : share);
  }
  return sum;
}

double decayed_reuse_histogram::predicted_misses(std::size_t capacity) const {
  return tail_sum(bins_, capacity, false);
}

double decayed_reuse_histogram::predicted_difference_variance(std::size_t a, std::size_t b) const {
  check_capacity(a);
  check_capacity(b);
  const std::size_t lo = std::min(a, b);
  const std::size_t hi = std::max(a, b);
  // The share of bin [first, last) at or above c.
  const auto share = [](std::size_t first, std::size_t last, std::size_t c) {
    if (c <= first) return 1.0;
    if (c >= last) return 0.0;
    return static_cast<double>(last - c) / static_cast<double>(last - first);
  };
  double variance = 0.0;
  for (std::size_t bin = lo / width_; bin < bin_count() && bin * width_ < hi; ++bin) {
    const std::size_t first = bin * width_;
    const std::size_t last = bin_upper(bin);
    const double d = share(first, last, lo) - share(first, last, hi);
    variance += d * d * squares_[bin];
  }
  return variance;
}

double decayed_reuse_histogram::predicted_misses_variance(std::size_t capacity) const {
  return tail_sum(squares_, capacity, true);
}

double decayed_reuse_histogram::predicted_miss_ratio(std::size_t capacity) const {
  const double misses = predicted_misses(capacity);
  // At most 1: the total is summed in another order than the misses.
  return total_ > 0.0 ? std::min(1.0, misses / total_) : 0.0;
}

std::vector<double> decayed_reuse_histogram::predicted_curve() const {
  // From the top down: M̂(C) = tail, M̂(c) = M̂(c + 1) + m(c).
  std::vector<double> curve(capacity_ + 1);
  double misses = bins_.back();
  curve[capacity_] = misses;
  for (std::size_t c = capacity_; c-- > 0;) {
    misses += marginal(c);
    curve[c] = misses;
  }
  return curve;
}

std::vector<double> decayed_reuse_histogram::marginals() const {
  std::vector<double> m(capacity_);
  for (std::size_t c = 0; c < capacity_; ++c) m[c] = marginal(c);
  return m;
}

void decayed_reuse_histogram::reset() noexcept {
  std::fill(bins_.begin(), bins_.end(), 0.0);
  std::fill(squares_.begin(), squares_.end(), 0.0);
  total_ = 0.0;
  bursts_ = 0;
  warm_records_ = 0;
  cold_ignored_ = 0;
}

}  // namespace expage
