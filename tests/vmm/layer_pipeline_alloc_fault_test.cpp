// layer_pipeline's strong guarantee against an allocation failure at every step of pin() and
// materialize() (the failing operator new of tests/common: not under a sanitizer).
#include "common/failing_operator_new.hpp"
#include "expage/memory/host_memory.hpp"
#include "expage/stream/host_stream.hpp"
#include "expage/vmm/host_vmm.hpp"
#include "expage/vmm/layer_pipeline.hpp"
#include "expage/vmm/vmm_block_pool.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <new>

namespace expage {
namespace {

using namespace expage::literals;
using expage::testing::fail_allocation;
using expage::testing::failing_new_available;
using expage::testing::stop_failing_allocations;

// 4 layers × 4 experts; each tensor of an expert fits one 64 KiB granule.
moe_geometry granule_geometry() {
  return moe_geometry(moe_geometry::config{
      .name = "tiny", .layers = 4, .experts_per_layer = 4, .top_k = 2, .hidden_size = 32, .intermediate_size = 48});
}

struct pipeline_rig {
  moe_geometry geometry = granule_geometry();
  host_vmm vmm{{.granularity = 64_KiB}};
  budget_tracker budget{1_GiB};
  host_memory host{{.block_size = 64_KiB, .alignment = 64_KiB}};
  tensor_storage<host_stream> storage{geometry, precision::bf16, host};
  host_stream compute{"compute"}, load_gate_up{"gate_up"}, load_down{"down"};
  layer_pipeline<host_vmm, host_stream> pipe{vmm,     geometry,     precision::bf16, budget.root(), storage,
                                             compute, load_gate_up, load_down,       {.window = 2}};

  [[nodiscard]] bool mapped(expert_id id) const {
    return pipe.state(id, expert_tensor::gate_up) != page_state::unmapped ||
           pipe.state(id, expert_tensor::down) != page_state::unmapped;
  }
};

// Every allocation of pin() fails in turn: after each failure the expert is neither pinned nor
// mapped, and no block or byte is held. Before, a failure noting the page just mapped (the undo
// list grew after the map) left it mapped and charged (found by review).
TEST(LayerPipelineFaults, AnAllocationFailureAnywhereInPinLeavesNothingMapped) {
  if (!failing_new_available) GTEST_SKIP() << "replaces operator new: not under a sanitizer";
  const expert_id id{2, 1};
  int failures = 0;
  for (int k = 1;; ++k) {
    pipeline_rig r;
    fail_allocation(k);
    try {
      r.pipe.pin(id);
    } catch (const std::bad_alloc&) {
      stop_failing_allocations();
      ++failures;
      EXPECT_FALSE(r.pipe.pinned(id)) << "allocation " << k;
      EXPECT_FALSE(r.mapped(id)) << "allocation " << k;
      EXPECT_EQ(r.budget.root().used(), 0U) << "allocation " << k;
      EXPECT_EQ(r.pipe.pool(expert_tensor::gate_up).leased(), 0U) << "allocation " << k;
      EXPECT_EQ(r.pipe.pool(expert_tensor::down).leased(), 0U) << "allocation " << k;
      continue;
    }
    stop_failing_allocations();
    EXPECT_TRUE(r.pipe.pinned(id));
    r.pipe.drain();
    break;
  }
  EXPECT_GT(failures, 2);
}

// Along a run long enough for the window's deque to allocate a node (64 entries), every
// materialize() has each of its allocations fail in turn: after each failure the layer is not in
// the window, none of its pages is mapped, and the budget holds exactly the window's layers.
// Before, the window's entry came after the layer was mapped, and its failure left a whole layer
// mapped and charged outside the window (found by review).
TEST(LayerPipelineFaults, AnAllocationFailureAnywhereInMaterializeLeavesTheLayerOut) {
  if (!failing_new_available) GTEST_SKIP() << "replaces operator new: not under a sanitizer";
  pipeline_rig r;
  const std::size_t layer_bytes = std::size_t{r.geometry.experts_per_layer()} * expert_tensor_count * 64_KiB;
  int failures = 0;
  const auto materialize = [&](std::uint32_t layer) {
    for (int k = 1;; ++k) {
      fail_allocation(k);
      try {
        r.pipe.materialize(layer);
        stop_failing_allocations();
        return;
      } catch (const std::bad_alloc&) {
        stop_failing_allocations();
        ++failures;
      }
      const auto window = r.pipe.window_layers();
      ASSERT_EQ(std::ranges::count(window, layer), 0) << "layer " << layer << ", allocation " << k;
      for (std::uint32_t e = 0; e < r.geometry.experts_per_layer(); ++e) {
        ASSERT_FALSE(r.mapped({layer, e})) << "layer " << layer << ", allocation " << k;
      }
      ASSERT_EQ(r.budget.root().used(), window.size() * layer_bytes) << "layer " << layer << ", allocation " << k;
    }
  };
  materialize(0);
  for (int pass = 0; pass < 20; ++pass) {
    for (std::uint32_t layer = 0; layer < r.geometry.layers(); ++layer) {
      r.pipe.forward(layer, [](host_stream&) {});
      materialize((layer + 1) % r.geometry.layers());
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  r.pipe.drain();
  EXPECT_GT(failures, 80);
}

// vmm_block_pool::acquire() whose own allocations fail (the lease's block list, then the room of
// the free list) leaves the budget's counters as they were: both come before the budget is
// asked. (The free list's room came after it, and a failure there raised its peak.)
TEST(VmmBlockPoolFaults, AFailedAllocationLeavesTheBudgetsCountersAsTheyWere) {
  if (!failing_new_available) GTEST_SKIP() << "replaces operator new: not under a sanitizer";
  for (int k = 1; k <= 2; ++k) {
    host_vmm vmm{{.granularity = 64_KiB}};
    budget_tracker budget{1_GiB};
    vmm_block_pool pool(vmm, budget.root(), {.max_blocks = 8});
    fail_allocation(k);
    EXPECT_THROW((void)pool.acquire(3), std::bad_alloc) << "allocation " << k;
    stop_failing_allocations();
    const auto s = budget.root().statistics();
    EXPECT_EQ(s.peak, 0U) << "allocation " << k;
    EXPECT_EQ(s.reservations, 0U) << "allocation " << k;
    EXPECT_EQ(pool.created(), 0U);
    auto lease = pool.acquire(3);  // and the pool works
    EXPECT_EQ(lease.size(), 3U);
  }
}

}  // namespace
}  // namespace expage
