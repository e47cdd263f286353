// The pager simulator's speed beside replay() on the same stream: the goal is at least
// 10 M routing events/s single-threaded for a demand-only LRU run (docs/performance.md).
#include <expage/cache/replay.hpp>
#include <expage/cache/reuse_distance.hpp>
#include <expage/predict/expert_predictor.hpp>
#include <expage/sim/kv_sessions.hpp>
#include <expage/sim/pager_sim.hpp>
#include <expage/sim/split_sim.hpp>
#include <expage/trace/synthetic_trace.hpp>

#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <limits>
#include <vector>

namespace {

const expage::moe_geometry& mixtral() {
  static const auto g = expage::moe_geometry::mixtral_8x7b();
  return g;
}

// A synthetic Mixtral decode trace: 64 sequences x 256 tokens x 32 layers = 524,288 routing events.
const expage::routing_trace& trace() {
  static const auto t = [] {
    expage::synthetic_options o;
    o.seed = 1;
    o.sequences = 64;
    o.decode_steps = 256;
    return expage::generate_synthetic(mixtral(), o);
  }();
  return t;
}

const expage::access_stream& stream() {
  static const expage::access_stream s(trace(), 128);
  return s;
}

// The same trace for per-layer slots (groups of at most top-k, so every cap from 2 runs).
const expage::access_stream& per_layer_stream() {
  static const expage::access_stream s(trace(), mixtral().top_k());
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

// Prefetch-aware eviction's cost: next-turn eviction with co-activation prefetch at r = 1, the
// victims ranked with the prefetcher's forecast (next_turn_policy::next_use) or without; next-turn
// demand loading beside them is the baseline.
template <int Mode>  // 0: demand only, 1: prefetch without forecast ranking, 2: with it
void BM_Simulate_NextTurn(benchmark::State& state) {
  const auto& s = stream();
  expage::predictive_prefetcher pf(expage::make_predictor("coactivation", 32, 8, 2),
                                   {.distance = 1, .threshold = 0.0F});
  expage::sim_options o{.capacity = slots, .transfer_compute_ratio = 1.0};
  if (Mode > 0) o.prefetch = &pf;
  o.forecast_eviction = Mode == 2;
  for (auto _ : state) {
    const auto r = expage::simulate(s, mixtral(), expage::policy_kind::next_turn, o);
    benchmark::DoNotOptimize(r.demand_misses);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(s.events()));
  state.SetLabel("routing events");
}
BENCHMARK(BM_Simulate_NextTurn<0>)->Name("BM_Simulate_NextTurn_Demand")->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Simulate_NextTurn<1>)->Name("BM_Simulate_NextTurn_Coactivation")->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Simulate_NextTurn<2>)
    ->Name("BM_Simulate_NextTurn_CoactivationForecastEviction")
    ->Unit(benchmark::kMillisecond);

