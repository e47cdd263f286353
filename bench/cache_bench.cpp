// Slot cache and replay, each beside its baseline in the same run.
//
//   BM_SlotCache_HitPath             vs  BM_Baseline_ListLru_HitPath   (goal ≥ 50 M accesses/s/core)
//   BM_SlotCache_Mixed               vs  BM_Baseline_ListLru_Mixed     (hits and misses, Qwen3-30B layer)
//   BM_SlotCache_Mixed_DuelNextTurn  vs  BM_SlotCache_Mixed_NextTurn   (duel_policy's LRU order beside next-turn)
//   BM_Replay_Synthetic/<policy>, BM_Replay_RealTrace/<policy>         (routing events/s)
//   BM_Replay_BinaryStreaming[Sequential|OneThread]  vs  BM_Replay_BinaryStreamingVersion1  vs
//   BM_Replay_BinaryInMemory  vs  BM_Baseline_SlotCache_Requests  vs  BM_Baseline_ListLru_Requests
//                              (decode + validate + checksum + LRU replay of one binary trace, in
//                               format version 4 (block CRC-32C) and version 1 (one FNV-1a); the
//                               baselines run over pre-decoded keys: slot_cache, what replay ran
//                               before it had its own cache, and a hash map + list LRU, what a
//                               general-purpose simulator such as libCacheSim runs per request)
//   BM_Replay_SweepOnePass     vs  BM_Replay_SweepPerCapacity    (16 sequential LRU capacities)
#include "expage/cache/duel_policy.hpp"
#include "expage/cache/lru_policy.hpp"
#include "expage/cache/next_turn_policy.hpp"
#include "expage/cache/replay.hpp"
#include "expage/cache/slot_cache.hpp"
#include "expage/cache/token_groups.hpp"
#include "expage/trace/synthetic_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include <benchmark/benchmark.h>

#include <cstdlib>
#include <filesystem>
#include <list>
#include <map>
#include <random>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// Mixtral-shaped top-2 groups over 8 experts of one layer, all resident
// (capacity 8): every access is a hit, so the loop times the hit path.
std::vector<std::array<std::uint32_t, 2>> hit_groups() {
  std::mt19937_64 rng(42);
  std::vector<std::array<std::uint32_t, 2>> groups(4096);
  for (auto& g : groups) {
    g[0] = static_cast<std::uint32_t>(rng() % 8);
    g[1] = static_cast<std::uint32_t>((g[0] + 1 + rng() % 7) % 8);
  }
  return groups;
}

void BM_SlotCache_HitPath(benchmark::State& state) {
  const auto geometry = expage::moe_geometry::mixtral_8x7b();
  expage::slot_cache<expage::lru_policy> cache(geometry, {.layout = expage::cache_layout::per_layer, .capacity = 8});
  const auto groups = hit_groups();
  for (std::uint32_t e = 0; e < 8; ++e) {
    const std::uint32_t one[] = {e};
    (void)cache.access(0, one);
  }
  std::size_t i = 0;
  for (auto _ : state) {
    const auto r = cache.access(0, groups[i++ & 4095]);
    benchmark::DoNotOptimize(r.hits);
  }
  state.SetItemsProcessed(state.iterations() * 2);  // expert accesses
}
BENCHMARK(BM_SlotCache_HitPath);

// The textbook LRU: a std::list in recency order and an unordered_map from key
// to list node; a hit splices the node to the front.
class list_lru {
 public:
  explicit list_lru(std::size_t capacity) : capacity_(capacity) {}
  bool access(std::uint32_t key) {
    if (auto it = index_.find(key); it != index_.end()) {
      order_.splice(order_.begin(), order_, it->second);
      return true;
    }
    if (order_.size() == capacity_) {
      index_.erase(order_.back());
      order_.pop_back();
    }
    order_.push_front(key);
    index_[key] = order_.begin();
    return false;
  }

 private:
  std::size_t capacity_;
  std::list<std::uint32_t> order_;
  std::unordered_map<std::uint32_t, std::list<std::uint32_t>::iterator> index_;
};

