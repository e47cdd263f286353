// SIEVE on hand-computed sequences.
#include "expage/cache/sieve_policy.hpp"

#include "cache/policy_driver.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace expage {
namespace {

using testing::policy_driver;
constexpr key_space eight{.layers = 1, .experts_per_layer = 8};

// Capacity 3. Queue (oldest first) A B C; A and B are hit. D: the hand starts at the oldest,
// clears A and B and evicts C, the newest, and rests past it (at the oldest again). E: A is
// unvisited now and goes; the hand rests on B. F: B goes. A hit protects a key once per
// sweep, and a new key that is not hit goes before older ones that were (quick demotion).
TEST(SievePolicy, EvictsTheFirstUnvisitedKeyFromTheHand) {
  policy_driver<sieve_policy> d(eight, 3);
  enum : std::uint32_t { A, B, C, D, E, F };
  EXPECT_FALSE(d.access(A));
  EXPECT_FALSE(d.access(B));
  EXPECT_FALSE(d.access(C));
  EXPECT_FALSE(d.access(A));
  EXPECT_FALSE(d.access(B));
  EXPECT_EQ(d.access(D), C);
  EXPECT_FALSE(d.policy.visited(A));
  EXPECT_FALSE(d.policy.visited(B));
  EXPECT_EQ(d.access(E), A);
  EXPECT_EQ(d.access(F), B);
  EXPECT_FALSE(d.access(D));  // queue D E F; D visited
  EXPECT_EQ(d.access(A), E);  // the hand wrapped to D, cleared it, evicted E
  EXPECT_FALSE(d.policy.visited(D));
}

// The hand passes a pinned key without clearing its bit: the hit it got in this step counts.
TEST(SievePolicy, PassesPinnedKeysWithoutClearingThem) {
  policy_driver<sieve_policy> d(eight, 3);
  EXPECT_FALSE(d.access(0));
  EXPECT_FALSE(d.access(1));
  EXPECT_FALSE(d.access(2));
  EXPECT_FALSE(d.access(0));  // 0 visited
  EXPECT_FALSE(d.access(1));  // 1 visited
  // 3 arrives in a group with 0 and 2: the hand passes pinned 0, clears 1, passes pinned 2,
  // wraps, passes 0 again and evicts 1.
  EXPECT_EQ(d.access(3, {0, 2}), 1U);
  EXPECT_TRUE(d.policy.visited(0));
}

// A sequential replay against libCacheSim: the hits and misses libcachesim 0.3.5 (PyPI) reports
// for this sequence at 5 slots, unit sizes.
TEST(SievePolicy, MatchesLibCacheSimOnARecordedSequence) {
  const std::vector<std::uint32_t> keys = {7, 4, 2, 0, 5, 7, 1, 8, 0, 6, 2, 7, 2, 2, 0, 2, 1, 6, 1, 3,
                                           3, 6, 1, 3, 4, 0, 0, 0, 6, 0, 3, 1, 0, 1, 3, 0, 1, 0, 1, 7,
                                           3, 1, 3, 1, 9, 2, 9, 0, 4, 9, 2, 4, 0, 1, 3, 2, 0, 5, 8, 9};
  policy_driver<sieve_policy> d({.layers = 1, .experts_per_layer = 12}, 5);
  EXPECT_EQ(d.hit_pattern(keys), "000001001001111101101011011101111111111011110011010000011000");
}

}  // namespace
}  // namespace expage
