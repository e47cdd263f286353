#include "expage/predict/eviction_duel.hpp"

#include "expage/core/error.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace expage {
namespace {

using ::testing::HasSubstr;

// The rule against a slow reference that keeps every pass's misses and sums the window from
// scratch at each decision: random misses, random pass lengths, several windows and margins.
TEST(EvictionDuel, DecidesAsAReferenceThatRecountsTheWindow) {
  std::uint64_t switched = 0;
  for (const std::uint32_t passes : {1U, 3U, 16U}) {
    for (const double margin : {0.0, 2.0, 5.5}) {
      std::mt19937_64 rng(passes * 131 + static_cast<std::uint64_t>(margin * 10));
      eviction_duel duel(passes, margin);
      std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>> history;  // [pass][group]
      bool leads = false;
      std::uint64_t switches = 0;
      for (int pass = 0; pass < 60; ++pass) {
        duel.begin_pass();
        history.emplace_back();
        const int groups = 1 + static_cast<int>(rng() % 8);
        for (int g = 0; g < groups; ++g) {
          // Phases in which either side misses more, so that both lead at times.
          const bool lru_better = (pass / 12) % 2 == 1;
          const std::uint64_t a = rng() % 4 + (lru_better ? 1 : 0);
          const std::uint64_t b = rng() % 4 + (lru_better ? 0 : 1);
          duel.add(a, b);
          history.back().emplace_back(a, b);
          double d = 0.0;  // the policy's misses − LRU's over the last `passes` passes and this one
          for (std::size_t p = history.size() - std::min<std::size_t>(history.size(), passes + 1); p < history.size();
               ++p) {
            for (const auto& [x, y] : history[p]) d += static_cast<double>(x) - static_cast<double>(y);
          }
          const bool now = leads ? d >= -margin : d > margin;
          switches += now != leads ? 1 : 0;
          leads = now;
          ASSERT_EQ(duel.decide(), leads) << "passes " << passes << " margin " << margin << " pass " << pass;
          ASSERT_EQ(duel.difference(), static_cast<std::int64_t>(d));
        }
      }
      EXPECT_EQ(duel.switches(), switches);
      switched += switches;
    }
  }
  EXPECT_GT(switched, 0U) << "the cases must make the duel change sides";
}

TEST(EvictionDuel, AMarginHoldsTheSideAgainstSmallLeads) {
  eviction_duel duel(2, 2.0);
  duel.begin_pass();
  duel.add(3, 1);  // LRU ahead by 2: not more than the margin
  EXPECT_FALSE(duel.decide());
  duel.add(1, 0);  // by 3
  EXPECT_TRUE(duel.decide());
  duel.add(0, 4);  // the policy ahead by 1: within the margin, LRU keeps the lead
  EXPECT_TRUE(duel.decide());
  duel.add(0, 2);  // the policy ahead by 3
  EXPECT_FALSE(duel.decide());
  EXPECT_EQ(duel.switches(), 2U);
  for (int i = 0; i < 3; ++i) duel.begin_pass();  // the whole window forgotten
  EXPECT_EQ(duel.difference(), 0);
  EXPECT_FALSE(duel.decide());
}

TEST(EvictionDuel, RefusesBadParameters) {
  const auto refused = [](std::uint32_t passes, double margin, const char* says) {
    try {
      eviction_duel duel(passes, margin);
      ADD_FAILURE() << "accepted: " << says;
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(says));
    }
  };
  refused(0, 2.0, "passes 0 out of range [1, 1048576]");
  refused(eviction_duel::max_passes + 1, 2.0, "passes 1048577 out of range [1, 1048576]");
  refused(4, -1.0, "margin -1 out of range [0, inf)");
  refused(4, std::nan(""), "margin nan out of range [0, inf)");

  // The static check the settings' owners call: 0 passes is theirs to mean "off".
  EXPECT_NO_THROW(eviction_duel::check(0, 2.0, "owner", "duel_"));
  const auto check_refused = [](std::uint32_t passes, double margin, const char* says) {
    try {
      eviction_duel::check(passes, margin, "owner", "duel_");
      ADD_FAILURE() << "accepted: " << says;
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(says));
    }
  };
  check_refused(eviction_duel::max_passes + 1, 2.0, "owner: duel_passes 1048577 out of range [0, 1048576]");
  check_refused(4, -0.5, "owner: duel_margin -0.5 out of range [0, inf)");
}

}  // namespace
}  // namespace expage
