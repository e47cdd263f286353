// S3-FIFO on hand-computed sequences (libCacheSim S3FIFO.c's rules).
#include "expage/cache/s3fifo_policy.hpp"

#include "cache/policy_driver.hpp"

#include <gtest/gtest.h>

namespace expage {
namespace {

using queue = s3fifo_policy::queue;
using testing::policy_driver;

// c = 20: the small queue's share is 2, the main queue's 18, the ghost queue's 18. Keys 0..19
// fill the cache: the first two stay in the small queue, the rest go to the main queue (as
// libCacheSim's S3FIFO.c does once the small queue is full). 0 is hit twice, 1 once.
//   20: evict from small (main holds 18, not more than its share): 0 was hit twice → main
//       (counter reset); 1 was hit once → victim, into the ghost queue; 20 enters small
//   1:  a ghost → it will enter main, which now holds 19 > 18: evict from main: 2, never hit,
//       is the victim (main-queue victims leave no ghost)
TEST(S3FifoPolicy, PromotesTwiceHitKeysAndRemembersSmallQueueVictims) {
  policy_driver<s3fifo_policy> d({.layers = 1, .experts_per_layer = 32}, 20);
  for (std::uint32_t k = 0; k < 20; ++k) (void)d.access(k);
  (void)d.access(0);
  (void)d.access(0);
  (void)d.access(1);
  EXPECT_EQ(d.policy.frequency(0), 2);
  EXPECT_EQ(d.access(20), 1U);
  EXPECT_EQ(d.policy.where(0), queue::main);
  EXPECT_EQ(d.policy.frequency(0), 0);
  EXPECT_EQ(d.policy.where(1), queue::ghost);
  EXPECT_EQ(d.policy.where(2), queue::main);
  EXPECT_EQ(d.policy.where(20), queue::small);
  EXPECT_EQ(d.access(1), 2U);
  EXPECT_EQ(d.policy.where(1), queue::main);
  EXPECT_EQ(d.policy.where(2), queue::none);
}

// The main queue is a 2-bit CLOCK. c = 2 (small share 0, main 2, ghost 1):
//   0, 1 fill the cache; 0 is hit 4 times (its counter saturates at 3), 1 once
//   2:  both are in main (the small share is 0), small is empty → main: 0 (3) reinserted with 2,
//       1 (1) with 0, 0 (2) with 1, then 1 (0) → victim; 2 enters small
//   3:  small: 2 (0) → victim, into the ghost queue
//   2:  a ghost: small: 3 (0) → victim, ghost; 2 enters main = [0 2]
//   4:  small is empty → main: 0 (1) reinserted with 0, then 2 (0) → victim
TEST(S3FifoPolicy, MainQueueIsATwoBitClock) {
  policy_driver<s3fifo_policy> d({.layers = 1, .experts_per_layer = 8}, 2);
  (void)d.access(0);
  (void)d.access(1);
  for (int i = 0; i < 4; ++i) (void)d.access(0);
  (void)d.access(1);
  EXPECT_EQ(d.policy.frequency(0), s3fifo_policy::max_frequency);
  EXPECT_EQ(d.access(2), 1U);
  EXPECT_EQ(d.policy.frequency(0), 1);
  EXPECT_EQ(d.access(3), 2U);
  EXPECT_EQ(d.policy.where(2), queue::ghost);
  EXPECT_EQ(d.access(2), 3U);
  EXPECT_EQ(d.policy.where(2), queue::main);
  EXPECT_EQ(d.policy.where(3), queue::ghost);
  EXPECT_EQ(d.access(4), 2U);
  EXPECT_EQ(d.policy.where(0), queue::main);
  EXPECT_EQ(d.policy.frequency(0), 0);
}

// Pins: a pinned small-queue key is passed over where it stands, counter unchanged; the key
// evicted in its place still enters the ghost queue.
TEST(S3FifoPolicy, PassesPinnedKeysWhereTheyStand) {
  policy_driver<s3fifo_policy> d({.layers = 1, .experts_per_layer = 32}, 20);
  for (std::uint32_t k = 0; k < 20; ++k) (void)d.access(k);  // small = [0 1], main = [2 .. 19]
  (void)d.access(0);                                         // counter 1: not enough to be promoted
  EXPECT_EQ(d.access(20, {0}), 1U);                          // 0 is pinned: 1 goes instead
  EXPECT_EQ(d.policy.where(0), queue::small);
  EXPECT_EQ(d.policy.frequency(0), 1);
  EXPECT_EQ(d.policy.where(1), queue::ghost);
}

}  // namespace
}  // namespace expage
