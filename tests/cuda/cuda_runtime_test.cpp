// expert_runtime on a GPU: cuda_vmm pages (stable tensors aliased into slots), cuda_stream copy
// and compute streams, sources in pinned host memory. Every routed expert is checked on the
// device through the stable view, the slot view and its version record. The CUDA instantiation
// compiles in CI; the test skips without a device.
#include "common/hot_set.hpp"
#include "cuda/device_pattern.hpp"

#include "expage/cache/lru_policy.hpp"
#include "expage/core/pattern.hpp"
#include "expage/core/units.hpp"
#include "expage/cuda/cuda_stream.hpp"
#include "expage/cuda/cuda_vmm.hpp"
#include "expage/cuda/device_expert_map.hpp"
#include "expage/cuda/device_mirror.hpp"
#include "expage/cuda/pinned_host_memory.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/memory/tensor_storage.hpp"
#include "expage/runtime/expert_runtime.hpp"

#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
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

TEST(DeviceExpertMap, ConstructionWithoutADeviceIsACudaErrorNotACrash) {
  if (cuda::device_available()) GTEST_SKIP() << "a device is present";
  EXPECT_THROW(cuda::device_expert_map(16, 2, nullptr), cuda_error);
  EXPECT_THROW(cuda::device_expert_map(16, 3, nullptr), invalid_argument);
}

// Two tiers (bf16, int4) with both device mirrors: after every lease and retargeting, the device
// maps and records equal the host views, and every routed expert reads right through its record.
TEST(CudaExpertRuntime, TwoTiersAndTheDeviceMirrorsFollowTheHostViews) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  const moe_geometry g(moe_geometry::config{.name = "gpu-tiers",
                                            .layers = 4,
                                            .experts_per_layer = 8,
                                            .top_k = 2,
                                            .hidden_size = 1024,
                                            .intermediate_size = 512});
  cuda::pinned_host_memory pinned;
  tensor_storage<cuda::cuda_stream> hi_store(g, precision::bf16, pinned);
  tensor_storage<cuda::cuda_stream> lo_store(g, precision::int4, pinned);
  const auto seed = [&](expert_id id, expert_tensor t, precision p) {
    return g.flat_index(id) * 4 + static_cast<std::uint64_t>(t) * 2 + (p == precision::bf16 ? 0 : 1) + 11;
  };
  for (std::uint64_t f = 0; f < g.expert_count(); ++f) {
    for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
      for (auto* store : {&hi_store, &lo_store}) {
        auto slot = store->slot(g.expert_at(f), t);
        fill_pattern(reinterpret_cast<std::uint64_t*>(slot.data()), store->tensor_bytes(t) / 8,
                     seed(g.expert_at(f), t, store->format()));
      }
    }
  }
  cuda::cuda_vmm vmm;
  cuda::cuda_stream copy, compute, prefetch;
  const auto pages = [&](precision p) {
    std::size_t n = 0;
    for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
      n += (g.tensor_bytes(t, p) + vmm.granularity() - 1) / vmm.granularity() * vmm.granularity();
    }
    return n;
  };
  budget_tracker budget(2 * pages(precision::bf16) + 6 * pages(precision::int4));
  cuda::device_mirror records(g.expert_count(), compute.native());
  cuda::device_expert_map maps(g.expert_count(), 2, compute.native());
  expert_runtime<cuda::cuda_vmm, cuda::cuda_stream, lru_policy> rt(
      g, budget.root(), vmm, copy, compute,
      tiered_source<cuda::cuda_stream>{.hi = expert_source<cuda::cuda_stream>::from(hi_store),
                                       .lo = expert_source<cuda::cuda_stream>::from(lo_store)},
      // No demand reserve: the behaviour the H200 run checked, before the reserve existed.
      {.capacity = 2, .lo_capacity = 6, .demand_reserve = 0, .record_mirror = &records, .map_mirror = &maps},
      &prefetch);
  std::mt19937_64 rng(5);
  std::vector<expert_id> hot;  // the hi targets, oldest first
  for (int step = 0; step < 60; ++step) {
    const auto layer = static_cast<std::uint32_t>(rng() % g.layers());
    const std::uint32_t a = static_cast<std::uint32_t>(rng() % 8);
    const std::uint32_t routed[] = {a, (a + 1 + static_cast<std::uint32_t>(rng() % 7)) % 8};
    auto lease = rt.acquire(layer, routed);
    compute.synchronize();
    for (std::size_t i = 0; i < 2; ++i) {
      const expert_id id{layer, routed[i]};
      const precision p = rt.format(lease.tiers()[i]);
      const auto& store = p == precision::bf16 ? hi_store : lo_store;
      for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
        EXPECT_EQ(
            device_mismatches(rt.records(layer)[routed[i]].tensor(t), store.tensor_bytes(t) / 8 * 8, seed(id, t, p)),
            0U);
      }
    }
    lease.release();
    compute.synchronize();
    // Every fifth step promotes the expert just served (from lo, mostly), as a hot-set controller
    // would (rotate_hot_set()). The demotion's lo version loads on the prefetch stream and its
    // record switches, which frees the hi version the promotion then loads into; each record
    // switches once its load and the lease's kernel are done.
    const expert_id served{layer, a};
    const std::vector<residency_target> targets =
        step % 5 == 0 ? rotate_hot_set(hot, served, 2) : std::vector<residency_target>{};
    const bool promoted = !targets.empty();
    if (promoted) rt.set_targets(targets);
    for (int round = 0; round < 2; ++round) {  // the demotion's switch, then the promotion's
      prefetch.synchronize();
      rt.poll();
    }
    compute.synchronize();
    if (promoted) {
      EXPECT_EQ(rt.active_tier(served), version_tier::hi) << step;
    }
    for (std::size_t tier = 0; tier < 2; ++tier) {
      std::vector<std::int32_t> device(g.expert_count());
      ASSERT_EQ(cudaMemcpy(device.data(), maps.map(static_cast<version_tier>(tier)), device.size() * 4,
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      for (std::uint32_t l = 0; l < g.layers(); ++l) {
        for (std::uint32_t e = 0; e < 8; ++e) {
          ASSERT_EQ(device[g.flat_index({l, e})], rt.expert_map(l, static_cast<version_tier>(tier))[e]) << step;
        }
      }
    }
    std::vector<version_record> device(g.expert_count());
    ASSERT_EQ(
        cudaMemcpy(device.data(), records.records(), device.size() * sizeof(version_record), cudaMemcpyDeviceToHost),
        cudaSuccess);
    for (std::uint32_t l = 0; l < g.layers(); ++l) {
      for (std::uint32_t e = 0; e < 8; ++e) {
        ASSERT_EQ(device[g.flat_index({l, e})].tensor(expert_tensor::gate_up),
                  rt.records(l)[e].tensor(expert_tensor::gate_up));
      }
    }
  }
  EXPECT_GT(rt.statistics().total.switches, 0U);
  EXPECT_EQ(maps.failed_updates(), 0U);
}

}  // namespace
}  // namespace expage::testing
