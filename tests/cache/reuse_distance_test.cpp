#include "expage/cache/reuse_distance.hpp"

#include "expage/core/error.hpp"

#include "cache/reuse_reference.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace expage {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
constexpr std::size_t cold = reuse_distance_tracker::cold;

TEST(ReuseDistanceTracker, CountsDistinctOtherKeysSinceThePreviousAccess) {
  reuse_distance_tracker rd(4);
  EXPECT_EQ(rd.access(0), cold);
  EXPECT_EQ(rd.access(1), cold);
  EXPECT_EQ(rd.access(1), 0U) << "a repeat is distance 0: any cache of capacity >= 1 hits";
  EXPECT_EQ(rd.access(0), 1U);
  EXPECT_EQ(rd.access(2), cold);
  EXPECT_EQ(rd.access(1), 2U) << "0 and 2 were accessed since";
  EXPECT_EQ(rd.access(1), 0U);
  EXPECT_EQ(rd.access(3), cold);
  EXPECT_EQ(rd.access(0), 3U) << "2, 1 and 3 since; 1 twice counts once";
  EXPECT_EQ(rd.accesses(), 9U);
  EXPECT_EQ(rd.distinct_keys(), 4U);
  EXPECT_TRUE(rd.seen(3));
  EXPECT_FALSE(rd.seen(4)) << "out of range is simply not seen";
}

TEST(ReuseDistanceTracker, AnLruCacheOfCapacityCHitsIffDistanceBelowC) {
  const auto keys = test::zipf_stream(16, 0.7, 2000, 11);
  for (std::size_t c = 0; c <= 16; ++c) {
    reuse_distance_tracker rd(16);
    test::lru_simulation lru(c);
    for (const std::size_t k : keys) {
      const std::uint64_t before = lru.misses();
      lru.access(k);
      const bool hit = lru.misses() == before;
      const std::size_t d = rd.access(k);
      ASSERT_EQ(hit, d < c) << "key " << k << " capacity " << c << " distance " << d;
    }
  }
}

// (key count, Zipf skew, window: 0 = default, 1 = key_count + 1, 2 = 2·key_count + 3)
class ReuseDistanceProperty : public ::testing::TestWithParam<std::tuple<std::size_t, double, int>> {};

TEST_P(ReuseDistanceProperty, EqualsTheNaiveLruStackAtEveryAccessAcrossCompactions) {
  const auto [key_count, skew, window_kind] = GetParam();
  const std::size_t window = window_kind == 0 ? 0 : window_kind == 1 ? key_count + 1 : 2 * key_count + 3;
  const std::size_t length = 20'000;
  const auto keys = test::zipf_stream(key_count, skew, length, 1234 + key_count);
  reuse_distance_tracker rd(key_count, window);
  test::naive_stack_distance naive;
  std::size_t colds = 0;
  for (std::size_t t = 0; t < keys.size(); ++t) {
    const std::size_t expected = naive.access(keys[t]);
    colds += expected == test::cold_reference;
    ASSERT_EQ(rd.access(keys[t]), expected) << "access " << t << " key " << keys[t];
  }
  EXPECT_EQ(rd.distinct_keys(), colds);
  EXPECT_EQ(rd.distinct_keys(), test::distinct(keys));
  EXPECT_EQ(rd.accesses(), length);
  if (window_kind != 0) {
    // A compaction happens at the latest every window() accesses.
    EXPECT_GE(rd.compactions(), (length - 1) / rd.window()) << "window " << rd.window();
    EXPECT_GT(rd.compactions(), 0U);
  }
}

INSTANTIATE_TEST_SUITE_P(KeyCountsSkewsWindows, ReuseDistanceProperty,
                         ::testing::Combine(::testing::Values(std::size_t{1}, std::size_t{2}, std::size_t{7},
                                                              std::size_t{64}, std::size_t{256}, std::size_t{1000}),
                                            ::testing::Values(0.0, 0.9, 1.4), ::testing::Values(0, 1, 2)));

// forget() takes a key out of the stack: the keys behind it come one nearer, its next access is
// cold, and compactions (forced by the smallest window) keep both.
TEST(ReuseDistanceTracker, ForgetTakesTheKeyOutOfTheStackAcrossCompactions) {
  for (const std::size_t window : {std::size_t{0}, std::size_t{65}}) {
    const std::size_t keys = 64;
    reuse_distance_tracker rd(keys, window);
    test::naive_stack_distance naive;
    std::mt19937_64 rng(29);
    std::size_t forgotten = 0;
    for (std::size_t t = 0; t < 20'000; ++t) {
      const std::size_t key = std::min(rng() % keys, rng() % keys);
      if (rng() % 5 == 0) {
        rd.forget(key);
        naive.forget(key);
        ++forgotten;
      } else {
        ASSERT_EQ(rd.access(key), naive.access(key)) << "access " << t << " key " << key << " window " << window;
      }
      ASSERT_EQ(rd.distinct_keys(), naive.size()) << "step " << t;
    }
    EXPECT_GT(forgotten, 0U);
    if (window != 0) {
      EXPECT_GT(rd.compactions(), 0U);
    }
  }
  reuse_distance_tracker rd(4);
  rd.forget(2);  // never accessed: nothing to forget
  EXPECT_EQ(rd.distinct_keys(), 0U);
  EXPECT_EQ(rd.access(0), cold);
  EXPECT_EQ(rd.access(1), cold);
  EXPECT_EQ(rd.access(2), cold);
  rd.forget(1);
  EXPECT_EQ(rd.distance(0), 1U) << "1 is gone from between them";
  EXPECT_EQ(rd.access(1), cold);
}

