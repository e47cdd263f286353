#include "expage/residency/residency_state.hpp"

#include "residency/test_versions.hpp"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <set>
#include <utility>

namespace expage {
namespace {

using rs = residency_state;

TEST(ResidencyState, BeginMatchesTheTableExhaustively) {
  for (const rs from : all_residency_states) {
    for (const rs to : all_residency_states) {
      EXPECT_EQ(can_begin(from, to), testing::reference_begin_edges().contains({from, to})) << from << " -> " << to;
    }
  }
}

TEST(ResidencyState, TransitionalStatesLeaveByPublishOrAbortOnly) {
  EXPECT_TRUE(is_legal_transition(rs::promoting, rs::resident_hi));  // publish
  EXPECT_TRUE(is_legal_transition(rs::promoting, rs::resident_lo));  // abort
  EXPECT_TRUE(is_legal_transition(rs::promoting, rs::absent));       // abort
  EXPECT_FALSE(is_legal_transition(rs::promoting, rs::demoting));
  EXPECT_TRUE(is_legal_transition(rs::demoting, rs::resident_lo));
  EXPECT_TRUE(is_legal_transition(rs::demoting, rs::resident_hi));
  EXPECT_TRUE(is_legal_transition(rs::evicting, rs::absent));
  EXPECT_TRUE(is_legal_transition(rs::evicting, rs::resident_lo));
  EXPECT_FALSE(is_legal_transition(rs::evicting, rs::promoting));
  EXPECT_FALSE(is_legal_transition(rs::resident_hi, rs::resident_lo));  // always through demoting
  EXPECT_FALSE(is_legal_transition(rs::absent, rs::evicting));
}

TEST(ResidencyState, TargetsAndNames) {
  EXPECT_EQ(target_of(rs::promoting), rs::resident_hi);
  EXPECT_EQ(target_of(rs::demoting), rs::resident_lo);
  EXPECT_EQ(target_of(rs::evicting), rs::absent);
  EXPECT_EQ(target_of(rs::resident_lo), rs::resident_lo);
  EXPECT_EQ(fmt::format("{}", rs::resident_hi), "resident_hi");
  EXPECT_EQ(to_string(rs::evicting), "evicting");
  std::set<std::string_view> names;
  for (const rs s : all_residency_states) names.insert(to_string(s));
  EXPECT_EQ(names.size(), 6U);
}

}  // namespace
}  // namespace expage
