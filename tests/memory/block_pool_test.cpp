#include "expage/memory/block_pool.hpp"

#include "common/test_memory.hpp"
#include "expage/core/pattern.hpp"
#include "expage/memory/host_memory.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <vector>

namespace expage {
namespace {

using namespace expage::literals;
using ::testing::AllOf;
using testing::counting_memory;
using ::testing::HasSubstr;
using testing::heap_memory;

using counted = counting_memory<heap_memory>;
constexpr std::size_t bs = 4096;

struct pool_fixture {
  budget_tracker budget{1_GiB};
  budget_account& account = budget.add_account("experts", 64 * bs);
  block_pool<counted> pool{counted(heap_memory(bs)), account, {.name = "hi", .max_blocks = 32, .growth_blocks = 4}};
  [[nodiscard]] const testing::memory_counters& backend() { return pool.backend().counters(); }
};

TEST(BlockPool, ValidatesItsOptions) {
  budget_tracker budget(1_GiB);
  auto& a = budget.root();
  auto make = [&](block_pool_options o) { block_pool<heap_memory> p(heap_memory(bs), a, std::move(o)); };
  EXPECT_THROW(make({.max_blocks = 0}), invalid_argument);
  EXPECT_THROW(make({.max_blocks = (1 << 24) + 1}), invalid_argument);
  EXPECT_THROW(make({.max_blocks = 8, .growth_blocks = 0}), invalid_argument);
  EXPECT_THROW(make({.max_blocks = 8, .growth_blocks = 9}), invalid_argument);
  try {
    make({.name = "lo", .max_blocks = 8, .initial_blocks = 9});
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("'lo'"), HasSubstr("initial_blocks 9"), HasSubstr("[0, 8]")));
  }
  EXPECT_NO_THROW(make({.max_blocks = 8, .growth_blocks = 8, .initial_blocks = 8}));
}

TEST(BlockPool, PreallocatesWholeSlabs) {
  budget_tracker budget(1_GiB);
  block_pool<counted> pool(counted(heap_memory(bs)), budget.root(),
                           {.max_blocks = 10, .growth_blocks = 4, .initial_blocks = 5});
  const auto s = pool.statistics();
  EXPECT_EQ(s.blocks_held, 8U) << "5 rounded up to two slabs of 4";
  EXPECT_EQ(s.blocks_free, 8U);
  EXPECT_EQ(s.slabs, 2U);
  EXPECT_EQ(pool.backend().counters().allocations.load(), 2U);
  EXPECT_EQ(budget.root().used(), 0U) << "the budget is charged for blocks in use, not held";
}

TEST(BlockPool, AcquiresChargesAndReleasesASingleBlock) {
  pool_fixture f;
  auto span = f.pool.acquire(100);
  ASSERT_TRUE(span);
  EXPECT_EQ(span.size(), 1U);
  EXPECT_EQ(span.bytes(), bs);
  EXPECT_EQ(span.pool(), &f.pool);
  EXPECT_EQ(f.account.used(), bs) << "charged a whole block";
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(span.front()) % 64, 0U);
  std::fill_n(span.front(), bs, std::byte{0x5A});
  span.release();
  EXPECT_FALSE(span);
  EXPECT_EQ(f.account.used(), 0U);
  span.release();  // idempotent
  EXPECT_EQ(f.pool.statistics().releases, 1U);
}

TEST(BlockPool, SpansHoldDistinctBlocksAndRecycleThemWithoutTheBackend) {
  pool_fixture f;
  std::set<std::byte*> seen;
  {
    auto a = f.pool.acquire(3 * bs);
    auto b = f.pool.acquire(5 * bs - 1);
    EXPECT_EQ(a.size(), 3U);
    EXPECT_EQ(b.size(), 5U);
    for (const auto* s : {&a, &b}) {
      for (std::byte* block : *s) {
        EXPECT_TRUE(seen.insert(block).second) << "block handed out twice";
      }
    }
    EXPECT_EQ(f.account.used(), 8 * bs);
    EXPECT_EQ(std::distance(a.begin(), a.end()), 3);
  }
  EXPECT_EQ(f.account.used(), 0U);
  const auto allocations = f.backend().allocations.load();
  for (int i = 0; i < 100; ++i) {
    auto s = f.pool.acquire(8 * bs);
    for (std::byte* block : s) EXPECT_TRUE(seen.count(block)) << "a recycled span reuses held blocks";
  }
  EXPECT_EQ(f.backend().allocations.load(), allocations) << "no backend call on the recycled path";
  EXPECT_EQ(f.pool.statistics().acquisitions, 102U);
}