void BM_Baseline_ListLru_HitPath(benchmark::State& state) {
  list_lru lru(8);
  const auto groups = hit_groups();
  for (std::uint32_t e = 0; e < 8; ++e) (void)lru.access(e);
  std::size_t i = 0;
  for (auto _ : state) {
    const auto& g = groups[i++ & 4095];
    benchmark::DoNotOptimize(lru.access(g[0]) + lru.access(g[1]));
  }
  state.SetItemsProcessed(state.iterations() * 2);
}
BENCHMARK(BM_Baseline_ListLru_HitPath);

// A realistic mix of hits and misses: one Qwen3-30B-A3B layer (128 experts,
// top-8) from the seeded synthetic generator, 32 slots.
std::vector<std::vector<std::uint32_t>> mixed_groups() {
  const auto g = expage::moe_geometry::qwen3_30b_a3b();
  expage::synthetic_options o;
  o.seed = 3;
  o.sequences = 4;
  o.decode_steps = 512;
  const auto trace = expage::generate_synthetic(g, o);
  std::vector<std::vector<std::uint32_t>> groups;
  for (const expage::routing_event& e : trace) {
    if (e.layer == 0) groups.emplace_back(e.experts.begin(), e.experts.end());
  }
  return groups;
}

template <class Policy>
void BM_SlotCache_Mixed(benchmark::State& state) {
  const auto geometry = expage::moe_geometry::qwen3_30b_a3b();
  expage::slot_cache<Policy> cache(geometry, {.layout = expage::cache_layout::per_layer, .capacity = 32});
  const auto groups = mixed_groups();
  std::size_t i = 0;
  std::uint64_t misses = 0;
  for (auto _ : state) {
    const auto r = cache.access(0, groups[i++ % groups.size()]);
    misses += r.misses;
  }
  state.SetItemsProcessed(state.iterations() * 8);
  state.counters["miss_ratio"] = static_cast<double>(misses) / static_cast<double>(state.iterations() * 8);
}
BENCHMARK(BM_SlotCache_Mixed<expage::lru_policy>)->Name("BM_SlotCache_Mixed");

// group_tokens() on every layer-step of a batch of 32 Qwen3-30B-A3B tokens at 16 / 32 / 64 slots
// (each step's union exceeds the slots): the default search (downward from first-fit's count,
// 1,000 nodes) beside first-fit alone (search_budget 0), its baseline. Per iteration: 96
// layer-steps (2 decode steps × 48 layers).
const std::vector<std::vector<std::span<const expage::expert_index>>>& batched_steps() {
  static const expage::routing_trace trace = expage::generate_synthetic(
      expage::moe_geometry::qwen3_30b_a3b(), {.seed = 1, .sequences = 32, .decode_steps = 2, .batch_size = 32});
  static const auto steps = [] {
    std::map<std::pair<std::uint32_t, std::uint32_t>, std::vector<std::span<const expage::expert_index>>> by_step;
    for (std::size_t i = 0; i < trace.size(); ++i) by_step[{trace[i].step, trace[i].layer}].push_back(trace[i].experts);
    std::vector<std::vector<std::span<const expage::expert_index>>> out;
    for (auto& [key, tokens] : by_step) out.push_back(std::move(tokens));
    return out;
  }();
  return steps;
}
void group_steps(benchmark::State& state, std::size_t budget) {
  const auto& steps = batched_steps();
  const auto capacity = static_cast<std::size_t>(state.range(0));
  std::size_t groups = 0;
  for (auto _ : state) {
    groups = 0;
    for (const auto& tokens : steps) groups += expage::group_tokens(tokens, capacity, budget).tokens.size();
    benchmark::DoNotOptimize(groups);
  }
  state.counters["groups"] = static_cast<double>(groups);
}
void BM_GroupTokens_Batch32(benchmark::State& state) { group_steps(state, expage::default_grouping_search_budget); }
BENCHMARK(BM_GroupTokens_Batch32)->Arg(16)->Arg(32)->Arg(64)->Unit(benchmark::kMillisecond);
void BM_Baseline_GroupTokens_FirstFit(benchmark::State& state) { group_steps(state, 0); }
BENCHMARK(BM_Baseline_GroupTokens_FirstFit)->Arg(16)->Arg(32)->Arg(64)->Unit(benchmark::kMillisecond);

