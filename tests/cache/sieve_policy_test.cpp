// SIEVE on hand-computed sequences.
#include "expage/cache/sieve_policy.hpp"

#include "cache/policy_driver.hpp"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace expage
