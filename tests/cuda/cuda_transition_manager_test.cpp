// transition_manager on a GPU: a cuda_stream as the migration stream, cuda::device_memory pools,
// pre-packed sources in pinned host memory (copied directly) or in pageable host memory (copied
// through a bounded pool of pinned staging blocks). Promotions, demotions and evictions really
// copy, and every published version is checked on the device by the pattern kernels. The CUDA
// instantiation compiles in CI; the tests skip without a device.
#include "cuda/device_pattern.hpp"

#include "expage/core/pattern.hpp"
#include "expage/core/units.hpp"
#include "expage/cuda/cuda_stream.hpp"
#include "expage/cuda/device_memory.hpp"
#include "expage/cuda/pinned_host_memory.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/formatters.hpp"
#include "expage/memory/block_pool.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/memory/host_memory.hpp"
#include "expage/memory/tensor_storage.hpp"
#include "expage/residency/handle_table.hpp"
#include "expage/residency/transition_manager.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace expage::testing {
namespace {

using namespace expage::literals;

// The instantiations an engine uses, checked whether or not a device is present.
using direct_manager = transition_manager<cuda::cuda_stream, cuda::device_memory>;
using staged_manager = transition_manager<cuda::cuda_stream, cuda::device_memory, cuda::pinned_host_memory>;

// 2 layers × 8 experts; a bf16 expert is 192 KiB, an int4 one (group 32) about 54 KiB.
moe_geometry small() {
  return moe_geometry(moe_geometry::config{.name = "small",
                                           .layers = 2,
                                           .experts_per_layer = 8,
                                           .top_k = 2,
                                           .hidden_size = 256,
                                           .intermediate_size = 128,
                                           .group_size = 32});
}

std::size_t block_bytes(precision p) {
  return static_cast<std::size_t>((small().expert_bytes(p) + 4095) / 4096 * 4096);
}

std::uint64_t seed_of(const moe_geometry& g, expert_id id, expert_tensor t, precision p) {
  return (g.flat_index(id) * 2 + static_cast<std::uint64_t>(t)) * 16 + static_cast<std::uint64_t>(p) + 1;
}

// Sources in `Source` host memory, device pools, a table and a migration stream; the manager
// (`Manager`) is built by each test, last, so that it stops before the rest goes away.
template <class Source>
struct rig {
  explicit rig(Source source_memory, std::size_t hi_experts)
      : geometry(small()),
        budget(1_GiB),
        hi_account(budget.add_account("hi", hi_experts * block_bytes(precision::bf16))),
        lo_account(budget.add_account("lo", 64 * block_bytes(precision::int4))),
        source(std::move(source_memory)),
        hi_store(geometry, precision::bf16, source),
        lo_store(geometry, precision::int4, source),
        hi_pool(cuda::device_memory({.block_size = block_bytes(precision::bf16)}), hi_account,
                {.name = "hi", .max_blocks = 64}),
        lo_pool(cuda::device_memory({.block_size = block_bytes(precision::int4)}), lo_account,
                {.name = "lo", .max_blocks = 64}),
        table(geometry) {
    for (std::uint64_t flat = 0; flat < geometry.expert_count(); ++flat) {
      const expert_id id = geometry.expert_at(flat);
      for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
        fill(hi_store, id, t, precision::bf16);
        fill(lo_store, id, t, precision::int4);
      }
    }
  }
  void fill(tensor_storage<cuda::cuda_stream>& store, expert_id id, expert_tensor t, precision p) {
    fill_pattern(reinterpret_cast<std::uint64_t*>(store.slot(id, t).data()), store.tensor_bytes(t) / 8,
                 seed_of(geometry, id, t, p));
  }
  [[nodiscard]] version_class<cuda::cuda_stream, cuda::device_memory> high() {
    return {.format = precision::bf16, .source = &hi_store, .pool = &hi_pool};
  }
  [[nodiscard]] version_class<cuda::cuda_stream, cuda::device_memory> low() {
    return {.format = precision::int4, .source = &lo_store, .pool = &lo_pool};
  }
  // Words of @p id's resolved version, read on the device, that differ from its pattern; the
  // version must be in @p format.
  ::testing::AssertionResult holds(expert_id id, precision format) const {
    const version_record* v = table.resolve(id);
    if (v == nullptr) return ::testing::AssertionFailure() << fmt::format("{} resolves to nothing", id);
    if (v->format != format) {
      return ::testing::AssertionFailure() << fmt::format("{} resolves to {}, not {}", id, v->format, format);
    }
    for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
      const std::size_t bytes = static_cast<std::size_t>(geometry.tensor_bytes(t, format)) / 8 * 8;
      if (const std::size_t bad = device_mismatches(v->tensor(t), bytes, seed_of(geometry, id, t, format))) {
        return ::testing::AssertionFailure()
               << fmt::format("{} {}: {} of {} words differ on the device", id, to_string(t), bad, bytes / 8);
      }
    }
    return ::testing::AssertionSuccess();
  }

  moe_geometry geometry;
  budget_tracker budget;
  budget_account& hi_account;
  budget_account& lo_account;
  Source source;
  tensor_storage<cuda::cuda_stream> hi_store, lo_store;
  block_pool<cuda::device_memory> hi_pool, lo_pool;
  handle_table table;
  cuda::cuda_stream migration;
};

