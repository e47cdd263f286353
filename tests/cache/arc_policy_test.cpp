// ARC on hand-computed sequences (Megiddo & Modha, Fig. 4).
#include "expage/cache/arc_policy.hpp"

#include "cache/policy_driver.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace expage {
namespace {

using list = arc_policy::list;
using testing::policy_driver;
constexpr key_space eight{.layers = 1, .experts_per_layer = 8};

// c = 2. Step by step, with the paper's cases:
//   0, 1        misses into T1 = [0 1] (LRU first)
//   0           hit: T1 = [1], T2 = [0]
//   2           case IV(B): REPLACE, |T1| = 1 > p = 0: 1 → B1; T1 = [2]
//   1           case II (ghost of B1): p = min(0 + max(|B2|/|B1|, 1), 2) = 1; REPLACE, |T1| = 1 = p
//               and 1 is not in B2: T2's LRU 0 → B2; 1 enters T2 = [1]
//   0           case III (ghost of B2): p = 1 − max(|B1|/|B2|, 1) = 0; REPLACE, |T1| = 1 > 0:
//               2 → B1; 0 enters T2 = [1 0]
//   3           case IV(B): |T1| = 0, so REPLACE takes T2's LRU 1 → B2; T1 = [3]
TEST(ArcPolicy, AdaptsItsTargetOnGhostHits) {
  policy_driver<arc_policy> d(eight, 2);
  EXPECT_FALSE(d.access(0));
  EXPECT_FALSE(d.access(1));
  EXPECT_FALSE(d.access(0));
  EXPECT_EQ(d.policy.where(0), list::t2);
  EXPECT_EQ(d.access(2), 1U);
  EXPECT_EQ(d.policy.where(1), list::b1);
  EXPECT_EQ(d.access(1), 0U);
  EXPECT_DOUBLE_EQ(d.policy.target(), 1.0);
  EXPECT_EQ(d.policy.where(1), list::t2);
  EXPECT_EQ(d.policy.where(0), list::b2);
  EXPECT_EQ(d.access(0), 2U);
  EXPECT_DOUBLE_EQ(d.policy.target(), 0.0);
  EXPECT_EQ(d.policy.where(2), list::b1);
  EXPECT_EQ(d.access(3), 1U);
  EXPECT_EQ(d.policy.where(1), list::b2);
  EXPECT_EQ(d.policy.where(3), list::t1);
}

// Scan resistance: keys used twice sit in T2, and a scan of keys used once only cycles T1.
// c = 3, p stays 0 (the scan's ghosts are never hit again).
TEST(ArcPolicy, AOneTimeScanDoesNotFlushFrequentKeys) {
  policy_driver<arc_policy> d(eight, 3);
  for (const std::uint32_t k : {0U, 1U, 0U, 1U}) (void)d.access(k);  // T2 = [0 1]
  for (std::uint32_t k = 2; k < 8; ++k) {
    const auto v = d.access(k);
    if (k > 2) {
      EXPECT_EQ(v, k - 1) << "the scan evicts its own previous key";
    }
  }
  EXPECT_EQ(d.policy.where(0), list::t2);
  EXPECT_EQ(d.policy.where(1), list::t2);
  EXPECT_DOUBLE_EQ(d.policy.target(), 0.0);
}

// Case IV(A): with |T1| = c the victim, T1's LRU, is forgotten rather than remembered; with
// |T1| < c the oldest ghost of B1 is forgotten and the victim enters B1 (|T1| + |B1| ≤ c).
TEST(ArcPolicy, BoundsT1AndB1ToTheCacheSize) {
  policy_driver<arc_policy> full(eight, 2);
  (void)full.access(0);
  (void)full.access(1);  // T1 = [0 1]: |T1| = c
  EXPECT_EQ(full.access(2), 0U);
  EXPECT_EQ(full.policy.where(0), list::none);

  policy_driver<arc_policy> d(eight, 2);
  (void)d.access(0);
  (void)d.access(1);
  (void)d.access(0);           // T1 = [1], T2 = [0]
  EXPECT_EQ(d.access(2), 1U);  // case IV(B): 1 → B1
  EXPECT_EQ(d.access(3), 2U);  // case IV(A), |T1| = 1 < c: B1's 1 forgotten, 2 → B1
  EXPECT_EQ(d.policy.where(1), list::none);
  EXPECT_EQ(d.policy.where(2), list::b1);
}

// Pins: REPLACE takes the least recent unpinned key of its list.
TEST(ArcPolicy, SkipsPinnedKeys) {
  policy_driver<arc_policy> d(eight, 3);
  for (const std::uint32_t k : {0U, 1U, 0U, 2U}) (void)d.access(k);  // T1 = [1 2], T2 = [0]
  EXPECT_EQ(d.access(3, {1}), 2U);                                   // |T1| = 2 > p = 0; 1 is pinned
  EXPECT_EQ(d.policy.where(2), list::b1);
  EXPECT_EQ(d.policy.where(1), list::t1);
}

// A sequential replay against libCacheSim: the hits and misses libcachesim 0.3.5 (PyPI) reports
// for this sequence at 5 slots, unit sizes. Its request 32 tells a real-valued p (the paper's,
// libCacheSim's) from an integer one.
TEST(ArcPolicy, MatchesLibCacheSimOnARecordedSequence) {
  const std::vector<std::uint32_t> keys = {2, 1, 5, 8,  13, 5, 5,  6, 6, 13, 7, 10, 6, 10, 10, 6, 1, 1, 7, 15,
                                           5, 6, 1, 3,  2,  4, 3,  0, 2, 0,  8, 1,  4, 5,  8,  1, 4, 1, 1, 0,
                                           7, 2, 0, 12, 1,  0, 13, 8, 0, 2,  4, 5,  3, 9,  6,  3, 4, 0, 7, 2};
  policy_driver<arc_policy> d({.layers = 1, .experts_per_layer = 16}, 5);
  EXPECT_EQ(d.hit_pattern(keys), "000001101100111101100110001011001011111100101100110000001000");
}

}  // namespace
}  // namespace expage
