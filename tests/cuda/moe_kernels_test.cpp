// The routing kernels (router top-k, remap, grouping) and the expert FFN kernel against their
// host references on fresh random inputs and poisoned outputs (skipped without a device), plus
// the argument checks their launchers make before touching a device.
#include "common/expert_ffn_case.hpp"
#include "cuda/device_buffer.hpp"
#include "cuda/device_pattern.hpp"

#include "expage/core/error.hpp"
#include "expage/cuda/expert_ffn.hpp"
#include "expage/cuda/moe_routing.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/format/float16.hpp"
#include "expage/moe/expert_ffn.hpp"
#include "expage/moe/routing.hpp"
#include "expage/residency/version_record.hpp"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <vector>

namespace expage::testing {
namespace {

// Logits from N(0, 2²) rounded to multiples of 1/4 so exact ties are common, and one in 97 +∞
// (a router that overflowed), so that some tokens take the softmax's limit.
std::vector<float> router_logits(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 2.0F);
  std::vector<float> out(n);
  for (float& l : out) l = std::round(normal(rng) * 4.0F) / 4.0F;
  for (std::size_t i = 13; i < n; i += 97) out[i] = std::numeric_limits<float>::infinity();
  return out;
}

TEST(RouterTopKKernel, MatchesTheHostReference) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  // Mixtral, Qwen3-30B-A3B and Qwen3-Next shapes; top_k > 32 (several selections per lane);
  // a single expert; the most experts a router takes (both sides sum the softmax in double: in
  // float the host's sequential sum and the device's 32 lane sums drifted apart past 1e-5).
  std::uint64_t seed = 400;
  for (const auto [tokens, experts, top_k] : {std::array<std::uint32_t, 3>{1000, 8, 2},
                                              {517, 128, 8},
                                              {64, 512, 10},
                                              {9, 1000, 40},
                                              {3, 1, 1},
                                              {2, 65536, 4}}) {
    const router_shape s{.tokens = tokens, .experts = experts, .top_k = top_k};
    const std::vector<float> logits = router_logits(std::size_t{s.tokens} * s.experts, ++seed);
    std::vector<std::uint16_t> bf16(logits.size());
    for (std::size_t i = 0; i < bf16.size(); ++i) bf16[i] = float_to_bf16(logits[i]);
    const device_buffer d_logits(logits);
    const device_buffer d_bf16(bf16);
    for (const bool use_bf16 : {false, true}) {
      for (const router_gating g : {router_gating::softmax, router_gating::softmax_renormalized}) {
        std::vector<std::int32_t> ids(s.pairs());
        std::vector<float> weights(s.pairs());
        std::vector<std::uint32_t> counts(s.experts);
        device_buffer d_ids(ids.size() * 4, poisoned);
        device_buffer d_weights(weights.size() * 4, poisoned);
        device_buffer d_counts(counts.size() * 4, poisoned);
        if (use_bf16) {
          router_top_k_bf16(bf16, s, g, ids, weights, counts);
          cuda::router_top_k_bf16_async(d_bf16.as<std::uint16_t>(), s, g, d_ids.as<std::int32_t>(),
                                        d_weights.as<float>(), d_counts.as<std::uint32_t>(), nullptr);
        } else {
          router_top_k(logits, s, g, ids, weights, counts);
          cuda::router_top_k_async(d_logits.as<float>(), s, g, d_ids.as<std::int32_t>(), d_weights.as<float>(),
                                   d_counts.as<std::uint32_t>(), nullptr);
        }
        EXPAGE_CUDA_CHECK(cudaStreamSynchronize(nullptr));
        SCOPED_TRACE(::testing::Message() << s.experts << " experts, top-" << s.top_k << ", " << to_string(g)
                                          << (use_bf16 ? ", bf16" : ", fp32"));
        ASSERT_EQ(d_ids.to_host<std::int32_t>(), ids);
        ASSERT_EQ(d_counts.to_host<std::uint32_t>(), counts);
        const std::vector<float> got = d_weights.to_host<float>();
        for (std::size_t p = 0; p < got.size(); ++p) ASSERT_NEAR(got[p], weights[p], 1e-5F * weights[p]) << p;
      }
    }
  }
}