TEST(ReuseDistanceTracker, CompactsWhenTheWindowFillsAndKeepsTheOrder) {
  reuse_distance_tracker rd(3, 4);  // the smallest window for 3 keys
  EXPECT_EQ(rd.window(), 4U);
  EXPECT_EQ(rd.access(0), cold);
  EXPECT_EQ(rd.access(1), cold);
  EXPECT_EQ(rd.access(2), cold);
  EXPECT_EQ(rd.access(1), 1U);
  EXPECT_EQ(rd.compactions(), 0U);
  EXPECT_EQ(rd.access(0), 2U) << "first access after the window filled";
  EXPECT_EQ(rd.compactions(), 1U);
  EXPECT_EQ(rd.access(0), 0U);
  EXPECT_EQ(rd.access(2), 2U);
  EXPECT_GE(rd.compactions(), 2U);
}

TEST(ReuseDistanceTracker, DefaultWindowIsEightKeysOrAtLeast1024) {
  EXPECT_EQ(reuse_distance_tracker(1).window(), 1024U);
  EXPECT_EQ(reuse_distance_tracker(256).window(), 2048U);
  EXPECT_EQ(reuse_distance_tracker(6144).window(), 8U * 6144U);
}

TEST(ReuseDistanceTracker, RejectsAKeyOutOfRangeNamingKeyAndRangeAndRecordsNothing) {
  reuse_distance_tracker rd(256);
  EXPECT_EQ(rd.access(5), cold);
  try {
    (void)rd.access(256);
    FAIL() << "expected invalid_argument";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("key 256"), HasSubstr("[0, 256)")));
  }
  EXPECT_THROW((void)rd.access(static_cast<std::size_t>(-1)), std::invalid_argument);
  EXPECT_EQ(rd.accesses(), 1U);
  EXPECT_EQ(rd.access(5), 0U) << "the failed accesses left no mark";
}

TEST(ReuseDistanceTracker, TryAccessReturnsNulloptForABadKeyAndRecordsNothing) {
  reuse_distance_tracker rd(8);
  EXPECT_EQ(rd.try_access(3), std::optional<std::size_t>(cold));
  EXPECT_EQ(rd.try_access(8), std::nullopt);
  EXPECT_EQ(rd.try_access(3), std::optional<std::size_t>(0));
  EXPECT_EQ(rd.accesses(), 2U);
  static_assert(noexcept(rd.try_access(0)));
}

TEST(ReuseDistanceTracker, RejectsBadKeyCountsAndWindowsNamingTheValue) {
  try {
    reuse_distance_tracker rd(0);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("key_count 0"), HasSubstr("[1, 1073741824]")));
  }
  EXPECT_THROW(reuse_distance_tracker(reuse_distance_tracker::max_key_count + 1), invalid_argument);
  try {
    reuse_distance_tracker rd(8, 8);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("window 8"), HasSubstr("[9, 2147483648]")));
  }
  EXPECT_THROW(reuse_distance_tracker(8, reuse_distance_tracker::max_window + 1), invalid_argument);
  EXPECT_NO_THROW(reuse_distance_tracker(8, 9));
}

TEST(ReuseDistanceTracker, ResetForgetsEveryAccess) {
  reuse_distance_tracker rd(4, 5);
  for (std::size_t k : {0U, 1U, 2U, 3U, 0U, 1U, 2U}) (void)rd.access(k);
  rd.reset();
  EXPECT_EQ(rd.accesses(), 0U);
  EXPECT_EQ(rd.distinct_keys(), 0U);
  EXPECT_EQ(rd.compactions(), 0U);
  EXPECT_FALSE(rd.seen(0));
  EXPECT_EQ(rd.access(1), cold);
  EXPECT_EQ(rd.access(0), cold);
  EXPECT_EQ(rd.access(1), 1U);
}

TEST(ReuseDistanceTracker, IsCopyableAndCopiesAreIndependent) {
  reuse_distance_tracker a(4);
  (void)a.access(0);
  (void)a.access(1);
  reuse_distance_tracker b = a;
  EXPECT_EQ(b.access(0), 1U);
  EXPECT_EQ(a.access(1), 0U);
}

#if EXPAGE_ASSERTIONS_ENABLED
TEST(ReuseDistanceTrackerDeathTest, AccessUncheckedAssertsTheKeyInDebugBuilds) {
  reuse_distance_tracker rd(4);
  EXPECT_DEATH((void)rd.access_unchecked(4), "key out of range");
}
#endif

}  // namespace
}  // namespace expage
