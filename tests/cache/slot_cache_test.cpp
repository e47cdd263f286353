#include "expage/cache/slot_cache.hpp"

#include "expage/cache/lru_policy.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <new>
#include <vector>

namespace expage {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

moe_geometry small() {
  return moe_geometry(moe_geometry::config{
      .name = "small", .layers = 3, .experts_per_layer = 6, .top_k = 2, .hidden_size = 64, .intermediate_size = 32});
}

TEST(SlotCache, ValidatesItsCapacity) {
  const auto g = small();
  EXPECT_THROW(slot_cache<lru_policy>(g, {.capacity = 0}), invalid_argument);
  EXPECT_THROW(slot_cache<lru_policy>(g, {.layout = cache_layout::per_layer, .capacity = 7}), invalid_argument);
  EXPECT_NO_THROW(slot_cache<lru_policy>(g, {.layout = cache_layout::global, .capacity = 18}));
  try {
    slot_cache<lru_policy> c(g, {.layout = cache_layout::global, .capacity = 19});
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("capacity 19"), HasSubstr("[1, 18]"), HasSubstr("global")));
  }
}

TEST(SlotCache, LoadsMissesIntoFreeSlotsAndPublishesTheExpertMap) {
  slot_cache<lru_policy> cache(small(), {.layout = cache_layout::per_layer, .capacity = 2});
  EXPECT_THAT(cache.expert_map(0), ElementsAre(-1, -1, -1, -1, -1, -1));
  const std::uint32_t first[] = {4, 1};
  const auto r = cache.access(0, first);
  EXPECT_EQ(r.hits, 0U);
  EXPECT_EQ(r.misses, 2U);
  ASSERT_EQ(r.loads.size(), 2U);
  EXPECT_EQ(r.loads[0].expert, (expert_id{0, 4}));
  EXPECT_EQ(r.loads[0].slot, 0);
  EXPECT_FALSE(r.loads[0].evicts);
  EXPECT_EQ(r.loads[1].slot, 1);
  EXPECT_THAT(cache.expert_map(0), ElementsAre(-1, 1, -1, -1, 0, -1));
  EXPECT_THAT(cache.expert_map(1), ElementsAre(-1, -1, -1, -1, -1, -1)) << "layers have their own slots";
  EXPECT_EQ(cache.expert_map().size(), 18U);
}

TEST(SlotCache, EvictsIntoTheVictimsSlotAndNeverEvictsTheGroup) {
  slot_cache<lru_policy> cache(small(), {.layout = cache_layout::per_layer, .capacity = 2});
  const std::uint32_t a[] = {1, 0};  // 1 in slot 0, 0 in slot 1; 1 is the least recently used
  // 2 misses before 1 is reached: LRU's victim would be 1, which this group reads, so the pin
  // makes it 0 (a policy that ignored the pins would evict 1 and miss it next).
  const std::uint32_t b[] = {2, 1};
  (void)cache.access(0, a);
  const auto r = cache.access(0, b);
  EXPECT_EQ(r.hits, 1U);
  EXPECT_EQ(r.misses, 1U);
  ASSERT_EQ(r.loads.size(), 1U);
  EXPECT_TRUE(r.loads[0].evicts);
  EXPECT_EQ(r.loads[0].evicted, (expert_id{0, 0}));
  EXPECT_EQ(r.loads[0].slot, 1) << "the newcomer takes the victim's slot";
  EXPECT_THAT(cache.expert_map(0), ElementsAre(-1, 0, 1, -1, -1, -1));
}

// LRU whose on_insert() throws on a chosen call, as a node-based policy's allocation may.
int flaky_fail_in = -1;  // the on_insert() call, counted from 0, that throws
struct flaky_lru : lru_policy {
  using lru_policy::lru_policy;
  void on_insert(std::uint32_t key, const access_context& ctx) {
    if (flaky_fail_in-- == 0) throw std::bad_alloc();
    lru_policy::on_insert(key, ctx);
  }
};

