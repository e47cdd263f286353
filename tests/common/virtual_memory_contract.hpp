// The contract every virtual_memory backend passes (TYPED_TEST_SUITE_P).
//
// Instantiate with a type V for which vmm_traits<V> is specialized:
//   static std::unique_ptr<V> make();     // backends own a mutex: not movable
//   static std::string unusable();        // non-empty: why the backend cannot run here (test skips)
//   static void fill(std::byte* p, std::size_t bytes, std::uint64_t seed);
//   static std::size_t mismatches(const std::byte* p, std::size_t bytes, std::uint64_t seed);
// Data is written and read through the mapped address itself.
#pragma once

#include "expage/core/error.hpp"
#include "expage/core/pattern.hpp"
#include "expage/detail/assert.hpp"
#include "expage/vmm/virtual_memory.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <latch>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

namespace expage::testing {

template <class V>
struct vmm_traits;

template <class V>
class virtual_memory_contract : public ::testing::Test {
 protected:
  using traits = vmm_traits<V>;
  using block = typename V::physical_block;

  void SetUp() override {
    if (const std::string why = traits::unusable(); !why.empty()) {
      GTEST_SKIP() << why;
    }
    vm_ = traits::make();
    g_ = vm_->granularity();
  }

  V& vm() { return *vm_; }
  std::size_t g() const { return g_; }

  std::unique_ptr<V> vm_;
  std::size_t g_ = 0;
};

TYPED_TEST_SUITE_P(virtual_memory_contract);

TYPED_TEST_P(virtual_memory_contract, ReservesGranuleAlignedRanges) {
  static_assert(virtual_memory<TypeParam>);
  auto& vm = this->vm();
  const std::size_t g = this->g();
  EXPECT_TRUE(g != 0 && (g & (g - 1)) == 0) << "granularity " << g << " is not a power of two";
  std::byte* a = vm.reserve(4 * g);
  std::byte* b = vm.reserve(g);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a) % g, 0U);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b) % g, 0U);
  EXPECT_TRUE(a + 4 * g <= b || b + g <= a) << "reservations overlap";
  vm.free(a);
  vm.free(b);
  EXPECT_THROW((void)vm.reserve(0), std::invalid_argument);
  EXPECT_THROW((void)vm.reserve(g + 8), std::invalid_argument);
}

TYPED_TEST_P(virtual_memory_contract, ContentSurvivesUnmapAndRemap) {
  auto& vm = this->vm();
  const std::size_t g = this->g();
  std::byte* base = vm.reserve(2 * g);
  std::byte* x = base + g;
  const auto a = vm.create();
  const auto b = vm.create();
  EXPECT_NE(a, b);
  EXPECT_EQ(vm.state(a), block_state::created);

  vm.map(a, x, access_mode::read_write);
  EXPECT_EQ(vm.state(a), block_state::mapped);
  TestFixture::traits::fill(x, g, 0xA);
  vm.unmap(x, g);
  EXPECT_EQ(vm.state(a), block_state::created);

  vm.map(b, x, access_mode::read_write);
  EXPECT_EQ(TestFixture::traits::mismatches(x, g, 0xA), g / 8) << "block B must not show block A's bytes";
  TestFixture::traits::fill(x, g, 0xB);
  vm.unmap(x, g);

  vm.map(a, x, access_mode::read_write);
  EXPECT_EQ(TestFixture::traits::mismatches(x, g, 0xA), 0U) << "block A's content did not survive unmap and remap";
  vm.unmap(x, g);
  vm.map(b, base, access_mode::read_write);  // another granule of the same range
  EXPECT_EQ(TestFixture::traits::mismatches(base, g, 0xB), 0U);
  vm.unmap(base, g);

  vm.release(a);
  vm.release(b);
  EXPECT_EQ(vm.state(a), block_state::free);
  vm.free(base);
}

TYPED_TEST_P(virtual_memory_contract, MapsBlocksSideBySideAndUnmapsARun) {
  auto& vm = this->vm();
  const std::size_t g = this->g();
  std::byte* base = vm.reserve(4 * g);
  const auto a = vm.create();
  const auto b = vm.create();
  vm.map(a, base + g, access_mode::read_write);
  vm.map(b, base + 2 * g, access_mode::none);
  vm.set_access(base + 2 * g, g, access_mode::read_write);
  TestFixture::traits::fill(base + g, g, 1);
  TestFixture::traits::fill(base + 2 * g, g, 2);
  EXPECT_EQ(TestFixture::traits::mismatches(base + g, g, 1), 0U);
  EXPECT_EQ(TestFixture::traits::mismatches(base + 2 * g, g, 2), 0U);
  vm.set_access(base + g, 2 * g, access_mode::read_write);  // one call over the contiguous run
  vm.unmap(base + g, 2 * g);                                // one call over the run
  EXPECT_EQ(vm.state(a), block_state::created);
  EXPECT_EQ(vm.state(b), block_state::created);
  // Swapped: each block's bytes follow it to the other granule.
  vm.map(b, base + g, access_mode::read_write);
  vm.map(a, base + 2 * g, access_mode::read_write);
  EXPECT_EQ(TestFixture::traits::mismatches(base + g, g, 2), 0U);
  EXPECT_EQ(TestFixture::traits::mismatches(base + 2 * g, g, 1), 0U);
  vm.unmap(base + g, 2 * g);
  vm.release(a);
  vm.release(b);
  vm.free(base);
}

