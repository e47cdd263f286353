// A hot set rotating through a runtime's hi tier, as a hot-set controller drives it: the whole
// set each call, the member that leaves it demoted first. Shared by the host and CUDA tiered
// runtime tests.
#pragma once

#include "expage/core/expert_id.hpp"
#include "expage/residency/residency_state.hpp"

#include <algorithm>
#include <cstddef>
#include <vector>

namespace expage::testing {

// Adds @p served to @p hot (oldest first) and returns the targets for set_targets(): the member
// leaving a full set (@p capacity hi versions) as resident_lo first, then every member as
// resident_hi. A remembered hi target is never another promotion's victim, so promoting without
// demoting would leave a full hi tier's newcomer waiting forever. Empty when @p served is hot.
[[nodiscard]] inline std::vector<residency_target> rotate_hot_set(std::vector<expert_id>& hot, expert_id served,
                                                                  std::size_t capacity) {
  if (std::find(hot.begin(), hot.end(), served) != hot.end()) return {};
  std::vector<residency_target> targets;
  if (hot.size() == capacity) {
    targets.push_back({hot.front(), residency_state::resident_lo});
    hot.erase(hot.begin());
  }
  hot.push_back(served);
  for (const expert_id& h : hot) targets.push_back({h, residency_state::resident_hi});
  return targets;
}

}  // namespace expage::testing
