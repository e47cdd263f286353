// The pager simulator's speed beside replay() on the same stream: the goal is at least
// 10 M routing events/s single-threaded for a demand-only LRU run (docs/performance.md).
#include <expage/cache/replay.hpp>
#include <expage/sim/pager_sim.hpp>
#include <expage/trace/synthetic_trace.hpp>

#include <benchmark/benchmark.h>

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

}  // namespace

BENCHMARK_MAIN();
