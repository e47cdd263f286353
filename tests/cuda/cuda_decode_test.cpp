// A short MoE decode on the GPU, the loop examples/moe_decode --backend cuda runs: two tiers (bf16
// and int4) of expert_runtime<cuda_vmm, cuda_stream> under a budget that forces evictions, the
// stored bytes in pinned host memory, the records view mirrored on the device, and the FFN run by
// cuda::expert_ffn_async() reading that mirror. Every layer step's output is checked against the
// host expert_ffn() over all-resident weights in the precision each expert was served at, within
// the device FFN's bound. The CUDA instantiation compiles in CI; the test skips without a device.
#include "common/expert_ffn_case.hpp"
#include "common/hot_set.hpp"
#include "cuda/device_buffer.hpp"
#include "cuda/device_pattern.hpp"

#include "expage/cache/lru_policy.hpp"
#include "expage/core/units.hpp"
#include "expage/cuda/cuda_stream.hpp"
#include "expage/cuda/cuda_vmm.hpp"
#include "expage/cuda/device_mirror.hpp"
#include "expage/cuda/expert_ffn.hpp"
#include "expage/cuda/pinned_host_memory.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/memory/tensor_storage.hpp"
#include "expage/moe/expert_ffn.hpp"
#include "expage/moe/routing.hpp"
#include "expage/runtime/expert_runtime.hpp"

#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <random>
#include <vector>

namespace expage::testing {
namespace {

// The device within 1e-5 of the fp64 reference, the host within 2e-6 (ffn_test_cases()): the two
// within their sum. examples/moe_decode --backend cuda holds every layer to the same bound.
constexpr double device_vs_host = 1.2e-5;

TEST(CudaDecode, ShortTwoTierDecodeOnCudaVmmMatchesTheHostReference) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  const moe_geometry g(moe_geometry::config{.name = "gpu-decode",
                                            .layers = 4,
                                            .experts_per_layer = 8,
                                            .top_k = 2,
                                            .hidden_size = 256,
                                            .intermediate_size = 128,
                                            .group_size = 64});
  const expert_ffn_shape shape = expert_ffn_shape::of(g);
  const std::uint64_t H = g.hidden_size();
  const std::uint32_t E = g.experts_per_layer();
  const std::uint32_t K = g.top_k();

  // Every expert's tensors in both precisions: host bytes for the reference, pinned for the loads.
  cuda::pinned_host_memory pinned;
  tensor_storage<cuda::cuda_stream> hi_store(g, precision::bf16, pinned);
  tensor_storage<cuda::cuda_stream> lo_store(g, precision::int4, pinned);
  std::vector<std::array<ffn_tensor_bytes, 2>> hi_bytes(g.expert_count()), lo_bytes(g.expert_count());
  for (std::uint64_t f = 0; f < g.expert_count(); ++f) {
    for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
      const auto ti = static_cast<std::size_t>(t);
      const std::vector<float> w = realistic_weights(g.shape(t).elements(), 900 + 2 * f + ti, 0.05F);
      hi_bytes[f][ti] = encode_tensor(w, g.shape(t), precision::bf16, g.group_size());
      lo_bytes[f][ti] = encode_tensor(w, g.shape(t), precision::int4, g.group_size());
      for (auto [store, bytes] : {std::pair{&hi_store, &hi_bytes[f][ti]}, std::pair{&lo_store, &lo_bytes[f][ti]}}) {
        ASSERT_EQ(bytes->bytes.size(), store->tensor_bytes(t));
        std::ranges::copy(bytes->bytes, store->slot(g.expert_at(f), t).begin());
      }
    }
  }
  const auto reference_record = [&](expert_id id, precision p) {
    auto& b = (p == precision::bf16 ? hi_bytes : lo_bytes)[g.flat_index(id)];
    return packed_version_record(p, b[0].bytes.data(), b[1].bytes.data(), shape);
  };

