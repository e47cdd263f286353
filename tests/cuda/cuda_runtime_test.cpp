// expert_runtime on a GPU: cuda_vmm pages (stable tensors aliased into slots), cuda_stream copy
// and compute streams, sources in pinned host memory. Every routed expert is checked on the
// device through the stable view, the slot view and its version record. The CUDA instantiation
// compiles in CI; the test skips without a device.
#include "cuda/device_pattern.hpp"

#include "expage/cache/lru_policy.hpp"
#include "expage/core/pattern.hpp"
#include "expage/core/units.hpp"
#include "expage/cuda/cuda_stream.hpp"
#include "expage/cuda/cuda_vmm.hpp"
#include "expage/cuda/pinned_host_memory.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/memory/tensor_storage.hpp"
#include "expage/runtime/expert_runtime.hpp"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace expage::testing {
namespace {

using namespace expage::literals;

// The instantiation an engine uses, checked whether or not a device is present.
using gpu_runtime = expert_runtime<cuda::cuda_vmm, cuda::cuda_stream, lru_policy>;

TEST(CudaExpertRuntime, LoadsEvictsAndEveryViewReadsTheExpertOnTheDevice) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  // 4 layers × 8 experts of 3 MiB (bf16): each tensor spans granules of the driver's 2 MiB.
  const moe_geometry g(moe_geometry::config{.name = "gpu-small",
                                            .layers = 4,
                                            .experts_per_layer = 8,
                                            .top_k = 2,
                                            .hidden_size = 1024,
                                            .intermediate_size = 512});
  cuda::pinned_host_memory pinned;
  tensor_storage<cuda::cuda_stream> storage(g, precision::bf16, pinned);
  const auto seed = [&](expert_id id, expert_tensor t) {
    return g.flat_index(id) * 2 + static_cast<std::uint64_t>(t) + 7;
  };
  for (std::uint64_t f = 0; f < g.expert_count(); ++f) {
    for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
      auto slot = storage.slot(g.expert_at(f), t);
      fill_pattern(reinterpret_cast<std::uint64_t*>(slot.data()), storage.tensor_bytes(t) / 8, seed(g.expert_at(f), t));
    }
  }
  cuda::cuda_vmm vmm;
  cuda::cuda_stream copy, compute;
  const std::size_t per_expert = (g.tensor_bytes(expert_tensor::gate_up, precision::bf16) + vmm.granularity() - 1) /
                                     vmm.granularity() * vmm.granularity() +
                                 (g.tensor_bytes(expert_tensor::down, precision::bf16) + vmm.granularity() - 1) /
                                     vmm.granularity() * vmm.granularity();
  budget_tracker budget(4 * per_expert);
  gpu_runtime rt(g, budget.root(), vmm, copy, compute, expert_source<cuda::cuda_stream>::from(storage));
  std::mt19937_64 rng(3);
  for (int step = 0; step < 40; ++step) {
    const auto layer = static_cast<std::uint32_t>(rng() % g.layers());
    const std::uint32_t a = static_cast<std::uint32_t>(rng() % 8);
    const std::uint32_t routed[] = {a, (a + 1 + static_cast<std::uint32_t>(rng() % 7)) % 8};
    auto lease = rt.acquire(layer, routed);
    compute.synchronize();  // the compute stream passed the loads' fences
    for (const std::uint32_t e : routed) {
      const expert_id id{layer, e};
      for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
        const std::size_t bytes = storage.tensor_bytes(t);
        EXPECT_EQ(device_mismatches(rt.stable_tensor(layer, t) + e * rt.page_bytes(t), bytes, seed(id, t)), 0U);
        EXPECT_EQ(device_mismatches(rt.slot_address(rt.expert_map(layer)[e], t), bytes, seed(id, t)), 0U);
        EXPECT_EQ(device_mismatches(rt.records(layer)[e].tensor(t), bytes, seed(id, t)), 0U);
      }
    }
    lease.release();
  }
  compute.synchronize();
  EXPECT_GT(rt.statistics().total.evictions, 0U);
  EXPECT_LE(budget.root().used(), 4 * per_expert);
}

}  // namespace
}  // namespace expage::testing
