// Fault injection: fail the Nth backend allocation, for every N a scenario
// reaches, and prove the strong guarantee: the pool, the backend and the
// budget end exactly as they were before the failing call.
#include "expage/memory/block_pool.hpp"

#include "common/test_memory.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace expage {
namespace {

using namespace expage::literals;
using backend = testing::failing_memory<testing::counting_memory<testing::heap_memory>>;
constexpr std::size_t block_bytes = 4096;

struct snapshot {
  std::size_t held, free, in_use, slabs;
  std::int64_t backend_live;
  std::vector<std::size_t> used;  // every account
  friend bool operator==(const snapshot&, const snapshot&) = default;
};

snapshot take_snapshot(block_pool<backend>& pool, budget_tracker& budget) {
  const auto s = pool.statistics();
  snapshot out{
      s.blocks_held, s.blocks_free, s.blocks_in_use, s.slabs, pool.backend().inner().counters().live_blocks.load(), {}};
  for (const auto& a : budget.statistics()) out.used.push_back(a.used);
  return out;
}

// A scenario of acquisitions that grows the pool several times, with a
// release and a trim in between. Returns the number of backend calls it made.
std::uint64_t run_scenario(std::optional<std::uint64_t> fail_at, std::uint64_t& failures_seen) {
  budget_tracker budget(1_GiB);
  auto& experts = budget.add_account("experts", 256 * block_bytes);
  auto& hi = budget.add_account("hi", 200 * block_bytes, experts);
  backend mem{testing::counting_memory<testing::heap_memory>(testing::heap_memory(block_bytes))};
  if (fail_at) mem.fail_on(*fail_at);
  auto counters = mem.inner().shared_counters();

  std::optional<block_pool<backend>> pool;
  try {
    pool.emplace(std::move(mem), hi,
                 block_pool_options{.name = "hi", .max_blocks = 128, .growth_blocks = 3, .initial_blocks = 7});
  } catch (const out_of_memory&) {
    ++failures_seen;
    EXPECT_EQ(counters->live_blocks.load(), 0) << "a failed constructor keeps nothing";
    EXPECT_EQ(budget.root().used(), 0U);
    return counters->allocations.load() + 1;
  }

  std::vector<block_span<backend>> spans;
  for (const std::size_t blocks : {2UL, 9UL, 1UL, 14UL, 5UL, 20UL}) {
    const snapshot before = take_snapshot(*pool, budget);
    try {
      spans.push_back(pool->acquire(blocks * block_bytes - 7));
    } catch (const out_of_memory&) {
      ++failures_seen;
      EXPECT_EQ(take_snapshot(*pool, budget), before) << "acquire of " << blocks << " blocks, failure at " << *fail_at;
      // The same request succeeds once the backend recovers.
      pool->backend().heal();
      spans.push_back(pool->acquire(blocks * block_bytes - 7));
      if (fail_at) pool->backend().fail_on(1);  // keep injecting on the next call, too
    }
    if (spans.size() == 3) {
      spans.erase(spans.begin());
      (void)pool->trim();
    }
  }
  // try_acquire: the noexcept twin gives the same guarantee (its own injected failure, not the
  // planned one: its call is not among those run_scenario() returns).
  const snapshot before = take_snapshot(*pool, budget);
  pool->backend().fail_on(1);
  auto big = pool->try_acquire(40 * block_bytes);
  EXPECT_FALSE(big) << "the growth's allocation fails";
  EXPECT_EQ(take_snapshot(*pool, budget), before);
  spans.clear();
  big.release();
  EXPECT_EQ(hi.used(), 0U);
  EXPECT_EQ(budget.root().used(), 0U);
  return counters->allocations.load();
}

TEST(BlockPoolFaults, EveryFailedBackendAllocationLeavesNoTrace) {
  std::uint64_t failures = 0;
  const std::uint64_t calls = run_scenario(std::nullopt, failures);
  ASSERT_GT(calls, 5U) << "the scenario must grow the pool several times";
  EXPECT_EQ(failures, 0U) << "no failure planned, none seen";
  for (std::uint64_t n = 1; n <= calls; ++n) {
    std::uint64_t seen = 0;
    (void)run_scenario(n, seen);
    EXPECT_GE(seen, 1U) << "failure " << n << " was never hit";
    failures += seen;
  }
}

TEST(BlockPoolFaults, AFailureAfterSomeSlabsOfOneGrowthRollsThemAllBack) {
  budget_tracker budget(1_GiB);
  backend mem{testing::counting_memory<testing::heap_memory>(testing::heap_memory(block_bytes))};
  block_pool<backend> pool(std::move(mem), budget.root(), {.max_blocks = 64, .growth_blocks = 2});
  auto first = pool.acquire(3 * block_bytes);  // two slabs
  const snapshot before = take_snapshot(pool, budget);
  pool.backend().fail_on(4);  // this growth needs 5 slabs: the 4th fails
  EXPECT_THROW((void)pool.acquire(11 * block_bytes), out_of_memory);
  EXPECT_EQ(take_snapshot(pool, budget), before);
  EXPECT_EQ(pool.backend().inner().counters().allocations.load(), 5U) << "three slabs were made, then returned";
  EXPECT_EQ(pool.statistics().slabs_allocated, 2U);
  pool.backend().heal();
  auto second = pool.acquire(11 * block_bytes);
  EXPECT_EQ(second.size(), 11U);
}

// A request over max_blocks is refused before the budget is asked, on every path: the budget's
// peak and reservation count stay as they were (the peak had reached 9 blocks on a pool of 8).
TEST(BlockPoolFaults, ALimitRefusalLeavesTheBudgetsCountersAsTheyWere) {
  budget_tracker budget(1_GiB);
  auto& hi = budget.add_account("hi", 1_MiB);
  backend mem{testing::counting_memory<testing::heap_memory>(testing::heap_memory(block_bytes))};
  block_pool<backend> pool(std::move(mem), hi, {.name = "hi", .max_blocks = 8, .growth_blocks = 2});
  auto held = pool.acquire(4 * block_bytes);
  const auto counters = [&] {
    const auto root = budget.root().statistics();
    const auto account = hi.statistics();
    return std::vector<std::uint64_t>{root.peak, root.reservations, account.peak, account.reservations, account.used};
  };
  const auto before = counters();
  EXPECT_THROW((void)pool.acquire(5 * block_bytes), out_of_memory);
  EXPECT_EQ(counters(), before) << "acquire(bytes)";
  EXPECT_FALSE(pool.try_acquire(5 * block_bytes));
  EXPECT_EQ(counters(), before) << "try_acquire()";
  reservation own = hi.reserve(5 * block_bytes - 1);
  const auto with_own = counters();
  EXPECT_THROW((void)pool.acquire(std::move(own)), out_of_memory);
  EXPECT_EQ(counters(), with_own) << "acquire(reservation&&): not even the rounding to whole blocks";
  EXPECT_EQ(own.bytes(), 5 * block_bytes - 1);
  EXPECT_EQ(pool.statistics().failed_limit, 3U);
  auto more = pool.acquire(4 * block_bytes);  // exactly the limit
  EXPECT_EQ(more.size(), 4U);
}

}  // namespace
}  // namespace expage
