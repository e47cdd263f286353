// LFRU on hand-computed sequences.
#include "expage/cache/lfru_policy.hpp"

#include "expage/cache/lfu_policy.hpp"
#include "expage/cache/lru_policy.hpp"

#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace expage {
namespace {

constexpr key_space eight_experts{.layers = 1, .experts_per_layer = 8};

// Accesses as (key, time), none evicting: a key's first access inserts it, the others hit.
template <class Policy>
Policy fed(Policy p, std::initializer_list<std::array<std::uint64_t, 2>> accesses) {
  std::array<bool, 8> seen{};
  for (const auto& [key, time] : accesses) {
    const auto k = static_cast<std::uint32_t>(key);
    if (seen[k]) {
      p.on_hit(k, {.time = time});
    } else {
      p.on_insert(k, {.time = time});
    }
    seen[k] = true;
  }
  return p;
}

TEST(LfruPolicy, ScoresHalveOncePerHalfLife) {
  const lfru_policy p = fed(lfru_policy(eight_experts, {.half_life = 2}), {{0, 0}, {0, 1}, {0, 2}, {1, 5}});
  // Key 0: epochs 0, 0, 1 → at epoch 1: 1 + 1/2 + 1/2 = 2; key 1: epoch 2 → 1.
  EXPECT_DOUBLE_EQ(p.score(0, 2), 2.0);
  EXPECT_DOUBLE_EQ(p.score(0, 6), 0.5);  // epoch 3: two halvings
  EXPECT_DOUBLE_EQ(p.score(1, 6), 0.5);
  EXPECT_EQ(lfru_policy(eight_experts).half_life(), 8U);  // default: 8 × layers
}

// LFRU sits between LFU and LRU. Half-life 2 groups, victims chosen at time 6 (epoch 3).
// The aging multiplies by 2^−age instead of calling ldexp: the same doubles, bit for bit, at every
// age, for values whose aged score is normal, subnormal or zero.
TEST(LfruPolicy, AgingEqualsLdexpBitForBit) {
  std::mt19937_64 rng(5);
  std::vector<double> values = {
      0.0, 1.0, 1.5, 3.0, 0.75, 1e6, 123456.789, 0x1.fffffffffffffp+30, std::numeric_limits<double>::min()};
  for (int i = 0; i < 200; ++i)
    values.push_back(std::ldexp(static_cast<double>(rng() >> 11), -static_cast<int>(rng() % 80)));
  for (const double v : values) {
    for (std::uint64_t age = 0; age <= 2100; ++age) {
      const double want = age >= 2048 ? 0.0 : std::ldexp(v, -static_cast<int>(age));
      const double got = detail::lfru_age(v, 5, 5 + age);
      ASSERT_EQ(std::bit_cast<std::uint64_t>(got), std::bit_cast<std::uint64_t>(want)) << v << " aged " << age;
    }
  }
}

TEST(LfruPolicy, WeighsFrequencyByRecency) {
  const std::uint8_t none[8] = {};
  const access_context now{.time = 6};
  // 0 at times 0, 1 (count 2, score 2/8); 1 at time 5 (count 1, score 1/2): LFRU and LRU evict
  // 0, whose accesses are old; LFU evicts 1, the rarer.
  {
    const auto a = {std::array<std::uint64_t, 2>{0, 0}, {0, 1}, {1, 5}};
    EXPECT_EQ(fed(lfru_policy(eight_experts, {.half_life = 2}), a).victim({none}, now), 0U);
    EXPECT_EQ(fed(lfu_policy(eight_experts), a).victim({none}, now), 1U);
  }
  // 0 at times 1, 2, 3 (score (1/2 + 1)/4 + 1/4 = 0.625); 1 at time 4 (1/2): LFRU evicts 1;
  // LRU evicts 0, the least recent.
  {
    const auto a = {std::array<std::uint64_t, 2>{0, 1}, {0, 2}, {0, 3}, {1, 4}};
    EXPECT_EQ(fed(lfru_policy(eight_experts, {.half_life = 2}), a).victim({none}, now), 1U);
    EXPECT_EQ(fed(lru_policy(eight_experts), a).victim({none}, now), 0U);
  }
}

// Equal scores: the older last access goes first, then the smaller key; pinned keys never.
TEST(LfruPolicy, BreaksTiesByRecencyAndSkipsPins) {
  lfru_policy p = fed(lfru_policy(eight_experts, {.half_life = 4}), {{3, 0}, {5, 1}, {2, 1}});
  std::uint8_t pins[8] = {};
  EXPECT_EQ(p.victim({pins}, {.time = 2}), 3U);
  pins[3] = 1;
  EXPECT_EQ(p.victim({pins}, {.time = 2}), 2U);
  p.on_evict(2);
  EXPECT_EQ(p.victim({pins}, {.time = 2}), 5U);
}

TEST(LfruPolicy, KeepsScoresAcrossEviction) {
  lfru_policy p = fed(lfru_policy(eight_experts, {.half_life = 100}), {{0, 0}, {0, 1}, {0, 2}});
  p.on_evict(0);
  p.on_insert(0, {.time = 3});
  EXPECT_DOUBLE_EQ(p.score(0, 3), 4.0);
}

}  // namespace
}  // namespace expage
