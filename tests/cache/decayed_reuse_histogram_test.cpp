#include "expage/cache/decayed_reuse_histogram.hpp"

#include "expage/cache/miss_ratio_curve.hpp"
#include "expage/cache/reuse_distance.hpp"
#include "expage/core/error.hpp"

#include "cache/reuse_reference.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace expage {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(DecayedReuseHistogram, WithNoDecayAndUnitBinsPredictsTheExactWarmCurve) {
  for (const std::size_t key_count : {1U, 5U, 64U, 256U}) {
    for (const double skew : {0.0, 1.1}) {
      const auto keys = test::zipf_stream(key_count, skew, 5000, 31 + key_count);
      reuse_distance_tracker rd(key_count);
      decayed_reuse_histogram h({.max_capacity = key_count, .bin_width = 1, .decay = 1.0});
      for (std::size_t t = 0; t < keys.size(); ++t) {
        if (t % 100 == 0) h.new_burst();  // bursts of 100 accesses; γ = 1 forgets nothing
        h.record(rd.access(keys[t]));
      }
      const auto exact = lru_miss_ratio_curve(key_count, keys);
      EXPECT_EQ(h.cold_ignored(), exact.compulsory_misses()) << "cold accesses are excluded";
      EXPECT_EQ(h.warm_records(), keys.size() - exact.compulsory_misses());
      EXPECT_EQ(h.total_mass(), static_cast<double>(h.warm_records()));
      const auto curve = h.predicted_curve();
      ASSERT_EQ(curve.size(), key_count + 1);
      for (std::size_t c = 0; c <= key_count; ++c) {
        const auto expected = static_cast<double>(exact.warm_misses(c));
        ASSERT_EQ(h.predicted_misses(c), expected) << "K " << key_count << " capacity " << c;
        ASSERT_EQ(curve[c], expected) << "K " << key_count << " capacity " << c;
        if (h.total_mass() > 0.0) {
          ASSERT_DOUBLE_EQ(h.predicted_miss_ratio(c), expected / h.total_mass());
        }
      }
    }
  }
}

TEST(DecayedReuseHistogram, WideBinsAreExactAtBinEdgesAndLinearInside) {
  const std::size_t key_count = 60;
  const auto keys = test::zipf_stream(key_count, 0.7, 4000, 8);
  reuse_distance_tracker rd(key_count);
  decayed_reuse_histogram h({.max_capacity = key_count, .bin_width = 7, .decay = 1.0});
  for (const std::size_t k : keys) h.record(rd.access(k));
  const auto exact = lru_miss_ratio_curve(key_count, keys);
  EXPECT_EQ(h.bin_count(), 9U) << "⌈60 / 7⌉";
  for (std::size_t edge = 0; edge <= key_count; edge += 7) {
    EXPECT_DOUBLE_EQ(h.predicted_misses(edge), static_cast<double>(exact.warm_misses(edge))) << "edge " << edge;
  }
  EXPECT_DOUBLE_EQ(h.predicted_misses(key_count), 0.0) << "the narrow last bin [56, 60) ends at C";
  // Inside bin [7, 14): a straight line between the edges.
  const double at7 = h.predicted_misses(7);
  const double at14 = h.predicted_misses(14);
  EXPECT_NEAR(h.predicted_misses(10), at7 + (at14 - at7) * 3.0 / 7.0, 1e-9);
}

// scale() multiplies every bin, the prediction with it, and refuses a share outside [0, 1].
TEST(DecayedReuseHistogram, ScaleForgetsAShareOfEveryBin) {
  decayed_reuse_histogram h({.max_capacity = 10, .bin_width = 2, .decay = 0.5});
  for (const std::size_t d : {0U, 3U, 3U, 7U, 12U}) h.record(d);
  std::vector<double> before;
  for (std::size_t c = 0; c <= 10; ++c) before.push_back(h.predicted_misses(c));
  h.scale(0.25);
  for (std::size_t c = 0; c <= 10; ++c) EXPECT_NEAR(h.predicted_misses(c), 0.25 * before[c], 1e-12) << c;
  EXPECT_NEAR(h.total_mass(), 0.25 * 5, 1e-12);
  h.scale(0.0);
  EXPECT_EQ(h.total_mass(), 0.0);
  EXPECT_EQ(h.predicted_misses(0), 0.0);
  try {
    h.scale(1.5);
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("keep 1.5 out of range [0, 1]"));
  }
  EXPECT_THROW(h.scale(std::nan("")), invalid_argument);
  EXPECT_THROW(h.scale(-0.1), invalid_argument);
}

