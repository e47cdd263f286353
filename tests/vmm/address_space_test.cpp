#include "expage/vmm/address_space.hpp"

#include "common/failing_vmm.hpp"
#include "expage/core/pattern.hpp"
#include "expage/vmm/host_vmm.hpp"
#include "expage/vmm/vmm_block_pool.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <optional>

namespace expage {
namespace {

using namespace expage::literals;
using ::testing::AllOf;
using ::testing::HasSubstr;

// 2 layers × 4 experts; gate_up bf16 = 2·96·64·2 = 24 KiB (6 pages), down = 12 KiB (3 pages).
moe_geometry tiny() {
  return moe_geometry(moe_geometry::config{
      .name = "tiny", .layers = 2, .experts_per_layer = 4, .top_k = 2, .hidden_size = 64, .intermediate_size = 96});
}

using expage::testing::failing_vmm;

std::uint64_t* words(std::byte* p) { return reinterpret_cast<std::uint64_t*>(p); }

TEST(AddressSpace, LaysOutEveryExpertAtAFixedAddress) {
  host_vmm vm;
  const auto g = tiny();
  address_space space(vm, g, expert_tensor::gate_up, precision::bf16);
  const std::size_t page = vm.granularity();
  EXPECT_EQ(space.page_bytes(), (24 * KiB + page - 1) / page * page) << "σ: rounded up to the granularity";
  EXPECT_EQ(space.blocks_per_page(), space.page_bytes() / page);
  EXPECT_EQ(space.bytes(), 8 * space.page_bytes());
  for (std::uint32_t l = 0; l < 2; ++l) {
    for (std::uint32_t e = 0; e < 4; ++e) {
      EXPECT_EQ(space.address({l, e}), space.base() + (l * 4 + e) * space.page_bytes()) << "Eq. 4";
      EXPECT_EQ(space.state({l, e}), page_state::unmapped);
    }
  }
  EXPECT_THROW((void)space.address({2, 0}), invalid_argument);
  EXPECT_THROW((void)space.state({0, 4}), invalid_argument);
}

TEST(AddressSpace, StreamsDifferentExpertsThroughTheSameBlocksAtStableAddresses) {
  host_vmm vm;
  const auto g = tiny();
  budget_tracker budget(1_GiB);
  address_space space(vm, g, expert_tensor::down, precision::bf16);
  vmm_block_pool pool(vm, budget.root(), {.max_blocks = 2 * space.blocks_per_page()});
  const std::size_t words_per_page = space.page_bytes() / 8;
  std::byte* const a0 = space.address({0, 0});
  // Three rounds: each expert is loaded with its own pattern, checked through
  // its stable address, then evicted; two leases' worth of blocks serve all 8.
  for (int round = 0; round < 3; ++round) {
    for (std::uint32_t e = 0; e < 8; ++e) {
      const expert_id id{e / 4, e % 4};
      auto lease = pool.acquire(space.blocks_per_page());
      space.begin_load(id, lease.blocks());
      EXPECT_EQ(space.state(id), page_state::loading);
      fill_pattern(words(space.address(id)), words_per_page, 100 * static_cast<std::uint64_t>(round) + e);
      space.finish_load(id);
      EXPECT_EQ(count_pattern_mismatches(words(space.address(id)), words_per_page,
                                         100 * static_cast<std::uint64_t>(round) + e),
                0U);
      EXPECT_EQ(space.blocks(id).size(), space.blocks_per_page());
      space.begin_evict(id);
      space.finish_evict(id);
      EXPECT_TRUE(space.blocks(id).empty());
    }
  }
  EXPECT_EQ(space.address({0, 0}), a0) << "the address never moves";
  EXPECT_EQ(pool.created(), space.blocks_per_page()) << "blocks are reused, not recreated";
  EXPECT_EQ(budget.root().used(), 0U);
}

TEST(AddressSpace, ABlocksContentSurvivesEvictionAndRemapping) {
  host_vmm vm;
  budget_tracker budget(1_GiB);
  address_space space(vm, tiny(), expert_tensor::down, precision::bf16);
  vmm_block_pool pool(vm, budget.root(), {.max_blocks = 8 * space.blocks_per_page()});
  const std::size_t words_per_page = space.page_bytes() / 8;
  auto lease = pool.acquire(space.blocks_per_page());
  space.begin_load({1, 2}, lease.blocks());
  fill_pattern(words(space.address({1, 2})), words_per_page, 7);
  space.finish_load({1, 2});
  space.begin_evict({1, 2});
  space.finish_evict({1, 2});
  // The same blocks behind another expert's address: the data comes along (Eq. 3: one mapping at a time).
  space.begin_load({0, 3}, lease.blocks());
  EXPECT_EQ(count_pattern_mismatches(words(space.address({0, 3})), words_per_page, 7), 0U);
  space.cancel_load({0, 3});
  EXPECT_EQ(space.state({0, 3}), page_state::unmapped);
}

TEST(AddressSpace, RejectsIllegalTransitionsAndWrongBlockCounts) {
  host_vmm vm;
  budget_tracker budget(1_GiB);
  address_space space(vm, tiny(), expert_tensor::gate_up, precision::bf16);
  vmm_block_pool pool(vm, budget.root(), {.max_blocks = 64});
  auto lease = pool.acquire(space.blocks_per_page());
  EXPECT_THROW(space.finish_load({0, 0}), invalid_argument);
  EXPECT_THROW(space.begin_evict({0, 0}), invalid_argument);
  try {
    space.finish_evict({0, 1});
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("finish_evict"), HasSubstr("L0.E1"), HasSubstr("unmapped, not evicting")));
  }
  auto short_lease = pool.acquire(1);
  EXPECT_THROW(space.begin_load({0, 0}, short_lease.blocks()), invalid_argument);
  space.begin_load({0, 0}, lease.blocks());
  EXPECT_THROW(space.begin_load({0, 0}, lease.blocks()), invalid_argument) << "a page maps one set of blocks";
  EXPECT_THROW(space.begin_load({0, 1}, lease.blocks()), std::invalid_argument) << "a block maps at one address";
  EXPECT_EQ(space.state({0, 1}), page_state::unmapped);
  space.cancel_load({0, 0});
}

