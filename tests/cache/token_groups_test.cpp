#include "expage/cache/token_groups.hpp"

#include "expage/core/error.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <vector>

namespace expage {
namespace {

std::vector<std::span<const std::uint32_t>> spans(const std::vector<std::vector<std::uint32_t>>& tokens) {
  return {tokens.begin(), tokens.end()};
}

TEST(GroupTokens, OneGroupWhenTheUnionFits) {
  const std::vector<std::vector<std::uint32_t>> t = {{0, 1}, {1, 2}, {2, 0}};
  const auto g = group_tokens(spans(t), 3);
  ASSERT_EQ(g.tokens.size(), 1U);
  EXPECT_EQ(g.tokens[0], (std::vector<std::uint32_t>{0, 1, 2}));
  EXPECT_EQ(g.experts[0], (std::vector<std::uint32_t>{0, 1, 2}));
  EXPECT_TRUE(g.minimal());
}

TEST(GroupTokens, SplitsIntoGroupsThatFitAndCoverEveryTokenOnce) {
  for (std::uint64_t seed = 1; seed <= 50; ++seed) {
    std::mt19937_64 rng(seed);
    std::vector<std::vector<std::uint32_t>> t(1 + rng() % 40);
    for (auto& tok : t) {
      while (tok.size() < 2) {
        const auto e = static_cast<std::uint32_t>(rng() % 16);
        if (std::find(tok.begin(), tok.end(), e) == tok.end()) tok.push_back(e);
      }
    }
    const std::size_t cap = 2 + rng() % 6;
    const auto g = group_tokens(spans(t), cap);
    std::vector<int> seen(t.size(), 0);
    std::set<std::uint32_t> all;
    for (const auto& tok : t) all.insert(tok.begin(), tok.end());
    EXPECT_EQ(g.lower_bound, (all.size() + cap - 1) / cap);
    EXPECT_GE(g.tokens.size(), g.lower_bound);
    for (std::size_t k = 0; k < g.tokens.size(); ++k) {
      EXPECT_LE(g.experts[k].size(), cap);
      EXPECT_TRUE(std::is_sorted(g.tokens[k].begin(), g.tokens[k].end()));
      std::set<std::uint32_t> u;
      for (const std::uint32_t i : g.tokens[k]) {
        ++seen[i];
        u.insert(t[i].begin(), t[i].end());
      }
      EXPECT_EQ(u, std::set<std::uint32_t>(g.experts[k].begin(), g.experts[k].end()));
    }
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int s) { return s == 1; })) << "seed " << seed;
  }
}

TEST(GroupTokens, RejectsImpossibleRequests) {
  const std::vector<std::vector<std::uint32_t>> t = {{0, 1, 2}};
  EXPECT_THROW((void)group_tokens(spans(t), 2), invalid_argument);
  EXPECT_THROW((void)group_tokens(spans(t), 0), invalid_argument);
  EXPECT_TRUE(group_tokens({}, 4).tokens.empty());
}

}  // namespace
}  // namespace expage