// What duel_policy's LRU order beside the policy costs per access (no switch: next-turn ranks).
BENCHMARK(BM_SlotCache_Mixed<expage::next_turn_policy>)->Name("BM_SlotCache_Mixed_NextTurn");
BENCHMARK(BM_SlotCache_Mixed<expage::duel_policy<expage::next_turn_policy>>)->Name("BM_SlotCache_Mixed_DuelNextTurn");

void BM_Baseline_ListLru_Mixed(benchmark::State& state) {
  list_lru lru(32);
  const auto groups = mixed_groups();
  std::size_t i = 0;
  std::uint64_t misses = 0;
  for (auto _ : state) {
    for (const std::uint32_t e : groups[i++ % groups.size()]) misses += lru.access(e) ? 0U : 1U;
  }
  state.SetItemsProcessed(state.iterations() * 8);
  state.counters["miss_ratio"] = static_cast<double>(misses) / static_cast<double>(state.iterations() * 8);
}
BENCHMARK(BM_Baseline_ListLru_Mixed);

void replay_bench(benchmark::State& state, const expage::routing_trace& trace, const expage::moe_geometry& g) {
  const auto policy = expage::all_policy_kinds()[static_cast<std::size_t>(state.range(0))];
  const std::uint32_t slots = static_cast<std::uint32_t>(g.expert_count() / 2);
  const expage::access_stream stream(trace, slots);
  for (auto _ : state) {
    const auto r = expage::replay(stream, g, policy, {.layout = expage::cache_layout::global, .capacity = slots});
    benchmark::DoNotOptimize(r.misses);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(trace.size()));
  state.SetLabel(std::string(expage::to_string(policy)));
}

void BM_Replay_Synthetic(benchmark::State& state) {
  static const auto g = expage::moe_geometry::mixtral_8x7b();
  static const auto trace = [] {
    expage::synthetic_options o;
    o.seed = 1;
    o.sequences = 8;
    o.decode_steps = 256;
    return expage::generate_synthetic(g, o);
  }();
  replay_bench(state, trace, g);
}
BENCHMARK(BM_Replay_Synthetic)->DenseRange(0, 10)->Unit(benchmark::kMillisecond);

// The real Mixtral HumanEval trace from ../shared/traces ($EXPAGE_TRACES_DIR), when present.
void BM_Replay_RealTrace(benchmark::State& state) {
  static const auto g = expage::moe_geometry::mixtral_8x7b();
  const char* env = std::getenv("EXPAGE_TRACES_DIR");
  const std::filesystem::path dir = env != nullptr
                                        ? std::filesystem::path(env)
                                        : std::filesystem::path(EXPAGE_SOURCE_DIR) / ".." / "shared" / "traces";
  const auto file = dir / "mixtral8x7b-vllm-humaneval" / "humaneval_2_routing.jsonl";
  if (!std::filesystem::exists(file)) {
    state.SkipWithError("real trace absent (set EXPAGE_TRACES_DIR)");
    return;
  }
  static const auto trace = expage::read_trace(file, g);
  replay_bench(state, trace, g);
}
BENCHMARK(BM_Replay_RealTrace)->DenseRange(0, 10)->Unit(benchmark::kMillisecond);

// --- the binary trace, end to end (issue 12, item 2) ---------------------------------------------

