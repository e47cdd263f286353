// Exact reuse distance and miss-ratio curves, each beside its baseline in the same run.
//
//   BM_ReuseDistance_Access/<layers>/<experts>/<top_k>  vs  BM_Baseline_NaiveStackDistance (O(n) move-to-front)
//   BM_MissRatioCurve_Build/...                         vs  BM_Baseline_LruListSimulation (one capacity only)
//   BM_LayeredMissCurves_Access/...                     (per-layer and global trackers together)
//   BM_DecayedReuseHistogram_Record                     (the online estimator's per-access cost)
//
// Workload: a routing-shaped stream with a fixed seed. Each forward pass visits
// every MoE layer in order and routes top_k distinct experts there; each layer
// has Zipf-like expert popularity (exponent 0.9, over a per-layer random
// permutation, not calibrated on a real trace). Keys are layer-major flat
// indices, as a global expert cache sees them: Mixtral-8x7B (32 × 8 = 256 keys,
// top-2) and Qwen3-30B-A3B (48 × 128 = 6144 keys, top-8).
//
// Goal (issue 5): reuse_distance_tracker::access ≥ 20 M accesses/s.
#include "expage/cache/decayed_reuse_histogram.hpp"
#include "expage/cache/layered_miss_curves.hpp"
#include "expage/cache/miss_ratio_curve.hpp"
#include "expage/cache/reuse_distance.hpp"
#include "expage/core/expert_id.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <list>
#include <random>
#include <unordered_map>
#include <vector>

namespace {

constexpr std::size_t stream_length = std::size_t{1} << 20;  // a power of two: wrap with a mask

struct routing_stream {
  std::size_t layers;
  std::size_t experts;
  std::vector<std::uint32_t> flat;     // layer * experts + expert
  std::vector<expage::expert_id> ids;  // the same accesses as (layer, expert)
};

const routing_stream& stream_for(std::int64_t layers_arg, std::int64_t experts_arg, std::int64_t top_k_arg) {
  static std::unordered_map<std::int64_t, routing_stream> cache;
  const std::int64_t id = (layers_arg << 40) | (experts_arg << 20) | top_k_arg;
  if (const auto it = cache.find(id); it != cache.end()) return it->second;
  const auto layers = static_cast<std::size_t>(layers_arg);
  const auto experts = static_cast<std::size_t>(experts_arg);
  const auto top_k = static_cast<std::size_t>(top_k_arg);
  std::mt19937_64 rng(20240605);
  std::vector<double> weights(experts);
  for (std::size_t i = 0; i < experts; ++i) weights[i] = 1.0 / std::pow(static_cast<double>(i + 1), 0.9);
  std::discrete_distribution<std::size_t> rank(weights.begin(), weights.end());
  std::vector<std::vector<std::uint32_t>> permutation(layers, std::vector<std::uint32_t>(experts));
  for (auto& p : permutation) {
    for (std::size_t i = 0; i < experts; ++i) p[i] = static_cast<std::uint32_t>(i);
    std::shuffle(p.begin(), p.end(), rng);
  }
  routing_stream s{layers, experts, {}, {}};
  s.flat.reserve(stream_length);
  std::vector<std::uint32_t> chosen;
  while (s.flat.size() < stream_length) {
    for (std::size_t l = 0; l < layers && s.flat.size() < stream_length; ++l) {
      chosen.clear();
      while (chosen.size() < top_k) {
        const std::uint32_t e = permutation[l][rank(rng)];
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
      }
      for (const std::uint32_t e : chosen) {
        if (s.flat.size() == stream_length) break;
        s.flat.push_back(static_cast<std::uint32_t>(l * experts + e));
        s.ids.push_back({.layer = static_cast<std::uint32_t>(l), .expert = e});
      }
    }
  }
  return cache.emplace(id, std::move(s)).first->second;
}

const routing_stream& stream_for(const benchmark::State& state) {
  return stream_for(state.range(0), state.range(1), state.range(2));
}

void label(benchmark::State& state, const routing_stream& s) {
  state.SetLabel(std::to_string(s.layers * s.experts) + " keys");
}

void BM_ReuseDistance_Access(benchmark::State& state) {
  const auto& s = stream_for(state);
  expage::reuse_distance_tracker rd(s.layers * s.experts);
  std::size_t i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(rd.access(s.flat[i]));
    i = (i + 1) & (stream_length - 1);
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["compactions"] = static_cast<double>(rd.compactions());
  label(state, s);
}

// The textbook O(n) method: the LRU stack as an array, most recent first; the
// distance is the key's index, and the key moves to the front.
void BM_Baseline_NaiveStackDistance(benchmark::State& state) {
  const auto& s = stream_for(state);
  std::vector<std::uint32_t> stack;
  stack.reserve(s.layers * s.experts);
  std::size_t i = 0;
  for (auto _ : state) {
    const std::uint32_t key = s.flat[i];
    auto it = std::find(stack.begin(), stack.end(), key);
    std::size_t distance = expage::reuse_distance_tracker::cold;
    if (it == stack.end()) {
      stack.push_back(key);
      it = stack.end() - 1;
    } else {
      distance = static_cast<std::size_t>(it - stack.begin());
    }
    std::rotate(stack.begin(), it, it + 1);
    benchmark::DoNotOptimize(distance);
    i = (i + 1) & (stream_length - 1);
  }
  state.SetItemsProcessed(state.iterations());
  label(state, s);
}

// The whole curve (every capacity 0..keys) of the first 2^16 accesses, per iteration.
constexpr std::size_t curve_accesses = std::size_t{1} << 16;

void BM_MissRatioCurve_Build(benchmark::State& state) {
  const auto& s = stream_for(state);
  const std::span<const std::uint32_t> prefix(s.flat.data(), curve_accesses);
  for (auto _ : state) {
    auto curve = expage::lru_miss_ratio_curve(s.layers * s.experts, prefix);
    benchmark::DoNotOptimize(curve.miss_counts().data());
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(curve_accesses));
  label(state, s);
}

// One std::list + unordered_map LRU at a single capacity (half the keys) over
// the same accesses: the per-capacity simulation a curve would otherwise need
// once per capacity.
void BM_Baseline_LruListSimulation(benchmark::State& state) {
  const auto& s = stream_for(state);
  const std::size_t capacity = s.layers * s.experts / 2;
  for (auto _ : state) {
    std::list<std::uint32_t> order;
    std::unordered_map<std::uint32_t, std::list<std::uint32_t>::iterator> where;
    std::uint64_t misses = 0;
    for (std::size_t t = 0; t < curve_accesses; ++t) {
      const std::uint32_t key = s.flat[t];
      if (const auto it = where.find(key); it != where.end()) {
        order.splice(order.begin(), order, it->second);
        continue;
      }
      ++misses;
      if (order.size() == capacity) {
        where.erase(order.back());
        order.pop_back();
      }
      order.push_front(key);
      where[key] = order.begin();
    }
    benchmark::DoNotOptimize(misses);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(curve_accesses));
  label(state, s);
}

void BM_LayeredMissCurves_Access(benchmark::State& state) {
  const auto& s = stream_for(state);
  expage::layered_miss_curves curves(s.layers, s.experts);
  std::size_t i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(curves.access(s.ids[i]));
    i = (i + 1) & (stream_length - 1);
  }
  state.SetItemsProcessed(state.iterations());
  label(state, s);
}