TYPED_TEST_P(virtual_memory_contract, RejectsIllegalMapsAndLeavesStateUnchanged) {
  auto& vm = this->vm();
  const std::size_t g = this->g();
  std::byte* base = vm.reserve(2 * g);
  const auto a = vm.create();
  const auto b = vm.create();
  vm.map(a, base, access_mode::read_write);

  EXPECT_THROW(vm.map(a, base + g, access_mode::read_write), std::invalid_argument) << "double map";
  EXPECT_THROW(vm.map(b, base, access_mode::read_write), std::invalid_argument) << "occupied granule";
  EXPECT_THROW(vm.map(b, base + 2 * g, access_mode::read_write), std::invalid_argument) << "past the end";
  EXPECT_THROW(vm.map(b, base - g, access_mode::read_write), std::invalid_argument) << "before the start";
  EXPECT_THROW(vm.map(b, base + g + 64, access_mode::read_write), std::invalid_argument) << "misaligned";
  EXPECT_THROW(vm.map(typename TestFixture::block{12345, 1}, base + g, access_mode::read_write), std::invalid_argument)
      << "unknown block";
  EXPECT_THROW(vm.set_access(base, 2 * g, access_mode::read_write), std::invalid_argument)
      << "access to a granule that holds no block";
  // An integer cast to access_mode that is neither value (it was taken as none).
  const auto bad_mode = static_cast<access_mode>(7);
  EXPECT_THROW(vm.map(b, base + g, bad_mode), std::invalid_argument) << "access_mode 7";
  EXPECT_THROW(vm.set_access(base, g, bad_mode), std::invalid_argument) << "access_mode 7";
  try {
    vm.set_access(base, g, bad_mode);
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("access_mode 7 out of range {none, read_write}"), std::string::npos)
        << e.what();
  }
  try {
    vm.map(a, base + g, access_mode::read_write);
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("already mapped"), std::string::npos) << e.what();
  }
  EXPECT_EQ(vm.state(a), block_state::mapped);
  EXPECT_EQ(vm.state(b), block_state::created);

  vm.unmap(base, g);
  vm.release(a);
  EXPECT_EQ(vm.state(a), block_state::free);
  EXPECT_THROW(vm.map(a, base, access_mode::read_write), std::invalid_argument) << "stale handle after release";
  const auto c = vm.create();  // may reuse a's slot: a must stay stale
  EXPECT_NE(c, a);
  EXPECT_EQ(vm.state(a), block_state::free);
  vm.map(b, base + g, access_mode::read_write);  // the failures above left the granule usable
  vm.unmap(base + g, g);
  vm.release(b);
  vm.release(c);
  vm.free(base);
}

TYPED_TEST_P(virtual_memory_contract, NoexceptMisuseIsCaught) {
  auto& vm = this->vm();
  const std::size_t g = this->g();
  std::byte* base = vm.reserve(2 * g);
  const auto a = vm.create();
  vm.map(a, base, access_mode::read_write);
#if EXPAGE_ASSERTIONS_ENABLED
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(vm.release(a), "mapped");
  EXPECT_DEATH(vm.unmap(base + g, g), "holds no block");
  EXPECT_DEATH(vm.free(base), "mapped");
  vm.unmap(base, g);
  vm.release(a);
  EXPECT_DEATH(vm.release(a), "released");
  vm.free(base);
  EXPECT_DEATH(vm.free(base), "reservation");
#else
  vm.release(a);  // ignored: the block is mapped
  EXPECT_EQ(vm.state(a), block_state::mapped);
  vm.unmap(base + g, g);  // ignored: nothing is mapped there
  vm.free(base);          // ignored: a block is mapped in it
  vm.unmap(base, g);
  EXPECT_EQ(vm.state(a), block_state::created);
  vm.unmap(base, g);  // ignored: unmapped twice
  vm.release(a);
  vm.release(a);  // ignored: released twice
  EXPECT_EQ(vm.state(a), block_state::free);
  vm.free(base);
  vm.free(base);  // ignored: freed twice
#endif
}