  cuda::cuda_vmm vmm;
  cuda::cuda_stream copy, compute, prefetch;
  const auto page = [&](precision p) {
    std::size_t n = 0;
    for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
      n += (g.tensor_bytes(t, p) + vmm.granularity() - 1) / vmm.granularity() * vmm.granularity();
    }
    return n;
  };
  // 2 bf16 and 6 int4 versions for 32 experts: misses evict.
  budget_tracker budget(2 * page(precision::bf16) + 6 * page(precision::int4));
  cuda::device_mirror mirror(g.expert_count(), compute.native());
  expert_runtime<cuda::cuda_vmm, cuda::cuda_stream, lru_policy> rt(
      g, budget.root(), vmm, copy, compute,
      tiered_source<cuda::cuda_stream>{.hi = expert_source<cuda::cuda_stream>::from(hi_store),
                                       .lo = expert_source<cuda::cuda_stream>::from(lo_store)},
      {.views = {.stable_tensors = false, .slots = false, .records = true},
       .capacity = 2,
       .lo_capacity = 6,
       .demand_reserve = 0,  // as measured on the H200 (2026-11-2x), before the reserve existed
       .record_mirror = &mirror},
      &prefetch);

  // A batch of 3 sequences, 6 tokens: each layer step routes 3 tokens (up to 6 experts).
  constexpr std::uint32_t n = 3;
  const std::size_t workspace_bytes = cuda::expert_ffn_workspace_bytes(n, K, shape);
  device_buffer d_x(n * H * sizeof(float)), d_out(n * H * sizeof(float), poisoned);
  device_buffer d_offsets((E + 1) * sizeof(std::uint32_t)), d_order(n * K * sizeof(std::uint32_t));
  device_buffer d_weights(n * K * sizeof(float)), d_workspace(workspace_bytes);
  std::mt19937_64 rng(17);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::vector<float> x(n * H), logits(n * E), weights(n * K), out(n * H), ref(n * H);
  std::vector<std::int32_t> ids(n * K);
  std::vector<std::uint32_t> counts(E), offsets(E + 1), order(n * K), position(n * K);
  std::vector<version_record> reference(E);
  std::uint64_t steps = 0;
  std::uint64_t lo_served = 0;
  std::vector<expert_id> hot;  // the hi targets, oldest first
  for (std::uint32_t token = 0; token < 6; ++token) {
    for (std::uint32_t layer = 0; layer < g.layers(); ++layer) {
      for (float& v : x) v = normal(rng);
      for (float& v : logits) v = normal(rng);
      router_top_k(logits, {.tokens = n, .experts = E, .top_k = K}, router_gating::softmax_renormalized, ids, weights,
                   counts);
      group_by_expert(ids, E, offsets, order, position);
      std::vector<std::uint32_t> routed;
      for (std::uint32_t e = 0; e < E; ++e) {
        if (offsets[e + 1] > offsets[e]) routed.push_back(e);
      }
      d_x.upload(x.data());  // waits until the bytes are on the device (device_buffer::upload())
      d_offsets.upload(offsets.data());
      d_order.upload(order.data());
      d_weights.upload(weights.data());
      auto lease = rt.acquire(layer, routed);
      for (std::size_t i = 0; i < routed.size(); ++i) {
        const precision p = rt.format(lease.tiers()[i]);
        reference[routed[i]] = reference_record({layer, routed[i]}, p);
        if (p == precision::int4) ++lo_served;
      }
      cuda::expert_ffn_async({.x = d_x.as<float>(),
                              .out = d_out.as<float>(),
                              .offsets = d_offsets.as<std::uint32_t>(),
                              .order = d_order.as<std::uint32_t>(),
                              .topk_weights = d_weights.as<float>(),
                              .records = mirror.records() + g.flat_index({layer, 0}),
                              .tokens = n,
                              .top_k = K,
                              .experts = E,
                              .shape = shape},
                             d_workspace.as<void>(), workspace_bytes, compute.native());
      lease.release();
      expert_ffn(x, K, offsets, order, weights, reference, shape, ref);
      compute.synchronize();
      d_out.download(out.data());
      const std::vector<double> want(ref.begin(), ref.end());
      EXPECT_LT(relative_error(out, want), device_vs_host) << "token " << token << " layer " << layer;
      ++steps;
      // Every other step promotes the step's first expert (served from lo, mostly), as a hot-set
      // controller would (rotate_hot_set()). Its bf16 version loads on the prefetch stream, into
      // the slot the demoted member's switch to lo frees, and the device record switches once it
      // is done.
      const expert_id first{layer, routed[0]};
      const std::vector<residency_target> targets =
          steps % 2 == 0 ? rotate_hot_set(hot, first, 2) : std::vector<residency_target>{};
      if (!targets.empty()) {
        rt.set_targets(targets);
        for (int round = 0; round < 2; ++round) {  // the demotion's switch, then the promotion's
          prefetch.synchronize();
          rt.poll();
        }
        compute.synchronize();
        EXPECT_EQ(rt.active_tier(first), version_tier::hi) << steps;
      }
    }
  }
  compute.synchronize();
  const runtime_statistics stats = rt.statistics();
  EXPECT_GT(stats.total.evictions, 0U);
  EXPECT_GT(stats.total.switches, 0U);
  EXPECT_GT(lo_served, 0U);
  EXPECT_LE(budget.root().used(), 2 * page(precision::bf16) + 6 * page(precision::int4));
}

}  // namespace
}  // namespace expage::testing
