// S3-FIFO on hand-computed sequences (libCacheSim S3FIFO.c's rules).
#include "expage/cache/s3fifo_policy.hpp"

#include "cache/policy_driver.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

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

// A sequential replay against libCacheSim: the hits and misses libcachesim 0.3.5 (PyPI) reports
// for this sequence at 20 slots, unit sizes (below 20 libCacheSim admits nothing).
TEST(S3FifoPolicy, MatchesLibCacheSimOnARecordedSequence) {
  const std::vector<std::uint32_t> keys = {
      9,  3,  4,  6,  3,  13, 2,  26, 4,  5,  3,  7,  14, 3,  25, 3,  2,  8,  9,  7,  19, 11, 6,  12, 6,  4,  3,
      13, 31, 20, 29, 23, 15, 11, 5,  19, 21, 18, 4,  7,  10, 9,  26, 2,  35, 20, 22, 31, 4,  5,  4,  3,  28, 18,
      1,  22, 10, 7,  3,  8,  15, 25, 5,  25, 17, 8,  17, 22, 14, 5,  9,  14, 0,  11, 16, 0,  26, 23, 20, 8,  3,
      29, 25, 25, 6,  3,  4,  13, 7,  21, 3,  0,  9,  6,  1,  4,  24, 9,  22, 23, 7,  29, 30, 5,  6,  16, 10, 1,
      13, 9,  1,  19, 5,  23, 10, 14, 32, 14, 12, 15, 12, 31, 1,  1,  16, 12, 22, 22, 5,  6,  12, 13, 30, 0,  22,
      5,  12, 11, 21, 5,  25, 5,  8,  1,  29, 9,  30, 9,  35, 1,  0,  8,  12, 1,  13, 18, 15, 16, 26, 3};
  policy_driver<s3fifo_policy> d({.layers = 1, .experts_per_layer = 40}, 20);
  EXPECT_EQ(d.hit_pattern(keys),
            "0000100010100101101100101111000001110011000101011111000001101011001101110101011110011110101011010111"
            "100110010110111001001011101111110011100111111111010111100101");
}

}  // namespace
}  // namespace expage