TEST(BlockPool, GrowsBySlabsUpToItsLimit) {
  pool_fixture f;
  auto a = f.pool.acquire(6 * bs);
  EXPECT_EQ(f.pool.statistics().blocks_held, 8U);
  EXPECT_EQ(f.backend().allocations.load(), 2U);
  auto b = f.pool.acquire(24 * bs);
  EXPECT_EQ(f.pool.statistics().blocks_held, 32U);
  EXPECT_EQ(f.pool.statistics().blocks_free, 2U);
  try {
    (void)f.pool.acquire(3 * bs);
    FAIL();
  } catch (const out_of_memory& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("'hi'"), HasSubstr("3 blocks requested"), HasSubstr("2 free"),
                                HasSubstr("limit 32 blocks")));
  }
  EXPECT_EQ(f.account.used(), 30 * bs) << "the refused request left no charge";
  EXPECT_EQ(f.pool.statistics().failed_limit, 1U);
  auto c = f.pool.acquire(2 * bs);
  EXPECT_EQ(f.pool.statistics().blocks_free, 0U);
}

TEST(BlockPool, BudgetRefusalLeavesThePoolUntouched) {
  pool_fixture f;
  auto filler = f.account.reserve(60 * bs);
  const auto before = f.pool.statistics();
  EXPECT_THROW((void)f.pool.acquire(5 * bs), out_of_budget);
  EXPECT_FALSE(f.pool.try_acquire(5 * bs));
  const auto after = f.pool.statistics();
  EXPECT_EQ(after.blocks_held, before.blocks_held);
  EXPECT_EQ(after.failed_budget, 2U);
  EXPECT_EQ(f.account.used(), 60 * bs);
  EXPECT_EQ(f.backend().allocations.load(), 0U) << "the budget is checked before the backend is touched";
}

TEST(BlockPool, RejectsZeroAndOversizedRequests) {
  pool_fixture f;
  EXPECT_THROW((void)f.pool.acquire(0), invalid_argument);
  try {
    (void)f.pool.acquire(33 * bs);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("'hi'"), HasSubstr("135168 bytes"), HasSubstr("[1, 131072]")));
  }
  EXPECT_THROW((void)f.pool.acquire(static_cast<std::size_t>(-1)), invalid_argument);
  EXPECT_FALSE(f.pool.try_acquire(0));
  EXPECT_FALSE(f.pool.try_acquire(static_cast<std::size_t>(-1)));
  EXPECT_EQ(f.account.used(), 0U);
  EXPECT_EQ(f.pool.statistics().blocks_held, 0U);
}

TEST(BlockPool, AcquiresWithACallersReservation) {
  pool_fixture f;
  reservation admitted = f.account.reserve(2 * bs + 1);  // DynaExq: try_reserve first, then allocate
  auto span = f.pool.acquire(std::move(admitted));
  EXPECT_FALSE(admitted);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(span.size(), 3U);
  EXPECT_EQ(span.charge().bytes(), 3 * bs) << "rounded up to whole blocks";
  EXPECT_EQ(f.account.used(), 3 * bs);

  reservation wrong = f.budget.root().reserve(bs);
  EXPECT_THROW((void)f.pool.acquire(std::move(wrong)), invalid_argument);
  EXPECT_TRUE(wrong) << "a refused reservation stays with the caller";
  reservation empty;
  EXPECT_THROW((void)f.pool.acquire(std::move(empty)), invalid_argument);

  // Rounding up needs budget the account no longer has: nothing changes.
  auto filler = f.account.reserve(f.account.available() - bs / 2);
  reservation almost = f.account.reserve(bs / 2);
  EXPECT_THROW((void)f.pool.acquire(std::move(almost)), out_of_budget);
  ASSERT_TRUE(almost);
  EXPECT_EQ(almost.bytes(), bs / 2);
  EXPECT_EQ(f.account.available(), 0U);
  EXPECT_EQ(f.pool.statistics().blocks_in_use, 3U);
}