TEST(RemapKernel, MatchesTheHostReference) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  for (const std::uint32_t experts : {8U, 128U, 512U}) {
    std::mt19937_64 rng(410 + experts);
    std::bernoulli_distribution resident(0.5);
    std::vector<std::int32_t> map(experts);
    for (std::size_t e = 0; e < experts; ++e) map[e] = resident(rng) ? static_cast<std::int32_t>(e / 2) : -1;
    std::uniform_int_distribution<std::int32_t> id(-1, static_cast<std::int32_t>(experts));
    std::vector<std::int32_t> ids(10007);
    for (std::int32_t& i : ids) i = id(rng);
    std::vector<std::int32_t> slots(ids.size());
    std::vector<std::uint8_t> missing(experts);
    const std::uint32_t misses = remap_experts(ids, map, slots, missing);

    const device_buffer d_ids(ids);
    const device_buffer d_map(map);
    device_buffer d_slots(slots.size() * 4, poisoned);
    device_buffer d_missing(missing.size(), poisoned);
    device_buffer d_misses(4, poisoned);
    cuda::remap_experts_async(d_ids.as<std::int32_t>(), static_cast<std::uint32_t>(ids.size()),
                              d_map.as<std::int32_t>(), experts, d_slots.as<std::int32_t>(),
                              d_missing.as<std::uint8_t>(), d_misses.as<std::uint32_t>(), nullptr);
    EXPAGE_CUDA_CHECK(cudaStreamSynchronize(nullptr));
    ASSERT_EQ(d_slots.to_host<std::int32_t>(), slots) << experts;
    ASSERT_EQ(d_missing.to_host<std::uint8_t>(), missing) << experts;
    ASSERT_EQ(d_misses.to_host<std::uint32_t>(), std::vector<std::uint32_t>{misses}) << experts;
  }
}

TEST(GroupByExpertKernel, MatchesTheHostCountingSort) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  struct group_case {
    std::uint32_t pairs;
    std::uint32_t experts;
  };
  for (const group_case c : {group_case{0, 8}, group_case{1, 1}, group_case{2000, 8}, group_case{65536, 128},
                             group_case{100003, 512}, group_case{5000, 65536}}) {
    std::mt19937_64 rng(420 + c.experts + c.pairs);
    std::uniform_int_distribution<std::int32_t> id(-1, static_cast<std::int32_t>(c.experts));
    std::vector<std::int32_t> ids(c.pairs);
    for (std::int32_t& i : ids) i = id(rng);
    std::vector<std::uint32_t> offsets(std::size_t{c.experts} + 1);
    std::vector<std::uint32_t> order(c.pairs);
    std::vector<std::uint32_t> position(c.pairs);
    group_by_expert(ids, c.experts, offsets, order, position);

    const device_buffer d_ids(ids);
    const std::size_t workspace_bytes = cuda::group_by_expert_workspace_bytes(c.pairs, c.experts);
    device_buffer d_workspace(workspace_bytes, poisoned);
    device_buffer d_offsets(offsets.size() * 4, poisoned);
    device_buffer d_order(order.size() * 4, poisoned);
    device_buffer d_position(position.size() * 4, poisoned);
    cuda::group_by_expert_async(d_ids.as<std::int32_t>(), c.pairs, c.experts, d_workspace.as<void>(), workspace_bytes,
                                d_offsets.as<std::uint32_t>(), d_order.as<std::uint32_t>(),
                                d_position.as<std::uint32_t>(), nullptr);
    EXPAGE_CUDA_CHECK(cudaStreamSynchronize(nullptr));
    SCOPED_TRACE(::testing::Message() << c.pairs << " pairs, " << c.experts << " experts");
    ASSERT_EQ(d_offsets.to_host<std::uint32_t>(), offsets);
    if (c.pairs == 0) continue;
    ASSERT_EQ(d_order.to_host<std::uint32_t>(), order);
    ASSERT_EQ(d_position.to_host<std::uint32_t>(), position);
  }
}

