#include "expage/cache/miss_ratio_curve.hpp"

#include "expage/core/error.hpp"

#include "cache/reuse_reference.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <list>
#include <tuple>
#include <vector>

namespace expage {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(MissRatioCurve, IsColdPlusTheSuffixSumOfTheHistogram) {
  // Distances 0 ×3, 1 ×0, 2 ×2, 3 ×1 over 4 keys; 4 compulsory misses.
  const std::vector<std::uint64_t> hist{3, 0, 2, 1};
  const miss_ratio_curve curve(hist, 4);
  EXPECT_EQ(curve.key_count(), 4U);
  EXPECT_EQ(curve.accesses(), 10U);
  EXPECT_EQ(curve.compulsory_misses(), 4U);
  EXPECT_THAT(curve.miss_counts(), ElementsAre(10U, 7U, 7U, 5U, 4U));
  EXPECT_EQ(curve.misses(0), 10U) << "a cache of no slots misses everything";
  EXPECT_EQ(curve.hits(2), 3U);
  EXPECT_EQ(curve.warm_misses(2), 3U);
  EXPECT_EQ(curve.warm_misses(4), 0U);
  EXPECT_DOUBLE_EQ(curve.miss_ratio(3), 0.5);
  EXPECT_THAT(curve.miss_ratios(), ElementsAre(1.0, 0.7, 0.7, 0.5, 0.4));
  EXPECT_THAT(curve.warm_histogram(), ElementsAre(3U, 0U, 2U, 1U));
}

TEST(MissRatioCurve, RejectsCapacitiesBeyondTheKeyCountNamingTheRange) {
  const std::vector<std::uint64_t> hist(8, 1);
  const miss_ratio_curve curve(hist, 0);
  EXPECT_NO_THROW((void)curve.misses(8));
  try {
    (void)curve.misses(9);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("capacity 9"), HasSubstr("[0, 8]")));
  }
  EXPECT_THROW((void)curve.hits(100), invalid_argument);
  EXPECT_THROW((void)curve.miss_ratio(9), invalid_argument);
  EXPECT_THROW((void)curve.warm_misses(9), invalid_argument);
}

TEST(MissRatioCurve, RejectsAnEmptyHistogramAndAnOverflowingCount) {
  try {
    miss_ratio_curve curve(std::span<const std::uint64_t>{}, 0);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("key count 0"));
  }
  const std::vector<std::uint64_t> huge{std::numeric_limits<std::uint64_t>::max(), 1};
  EXPECT_THROW(miss_ratio_curve(huge, 0), invalid_argument);
}

TEST(MissRatioCurve, AnEmptyStreamHasRatioZeroEverywhere) {
  const miss_curve_builder b(5);
  const auto curve = b.curve();
  EXPECT_EQ(curve.accesses(), 0U);
  EXPECT_EQ(curve.miss_ratio(0), 0.0);
  EXPECT_THAT(curve.miss_ratios(), ElementsAre(0.0, 0.0, 0.0, 0.0, 0.0, 0.0));
}

// (key count, Zipf skew)
class MissRatioCurveProperty : public ::testing::TestWithParam<std::tuple<std::size_t, double>> {};

TEST_P(MissRatioCurveProperty, EqualsAPlainLruSimulationAtEveryCapacity) {
  const auto [key_count, skew] = GetParam();
  const auto keys = test::zipf_stream(key_count, skew, 6000, 77 + key_count);
  const auto curve = lru_miss_ratio_curve(key_count, keys);
  ASSERT_EQ(curve.key_count(), key_count);
  EXPECT_EQ(curve.accesses(), keys.size());
  EXPECT_EQ(curve.compulsory_misses(), test::distinct(keys)) << "compulsory misses = distinct keys";
  for (std::size_t c = 0; c <= key_count; ++c) {
    ASSERT_EQ(curve.misses(c), test::lru_misses(keys, c)) << "capacity " << c;
    if (c > 0) {
      ASSERT_LE(curve.misses(c), curve.misses(c - 1)) << "non-increasing at " << c;
    }
  }
  EXPECT_EQ(curve.misses(0), keys.size());
  EXPECT_EQ(curve.misses(key_count), curve.compulsory_misses());
}