TEST(BlockPool, ACallersReservationIsLeftIntactWhenTheBackendFails) {
  budget_tracker budget(1_GiB);
  using failing = testing::failing_memory<counted>;
  block_pool<failing> pool(failing(counted(heap_memory(bs))), budget.root(), {.max_blocks = 8, .growth_blocks = 2});
  reservation r = budget.root().reserve(3 * bs - 10);
  pool.backend().fail_on(1);
  EXPECT_THROW((void)pool.acquire(std::move(r)), out_of_memory);
  ASSERT_TRUE(r);
  EXPECT_EQ(r.bytes(), 3 * bs - 10) << "the rounding was undone";
  EXPECT_EQ(budget.root().used(), 3 * bs - 10);
  EXPECT_EQ(pool.statistics().failed_backend, 1U);
  auto span = pool.acquire(std::move(r));
  EXPECT_EQ(span.size(), 3U);
}

TEST(BlockPool, TrimReturnsWhollyFreeSlabs) {
  pool_fixture f;
  auto a = f.pool.acquire(12 * bs);    // three slabs
  auto keep = f.pool.acquire(1 * bs);  // a fourth slab, partly used
  a.release();
  EXPECT_EQ(f.pool.statistics().blocks_held, 16U);
  const std::size_t returned = f.pool.trim();
  EXPECT_EQ(returned, 12U);
  const auto s = f.pool.statistics();
  EXPECT_EQ(s.blocks_held, 4U);
  EXPECT_EQ(s.blocks_free, 3U);
  EXPECT_EQ(s.slabs_trimmed, 3U);
  EXPECT_EQ(f.backend().live_blocks.load(), 4);
  auto again = f.pool.acquire(10 * bs);  // 3 free + two regrown slabs in the freed slots
  EXPECT_EQ(f.pool.statistics().blocks_held, 12U);
  EXPECT_EQ(f.backend().live_blocks.load(), 12);
  EXPECT_EQ(f.pool.trim(), 0U) << "nothing wholly free";
}

TEST(BlockPool, DestructionReturnsEverySlab) {
  budget_tracker budget(1_GiB);
  std::shared_ptr<testing::memory_counters> counters;
  {
    counted backend{heap_memory(bs)};
    counters = backend.shared_counters();
    block_pool<counted> pool(std::move(backend), budget.root(),
                             {.max_blocks = 20, .growth_blocks = 3, .initial_blocks = 7});
    auto s = pool.acquire(15 * bs);
  }
  EXPECT_EQ(counters->live_blocks.load(), 0);
  EXPECT_EQ(counters->allocations.load(), counters->deallocations.load());
}

TEST(BlockPool, PoolsForDifferentRolesShareOneBudgetTree) {
  budget_tracker budget(10 * bs);
  auto& hi = budget.add_account("experts_hi", 8 * bs);
  auto& lo = budget.add_account("experts_lo", 8 * bs);
  block_pool<heap_memory> hi_pool(heap_memory(bs), hi, {.name = "hi", .max_blocks = 16});
  block_pool<heap_memory> lo_pool(heap_memory(bs), lo, {.name = "lo", .max_blocks = 16});
  auto h = hi_pool.acquire(6 * bs);
  auto l = lo_pool.acquire(4 * bs);
  EXPECT_EQ(budget.root().used(), 10 * bs);
  EXPECT_THROW((void)lo_pool.acquire(bs), out_of_budget) << "the device budget binds both roles";
  h.release();
  EXPECT_NO_THROW((void)lo_pool.acquire(4 * bs));
}

TEST(BlockPool, SpansMoveAndReleaseOnDestruction) {
  pool_fixture f;
  using span = block_span<counted>;
  span a = f.pool.acquire(2 * bs);
  span b(std::move(a));
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(b.size(), 2U);
  span c = f.pool.acquire(bs);
  c = std::move(b);
  EXPECT_EQ(f.account.used(), 2 * bs) << "move-assignment released c's block";
  f.pool.release(std::move(c));
  EXPECT_EQ(f.account.used(), 0U);
  EXPECT_EQ(f.pool.statistics().blocks_in_use, 0U);
}

#if EXPAGE_ASSERTIONS_ENABLED
TEST(BlockPoolDeathTest, ReleasingAForeignSpanAsserts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        pool_fixture f;
        pool_fixture g;
        auto s = g.pool.acquire(bs);
        f.pool.release(std::move(s));
      },
      "belongs to another pool");
}
#endif

