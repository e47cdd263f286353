// An insert that fails on an allocation leaves its key resident in the runtime but unranked by
// the policy (expert_runtime keeps the version; duel_policy documents the same). The key's next
// hit ranks it again. Before, the node-based policies' hit found no node and did nothing: the
// key stayed unranked for good, and with the other residents pinned victim() returned a pinned
// key (0). This binary's operator new is common/failing_operator_new.hpp's (skipped under a
// sanitizer).
#include "common/failing_operator_new.hpp"
#include "expage/cache/belady_policy.hpp"
#include "expage/cache/eviction_policy.hpp"
#include "expage/cache/fmoe_priority_policy.hpp"
#include "expage/cache/lfru_policy.hpp"
#include "expage/cache/lfu_policy.hpp"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <new>

namespace expage::testing {
namespace {

template <class Policy>
class PolicyAllocationFaults : public ::testing::Test {};
using node_policies = ::testing::Types<lfru_policy, fmoe_priority_policy, lfu_policy, belady_policy>;
TYPED_TEST_SUITE(PolicyAllocationFaults, node_policies);

TYPED_TEST(PolicyAllocationFaults, AKeyWhoseInsertFailedIsRankedAgainByItsNextHit) {
  if (!failing_new_available) GTEST_SKIP() << "replaces operator new: not under a sanitizer";
  constexpr key_space four{.layers = 1, .experts_per_layer = 4};
  TypeParam policy(four);
  std::uint64_t time = 0;
  const auto at = [&] { return access_context{.time = ++time, .next_use = 100 + time}; };
  policy.on_insert(0, at());
  policy.on_insert(1, at());
  bool threw = false;
  for (int k = 1; k <= 8 && !threw; ++k) {  // the insert's first allocation that fails
    fail_allocation(k);
    try {
      policy.on_insert(2, at());
      policy.on_evict(2);  // it did not fail: out again, and the next k
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    stop_failing_allocations();
  }
  ASSERT_TRUE(threw) << "no allocation of on_insert() failed";
  policy.on_hit(2, at());                              // resident in the cache all along
  const std::array<std::uint8_t, 4> pins{1, 1, 0, 1};  // 0, 1 (and the absent 3) pinned
  EXPECT_EQ(policy.victim(pin_view{pins.data()}, at()), 2U);
}

}  // namespace
}  // namespace expage::testing
