// The host routing step and the host fp32 expert FFN, each beside a baseline in the same run.
//
//   BM_Router_TopK/<experts>      vs  BM_Baseline_RowMax/<experts> (one pass over the same logits)
//   BM_Remap_Experts              vs  BM_Baseline_Memcpy (the same id bytes)
//   BM_Group_ByExpert             vs  BM_Baseline_StableSort (std::stable_sort of the pairs by expert)
//   BM_ExpertFfn_Host/<bits>      vs  BM_Baseline_Fp32Ffn (the same arithmetic on pre-decoded fp32 rows)
//
// Routing: 4096 tokens, top-8 of 128 experts (Qwen3-30B-A3B) and top-2 of 8 (Mixtral). FFN:
// Qwen3-30B-A3B's expert shape (hidden 2048, FFN 768), 32 tokens routed top-2 over 8 experts,
// weights bf16 (bits = 16) or int4 group 128. Rates: tokens/s (items) and, for the FFN, bytes of
// weights read per second. Results: docs/kernels.md.
#include "expage/core/precision.hpp"
#include "expage/moe/expert_ffn.hpp"
#include "expage/moe/routing.hpp"
#include "expage/residency/version_record.hpp"

#include "moe_layer.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

constexpr std::uint32_t tokens = 4096;

expage::router_shape routing_of(const benchmark::State& state) {
  const auto experts = static_cast<std::uint32_t>(state.range(0));
  return {.tokens = tokens, .experts = experts, .top_k = experts >= 128 ? 8U : 2U};
}

void count_tokens(benchmark::State& state, std::uint32_t n) {
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(n));
}

void BM_Baseline_RowMax(benchmark::State& state) {
  const expage::router_shape r = routing_of(state);
  const std::vector<float> logits = expage::bench::router_logits(std::size_t{r.tokens} * r.experts);
  std::vector<float> max(r.tokens);
  for (auto _ : state) {
    for (std::size_t t = 0; t < r.tokens; ++t) {
      const auto row = logits.begin() + static_cast<std::ptrdiff_t>(t * r.experts);
      max[t] = *std::max_element(row, row + r.experts);
    }
    benchmark::DoNotOptimize(max.data());
  }
  count_tokens(state, r.tokens);
}
BENCHMARK(BM_Baseline_RowMax)->ArgName("experts")->Arg(8)->Arg(128)->Unit(benchmark::kMicrosecond);

void BM_Router_TopK(benchmark::State& state) {
  const expage::router_shape r = routing_of(state);
  const std::vector<float> logits = expage::bench::router_logits(std::size_t{r.tokens} * r.experts);
  std::vector<std::int32_t> ids(r.pairs());
  std::vector<float> weights(r.pairs());
  std::vector<std::uint32_t> counts(r.experts);
  for (auto _ : state) {
    expage::router_top_k(logits, r, expage::router_gating::softmax_renormalized, ids, weights, counts);
    benchmark::DoNotOptimize(ids.data());
  }
  count_tokens(state, r.tokens);
}
BENCHMARK(BM_Router_TopK)->ArgName("experts")->Arg(8)->Arg(128)->Unit(benchmark::kMicrosecond);

// Pairs of the Qwen3 routing (4096 tokens × top-8 of 128).
const expage::bench::routed_ids& pairs() {
  static const expage::bench::routed_ids p(tokens);
  return p;
}