TEST(RoutingKernels, RejectBadArgumentsBeforeLaunching) {
  // Checked before any CUDA call, so these hold with or without a device.
  alignas(256) std::byte fake[1024];
  auto* ids = reinterpret_cast<std::int32_t*>(fake);
  auto* weights = reinterpret_cast<float*>(fake);
  auto* counts = reinterpret_cast<std::uint32_t*>(fake);
  const auto* logits = reinterpret_cast<const float*>(fake);
  EXPECT_THROW(cuda::router_top_k_async(logits, {.tokens = 1, .experts = 8, .top_k = 9}, router_gating::softmax, ids,
                                        weights, counts, nullptr),
               invalid_argument);
  EXPECT_THROW(cuda::router_top_k_async(logits, {.tokens = 1, .experts = 70000, .top_k = 1}, router_gating::softmax,
                                        ids, weights, counts, nullptr),
               invalid_argument);
  EXPECT_THROW(cuda::router_top_k_async(nullptr, {.tokens = 1, .experts = 8, .top_k = 2}, router_gating::softmax, ids,
                                        weights, counts, nullptr),
               invalid_argument);
  EXPECT_THROW(cuda::router_top_k_bf16_async(reinterpret_cast<const std::uint16_t*>(fake),
                                             {.tokens = 1, .experts = 8, .top_k = 2}, router_gating::softmax, ids,
                                             weights, nullptr, nullptr),
               invalid_argument);
  EXPECT_THROW(
      cuda::remap_experts_async(ids, 4, nullptr, 8, ids, reinterpret_cast<std::uint8_t*>(fake), counts, nullptr),
      invalid_argument);
  EXPECT_THROW(cuda::remap_experts_async(ids, 4, ids, 0, ids, reinterpret_cast<std::uint8_t*>(fake), counts, nullptr),
               invalid_argument);
  auto* u32 = reinterpret_cast<std::uint32_t*>(fake);
  EXPECT_THROW(cuda::group_by_expert_async(ids, 4, 0, fake, sizeof fake, u32, u32, u32, nullptr), invalid_argument);
  EXPECT_THROW(cuda::group_by_expert_async(ids, 4, 8, fake + 4, sizeof fake, u32, u32, u32, nullptr), invalid_argument);
  EXPECT_THROW(cuda::group_by_expert_async(ids, 4, 8, fake, sizeof fake, u32, nullptr, u32, nullptr), invalid_argument);
}

// The case's tensors uploaded, and the device copy of its records (the table's mirror), which
// @p edit may change first.
std::vector<float> run_on_device(const ffn_case& c,
                                 const std::function<void(std::vector<version_record>&)>& edit = {}) {
  std::vector<std::unique_ptr<device_buffer>> tensors;
  std::vector<std::byte*> gate_up;
  std::vector<std::byte*> down;
  for (std::size_t e = 0; e < c.formats.size(); ++e) {
    gate_up.push_back(tensors.emplace_back(std::make_unique<device_buffer>(c.gate_up[e].bytes))->as<std::byte>());
    down.push_back(tensors.emplace_back(std::make_unique<device_buffer>(c.down[e].bytes))->as<std::byte>());
  }
  std::vector<version_record> records = c.records(gate_up, down);
  if (edit) edit(records);
  const device_buffer d_records(records);
  const device_buffer d_x(c.x);
  const device_buffer d_offsets(c.offsets);
  const device_buffer d_order(c.order);
  const device_buffer d_weights(c.gate_weights);
  device_buffer d_out(c.x.size() * sizeof(float), poisoned);
  const std::size_t workspace_bytes = cuda::expert_ffn_workspace_bytes(c.tokens, c.top_k, c.shape);
  device_buffer d_workspace(workspace_bytes, poisoned);
  const cuda::expert_ffn_problem problem{.x = d_x.as<float>(),
                                         .out = d_out.as<float>(),
                                         .offsets = d_offsets.as<std::uint32_t>(),
                                         .order = d_order.as<std::uint32_t>(),
                                         .topk_weights = d_weights.as<float>(),
                                         .records = d_records.as<version_record>(),
                                         .tokens = c.tokens,
                                         .top_k = c.top_k,
                                         .experts = static_cast<std::uint32_t>(c.formats.size()),
                                         .shape = c.shape};
  cuda::expert_ffn_async(problem, d_workspace.as<void>(), workspace_bytes, nullptr);
  EXPAGE_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  return d_out.to_host<float>();
}

