#include "expage/cache/miss_ratio_curve.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace expage {

miss_ratio_curve::miss_ratio_curve(std::span<const std::uint64_t> warm_histogram, std::uint64_t compulsory_misses)
    : histogram_(warm_histogram.begin(), warm_histogram.end()) {
  if (histogram_.empty()) {
    throw invalid_argument(fmt::format("miss_ratio_curve: key count 0 (an empty histogram) out of range [1, {}]",
                                       std::numeric_limits<std::size_t>::max()));
  }
  // WiSP Eq. 3 as a suffix sum: misses_[c] = cold + Σ_{d ≥ c} hist[d].
  misses_.resize(histogram_.size() + 1);
  std::uint64_t sum = compulsory_misses;
  misses_.back() = sum;
  for (std::size_t d = histogram_.size(); d-- > 0;) {
    if (histogram_[d] > std::numeric_limits<std::uint64_t>::max() - sum) {
      throw invalid_argument(
          fmt::format("miss_ratio_curve: access count overflows 64 bits at distance {} (count {} on top of {})", d,
                      histogram_[d], sum));
    }
    sum += histogram_[d];
    misses_[d] = sum;
  }
}

std::vector<double> miss_ratio_curve::miss_ratios() const {
  std::vector<double> ratios(misses_.size(), 0.0);
  if (accesses() != 0) {
    const auto total = static_cast<double>(accesses());
    std::transform(misses_.begin(), misses_.end(), ratios.begin(),
                   [total](std::uint64_t m) { return static_cast<double>(m) / total; });
  }
  return ratios;
}

void miss_ratio_curve::throw_capacity_out_of_range(std::size_t capacity) const {
  throw invalid_argument(
      fmt::format("miss_ratio_curve: capacity {} out of range [0, {}]", capacity, histogram_.size()));
}

void miss_curve_builder::reset() noexcept {
  tracker_.reset();
  std::fill(histogram_.begin(), histogram_.end(), std::uint64_t{0});
}

void miss_curve_builder::throw_stream_key_out_of_range(const std::string& key, std::size_t position) const {
  throw invalid_argument(fmt::format("key {} at position {} of the stream out of range [0, {}) of miss_curve_builder",
                                     key, position, histogram_.size()));
}

}  // namespace expage