// A Mixtral decode trace (64 sequences × 256 steps, batch 1: 524,288 events, 1,048,576 expert
// requests) encoded in expage's binary format (version 4, what expage writes, unless version 1 is
// asked; version 3 reads as fast: the same blocks), held in memory so the figures exclude the disk.
const std::string& binary_trace(std::uint16_t version = expage::binary_trace_version_named) {
  static const expage::routing_trace trace = [] {
    expage::synthetic_options o;
    o.seed = 1;
    o.sequences = 64;
    o.decode_steps = 256;
    return expage::generate_synthetic(expage::moe_geometry::mixtral_8x7b(), o);
  }();
  static const std::string v4 = expage::encode_binary(trace, {.geometry = "mixtral-8x7b"});
  static const std::string v1 = expage::encode_binary(trace, {.version = expage::binary_trace_version});
  return version == expage::binary_trace_version ? v1 : v4;
}
std::span<const std::byte> binary_bytes(std::uint16_t version = expage::binary_trace_version_named) {
  const std::string& bytes = binary_trace(version);
  return std::as_bytes(std::span<const char>(bytes.data(), bytes.size()));
}
constexpr std::uint32_t bench_slots = 128;

void stream_replay(benchmark::State& state, std::uint16_t version, expage::replay_mode mode, bool read_ahead = true) {
  const auto g = expage::moe_geometry::mixtral_8x7b();
  const expage::replay_job jobs[] = {
      {expage::policy_kind::lru, {.layout = expage::cache_layout::global, .capacity = bench_slots, .mode = mode}}};
  std::uint64_t requests = 0;
  const std::span<const std::byte> bytes = binary_bytes(version);  // generated and encoded before the timed loop
  for (auto _ : state) {
    expage::binary_trace_reader in(bytes, g, "bench.bin", {.read_ahead = read_ahead});
    const auto r = expage::replay_ordered(in, g, jobs);
    requests = (*r)[0].accesses;
    benchmark::DoNotOptimize(r->front().misses);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(requests));
}
// Version 4 (14 MB: from 4 MiB on a helper thread reads, checks and decodes ahead, whose CPU time
// Google Benchmark does not count; the wall time does), and the same on the caller's thread alone.
void BM_Replay_BinaryStreaming(benchmark::State& state) {
  stream_replay(state, expage::binary_trace_version_named, expage::replay_mode::grouped);
}
BENCHMARK(BM_Replay_BinaryStreaming)->Unit(benchmark::kMillisecond)->UseRealTime();
void BM_Replay_BinaryStreamingSequential(benchmark::State& state) {
  stream_replay(state, expage::binary_trace_version_named, expage::replay_mode::sequential);
}
BENCHMARK(BM_Replay_BinaryStreamingSequential)->Unit(benchmark::kMillisecond)->UseRealTime();
void BM_Replay_BinaryStreamingOneThread(benchmark::State& state) {
  stream_replay(state, expage::binary_trace_version_named, expage::replay_mode::grouped, false);
}
BENCHMARK(BM_Replay_BinaryStreamingOneThread)->Unit(benchmark::kMillisecond)->UseRealTime();
// Version 1 (14 MB: from 4 MiB on its FNV-1a runs on the reader's helper thread, whose CPU time
// Google Benchmark does not count; the wall time does).
void BM_Replay_BinaryStreamingVersion1(benchmark::State& state) {
  stream_replay(state, expage::binary_trace_version, expage::replay_mode::grouped);
}
BENCHMARK(BM_Replay_BinaryStreamingVersion1)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Replay_BinaryInMemory(benchmark::State& state) {
  const auto g = expage::moe_geometry::mixtral_8x7b();
  std::uint64_t requests = 0;
  const std::span<const std::byte> bytes = binary_bytes();  // generated and encoded before the timed loop
  for (auto _ : state) {
    const expage::routing_trace t = expage::parse_binary(bytes, g, "bench.bin");
    const auto r = expage::replay(t, g, expage::policy_kind::lru,
                                  {.layout = expage::cache_layout::global, .capacity = bench_slots});
    requests = r.accesses;
    benchmark::DoNotOptimize(r.misses);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(requests));
}
BENCHMARK(BM_Replay_BinaryInMemory)->Unit(benchmark::kMillisecond);