// Tracker + decayed histogram (bins of 4, γ = 0.9), a new burst every 512 accesses.
void BM_DecayedReuseHistogram_Record(benchmark::State& state) {
  const auto& s = stream_for(state);
  const std::size_t keys = s.layers * s.experts;
  expage::reuse_distance_tracker rd(keys);
  expage::decayed_reuse_histogram h({.max_capacity = keys, .bin_width = 4, .decay = 0.9});
  std::size_t i = 0;
  for (auto _ : state) {
    if ((i & 511) == 0) h.new_burst();
    h.record(rd.access(s.flat[i]));
    i = (i + 1) & (stream_length - 1);
  }
  benchmark::DoNotOptimize(h.total_mass());
  state.SetItemsProcessed(state.iterations());
  label(state, s);
}

// {layers, experts per layer, top_k}: Mixtral-8x7B and Qwen3-30B-A3B.
void model_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"layers", "experts", "top_k"});
  b->Args({32, 8, 2});
  b->Args({48, 128, 8});
}

BENCHMARK(BM_ReuseDistance_Access)->Apply(model_shapes);
BENCHMARK(BM_Baseline_NaiveStackDistance)->Apply(model_shapes);
BENCHMARK(BM_MissRatioCurve_Build)->Apply(model_shapes);
BENCHMARK(BM_Baseline_LruListSimulation)->Apply(model_shapes);
BENCHMARK(BM_LayeredMissCurves_Access)->Apply(model_shapes);
BENCHMARK(BM_DecayedReuseHistogram_Record)->Apply(model_shapes);

}  // namespace

BENCHMARK_MAIN();
