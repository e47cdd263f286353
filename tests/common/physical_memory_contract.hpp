// The contract every physical_memory backend passes (TYPED_TEST_SUITE_P).
//
// Instantiate with a type M for which memory_traits<M> is specialized:
//   static M make();
//   static std::string unusable();   // non-empty: why the backend cannot run here (test skips)
//   static void fill(std::byte* p, std::size_t bytes, std::uint64_t seed);
//   static std::size_t mismatches(const std::byte* p, std::size_t bytes, std::uint64_t seed);
#pragma once

#include "expage/core/error.hpp"
#include "expage/core/pattern.hpp"
#include "expage/core/units.hpp"
#include "expage/memory/block_pool.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/memory/physical_memory.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace expage::testing {

template <class M>
struct memory_traits;

/// memory_traits for backends whose memory the host can touch directly.
template <class M>
struct host_touchable_traits {
  static void fill(std::byte* p, std::size_t bytes, std::uint64_t seed) {
    fill_pattern(reinterpret_cast<std::uint64_t*>(p), bytes / 8, seed);
  }
  static std::size_t mismatches(const std::byte* p, std::size_t bytes, std::uint64_t seed) {
    return count_pattern_mismatches(reinterpret_cast<const std::uint64_t*>(p), bytes / 8, seed);
  }
  static std::string unusable() { return {}; }
};

template <class M>
class physical_memory_contract : public ::testing::Test {
 protected:
  using traits = memory_traits<M>;
  void SetUp() override {
    if (const std::string why = traits::unusable(); !why.empty()) {
      GTEST_SKIP() << why;
    }
  }
};

TYPED_TEST_SUITE_P(physical_memory_contract);

TYPED_TEST_P(physical_memory_contract, DescribesItsGeometry) {
  static_assert(physical_memory<TypeParam>);
  const TypeParam m = TestFixture::traits::make();
  const std::size_t a = m.alignment();
  EXPECT_GT(m.block_size(), 0U);
  EXPECT_TRUE(a != 0 && (a & (a - 1)) == 0) << "alignment " << a << " is not a power of two";
  EXPECT_EQ(m.block_size() % a, 0U) << "block size " << m.block_size() << " is not a multiple of " << a;
  EXPECT_EQ(m.block_size() % 8, 0U);
}

TYPED_TEST_P(physical_memory_contract, AllocatesAlignedWritableContiguousBlocks) {
  TypeParam m = TestFixture::traits::make();
  for (const std::size_t n : {std::size_t{1}, std::size_t{2}, std::size_t{5}}) {
    std::byte* p = m.allocate(n);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % m.alignment(), 0U);
    const std::size_t bytes = n * m.block_size();
    TestFixture::traits::fill(p, bytes, 1000 + n);
    EXPECT_EQ(TestFixture::traits::mismatches(p, bytes, 1000 + n), 0U);
    EXPECT_EQ(TestFixture::traits::mismatches(p, bytes, 1), bytes / 8) << "the check must be able to fail";
    m.deallocate(p, n);
  }
}

TYPED_TEST_P(physical_memory_contract, AllocationsAreDisjoint) {
  TypeParam m = TestFixture::traits::make();
  const std::size_t bs = m.block_size();
  std::vector<std::pair<std::byte*, std::size_t>> live;
  for (std::size_t i = 0; i < 10; ++i) {
    const std::size_t n = 1 + i % 3;
    live.emplace_back(m.allocate(n), n);
    TestFixture::traits::fill(live.back().first, n * bs, i);
  }
  for (std::size_t i = 0; i < live.size(); ++i) {
    EXPECT_EQ(TestFixture::traits::mismatches(live[i].first, live[i].second * bs, i), 0U) << "allocation " << i;
    for (std::size_t j = i + 1; j < live.size(); ++j) {
      const auto [a, na] = live[i];
      const auto [b, nb] = live[j];
      EXPECT_TRUE(a + na * bs <= b || b + nb * bs <= a) << "allocations " << i << " and " << j << " overlap";
    }
  }
  for (auto [p, n] : live) m.deallocate(p, n);
}

TYPED_TEST_P(physical_memory_contract, RejectsZeroAndOverflowingCounts) {
  TypeParam m = TestFixture::traits::make();
  EXPECT_THROW((void)m.allocate(0), std::invalid_argument);
  const std::size_t too_many = max_bytes / m.block_size() + 1;
  try {
    std::byte* p = m.allocate(too_many);
    m.deallocate(p, too_many);
    ADD_FAILURE() << "allocate(" << too_many << ") succeeded";
  } catch (const std::invalid_argument&) {
  } catch (const std::bad_alloc&) {
  }
}

TYPED_TEST_P(physical_memory_contract, ConcurrentAllocateAndDeallocate) {
  TypeParam m = TestFixture::traits::make();
  const std::size_t bs = m.block_size();
  constexpr int threads = 4;
  std::vector<std::size_t> bad(threads, 0);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 7);
      for (int i = 0; i < 25; ++i) {
        const std::size_t n = 1 + rng() % 3;
        std::byte* p = m.allocate(n);
        const std::uint64_t seed = rng();
        TestFixture::traits::fill(p, n * bs, seed);
        bad[static_cast<std::size_t>(t)] += TestFixture::traits::mismatches(p, n * bs, seed);
        m.deallocate(p, n);
      }
    });
  }
  for (auto& th : pool) th.join();
  for (int t = 0; t < threads; ++t) EXPECT_EQ(bad[static_cast<std::size_t>(t)], 0U) << "thread " << t;
}

TYPED_TEST_P(physical_memory_contract, BacksABlockPool) {
  TypeParam m = TestFixture::traits::make();
  const std::size_t bs = m.block_size();
  budget_tracker budget(64 * bs);
  auto& account = budget.add_account("pool", 16 * bs);
  {
    block_pool pool(std::move(m), account, {.name = "contract", .max_blocks = 16, .growth_blocks = 4});
    std::vector<typename block_pool<TypeParam>::span> spans;
    std::uint64_t seed = 0;
    for (const std::size_t n : {1UL, 3UL, 4UL, 2UL, 6UL}) {
      spans.push_back(pool.acquire(n * bs));
      ASSERT_EQ(spans.back().size(), n);
      for (std::byte* block : spans.back()) TestFixture::traits::fill(block, bs, seed++);
    }
    EXPECT_EQ(account.used(), 16 * bs);
    EXPECT_FALSE(pool.try_acquire(1));
    seed = 0;
    for (const auto& s : spans) {
      for (std::byte* block : s) EXPECT_EQ(TestFixture::traits::mismatches(block, bs, seed++), 0U);
    }
    spans.clear();
    EXPECT_EQ(account.used(), 0U);
  }
  EXPECT_EQ(budget.root().used(), 0U);
}

REGISTER_TYPED_TEST_SUITE_P(physical_memory_contract, DescribesItsGeometry, AllocatesAlignedWritableContiguousBlocks,
                            AllocationsAreDisjoint, RejectsZeroAndOverflowingCounts, ConcurrentAllocateAndDeallocate,
                            BacksABlockPool);

}  // namespace expage::testing