TEST(ExpertFfnKernel, MatchesTheFp64ReferencePerPrecision) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  std::uint64_t seed = 600;
  for (const ffn_test_case& t : ffn_test_cases()) {
    ffn_case c(t.spec, ++seed);
    const std::vector<float> out = run_on_device(c);
    EXPECT_LT(relative_error(out, c.reference()), t.bounds.device_vs_stored) << t.spec.name;
    EXPECT_LT(relative_error(out, c.reference(false)), t.bounds.vs_original) << t.spec.name;
  }
}

// A record laid out for another shape of the same size (int4 hidden 16 x intermediate 16 read as
// 32 x 8, in groups of 32: 576 bytes each) is refused on the device as on the host
// (detail::ffn_record_fits()): its tokens' outputs are NaN, where the kernel used to read past
// its down tensor. The other experts' tokens are computed as ever.
TEST(ExpertFfnKernel, ARecordLaidOutForAnotherShapeGivesNaNInItsTokens) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  const expert_ffn_shape called{.hidden = 32, .intermediate = 8, .group_size = 32};
  const expert_ffn_shape built{.hidden = 16, .intermediate = 16, .group_size = 32};
  ffn_case c({"split", called, 32, 1, {precision::int4, precision::int4, precision::int4, precision::int4}}, 540);
  const std::vector<float> out = run_on_device(c, [&](std::vector<version_record>& records) {
    records[1] = packed_version_record(precision::int4, records[1].data[0], records[1].data[1], built);
  });
  const std::vector<double> want = c.reference();
  double scale = 0;
  for (const double v : want) scale = std::max(scale, std::abs(v));
  int refused = 0;
  for (std::uint32_t t = 0; t < c.tokens; ++t) {
    const bool to_refused = c.ids[t] == 1;  // top-1
    refused += to_refused ? 1 : 0;
    for (std::uint64_t h = 0; h < called.hidden; ++h) {
      const float v = out[t * called.hidden + h];
      if (to_refused) {
        EXPECT_TRUE(std::isnan(v)) << "token " << t;
      } else {
        EXPECT_NEAR(v, want[t * called.hidden + h], 1e-4 * scale + 1e-7) << "token " << t;
      }
    }
  }
  EXPECT_GT(refused, 0);
}

TEST(ExpertFfnKernel, RejectsBadArgumentsBeforeLaunching) {
  // Checked before any CUDA call, so these hold with or without a device.
  alignas(16) std::byte fake[4096];
  auto* f = reinterpret_cast<float*>(fake);
  auto* u32 = reinterpret_cast<std::uint32_t*>(fake);
  const cuda::expert_ffn_problem ok{.x = f,
                                    .out = f,
                                    .offsets = u32,
                                    .order = u32,
                                    .topk_weights = f,
                                    .records = reinterpret_cast<const version_record*>(fake),
                                    .tokens = 2,
                                    .top_k = 2,
                                    .experts = 4,
                                    .shape = {.hidden = 8, .intermediate = 4, .group_size = 4}};
  EXPECT_EQ(cuda::expert_ffn_workspace_bytes(2, 2, ok.shape), 2U * 2 * 4 * 4);
  const auto launch = [&](cuda::expert_ffn_problem p, std::size_t workspace_bytes, std::byte* workspace) {
    cuda::expert_ffn_async(p, workspace, workspace_bytes, nullptr);
  };
  cuda::expert_ffn_problem p = ok;
  p.shape.hidden = 0;
  EXPECT_THROW(launch(p, 1024, fake), invalid_argument);
  p = ok;
  p.experts = 0;
  EXPECT_THROW(launch(p, 1024, fake), invalid_argument);
  p = ok;
  p.top_k = 0;
  EXPECT_THROW(launch(p, 1024, fake), invalid_argument);
  p = ok;
  p.records = nullptr;
  EXPECT_THROW(launch(p, 1024, fake), invalid_argument);
  EXPECT_THROW(launch(ok, 63, fake), invalid_argument);        // 64 bytes needed
  EXPECT_THROW(launch(ok, 1024, fake + 4), invalid_argument);  // misaligned
}

}  // namespace
}  // namespace expage::testing