INSTANTIATE_TEST_SUITE_P(KeyCountsAndSkews, MissRatioCurveProperty,
                         ::testing::Combine(::testing::Values(std::size_t{1}, std::size_t{3}, std::size_t{16},
                                                              std::size_t{100}, std::size_t{256}),
                                            ::testing::Values(0.0, 0.8, 1.3)));

TEST(MissCurveBuilder, GivesTheCurveOfThePrefixSeenSoFar) {
  const auto keys = test::zipf_stream(32, 1.0, 3000, 5);
  miss_curve_builder b(32, 40);  // a small window: compactions along the way
  const std::vector<std::size_t> first(keys.begin(), keys.begin() + 1000);
  b.access_all(first);
  for (std::size_t c = 0; c <= 32; ++c) ASSERT_EQ(b.curve().misses(c), test::lru_misses(first, c));
  for (std::size_t t = 1000; t < keys.size(); ++t) (void)b.access(keys[t]);
  for (std::size_t c = 0; c <= 32; ++c) ASSERT_EQ(b.curve().misses(c), test::lru_misses(keys, c));
  EXPECT_GT(b.tracker().compactions(), 0U);
  EXPECT_EQ(b.accesses(), keys.size());
}

TEST(MissCurveBuilder, RejectsBadKeysNamingThemAndRecordsNothing) {
  miss_curve_builder b(6);
  (void)b.access(1);
  try {
    (void)b.access(6);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("key 6"), HasSubstr("[0, 6)")));
  }
  EXPECT_EQ(b.try_access(7), std::nullopt);
  EXPECT_EQ(b.try_access(1), std::optional<std::size_t>(0));
  const std::vector<int> stream{1, 2, -3, 4};
  try {
    b.access_all(stream);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("key -3"), HasSubstr("position 2"), HasSubstr("[0, 6)")));
  }
  const std::vector<std::uint64_t> too_big{0, 6};
  EXPECT_THROW(b.access_all(too_big), invalid_argument);
  EXPECT_EQ(b.accesses(), 2U) << "a stream with a bad key is rejected as a whole";
  EXPECT_THROW((void)lru_miss_ratio_curve(0, std::vector<int>{}), invalid_argument);
  EXPECT_THROW((void)lru_miss_ratio_curve(4, std::vector<int>{0, 4}), invalid_argument);
}

// Keys of a type std::cmp_less cannot compare (bool, the character types) are refused by the
// constraint, not deep inside the standard library.
template <class Keys>
concept curve_keys = requires(Keys k) {
  lru_miss_ratio_curve(2, k);
};
static_assert(curve_keys<std::vector<int>>);
static_assert(curve_keys<std::vector<std::uint32_t>>);
static_assert(!curve_keys<std::vector<char>>);
static_assert(!curve_keys<std::vector<bool>>);
static_assert(!curve_keys<std::vector<char32_t>>);

TEST(MissCurveBuilder, ResetStartsAFreshStream) {
  miss_curve_builder b(4);
  b.access_all(std::vector<unsigned>{0, 1, 0, 1, 2});
  b.reset();
  EXPECT_EQ(b.accesses(), 0U);
  EXPECT_EQ(b.compulsory_misses(), 0U);
  EXPECT_THAT(b.warm_histogram(), ElementsAre(0U, 0U, 0U, 0U));
  b.access_all(std::vector<unsigned>{3, 3});
  EXPECT_THAT(b.curve().miss_counts(), ElementsAre(2U, 1U, 1U, 1U, 1U));
}

}  // namespace
}  // namespace expage