// A policy that throws on a later miss of a group: none of the group's loads reached the caller,
// so none may stay in the map (a retried step would hit an expert whose copy was never issued,
// over the evicted expert's weights). The victims chosen so far stay evicted, their slots free.
TEST(SlotCache, APolicyThatThrowsMidGroupLeavesNoLoadTheCallerWasNotTold) {
  slot_cache<flaky_lru> cache(small(), {.layout = cache_layout::per_layer, .capacity = 3});
  const std::uint32_t first[] = {0, 1, 2};
  (void)cache.access(0, first);
  const std::uint32_t second[] = {3, 2, 4};  // 3 evicts 0, 2 hits, 4's insert throws
  flaky_fail_in = 1;
  EXPECT_THROW((void)cache.access(0, second), std::bad_alloc);
  EXPECT_THAT(cache.expert_map(0), ElementsAre(-1, 1, 2, -1, -1, -1)) << "3 is not resident: its load was undone";
  const auto& s = cache.statistics();
  EXPECT_EQ(s.groups, 1U);
  EXPECT_EQ(s.misses, 3U) << "the failed group's misses are not counted";
  EXPECT_EQ(s.evictions, 1U) << "0 was evicted";
  EXPECT_EQ(s.misses - s.evictions, 2U) << "the residents";
  // The step again: 3 and 4 are misses, issued this time: 3 into the slot 0 left, 4 over 1.
  const auto r = cache.access(0, second);
  EXPECT_EQ(r.hits, 1U);
  ASSERT_EQ(r.loads.size(), 2U);
  EXPECT_FALSE(r.loads[0].evicts);
  EXPECT_TRUE(r.loads[1].evicts);
  EXPECT_EQ(r.loads[1].evicted, (expert_id{0, 1}));
  EXPECT_EQ(cache.expert_map(0)[3], r.loads[0].slot);
  EXPECT_EQ(cache.expert_map(0)[4], r.loads[1].slot);
  EXPECT_NE(r.loads[0].slot, r.loads[1].slot);
  EXPECT_EQ(cache.statistics().misses - cache.statistics().evictions, 3U);
}

TEST(SlotCache, PinsTheWholeGroupEvenWhenThePolicyWouldChooseIt) {
  // Capacity 2, LRU order after the first group: 3 (older), 5 (newer). The second
  // group asks for 3 (hit, pinned) and 4 (miss): LRU's victim must skip 3.
  slot_cache<lru_policy> cache(small(), {.layout = cache_layout::per_layer, .capacity = 2});
  const std::uint32_t a[] = {3, 5};
  const std::uint32_t b[] = {4, 3};  // 4 is requested first: at that moment 3 is the LRU key
  (void)cache.access(2, a);
  const auto r = cache.access(2, b);
  ASSERT_EQ(r.loads.size(), 1U);
  EXPECT_EQ(r.loads[0].evicted, (expert_id{2, 5}));
  EXPECT_TRUE(cache.resident({2, 3}));
  EXPECT_TRUE(cache.resident({2, 4}));
}

TEST(SlotCache, GlobalSlotsAreSharedAcrossLayers) {
  slot_cache<lru_policy> cache(small(), {.layout = cache_layout::global, .capacity = 3});
  const std::uint32_t a[] = {0, 1};
  const std::uint32_t b[] = {5};
  const std::uint32_t c[] = {2};
  (void)cache.access(0, a);
  (void)cache.access(1, b);
  const auto r = cache.access(2, c);
  ASSERT_EQ(r.loads.size(), 1U);
  EXPECT_EQ(r.loads[0].evicted, (expert_id{0, 0}));
  EXPECT_FALSE(cache.resident({0, 0}));
  EXPECT_TRUE(cache.resident({2, 2}));
  EXPECT_EQ(cache.statistics().evictions, 1U);
  EXPECT_EQ(cache.statistics().accesses, 4U);
  EXPECT_EQ(cache.statistics().groups, 3U);
}

