// S3-FIFO on hand-computed sequences (libCacheSim S3FIFOv0.c's rules).
#include "expage/cache/s3fifo_policy.hpp"

#include "cache/policy_driver.hpp"

#include <gtest/gtest.h>

namespace expage {
namespace {

using queue = s3fifo_policy::queue;
using testing::policy_driver;

// c = 10: the small queue's share is 1, the main queue's 9, the ghost queue's 9. Keys 0..9 fill
// the small queue (nothing is evicted before the cache is full); 0 is hit twice, 1 once.
//   10: evict from small (main holds 0 ≤ 9): 0 was hit twice → main (counter reset);
//       1 was hit once → victim, into the ghost queue; 10 enters small
//   1:  a ghost: evict from small: 2 (never hit) → victim, ghost; 1 enters main
TEST(S3FifoPolicy, PromotesTwiceHitKeysAndRemembersSmallQueueVictims) {
  policy_driver<s3fifo_policy> d({.layers = 1, .experts_per_layer = 16}, 10);
  for (std::uint32_t k = 0; k < 10; ++k) (void)d.access(k);
  (void)d.access(0);
  (void)d.access(0);
  (void)d.access(1);
  EXPECT_EQ(d.policy.frequency(0), 2);
  EXPECT_EQ(d.access(10), 1U);
  EXPECT_EQ(d.policy.where(0), queue::main);
  EXPECT_EQ(d.policy.frequency(0), 0);
  EXPECT_EQ(d.policy.where(1), queue::ghost);
  EXPECT_EQ(d.access(1), 2U);
  EXPECT_EQ(d.policy.where(1), queue::main);
  EXPECT_EQ(d.policy.where(2), queue::ghost);
}

// The main queue is a 2-bit CLOCK. c = 2 (small share 0, main 2, ghost 1):
//   0, 1 into small; 0 hit twice
//   2:  small: 0 → main, 1 → victim (ghost [1]); small = [2]
//   1:  ghost hit: small: 2 → victim (ghost [2]); 1 enters main = [0 1]
//   1 ×4: counter saturates at 3
//   3:  small is empty → main: 0 (counter 0) → victim; small = [3]
//   4:  small: 3 → victim (ghost [3], 2 forgotten); main = [1]
//   5:  small: 4 → victim; the main key 1 outlives every key that passes through small
TEST(S3FifoPolicy, MainQueueIsATwoBitClock) {
  policy_driver<s3fifo_policy> d({.layers = 1, .experts_per_layer = 8}, 2);
  (void)d.access(0);
  (void)d.access(1);
  (void)d.access(0);
  (void)d.access(0);
  EXPECT_EQ(d.access(2), 1U);
  EXPECT_EQ(d.access(1), 2U);
  for (int i = 0; i < 4; ++i) (void)d.access(1);
  EXPECT_EQ(d.policy.frequency(1), s3fifo_policy::max_frequency);
  EXPECT_EQ(d.access(3), 0U);
  EXPECT_EQ(d.access(4), 3U);
  EXPECT_EQ(d.policy.where(2), queue::none);
  EXPECT_EQ(d.policy.where(3), queue::ghost);
  EXPECT_EQ(d.access(5), 4U);
  EXPECT_EQ(d.policy.where(1), queue::main);
}

// Pins: a pinned small-queue key is passed over where it stands, counter unchanged.
TEST(S3FifoPolicy, PassesPinnedKeysWhereTheyStand) {
  policy_driver<s3fifo_policy> d({.layers = 1, .experts_per_layer = 8}, 3);
  for (const std::uint32_t k : {0U, 1U, 2U}) (void)d.access(k);
  (void)d.access(0);                // counter 1: not enough to be promoted
  EXPECT_EQ(d.access(3, {0}), 1U);  // 0 is pinned: 1 goes instead
  EXPECT_EQ(d.policy.where(0), queue::small);
  EXPECT_EQ(d.policy.frequency(0), 1);
  EXPECT_EQ(d.policy.where(1), queue::ghost);
}

}  // namespace
}  // namespace expage