template <class Manager>
void target_all(Manager& manager, const moe_geometry& g, residency_state s) {
  std::vector<typename Manager::target> all;
  for (std::uint64_t flat = 0; flat < g.expert_count(); ++flat) all.push_back({g.expert_at(flat), s});
  manager.set_targets(all);
}

TEST(CudaTransitionManager, PromotesDemotesAndEvictsWithRealCopiesFromPinnedSources) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  rig r(cuda::pinned_host_memory({.block_size = 64_KiB}), 4);
  direct_manager manager(r.table, r.migration, r.high(), r.low(), {.max_in_flight = 3});
  using target = direct_manager::target;

  target_all(manager, r.geometry, residency_state::resident_lo);
  ASSERT_TRUE(manager.wait_idle());
  for (std::uint64_t flat = 0; flat < r.geometry.expert_count(); ++flat) {
    const expert_id id = r.geometry.expert_at(flat);
    EXPECT_EQ(r.table.state(id), residency_state::resident_lo) << fmt::format("{}", id);
    EXPECT_TRUE(r.holds(id, precision::int4));
  }

  const std::vector<target> promote = {{{0, 1}, residency_state::resident_hi},
                                       {{0, 6}, residency_state::resident_hi},
                                       {{1, 3}, residency_state::resident_hi}};
  manager.set_targets(promote);
  ASSERT_TRUE(manager.wait_idle());
  for (const target& t : promote) {
    EXPECT_EQ(r.table.state(t.expert), residency_state::resident_hi);
    EXPECT_TRUE(r.holds(t.expert, precision::bf16));
  }

  // Demote one promoted expert, evict another and a low one.
  manager.set_targets(std::vector<target>{
      {{0, 6}, residency_state::resident_lo}, {{1, 3}, residency_state::absent}, {{1, 0}, residency_state::absent}});
  ASSERT_TRUE(manager.wait_idle());
  EXPECT_TRUE(r.holds({0, 1}, precision::bf16));
  EXPECT_TRUE(r.holds({0, 6}, precision::int4));
  EXPECT_EQ(r.table.state({1, 3}), residency_state::absent);
  EXPECT_EQ(r.table.state({1, 0}), residency_state::absent);
  EXPECT_EQ(r.table.resolve({1, 3}), nullptr);

  // The replaced versions' device blocks go back once no window can read them.
  (void)r.table.collect();
  EXPECT_EQ(r.hi_account.used(), 1 * r.hi_pool.block_size());
  EXPECT_EQ(r.lo_account.used(), 13 * r.lo_pool.block_size());
  const transition_manager_statistics s = manager.statistics();
  EXPECT_EQ(s.failed, 0U);
  EXPECT_EQ(s.in_flight, 0U);
  EXPECT_EQ(s.completed, 16U + 3U + 3U);
  EXPECT_EQ(s.bytes_moved, 17 * r.lo_pool.block_size() + 3 * r.hi_pool.block_size());
}

TEST(CudaTransitionManager, CopiesPageableSourcesThroughAPinnedStagingPool) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  rig r(host_memory({.block_size = 64_KiB, .alignment = 64_KiB}), 16);
  budget_tracker staging_budget(1_GiB);
  block_pool<cuda::pinned_host_memory> staging(cuda::pinned_host_memory({.block_size = block_bytes(precision::bf16)}),
                                               staging_budget.root(), {.name = "staging", .max_blocks = 2});
  staged_manager manager(r.table, r.migration, r.high(), r.low(), {.max_in_flight = 4}, &staging);

  // Sixteen promotions through two staging blocks: the ring wraps eight times.
  target_all(manager, r.geometry, residency_state::resident_hi);
  ASSERT_TRUE(manager.wait_idle());
  for (std::uint64_t flat = 0; flat < r.geometry.expert_count(); ++flat) {
    EXPECT_TRUE(r.holds(r.geometry.expert_at(flat), precision::bf16));
  }
  EXPECT_LE(staging.statistics().peak_in_use, 2U);
  EXPECT_EQ(staging.statistics().blocks_in_use, 0U);

  // Everything down to int4, through the same staging blocks.
  target_all(manager, r.geometry, residency_state::resident_lo);
  ASSERT_TRUE(manager.wait_idle());
  for (std::uint64_t flat = 0; flat < r.geometry.expert_count(); ++flat) {
    EXPECT_TRUE(r.holds(r.geometry.expert_at(flat), precision::int4));
  }
  (void)r.table.collect();
  EXPECT_EQ(r.hi_account.used(), 0U);
  EXPECT_EQ(manager.statistics().failed, 0U);
  EXPECT_EQ(manager.statistics().completed, 32U);
}

}  // namespace
}  // namespace expage::testing