TEST(DecayedReuseHistogram, BinsDistancesAndSendsFarOnesToTheTail) {
  decayed_reuse_histogram h({.max_capacity = 10, .bin_width = 4, .decay = 1.0});
  EXPECT_EQ(h.bin_count(), 3U);  // [0, 4), [4, 8), [8, 10)
  EXPECT_EQ(h.bin_lower(1), 4U);
  EXPECT_EQ(h.bin_lower(3), 10U) << "the tail starts at C";
  for (std::size_t d : {0U, 3U, 4U, 9U, 10U, 500U}) h.record(d);
  h.record(reuse_distance_tracker::cold);
  EXPECT_THAT(h.counts(), ElementsAre(2.0, 1.0, 1.0, 2.0));
  EXPECT_EQ(h.cold_ignored(), 1U);
  EXPECT_EQ(h.total_mass(), 6.0);
  EXPECT_EQ(h.predicted_misses(10), 2.0) << "tail distances miss at every capacity of interest";
  EXPECT_EQ(h.predicted_misses(0), 6.0);
  EXPECT_EQ(h.predicted_misses(9), 2.5) << "half of the 2-wide bin [8, 10) is ≥ 9";
  EXPECT_EQ(h.marginal(9), 0.5);
  EXPECT_EQ(h.marginal(0), 0.5);
  EXPECT_EQ(h.marginal(5), 0.25);
}

TEST(DecayedReuseHistogram, DecayHalvesTheOldMassPerBurst) {
  decayed_reuse_histogram h({.max_capacity = 8, .bin_width = 2, .decay = 0.5});
  h.new_burst();
  for (int i = 0; i < 8; ++i) h.record(3);
  EXPECT_EQ(h.total_mass(), 8.0);
  h.new_burst();
  EXPECT_EQ(h.counts()[1], 4.0) << "old mass halved";
  EXPECT_EQ(h.total_mass(), 4.0);
  h.add_burst(std::vector<std::size_t>{0, 0, 7, reuse_distance_tracker::cold});
  EXPECT_THAT(h.counts(), ElementsAre(2.0, 2.0, 0.0, 1.0, 0.0));
  EXPECT_EQ(h.total_mass(), 5.0);
  EXPECT_EQ(h.bursts(), 3U);
  EXPECT_EQ(h.warm_records(), 11U);
  EXPECT_EQ(h.cold_ignored(), 1U);
  h.new_burst();
  EXPECT_THAT(h.counts(), ElementsAre(1.0, 1.0, 0.0, 0.5, 0.0));
  EXPECT_DOUBLE_EQ(h.predicted_miss_ratio(4), 0.5 / 2.5);
}

TEST(DecayedReuseHistogram, AnIdleStreamDecaysToExactlyZero) {
  decayed_reuse_histogram h({.max_capacity = 4, .bin_width = 1, .decay = 1e-100});
  h.record(1);
  for (int i = 0; i < 4; ++i) h.new_burst();
  EXPECT_EQ(h.counts()[1], 0.0) << "no subnormals";
  EXPECT_EQ(h.total_mass(), 0.0);
  EXPECT_EQ(h.predicted_miss_ratio(0), 0.0);
}

TEST(DecayedReuseHistogram, MarginalsAreNonNegativeFiniteDifferencesOfTheCurve) {
  for (const std::size_t width : {1U, 3U, 16U}) {
    const std::size_t key_count = 48;
    const auto keys = test::zipf_stream(key_count, 0.9, 6000, 400 + width);
    reuse_distance_tracker rd(key_count);
    decayed_reuse_histogram h({.max_capacity = 40, .bin_width = width, .decay = 0.8});  // C < key count: a tail
    for (std::size_t t = 0; t < keys.size(); ++t) {
      if (t % 64 == 0) h.new_burst();
      h.record(rd.access(keys[t]));
    }
    const auto curve = h.predicted_curve();
    const auto marginals = h.marginals();
    ASSERT_EQ(marginals.size(), 40U);
    for (std::size_t c = 0; c < 40; ++c) {
      ASSERT_GE(marginals[c], 0.0) << "width " << width << " capacity " << c;
      ASSERT_EQ(marginals[c], h.marginal(c));
      ASSERT_NEAR(marginals[c], curve[c] - curve[c + 1], 1e-9 * h.total_mass()) << "capacity " << c;
      ASSERT_NEAR(curve[c], h.predicted_misses(c), 1e-9 * h.total_mass()) << "capacity " << c;
      ASSERT_LE(curve[c + 1], curve[c]);
    }
    EXPECT_NEAR(curve[0], h.total_mass(), 1e-9 * h.total_mass());
    EXPECT_EQ(curve[40], h.counts().back()) << "M̂(C) is the tail";
  }
}