TYPED_TEST_P(virtual_memory_contract, ReleaseReturnsMemory) {
  auto& vm = this->vm();
  const std::size_t g = this->g();
  constexpr std::size_t n = 4;
  std::byte* base = vm.reserve(n * g);
  std::vector<typename TestFixture::block> blocks;
  const std::size_t before = vm.physical_bytes();
  for (std::size_t i = 0; i < n; ++i) {
    blocks.push_back(vm.create());
    vm.map(blocks.back(), base + i * g, access_mode::read_write);
    TestFixture::traits::fill(base + i * g, g, i);  // host memory is committed on first touch
  }
  const std::size_t held = vm.physical_bytes();
  EXPECT_GE(held, before + n * g);
  vm.unmap(base, n * g);
  EXPECT_EQ(vm.physical_bytes(), held) << "unmapping must keep the blocks' memory";
  for (const auto& b : blocks) vm.release(b);
  EXPECT_LE(vm.physical_bytes(), held - n * g) << "release must return the memory to the system";
  // Reused blocks start clean of the old data's ownership: state and handles are fresh.
  const auto again = vm.create();
  EXPECT_EQ(vm.state(again), block_state::created);
  vm.release(again);
  vm.free(base);
}

TYPED_TEST_P(virtual_memory_contract, ConcurrentMapUnmapOfDistinctGranules) {
  auto& vm = this->vm();
  const std::size_t g = this->g();
  constexpr int threads = 4;
  constexpr int rounds = 40;
  std::byte* base = vm.reserve(threads * g);
  std::vector<std::size_t> bad(threads, 0);
  std::latch start(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::byte* x = base + static_cast<std::size_t>(t) * g;
      const auto mine = vm.create();
      const auto other = vm.create();
      start.arrive_and_wait();
      for (int i = 0; i < rounds; ++i) {
        const auto seed = static_cast<std::uint64_t>(t * 1000 + i);
        vm.map(mine, x, access_mode::read_write);
        TestFixture::traits::fill(x, g, seed);
        vm.unmap(x, g);
        vm.map(other, x, access_mode::read_write);
        TestFixture::traits::fill(x, g, seed + 500);
        vm.unmap(x, g);
        vm.map(mine, x, access_mode::read_write);
        bad[static_cast<std::size_t>(t)] += TestFixture::traits::mismatches(x, g, seed);
        vm.unmap(x, g);
      }
      vm.release(mine);
      vm.release(other);
    });
  }
  for (auto& th : pool) th.join();
  for (int t = 0; t < threads; ++t) EXPECT_EQ(bad[static_cast<std::size_t>(t)], 0U) << "thread " << t;
  vm.free(base);
}

TYPED_TEST_P(virtual_memory_contract, AliasesShareBytesUntilTheLastUnmap) {
  if constexpr (aliasing_virtual_memory<TypeParam>) {
    auto& vm = this->vm();
    const std::size_t g = this->g();
    std::byte* stable = vm.reserve(2 * g);
    std::byte* slots = vm.reserve(2 * g);
    const auto a = vm.create();
    EXPECT_THROW(vm.map_alias(a, slots, access_mode::read_write), std::invalid_argument) << "not mapped yet";
    vm.map(a, stable + g, access_mode::read_write);
    vm.map_alias(a, slots, access_mode::read_write);
    vm.map_alias(a, slots + g, access_mode::read_write);
    EXPECT_THROW(vm.map_alias(a, slots, access_mode::read_write), std::invalid_argument) << "granule occupied";
    EXPECT_THROW(vm.map(a, stable, access_mode::read_write), std::invalid_argument) << "map() of a mapped block";
    TestFixture::traits::fill(stable + g, g, 0xC);
    EXPECT_EQ(TestFixture::traits::mismatches(slots, g, 0xC), 0U) << "an alias must show the block's bytes";
    EXPECT_EQ(TestFixture::traits::mismatches(slots + g, g, 0xC), 0U);
    TestFixture::traits::fill(slots + g, g, 0xD);
    EXPECT_EQ(TestFixture::traits::mismatches(stable + g, g, 0xD), 0U) << "writes through an alias reach the block";

    vm.unmap(stable + g, g);  // the first mapping goes first: the block stays mapped through its aliases
    EXPECT_EQ(vm.state(a), block_state::mapped);
    EXPECT_EQ(TestFixture::traits::mismatches(slots, g, 0xD), 0U);
    vm.unmap(slots, 2 * g);  // both aliases in one run
    EXPECT_EQ(vm.state(a), block_state::created);
    vm.map(a, stable, access_mode::read_write);
    EXPECT_EQ(TestFixture::traits::mismatches(stable, g, 0xD), 0U) << "the bytes survive every unmap";
    vm.unmap(stable, g);
    vm.release(a);
    vm.free(stable);
    vm.free(slots);
  } else {
    GTEST_SKIP() << "the backend does not model aliasing_virtual_memory";
  }
}

REGISTER_TYPED_TEST_SUITE_P(virtual_memory_contract, ReservesGranuleAlignedRanges, ContentSurvivesUnmapAndRemap,
                            MapsBlocksSideBySideAndUnmapsARun, RejectsIllegalMapsAndLeavesStateUnchanged,
                            NoexceptMisuseIsCaught, ReleaseReturnsMemory, ConcurrentMapUnmapOfDistinctGranules,
                            AliasesShareBytesUntilTheLastUnmap);

}  // namespace expage::testing