void BM_Baseline_Memcpy(benchmark::State& state) {
  std::vector<std::int32_t> out(pairs().ids.size());
  for (auto _ : state) {
    std::memcpy(out.data(), pairs().ids.data(), out.size() * 4);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  count_tokens(state, tokens);
}
BENCHMARK(BM_Baseline_Memcpy)->Unit(benchmark::kMicrosecond);

void BM_Remap_Experts(benchmark::State& state) {
  std::vector<std::int32_t> slots(pairs().ids.size());
  std::vector<std::uint8_t> missing(pairs().map.size());
  for (auto _ : state) benchmark::DoNotOptimize(expage::remap_experts(pairs().ids, pairs().map, slots, missing));
  count_tokens(state, tokens);
}
BENCHMARK(BM_Remap_Experts)->Unit(benchmark::kMicrosecond);

void BM_Baseline_StableSort(benchmark::State& state) {
  const std::vector<std::int32_t>& ids = pairs().ids;
  std::vector<std::uint32_t> order(ids.size());
  for (auto _ : state) {
    std::iota(order.begin(), order.end(), 0U);
    std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) { return ids[a] < ids[b]; });
    benchmark::DoNotOptimize(order.data());
  }
  count_tokens(state, tokens);
}
BENCHMARK(BM_Baseline_StableSort)->Unit(benchmark::kMicrosecond);

void BM_Group_ByExpert(benchmark::State& state) {
  const std::vector<std::int32_t>& ids = pairs().ids;
  std::vector<std::uint32_t> offsets(129);
  std::vector<std::uint32_t> order(ids.size());
  std::vector<std::uint32_t> position(ids.size());
  for (auto _ : state) {
    expage::group_by_expert(ids, 128, offsets, order, position);
    benchmark::DoNotOptimize(order.data());
  }
  count_tokens(state, tokens);
}
BENCHMARK(BM_Group_ByExpert)->Unit(benchmark::kMicrosecond);

constexpr expage::expert_ffn_shape ffn_shape{.hidden = 2048, .intermediate = 768, .group_size = 128};
constexpr expage::router_shape ffn_routing{.tokens = 32, .experts = 8, .top_k = 2};

void BM_Baseline_Fp32Ffn(benchmark::State& state) {
  // The FFN's arithmetic on one fp32 row (8 KiB, L1-resident) reused for every weight row: per
  // expert and weight row, one dot product per token of the expert. What BM_ExpertFfn_Host does
  // minus the decoding and minus reading the weights from memory (its floor of arithmetic).
  const expage::bench::moe_layer layer(ffn_shape, ffn_routing, expage::precision::bf16);
  const std::vector<float> w = expage::bench::realistic_weights(ffn_shape.hidden);
  std::vector<float> h(ffn_routing.pairs() * 2 * ffn_shape.intermediate);
  for (auto _ : state) {
    std::size_t k = 0;
    for (std::uint32_t e = 0; e < ffn_routing.experts; ++e) {
      for (std::uint64_t r = 0; r < 3 * ffn_shape.intermediate; ++r) {  // 2·I rows of H, H rows of I: 3·H·I
        for (std::uint32_t i = layer.offsets[e]; i < layer.offsets[e + 1]; ++i) {
          const float* x = layer.x.data() + std::size_t{layer.order[i] / ffn_routing.top_k} * ffn_shape.hidden;
          float sum = 0.0F;
          for (std::uint64_t c = 0; c < ffn_shape.hidden; ++c) sum += w[c] * x[c];
          h[k++ % h.size()] = sum;
        }
      }
    }
    benchmark::DoNotOptimize(h.data());
  }
  count_tokens(state, ffn_routing.tokens);
}
BENCHMARK(BM_Baseline_Fp32Ffn)->Unit(benchmark::kMillisecond);

void BM_ExpertFfn_Host(benchmark::State& state) {
  expage::bench::moe_layer layer(ffn_shape, ffn_routing,
                                 state.range(0) == 16 ? expage::precision::bf16 : expage::precision::int4);
  const std::vector<expage::version_record> records = layer.host_records();
  std::vector<float> out(layer.x.size());
  for (auto _ : state) {
    expage::expert_ffn(layer.x, ffn_routing.top_k, layer.offsets, layer.order, layer.gate_weights, records, ffn_shape,
                       out);
    benchmark::DoNotOptimize(out.data());
  }
  count_tokens(state, ffn_routing.tokens);
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(layer.active_weight_bytes()));
}
BENCHMARK(BM_ExpertFfn_Host)->ArgName("bits")->Arg(16)->Arg(4)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