// predicted_misses() never rises with the capacity, not even by a rounding, and
// predicted_miss_ratio() never exceeds 1: the two cases a review found (bins summed in another
// order at neighbouring capacities; the total summed in another order than the misses), then
// random histograms.
TEST(DecayedReuseHistogram, ThePredictedCurveNeverRisesAndTheRatioStaysAtMostOne) {
  decayed_reuse_histogram h({.max_capacity = 3, .bin_width = 1, .decay = 0.3});
  h.record(3);  // the tail
  h.new_burst();
  h.new_burst();
  h.record(1);
  h.record(1);
  h.new_burst();
  h.record(2);
  h.record(2);  // bin 0 stays empty: M̂(0) and M̂(1) add the same masses
  EXPECT_LE(h.predicted_misses(1), h.predicted_misses(0));
  decayed_reuse_histogram r({.max_capacity = 3, .bin_width = 1, .decay = 0.7});
  r.record(0);
  r.new_burst();
  r.record(1);
  r.new_burst();
  r.record(0);
  r.record(0);
  EXPECT_LE(r.predicted_miss_ratio(0), 1.0);
  std::mt19937_64 rng(17);
  for (int round = 0; round < 3000; ++round) {
    const std::size_t capacity = 1 + rng() % 12;
    const std::size_t width = 1 + rng() % std::min<std::size_t>(capacity, 4);
    decayed_reuse_histogram x(
        {.max_capacity = capacity, .bin_width = width, .decay = 0.3 + 0.7 * static_cast<double>(rng() % 100) / 100.0});
    for (int i = 0; i < 20; ++i) {
      if (rng() % 4 == 0) x.new_burst();
      x.record(rng() % (capacity + 3));
    }
    for (std::size_t c = 0; c < capacity; ++c) {
      ASSERT_LE(x.predicted_misses(c + 1), x.predicted_misses(c)) << "round " << round << " capacity " << c;
    }
    ASSERT_LE(x.predicted_miss_ratio(0), 1.0) << "round " << round;
  }
}

// The variance estimate is the same tail sum over squared weights: Σ_k γ^{2k}·n_k of the
// distances ≥ c recorded k bursts ago (for a bin straddling c, its share squared), scaled by keep² —
// against a brute force over the recorded (burst, distance) pairs.
TEST(DecayedReuseHistogram, TheVarianceIsTheTailSumOfSquaredWeights) {
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 200; ++trial) {
    const std::size_t capacity = 1 + rng() % 40;
    const std::size_t width = 1 + rng() % capacity;
    const double decay = trial % 5 == 0 ? 1.0 : 0.5 + 0.5 * static_cast<double>(rng() % 100) / 100.0;
    decayed_reuse_histogram h({.max_capacity = capacity, .bin_width = width, .decay = decay});
    std::vector<std::pair<int, std::size_t>> seen;  // (burst, distance)
    const int bursts = 1 + static_cast<int>(rng() % 6);
    for (int b = 0; b < bursts; ++b) {
      h.new_burst();
      for (int i = static_cast<int>(rng() % 20); i > 0; --i) {
        const std::size_t d = rng() % (capacity + 5);
        h.record(d);
        seen.emplace_back(b, d);
      }
    }
    const double keep = trial % 3 == 0 ? 0.5 : 1.0;
    h.scale(keep);
    for (std::size_t c = 0; c <= capacity; ++c) {
      double want = 0.0;
      for (const auto& [b, d] : seen) {
        const double w = std::pow(decay, 2 * (bursts - 1 - b)) * keep * keep;
        const std::size_t lo = std::min(d, capacity) / width * width;  // its bin's first distance
        const std::size_t hi = d >= capacity ? capacity : std::min(lo + width, capacity);
        if (d >= capacity || lo >= c) {
          want += w;  // wholly at or above c
        } else if (hi > c) {
          const double share = static_cast<double>(hi - c) / static_cast<double>(hi - lo);
          want += w * share * share;  // M̂ holds the bin's share of the count: its variance, share²
        }
      }
      EXPECT_NEAR(h.predicted_misses_variance(c), want, 1e-9 * std::max(1.0, want))
          << "trial " << trial << " capacity " << c;
    }
    // The difference of two tails: each record by the difference of its bin's shares at the two
    // capacities, squared (1 or 0 with unit bins: the records between them).
    const auto share = [&](std::size_t d, std::size_t c) {
      if (d >= capacity) return 1.0;
      const std::size_t lo = d / width * width;
      const std::size_t hi = std::min(lo + width, capacity);
      return c <= lo ? 1.0 : c >= hi ? 0.0 : static_cast<double>(hi - c) / static_cast<double>(hi - lo);
    };
    for (int pair = 0; pair < 20; ++pair) {
      const std::size_t a = rng() % (capacity + 1);
      const std::size_t b = rng() % (capacity + 1);
      double want = 0.0;
      for (const auto& [burst, d] : seen) {
        const double diff = share(d, a) - share(d, b);
        want += std::pow(decay, 2 * (bursts - 1 - burst)) * keep * keep * diff * diff;
      }
      EXPECT_NEAR(h.predicted_difference_variance(a, b), want, 1e-9 * std::max(1.0, want))
          << "trial " << trial << " caps " << a << ", " << b;
      EXPECT_EQ(h.predicted_difference_variance(a, b), h.predicted_difference_variance(b, a));
    }
  }
  decayed_reuse_histogram h({.max_capacity = 4, .bin_width = 1, .decay = 0.5});
  h.record(1);
  h.reset();
  EXPECT_EQ(h.predicted_misses_variance(0), 0.0);
  EXPECT_THROW((void)h.predicted_misses_variance(5), invalid_argument);
  EXPECT_THROW((void)h.predicted_difference_variance(0, 5), invalid_argument);
}

