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
}

void decayed_reuse_histogram::new_burst() noexcept {
  ++bursts_;
  if (decay_ == 1.0) return;
  double total = 0.0;
  for (double& h : bins_) {
    h *= decay_;
    if (h < std::numeric_limits<double>::min()) h = 0.0;  // no subnormals on idle streams
    total += h;
  }
  total_ = total;  // re-summed, so total_mass() never drifts from the bins
}

void decayed_reuse_histogram::scale(double keep) {
  if (!(keep >= 0.0 && keep <= 1.0)) {
    throw invalid_argument(fmt::format("decayed_reuse_histogram::scale: keep {} out of range [0, 1]", keep));
  }
  double total = 0.0;
  for (double& h : bins_) {
    h *= keep;
    if (h < std::numeric_limits<double>::min()) h = 0.0;
    total += h;
  }
  total_ = total;
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

double decayed_reuse_histogram::predicted_misses(std::size_t capacity) const {
  check_capacity(capacity);
  const std::size_t first = capacity / width_;  // the bin holding distance `capacity` (or the tail)
  // The tail, then the bins from the top down: every capacity adds the same terms in the same
  // order as the one above it, plus non-negative ones, so the curve never rises by a rounding.
  double misses = bins_.back();
  for (std::size_t b = bin_count(); b-- > first + 1;) misses += bins_[b];
  if (first < bin_count()) {
    // Uniform within the bin: the share of its distances that are ≥ capacity.
    const std::size_t lo = first * width_;
    const std::size_t hi = bin_upper(first);
    misses += bins_[first] * static_cast<double>(hi - capacity) / static_cast<double>(hi - lo);
  }
  return misses;
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
  total_ = 0.0;
  bursts_ = 0;
  warm_records_ = 0;
  cold_ignored_ = 0;
}

}  // namespace expage