// The trace's requests, decoded beforehand (the baselines pay for the cache alone): global keys
// layer · E + expert, in execution and top-k order.
const std::vector<std::uint64_t>& request_keys() {
  static const std::vector<std::uint64_t> keys = [] {
    const auto g = expage::moe_geometry::mixtral_8x7b();
    std::vector<std::uint64_t> k;
    for (const expage::routing_event& e : expage::parse_binary(binary_bytes(), g, "bench.bin")) {
      for (const std::uint32_t x : e.experts) k.push_back(std::uint64_t{e.layer} * g.experts_per_layer() + x);
    }
    return k;
  }();
  return keys;
}

// slot_cache<lru_policy>, one request per access() (sequential): the cache replay() ran before.
void BM_Baseline_SlotCache_Requests(benchmark::State& state) {
  const auto g = expage::moe_geometry::mixtral_8x7b();
  const std::vector<std::uint64_t>& keys = request_keys();
  for (auto _ : state) {
    expage::slot_cache<expage::lru_policy> cache(g, {.layout = expage::cache_layout::global, .capacity = bench_slots});
    for (const std::uint64_t k : keys) {
      const auto e = static_cast<expage::expert_index>(k % g.experts_per_layer());
      (void)cache.access(static_cast<std::uint32_t>(k / g.experts_per_layer()), std::span(&e, 1));
    }
    benchmark::DoNotOptimize(cache.statistics().misses);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(keys.size()));
}
BENCHMARK(BM_Baseline_SlotCache_Requests)->Unit(benchmark::kMillisecond);

void BM_Baseline_ListLru_Requests(benchmark::State& state) {
  const std::vector<std::uint64_t>& keys = request_keys();
  for (auto _ : state) {
    std::list<std::uint64_t> order;
    std::unordered_map<std::uint64_t, std::list<std::uint64_t>::iterator> where;
    std::uint64_t misses = 0;
    for (const std::uint64_t k : keys) {
      const auto it = where.find(k);
      if (it != where.end()) {
        order.splice(order.begin(), order, it->second);
        continue;
      }
      ++misses;
      if (order.size() == bench_slots) {
        where.erase(order.back());
        order.pop_back();
      }
      order.push_front(k);
      where.emplace(k, order.begin());
    }
    benchmark::DoNotOptimize(misses);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(keys.size()));
}
BENCHMARK(BM_Baseline_ListLru_Requests)->Unit(benchmark::kMillisecond);

std::vector<expage::replay_job> sweep_jobs() {
  std::vector<expage::replay_job> jobs;
  for (std::uint32_t c = 16; c <= 256; c += 16) {
    jobs.push_back({expage::policy_kind::lru,
                    {.layout = expage::cache_layout::global, .capacity = c, .mode = expage::replay_mode::sequential}});
  }
  return jobs;
}

void BM_Replay_SweepOnePass(benchmark::State& state) {
  const auto g = expage::moe_geometry::mixtral_8x7b();
  const auto jobs = sweep_jobs();
  const std::span<const std::byte> bytes = binary_bytes();  // generated and encoded before the timed loop
  for (auto _ : state) {
    expage::binary_trace_reader in(bytes, g, "bench.bin");
    const auto r = expage::replay_ordered(in, g, jobs);
    benchmark::DoNotOptimize(r->back().misses);
  }
  state.SetItemsProcessed(state.iterations() * 1048576 * static_cast<std::int64_t>(jobs.size()));
}
BENCHMARK(BM_Replay_SweepOnePass)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Replay_SweepPerCapacity(benchmark::State& state) {
  const auto g = expage::moe_geometry::mixtral_8x7b();
  const auto jobs = sweep_jobs();
  const std::span<const std::byte> bytes = binary_bytes();  // generated and encoded before the timed loop
  for (auto _ : state) {
    for (const auto& job : jobs) {
      expage::binary_trace_reader in(bytes, g, "bench.bin");
      const auto r = expage::replay_ordered(in, g, std::span(&job, 1));
      benchmark::DoNotOptimize(r->back().misses);
    }
  }
  state.SetItemsProcessed(state.iterations() * 1048576 * static_cast<std::int64_t>(jobs.size()));
}
BENCHMARK(BM_Replay_SweepPerCapacity)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