TEST(SlotCache, RejectsBadRequestsAndChangesNothing) {
  slot_cache<lru_policy> cache(small(), {.layout = cache_layout::per_layer, .capacity = 2});
  const std::uint32_t ok[] = {0};
  (void)cache.access(0, ok);
  const std::vector<std::int32_t> before(cache.expert_map().begin(), cache.expert_map().end());
  const std::uint32_t bad_expert[] = {1, 6};
  const std::uint32_t repeated[] = {2, 2};
  const std::uint32_t too_many[] = {1, 2, 3};
  const std::uint64_t short_hint[] = {1};
  const std::uint32_t pair[] = {1, 2};
  EXPECT_THROW((void)cache.access(3, ok), invalid_argument);
  try {
    (void)cache.access(0, bad_expert);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("expert 6 out of range [0, 6) in layer 0"));
  }
  EXPECT_THROW((void)cache.access(0, repeated), invalid_argument);
  try {
    (void)cache.access(0, too_many);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("3 experts"), HasSubstr("at most 2"), HasSubstr("group_tokens")));
  }
  EXPECT_THROW((void)cache.access(0, pair, {.next_use = short_hint}), invalid_argument);
  EXPECT_EQ(std::vector<std::int32_t>(cache.expert_map().begin(), cache.expert_map().end()), before);
  EXPECT_EQ(cache.statistics().groups, 1U);
  // The pin bytes were cleaned up after each refusal: a legal group still works.
  const auto r = cache.access(0, pair);
  EXPECT_EQ(r.misses, 2U);
}

TEST(SlotCache, AGlobalScopeOfMoreKeysThanA32BitKeyNumbersIsRefused) {
  // moe_geometry allows 65536 × 65536 experts: 2^32 global keys, one more than a 32-bit key can
  // number. The product is computed in 64 bits and refused instead of wrapping to 0.
  const key_space space{.layers = 65536, .experts_per_layer = 65536, .global = true};
  EXPECT_EQ(space.key_count(), std::uint64_t{1} << 32U);
  EXPECT_EQ(space.key_of(65535, 65535), 0xFFFF'FFFFU);
  const moe_geometry huge({.name = "huge",
                           .layers = 65536,
                           .experts_per_layer = 65536,
                           .top_k = 1,
                           .hidden_size = 1,
                           .intermediate_size = 1,
                           .group_size = 1});
  try {
    slot_cache<lru_policy> cache(huge, {.layout = cache_layout::global, .capacity = 1});
    FAIL() << "a 2^32-key global cache was built";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("4294967296 keys (65536 layers × 65536 experts), out of range [1, 4294967295]"));
  }
  try {  // a layout that is neither: refused (it ran as per-layer)
    slot_cache<lru_policy> cache(huge, {.layout = static_cast<cache_layout>(7), .capacity = 1});
    FAIL() << "layout 7 accepted";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("slot_cache: layout 7 out of range [0, 2)"));
  }
}

}  // namespace
}  // namespace expage

namespace expage {
namespace {

// resident() and expert_map(layer) are noexcept queries with preconditions (issue 15, item 9):
// builds with assertions catch a call outside the geometry instead of reading past the map.
TEST(SlotCache, QueriesOutsideTheGeometryAreCaught) {
  slot_cache<lru_policy> cache(moe_geometry::mixtral_8x7b(), {.layout = cache_layout::per_layer, .capacity = 2});
  EXPECT_FALSE(cache.resident({.layer = 31, .expert = 7}));
  EXPECT_EQ(cache.expert_map(31).size(), 8U);
#if EXPAGE_ASSERTIONS_ENABLED
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH((void)cache.resident({.layer = 32, .expert = 0}), "out of range");
  EXPECT_DEATH((void)cache.resident({.layer = 0, .expert = 8}), "out of range");
  EXPECT_DEATH((void)cache.expert_map(32), "out of range");
#endif
}

}  // namespace
}  // namespace expage