TEST(AddressSpaceFaults, AFailingMapLeavesThePageUnmappedAndTheBlocksFree) {
  failing_vmm vm;
  budget_tracker budget(1_GiB);
  address_space space(vm, tiny(), expert_tensor::gate_up, precision::bf16);
  vmm_block_pool pool(vm, budget.root(), {.max_blocks = 64});
  auto lease = pool.acquire(space.blocks_per_page());
  const std::size_t used = budget.root().used();
  for (int n = 1; n <= static_cast<int>(space.blocks_per_page()); ++n) {
    vm.fail_map_in = n;
    EXPECT_THROW(space.begin_load({1, 1}, lease.blocks()), out_of_memory) << "failure at map " << n;
    EXPECT_EQ(space.state({1, 1}), page_state::unmapped);
    for (const auto b : lease.blocks()) EXPECT_EQ(vm.state(b), block_state::created) << "failure at map " << n;
    EXPECT_EQ(budget.root().used(), used);
  }
  vm.fail_map_in.reset();
  space.begin_load({1, 1}, lease.blocks());
  space.cancel_load({1, 1});
}

TEST(VmmBlockPool, ChargesLeasesAndReusesBlocks) {
  host_vmm vm;
  budget_tracker budget(64 * vm.granularity());
  auto& acct = budget.add_account("down", 10 * vm.granularity());
  vmm_block_pool pool(vm, acct, {.max_blocks = 12, .initial_blocks = 4});
  EXPECT_EQ(pool.created(), 4U);
  EXPECT_EQ(acct.used(), 0U) << "charged for blocks leased, not created";
  {
    auto a = pool.acquire(6);
    EXPECT_EQ(a.size(), 6U);
    EXPECT_EQ(acct.used(), 6 * vm.granularity());
    EXPECT_EQ(pool.created(), 6U);
    EXPECT_THROW((void)pool.acquire(5), out_of_budget);
    EXPECT_EQ(pool.created(), 6U) << "a refused lease creates nothing";
    auto b = pool.acquire(4);
    EXPECT_EQ(pool.leased(), 10U);
  }
  EXPECT_EQ(acct.used(), 0U);
  EXPECT_EQ(pool.free_blocks(), 10U);
  EXPECT_THROW((void)pool.acquire(0), invalid_argument);
  EXPECT_THROW((void)pool.acquire(13), invalid_argument);
  EXPECT_THROW(vmm_block_pool(vm, acct, {.max_blocks = 0}), invalid_argument);
  // A lease's charge, blocks × granularity, must be a size a budget reserves (≤ max_bytes); the
  // largest such limit is accepted without sizing anything to it.
  const std::size_t most = max_bytes / vm.granularity();
  EXPECT_THROW(vmm_block_pool(vm, acct, {.max_blocks = most + 1}), invalid_argument);
  vmm_block_pool unbounded(vm, acct, {.max_blocks = most, .initial_blocks = 1});
  auto c = unbounded.acquire(3);
  EXPECT_EQ(unbounded.created(), 3U);
}

TEST(VmmBlockPool, ReachesItsLimitCleanly) {
  host_vmm vm;
  budget_tracker budget(1_GiB);
  vmm_block_pool pool(vm, budget.root(), {.max_blocks = 5});
  auto a = pool.acquire(4);
  try {
    (void)pool.acquire(2);
    FAIL();
  } catch (const out_of_memory& e) {
    EXPECT_THAT(e.what(),
                AllOf(HasSubstr("2 blocks requested"), HasSubstr("1 more may be created"), HasSubstr("max 5")));
  }
  EXPECT_EQ(budget.root().used(), 4 * vm.granularity());
  // The limit is checked before the budget is asked: the refusal raised neither the peak nor
  // the reservations granted (the peak had reached 6 blocks on a pool of 5).
  const auto s = budget.root().statistics();
  EXPECT_EQ(s.peak, 4 * vm.granularity());
  EXPECT_EQ(s.reservations, 1U);
}

TEST(VmmBlockPoolFaults, AFailingCreateGivesBackWhatTheCallCreated) {
  failing_vmm vm;
  budget_tracker budget(1_GiB);
  vmm_block_pool pool(vm, budget.root(), {.max_blocks = 16, .initial_blocks = 2});
  for (int n = 1; n <= 4; ++n) {
    vm.fail_create_in = n;
    EXPECT_THROW((void)pool.acquire(6), out_of_memory) << "failure at create " << n;
    EXPECT_EQ(pool.created(), 2U);
    EXPECT_EQ(pool.free_blocks(), 2U);
    EXPECT_EQ(budget.root().used(), 0U);
  }
  vm.fail_create_in.reset();
  auto ok = pool.acquire(6);
  EXPECT_EQ(pool.created(), 6U);
}

}  // namespace
}  // namespace expage
