// The pager simulator's speed beside replay() on the same stream: the goal is at least
// 10 M routing events/s single-threaded for a demand-only LRU run (docs/performance.md).
#include <expage/cache/replay.hpp>
#include <expage/predict/expert_predictor.hpp>
#include <expage/sim/pager_sim.hpp>
#include <expage/trace/synthetic_trace.hpp>

#include <benchmark/benchmark.h>

#include <limits>
#include <vector>

namespace {

const expage::moe_geometry& mixtral() {
  static const auto g = expage::moe_geometry::mixtral_8x7b();
  return g;
}

// A synthetic Mixtral decode trace: 64 sequences x 256 tokens x 32 layers = 524,288 routing events.
const expage::access_stream& stream() {
  static const auto trace = [] {
    expage::synthetic_options o;
    o.seed = 1;
    o.sequences = 64;
    o.decode_steps = 256;
    return expage::generate_synthetic(mixtral(), o);
  }();
  static const expage::access_stream s(trace, 128);
  return s;
}

constexpr std::uint32_t slots = 128;  // half of Mixtral's 256 experts, global

// Baseline: replay() of the same stream (misses only, no time).
void BM_Replay_Lru(benchmark::State& state) {
  const auto& s = stream();
  for (auto _ : state) {
    const auto r = expage::replay(s, mixtral(), expage::policy_kind::lru,
                                  {.layout = expage::cache_layout::global, .capacity = slots});
    benchmark::DoNotOptimize(r.misses);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(s.events()));
  state.SetLabel("routing events");
}
BENCHMARK(BM_Replay_Lru)->Unit(benchmark::kMillisecond);

// The simulator, demand loading only (the goal's configuration), at bf16 over PCIe 4.
void BM_Simulate_LruDemand(benchmark::State& state) {
  const auto& s = stream();
  for (auto _ : state) {
    const auto r = expage::simulate(s, mixtral(), expage::policy_kind::lru, {.capacity = slots});
    benchmark::DoNotOptimize(r.demand_misses);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(s.events()));
  state.SetLabel("routing events");
}
BENCHMARK(BM_Simulate_LruDemand)->Unit(benchmark::kMillisecond);

// With a noisy oracle prefetcher (recall 0.9, 2 groups ahead) at r = 2.7: the prefetch path's cost.
void BM_Simulate_LruOraclePrefetch(benchmark::State& state) {
  const auto& s = stream();
  expage::oracle_prefetcher oracle(2, 0.9);
  for (auto _ : state) {
    const auto r = expage::simulate(s, mixtral(), expage::policy_kind::lru,
                                    {.capacity = slots, .transfer_compute_ratio = 2.7, .prefetch = &oracle});
    benchmark::DoNotOptimize(r.demand_misses);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(s.events()));
  state.SetLabel("routing events");
}
BENCHMARK(BM_Simulate_LruOraclePrefetch)->Unit(benchmark::kMillisecond);

// Co-activation prefetch at r = 1 with cost-benefit admission, without and with the guards: the
// guards' demand-only shadow run is their cost.
template <bool Guarded>
void BM_Simulate_LruCoactivation(benchmark::State& state) {
  const auto& s = stream();
  expage::predictive_prefetcher pf(expage::make_predictor("coactivation", 32, 8, 2),
                                   {.distance = 1, .threshold = 0.0F});
  expage::sim_options o{.capacity = slots, .transfer_compute_ratio = 1.0, .prefetch = &pf};
  if (!Guarded) {
    o.max_prefetch_overhead = std::numeric_limits<double>::infinity();
    o.stall_guard = false;
  }
  for (auto _ : state) {
    const auto r = expage::simulate(s, mixtral(), expage::policy_kind::lru, o);
    benchmark::DoNotOptimize(r.demand_misses);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(s.events()));
  state.SetLabel("routing events");
}
BENCHMARK(BM_Simulate_LruCoactivation<false>)
    ->Name("BM_Simulate_LruCoactivation_Unguarded")
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Simulate_LruCoactivation<true>)
    ->Name("BM_Simulate_LruCoactivation_Guarded")
    ->Unit(benchmark::kMillisecond);

// One forward pass of a predictor on Mixtral's shape: observe each layer, predict the next. The
// per-layer frequency table is the baseline; co-activation and fMoE's map store (1K maps, full
// after the first thousand passes) beside it. Items: layers.
void BM_Predictor_Pass(benchmark::State& state, const char* name) {
  const auto& s = stream();
  auto p = expage::make_predictor(name, 32, 8, 2);
  std::vector<float> probability(8);
  std::size_t g = 0;
  for (std::size_t warm = 0; warm < 2048 * 32; ++warm, g = (g + 1) % s.groups()) {  // fill the map store
    if (s.starts_pass(g)) p->begin_pass();
    p->observe(s.layer(g), s.experts(g));
  }
  for (auto _ : state) {
    if (s.starts_pass(g)) p->begin_pass();
    const std::uint32_t layer = s.layer(g);
    p->observe(layer, s.experts(g));
    if (layer + 1 < 32) p->predict(layer + 1, probability);
    benchmark::DoNotOptimize(probability.data());
    g = (g + 1) % s.groups();
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel("layers");
}
BENCHMARK_CAPTURE(BM_Predictor_Pass, frequency, "frequency");
BENCHMARK_CAPTURE(BM_Predictor_Pass, coactivation, "coactivation");
BENCHMARK_CAPTURE(BM_Predictor_Pass, fmoe, "fmoe");

}  // namespace

BENCHMARK_MAIN();