TEST(DecayedReuseHistogram, RejectsBadParametersNamingTheValue) {
  const auto message = [](decayed_reuse_histogram::config cfg) -> std::string {
    try {
      decayed_reuse_histogram h(cfg);
    } catch (const invalid_argument& e) {
      return e.what();
    }
    return "no exception";
  };
  EXPECT_THAT(message({.max_capacity = 0}), AllOf(HasSubstr("max_capacity 0"), HasSubstr("[1, 1073741824]")));
  EXPECT_THAT(message({.max_capacity = 8, .bin_width = 0}), AllOf(HasSubstr("bin_width 0"), HasSubstr("[1, 8]")));
  EXPECT_THAT(message({.max_capacity = 8, .bin_width = 9}), HasSubstr("bin_width 9"));
  EXPECT_THAT(message({.max_capacity = 8, .decay = 0.0}), AllOf(HasSubstr("decay 0"), HasSubstr("(0, 1]")));
  EXPECT_THAT(message({.max_capacity = 8, .decay = 1.5}), HasSubstr("decay 1.5"));
  EXPECT_THAT(message({.max_capacity = 8, .decay = -0.25}), HasSubstr("decay -0.25"));
  EXPECT_THAT(message({.max_capacity = 8, .decay = std::nan("")}), HasSubstr("decay nan"));
  EXPECT_THAT(message({.max_capacity = 8, .decay = std::numeric_limits<double>::infinity()}), HasSubstr("decay inf"));
  EXPECT_EQ(message({.max_capacity = 8, .bin_width = 8, .decay = 1.0}), "no exception");

  decayed_reuse_histogram h({.max_capacity = 8});
  try {
    (void)h.predicted_misses(9);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("capacity 9"), HasSubstr("[0, 8]")));
  }
  EXPECT_THROW((void)h.predicted_miss_ratio(9), invalid_argument);
  try {
    (void)h.marginal(8);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("capacity 8"), HasSubstr("[0, 8)")));
  }
}

TEST(DecayedReuseHistogram, ResetKeepsTheConfiguration) {
  decayed_reuse_histogram h({.max_capacity = 6, .bin_width = 2, .decay = 0.75});
  h.add_burst(std::vector<std::size_t>{1, 2, reuse_distance_tracker::cold});
  h.reset();
  EXPECT_EQ(h.total_mass(), 0.0);
  EXPECT_EQ(h.bursts(), 0U);
  EXPECT_EQ(h.warm_records(), 0U);
  EXPECT_EQ(h.cold_ignored(), 0U);
  EXPECT_EQ(h.decay(), 0.75);
  EXPECT_EQ(h.bin_width(), 2U);
  EXPECT_EQ(h.max_capacity(), 6U);
  EXPECT_THAT(h.predicted_curve(), ElementsAre(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0));
}

}  // namespace
}  // namespace expage
