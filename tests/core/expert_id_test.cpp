#include "expage/core/expert_id.hpp"
#include "expage/formatters.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <unordered_set>
#include <vector>

namespace {

using expage::expert_id;

constexpr std::uint32_t max_u32 = std::numeric_limits<std::uint32_t>::max();

static_assert(expert_id{.layer = 0, .expert = 5} < expert_id{.layer = 1, .expert = 0});
static_assert(expert_id{.layer = 2, .expert = 3} == expert_id{.layer = 2, .expert = 3});
static_assert(expert_id{}.layer == 0 && expert_id{}.expert == 0);

TEST(ExpertId, DefaultIsLayerZeroExpertZero) {
  const expert_id id;
  EXPECT_EQ(id.layer, 0U);
  EXPECT_EQ(id.expert, 0U);
  EXPECT_EQ(id, (expert_id{.layer = 0, .expert = 0}));
}

TEST(ExpertId, Equality) {
  const expert_id a{.layer = 7, .expert = 3};
  EXPECT_TRUE(a == (expert_id{.layer = 7, .expert = 3}));
  EXPECT_FALSE(a != (expert_id{.layer = 7, .expert = 3}));
  EXPECT_NE(a, (expert_id{.layer = 3, .expert = 7}));
  EXPECT_NE(a, (expert_id{.layer = 7, .expert = 4}));
  EXPECT_NE(a, (expert_id{.layer = 8, .expert = 3}));
}

TEST(ExpertId, OrderingIsLayerMajor) {
  // Layer decides first, whatever the expert index.
  EXPECT_LT((expert_id{.layer = 0, .expert = max_u32}), (expert_id{.layer = 1, .expert = 0}));
  EXPECT_GT((expert_id{.layer = 2, .expert = 0}), (expert_id{.layer = 1, .expert = 100}));
  // Within a layer, the expert index.
  EXPECT_LT((expert_id{.layer = 3, .expert = 1}), (expert_id{.layer = 3, .expert = 2}));
  EXPECT_LE((expert_id{.layer = 3, .expert = 2}), (expert_id{.layer = 3, .expert = 2}));
  EXPECT_EQ((expert_id{.layer = 3, .expert = 2} <=> expert_id{.layer = 3, .expert = 2}), std::strong_ordering::equal);
  EXPECT_EQ((expert_id{.layer = 1, .expert = 9} <=> expert_id{.layer = 2, .expert = 0}), std::strong_ordering::less);
}

TEST(ExpertId, SortingGivesLayerMajorOrder) {
  std::vector<expert_id> ids = {{2, 0}, {0, 3}, {1, 1}, {0, 0}, {1, 0}, {2, 5}, {0, 1}};
  std::sort(ids.begin(), ids.end());
  const std::vector<expert_id> want = {{0, 0}, {0, 1}, {0, 3}, {1, 0}, {1, 1}, {2, 0}, {2, 5}};
  EXPECT_EQ(ids, want);
}

TEST(ExpertId, HashDistinguishesSwappedIndices) {
  const std::hash<expert_id> hash;
  EXPECT_NE(hash({.layer = 1, .expert = 2}), hash({.layer = 2, .expert = 1}));
  EXPECT_NE(hash({.layer = 0, .expert = 1}), hash({.layer = 1, .expert = 0}));
  EXPECT_NE(hash({.layer = 0, .expert = max_u32}), hash({.layer = 1, .expert = 0}));
}

TEST(ExpertId, HashIsConsistentWithEquality) {
  const std::hash<expert_id> hash;
  EXPECT_EQ(hash({.layer = 7, .expert = 3}), hash({.layer = 7, .expert = 3}));
  static_assert(noexcept(hash(expert_id{})));
}

TEST(ExpertId, HashHasNoCollisionsOnAModelSizedGrid) {
  // 64 layers x 512 experts: more than any preset model.
  const std::hash<expert_id> hash;
  std::unordered_set<std::size_t> seen;
  for (std::uint32_t layer = 0; layer < 64; ++layer) {
    for (std::uint32_t expert = 0; expert < 512; ++expert) {
      EXPECT_TRUE(seen.insert(hash({.layer = layer, .expert = expert})).second) << layer << "." << expert;
    }
  }
  EXPECT_EQ(seen.size(), std::size_t{64 * 512});
}

TEST(ExpertId, UsableInUnorderedSet) {
  std::unordered_set<expert_id> set;
  EXPECT_TRUE(set.insert({.layer = 1, .expert = 2}).second);
  EXPECT_TRUE(set.insert({.layer = 2, .expert = 1}).second);
  EXPECT_FALSE(set.insert({.layer = 1, .expert = 2}).second);
  EXPECT_EQ(set.size(), std::size_t{2});
  EXPECT_EQ(set.count({.layer = 1, .expert = 2}), std::size_t{1});
  EXPECT_EQ(set.count({.layer = 2, .expert = 1}), std::size_t{1});
  EXPECT_EQ(set.count({.layer = 1, .expert = 1}), std::size_t{0});
  EXPECT_EQ(set.erase({.layer = 1, .expert = 2}), std::size_t{1});
  EXPECT_EQ(set.count({.layer = 1, .expert = 2}), std::size_t{0});
}

TEST(ExpertId, FmtPrintsLayerAndExpert) {
  EXPECT_EQ(fmt::format("{}", expert_id{.layer = 7, .expert = 3}), "L7.E3");
  EXPECT_EQ(fmt::format("{}", expert_id{}), "L0.E0");
  EXPECT_EQ(fmt::format("{}", expert_id{.layer = 26, .expert = 511}), "L26.E511");
  EXPECT_EQ(fmt::format("{}", expert_id{.layer = max_u32, .expert = max_u32}), "L4294967295.E4294967295");
  EXPECT_EQ(fmt::format("miss on {} then {}", expert_id{.layer = 0, .expert = 1}, expert_id{.layer = 1, .expert = 0}),
            "miss on L0.E1 then L1.E0");
}

TEST(ExpertId, FmtRejectsAFormatSpec) {
  EXPECT_THROW((void)fmt::format(fmt::runtime("{:x}"), expert_id{}), fmt::format_error);
}

}  // namespace