// --- property test: random acquire/release against a model ------------------------

TEST(BlockPoolProperty, MatchesAModelAndNeverSharesABlock) {
  for (std::uint64_t seed = 1; seed <= 10; ++seed) {
    std::mt19937_64 rng(seed);
    budget_tracker budget(1_GiB);
    auto& account = budget.add_account("acct", (20 + rng() % 40) * bs);
    const std::size_t max_blocks = 16 + rng() % 48;
    const std::size_t growth = 1 + rng() % 8;
    block_pool<counted> pool(counted(heap_memory(bs)), account,
                             {.max_blocks = max_blocks, .growth_blocks = std::min(growth, max_blocks)});
    std::vector<block_span<counted>> live;
    std::map<std::byte*, std::size_t> owner;  // block -> index into live at insertion (for pattern seed)
    std::size_t in_use = 0;
    for (int step = 0; step < 1500; ++step) {
      if (rng() % 3 != 0 || live.empty()) {
        const std::size_t n = 1 + rng() % 6;
        const bool budget_ok = (in_use + n) * bs <= account.capacity();
        const std::size_t held = pool.statistics().blocks_held;
        const std::size_t free = held - in_use;
        const bool limit_ok = n <= free || n - free <= max_blocks - held;
        auto s = pool.try_acquire(n * bs - rng() % bs);
        ASSERT_EQ(static_cast<bool>(s), budget_ok && limit_ok) << "seed " << seed << " step " << step;
        if (s) {
          const auto tag = static_cast<std::uint64_t>(step);
          for (std::byte* b : s) {
            ASSERT_TRUE(owner.emplace(b, tag).second) << "block shared between two spans";
            fill_pattern(reinterpret_cast<std::uint64_t*>(b), bs / 8, tag);
          }
          in_use += n;
          live.push_back(std::move(s));
        }
      } else {
        const std::size_t k = rng() % live.size();
        for (std::byte* b : live[k]) {
          ASSERT_EQ(count_pattern_mismatches(reinterpret_cast<std::uint64_t*>(b), bs / 8, owner[b]), 0U)
              << "a block was overwritten while in use";
          owner.erase(b);
        }
        in_use -= live[k].size();
        live[k] = std::move(live.back());
        live.pop_back();
      }
      const auto st = pool.statistics();
      ASSERT_EQ(st.blocks_in_use, in_use);
      ASSERT_EQ(st.blocks_free + st.blocks_in_use, st.blocks_held);
      ASSERT_LE(st.blocks_held, max_blocks);
      ASSERT_EQ(account.used(), in_use * bs);
      ASSERT_EQ(pool.backend().counters().live_blocks.load(), static_cast<std::int64_t>(st.blocks_held));
      if (step % 200 == 199) (void)pool.trim();
    }
  }
}

// --- concurrency: TSan proves the locking, the patterns prove exclusivity --------

TEST(BlockPoolConcurrency, ThreadsNeverShareBlocks) {
  budget_tracker budget(1_GiB);
  auto& account = budget.add_account("acct", 48 * bs);
  block_pool<heap_memory> pool(heap_memory(bs), account, {.max_blocks = 40, .growth_blocks = 5});
  constexpr int threads = 4;
  std::atomic<std::uint64_t> corrupt{0};
  std::atomic<std::uint64_t> acquired{0};
  std::barrier start(threads);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937_64 rng(1234 + static_cast<std::uint64_t>(t));
      start.arrive_and_wait();
      for (int i = 0; i < 3000; ++i) {
        auto s = pool.try_acquire((1 + rng() % 8) * bs);
        if (!s) continue;
        acquired.fetch_add(1, std::memory_order_relaxed);
        const std::uint64_t tag = rng();
        for (std::byte* b : s) fill_pattern(reinterpret_cast<std::uint64_t*>(b), 64, tag);
        for (std::byte* b : s) corrupt += count_pattern_mismatches(reinterpret_cast<std::uint64_t*>(b), 64, tag);
        if (i % 500 == 0) (void)pool.trim();
      }
    });
  }
  for (auto& w : workers) w.join();
  EXPECT_EQ(corrupt.load(), 0U);
  EXPECT_GT(acquired.load(), 1000U);
  EXPECT_EQ(account.used(), 0U);
  EXPECT_EQ(pool.statistics().blocks_in_use, 0U);
}

}  // namespace
}  // namespace expage