// One forward pass of a predictor on Mixtral's shape: observe each layer, predict the next. The
// per-layer frequency table is the baseline; co-activation (log-odds pooling, the default, and
// WiSP's mean) and fMoE's map store (1K maps, full after the first thousand passes) beside it.
// Items: layers.
void predictor_pass(benchmark::State& state, expage::expert_predictor& p) {
  const auto& s = stream();
  std::vector<float> probability(8);
  std::size_t g = 0;
  for (std::size_t warm = 0; warm < 2048 * 32; ++warm, g = (g + 1) % s.groups()) {  // fill the map store
    if (s.starts_pass(g)) p.begin_pass();
    p.observe(s.layer(g), s.experts(g));
  }
  for (auto _ : state) {
    if (s.starts_pass(g)) p.begin_pass();
    const std::uint32_t layer = s.layer(g);
    p.observe(layer, s.experts(g));
    if (layer + 1 < 32) p.predict(layer + 1, probability);
    benchmark::DoNotOptimize(probability.data());
    g = (g + 1) % s.groups();
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel("layers");
}
void BM_Predictor_Pass(benchmark::State& state, const char* name) {
  if (std::string_view(name) == "coactivation_mean") {
    expage::coactivation_predictor mean(32, 8, 2, expage::coactivation_predictor::default_window,
                                        expage::coactivation_predictor::mean_decay, expage::coactivation_pooling::mean);
    predictor_pass(state, mean);
    return;
  }
  predictor_pass(state, *expage::make_predictor(name, 32, 8, 2));
}
BENCHMARK_CAPTURE(BM_Predictor_Pass, frequency, "frequency");
BENCHMARK_CAPTURE(BM_Predictor_Pass, coactivation, "coactivation");
BENCHMARK_CAPTURE(BM_Predictor_Pass, coactivation_mean, "coactivation_mean");
BENCHMARK_CAPTURE(BM_Predictor_Pass, fmoe, "fmoe");

// fMoE's store with the optional fields: full router probability vectors as rows and 64-float
// sketches for semantic search (the first 3 layers of each pass), beside the sparse store above.
void BM_Predictor_FmoeWithFields(benchmark::State& state) {
  static const auto fields = [] {
    expage::synthetic_options o;
    o.seed = 2;
    o.sequences = 16;
    o.decode_steps = 256;
    o.cross_layer = 0.65;
    o.probabilities = true;
    o.sketch_dims = 64;
    return expage::generate_synthetic(mixtral(), o);
  }();
  expage::fmoe_map_predictor p(32, 8, 2);
  std::vector<float> probability(8);
  std::size_t i = 0;
  std::uint32_t previous = 32;
  const auto step = [&] {
    const expage::routing_event e = fields[i];
    if (e.layer <= previous) p.begin_pass();
    previous = e.layer;
    p.observe_routing(e.layer, {.experts = e.experts, .probabilities = e.probabilities, .sketch = e.sketch});
    i = (i + 1) % fields.size();
    return e.layer;
  };
  for (std::size_t warm = 0; warm < 2048 * 32; ++warm) static_cast<void>(step());  // fill the map store
  for (auto _ : state) {
    const std::uint32_t layer = step();
    if (layer + 1 < 32) p.predict(layer + 1, probability);
    benchmark::DoNotOptimize(probability.data());
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel("layers");
}
BENCHMARK(BM_Predictor_FmoeWithFields);

// The KV side of the split: the tool-calls session mix over the stream's passes (one step each).
const expage::kv_block_stream& kv_stream() {
  static const auto kv = [] {
    expage::kv_session_options o;
    o.phases = expage::kv_session_preset("tool-calls", stream().passes());
    return expage::generate_kv_sessions(o);
  }();
  return kv;
}

// Baseline: the exact LRU stack distance of every block read (what the miss curve costs).
void BM_KvPool_StackDistances(benchmark::State& state) {
  const auto& kv = kv_stream();
  for (auto _ : state) {
    expage::reuse_distance_tracker rd(kv.key_count());
    std::uint64_t far = 0;
    for (std::uint64_t s = 0; s < kv.steps(); ++s) {
      for (const std::uint32_t b : kv.blocks(s)) far += rd.access(b) >= 2048 ? 1U : 0U;
    }
    benchmark::DoNotOptimize(far);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(kv.references()));
  state.SetLabel("block reads");
}
BENCHMARK(BM_KvPool_StackDistances)->Unit(benchmark::kMillisecond);

// simulate_kv_pool(): the LRU block pool at one size (what every split's KV side costs).
void BM_KvPool_Replay(benchmark::State& state) {
  const auto& kv = kv_stream();
  for (auto _ : state) {
    const auto r = expage::simulate_kv_pool(kv, 2048);
    benchmark::DoNotOptimize(r.recomputes);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(kv.references()));
  state.SetLabel("block reads");
}
BENCHMARK(BM_KvPool_Replay)->Unit(benchmark::kMillisecond);

expage::split_workload split_workload() {
  expage::split_workload w;
  w.experts = &per_layer_stream();
  w.kv = &kv_stream();
  w.geometry = mixtral();
  w.expert_options.hardware = expage::hardware_profile::preset("c2c");
  w.kv_bytes_per_token = 128 * 1024;
  w.kv_floor_bytes = kv_stream().peak_step_blocks() * 16 * w.kv_bytes_per_token;
  const std::uint64_t slot = std::uint64_t{mixtral().layers()} * mixtral().expert_bytes(expage::precision::bf16);
  w.budget_bytes = w.kv_floor_bytes + 6 * slot;
  return w;
}

// Baseline: one static split (a per-layer expert simulation and a KV pool replay).
void BM_Split_Static(benchmark::State& state) {
  const auto w = split_workload();
  const std::uint32_t caps[] = {5};
  for (auto _ : state) {
    const auto r = expage::evaluate_split_schedule(w, caps, "static");
    benchmark::DoNotOptimize(r.expert_stall_seconds);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(stream().events()));
  state.SetLabel("routing events");
}
BENCHMARK(BM_Split_Static)->Unit(benchmark::kMillisecond);

// The online controller: both streams' reuse distances into its histograms, a decision per
// burst, then the same simulation of its schedule.
void BM_Split_Online(benchmark::State& state) {
  const auto w = split_workload();
  for (auto _ : state) {
    const auto r = expage::run_online_split(w, {});
    benchmark::DoNotOptimize(r.expert_stall_seconds);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(stream().events()));
  state.SetLabel("routing events");
}
BENCHMARK(BM_Split_Online)->Unit(benchmark::kMillisecond);

// The same run without the controller's noise gate (online_split_config::noise_gate = 0): what
// the gate's variance sums cost per burst, beside BM_Split_Online.
void BM_Split_Online_NoNoiseGate(benchmark::State& state) {
  const auto w = split_workload();
  expage::online_split_options options;
  options.controller.noise_gate = 0.0;
  for (auto _ : state) {
    const auto r = expage::run_online_split(w, options);
    benchmark::DoNotOptimize(r.expert_stall_seconds);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(stream().events()));
  state.SetLabel("routing events");
}
BENCHMARK(BM_Split_Online_NoNoiseGate)->Unit(benchmark::kMillisecond);

// The per-phase hindsight oracle over the grid already run (what expage-plan adds beside the
// grid): per phase, the cheapest run's burst costs summed. Against BM_Split_Static, the cost of
// one grid point.
void BM_Split_PhaseOracle(benchmark::State& state) {
  const auto w = split_workload();
  const auto grid = expage::split_grid(w);
  for (auto _ : state) {
    const auto o = expage::split_phase_oracle(w, grid);
    benchmark::DoNotOptimize(o.cost);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(grid.size() * grid.front().bursts.size()));
  state.SetLabel(fmt::format("{} grid runs x {} bursts", grid.size(), grid.front().bursts.size()));
}
BENCHMARK(BM_Split_PhaseOracle)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
