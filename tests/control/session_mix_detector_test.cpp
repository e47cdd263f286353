#include "expage/control/session_mix_detector.hpp"

#include "expage/core/error.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

namespace expage {
namespace {

using ::testing::HasSubstr;

// Against a slow reference written from the documentation: a decayed average of the footprints,
// a change when one falls below average / r (average ≥ 1), then a restart at it and ⌈1/(1 − γ)⌉
// tentative bursts; random footprints, stationary stretches and drops.
TEST(SessionMixDetector, MatchesAReferenceOnRandomFootprints) {
  for (const double ratio : {1.5, 3.0, 8.0}) {
    for (const double decay : {0.5, 0.85, 1.0}) {
      session_mix_detector d(ratio, decay);
      double average = -1.0;
      int tentative = 0;
      std::uint64_t changes = 0;
      const int memory = decay == 1.0 ? 1000 : static_cast<int>(std::ceil(1.0 / (1.0 - decay) - 1e-9));
      std::mt19937_64 rng(static_cast<std::uint64_t>(ratio * 100 + decay * 10));
      std::uint64_t level = 300;
      for (int burst = 0; burst < 400; ++burst) {
        d.new_burst();
        if (tentative > 0) --tentative;
        if (rng() % 40 == 0) level = level > 100 ? 1 + rng() % 20 : 200 + rng() % 300;  // a new mix now and then
        const std::uint64_t now = level / 2 + rng() % (level + 1);
        bool expected = false;
        if (average < 0.0) {
          average = static_cast<double>(now);
        } else if (average >= 1.0 && static_cast<double>(now) * ratio < average) {
          expected = true;
          average = static_cast<double>(now);
          ++changes;
          tentative = memory;
        } else {
          average = decay * average + (1.0 - decay) * static_cast<double>(now);
        }
        ASSERT_EQ(d.observe(now), expected) << "ratio " << ratio << " decay " << decay << " burst " << burst;
        ASSERT_EQ(d.tentative(), tentative > 0) << burst;
      }
      EXPECT_EQ(d.changes(), changes);
      EXPECT_GT(changes, 0U) << "the random mixes must include drops past the ratio";
    }
  }
}

TEST(SessionMixDetector, OffNeverFiresAndBadValuesAreNamed) {
  session_mix_detector off(0.0, 0.9);
  EXPECT_FALSE(off.observe(1000));
  EXPECT_FALSE(off.observe(0));
  EXPECT_FALSE(off.tentative());
  EXPECT_EQ(off.changes(), 0U);
  session_mix_detector empty(2.0, 0.9);  // no open block yet: an average of 0 never triggers
  EXPECT_FALSE(empty.observe(0));
  EXPECT_FALSE(empty.observe(0));
  try {
    session_mix_detector(1.0, 0.9);
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("session_mix_detector: change_ratio 1 out of range 0 or (1, inf)"));
  }
  EXPECT_THROW(session_mix_detector(-3.0, 0.9), invalid_argument);
  EXPECT_THROW(session_mix_detector(std::nan(""), 0.9), invalid_argument);
  // inf would never fire (and 0 x inf is NaN): refused, not silently off.
  EXPECT_THROW(session_mix_detector(std::numeric_limits<double>::infinity(), 0.9), invalid_argument);
  try {
    session_mix_detector(3.0, 0.0);
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("decay 0 out of range (0, 1]"));
  }
}

}  // namespace
}  // namespace expage
