// expert_runtime, each path beside its baseline in the same run.
//
//   BM_Runtime_AcquireRelease_AllHit      vs  BM_Baseline_SlotCache_AllHit
//       Mixtral-8x7B routing (32 layers × 8 experts, top-2, batch 1), every expert resident;
//       goal ≤ 1.5× the slot cache's access alone and under 1 µs. The engine releases with its
//       own completion (already recorded, as a CUDA event would be); the _RecordEvent variant
//       lets release() record the compute stream's event itself (a host_stream record).
//   BM_Runtime_AcquireRelease_AllHit_Prefetcher  vs  BM_Runtime_AcquireRelease_AllHit
//       the same, with a runtime_prefetcher (co-activation) told each layer's routing: what
//       prediction, the stale-request cancel and the guards add per layer (every expert is
//       resident, so no load is issued).
//   BM_Runtime_AcquireRelease_AllHit_Prefetcher  vs  BM_Runtime_AcquireRelease_AllHit_PrefetcherNoStallGuard
//       what the stall guard's window (runtime_prefetch_options::stall_passes) adds per layer.
//   BM_Runtime_AcquireRelease_AllHit_PrefetcherDuel  vs  BM_Runtime_AcquireRelease_AllHit_Prefetcher
//       the same with next-turn inside a duel_policy: what the duel (a second key-only shadow,
//       next-turn's, and the duel's step) adds per layer.
//   BM_Runtime_AcquireRelease_AllHit_Tiered  vs  BM_Runtime_AcquireRelease_AllHit
//       two tiers (bf16 hi, int4 lo), half of every layer's experts active in each: what serving
//       each expert from its active tier (lease::tiers()) adds to the one-tier hit path.
//   BM_Runtime_Miss/<model>/<views>       vs  BM_Baseline_CopyIntoMappedPages/<model>,
//                                             BM_Baseline_CopyIntoRotatingPages/<model>,
//                                             BM_Baseline_StreamsFenceIntoRotatingPages/<model>/0
//                                             and BM_Baseline_StreamCopyIntoMappedPages/<model>
//       one expert loaded per lease at its real size (Mixtral-8x7B 336 MiB, Qwen3-30B-A3B
//       9 MiB, bf16), evicting another: map, fill on the copy stream, fences, unmap; goal
//       ≤ 1.05× a memcpy of the same bytes into pages mapped once. Second argument: 0 with every
//       view (the stable page is mapped per miss), 1 with the records view alone (slot mappings).
//   BM_Runtime_Miss_CopyEngine/<model>    vs  BM_Baseline_CopyEngineIntoRotatingPages/<model>,
//                                             BM_Baseline_StreamsFenceIntoRotatingPages/<model>/1
//                                             and the memcpy baselines above
//       the same miss, records view alone, with the loader an engine on the host would use: a
//       host_copy_engine (one worker and the copy stream's thread, 2 MiB chunks, non-temporal
//       stores) in the copy stream's order. Against the same engine's copy without the runtime
//       it says what the runtime and its streams add to the copy they are given; against the
//       same copy through the same streams and fence, what the runtime alone adds;
//       BM_Baseline_StreamsFenceIntoRotatingPages/<model>/2 is those hand-offs with no copy.
//       Against the memcpy baselines, what the miss path costs.
//   BM_Baseline_WakeRoundTrip
//       two wake-ups of a sleeping thread (atomic wait/notify): the unit of the host streams'
//       fixed cost per miss.
#include "expage/cache/duel_policy.hpp"
#include "expage/cache/lru_policy.hpp"
#include "expage/cache/next_turn_policy.hpp"
#include "expage/cache/slot_cache.hpp"
#include "expage/core/units.hpp"
#include "expage/predict/expert_predictor.hpp"
#include "expage/runtime/expert_runtime.hpp"
#include "expage/runtime/runtime_prefetcher.hpp"
#include "expage/stream/host_copy_engine.hpp"
#include "expage/stream/host_stream.hpp"
#include "expage/vmm/host_vmm.hpp"

#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace expage::literals;
using runtime = expage::expert_runtime<expage::host_vmm, expage::host_stream, expage::lru_policy>;
// The same with next-turn inside a duel_policy: the prefetcher then runs the eviction duel.
using duel_runtime =
    expage::expert_runtime<expage::host_vmm, expage::host_stream, expage::duel_policy<expage::next_turn_policy>>;

// Mixtral's routing shape with experts scaled to 1/64 width: the hit path never touches expert bytes.
expage::moe_geometry mixtral_routing() {
  auto c = expage::moe_geometry::mixtral_8x7b().configuration();
  c.hidden_size /= 64;
  c.intermediate_size /= 64;
  return expage::moe_geometry(c);
}

std::vector<std::array<std::uint32_t, 2>> top2_groups() {
  std::mt19937_64 rng(42);
  std::vector<std::array<std::uint32_t, 2>> groups(4096);
  for (auto& g : groups) {
    g[0] = static_cast<std::uint32_t>(rng() % 8);
    g[1] = static_cast<std::uint32_t>((g[0] + 1 + rng() % 7) % 8);
  }
  return groups;
}

// A bf16 source whose every expert is a copy of @p bytes (one expert's, filled here: gate_up, then
// down from its own bytes, as an engine's weights are distinct tensors), enqueued on the copy
// stream, or through @p engine in the stream's order when one is given. The baselines read the
// same bytes the same way (two_copy_case).
expage::expert_source<expage::host_stream> zero_source(const expage::moe_geometry& g, std::vector<std::byte>& bytes,
                                                       expage::host_copy_engine* engine = nullptr) {
  bytes.assign(g.expert_bytes(expage::precision::bf16), std::byte{1});
  return {.format = expage::precision::bf16,
          .load = [&g, &bytes, engine](expage::expert_id, expage::expert_tensor t, std::span<std::byte> page,
                                       expage::host_stream& s) {
            const std::size_t n = g.tensor_bytes(t, expage::precision::bf16);
            const std::byte* const from =
                bytes.data() + (t == expage::expert_tensor::down
                                    ? g.tensor_bytes(expage::expert_tensor::gate_up, expage::precision::bf16)
                                    : 0);
            if (engine != nullptr) {
              engine->copy(page.data(), from, n, s);
            } else {
              s.copy(page.data(), from, n);
            }
            return n;
          }};
}

void BM_Baseline_SlotCache_AllHit(benchmark::State& state) {
  const auto g = mixtral_routing();
  expage::slot_cache<expage::lru_policy> cache(g, {.layout = expage::cache_layout::global, .capacity = 256});
  const std::uint32_t all[] = {0, 1, 2, 3, 4, 5, 6, 7};
  for (std::uint32_t l = 0; l < g.layers(); ++l) (void)cache.access(l, all);
  const auto groups = top2_groups();
  std::size_t i = 0;
  for (auto _ : state) {
    const auto r = cache.access(static_cast<std::uint32_t>(i % 32), groups[i & 4095]);
    ++i;
    benchmark::DoNotOptimize(r.hits);
  }
  state.SetItemsProcessed(state.iterations());  // layers served
}
BENCHMARK(BM_Baseline_SlotCache_AllHit);

template <bool RecordEvent, bool Prefetcher = false, class Runtime = runtime, bool StallGuard = true>
void BM_Runtime_AcquireRelease_AllHit(benchmark::State& state) {
  const auto g = mixtral_routing();
  expage::host_vmm vmm({.granularity = 4_KiB});
  expage::host_stream copy("copy"), compute("compute"), prefetch("prefetch");
  std::vector<std::byte> bytes;
  auto source = zero_source(g, bytes);
  Runtime rt(
      g,
      [&]() -> expage::budget_account& {
        static expage::budget_tracker budget(1_GiB);
        return budget.root();
      }(),
      vmm, copy, compute, source, {.capacity = 256}, Prefetcher ? &prefetch : nullptr);
  std::optional<expage::runtime_prefetcher<Runtime>> pf;  // needs the prefetch stream
  if constexpr (Prefetcher) {
    pf.emplace(rt, expage::make_predictor("coactivation", g.layers(), 8, 2),
               StallGuard ? expage::runtime_prefetch_options{} : expage::runtime_prefetch_options{.stall_passes = 0});
  }
  const std::uint32_t all[] = {0, 1, 2, 3, 4, 5, 6, 7};
  for (std::uint32_t l = 0; l < g.layers(); ++l) rt.acquire(l, all).release();
  compute.synchronize();
  copy.synchronize();
  rt.poll();
  const auto groups = top2_groups();
  expage::completion_flag kernel_done;  // the engine's event of its kernel, recorded elsewhere
  kernel_done.set();
  std::size_t i = 0;
  for (auto _ : state) {
    const auto layer = static_cast<std::uint32_t>(i % 32);
    auto lease = rt.acquire(layer, groups[i & 4095]);
    if constexpr (Prefetcher) pf->on_routed(layer, groups[i & 4095]);
    ++i;
    if constexpr (RecordEvent) {
      lease.release();
    } else {
      lease.release(kernel_done);
    }
  }
  compute.synchronize();
  state.SetItemsProcessed(state.iterations());
  state.counters["misses"] = static_cast<double>(rt.statistics().total.misses - 256);
}
BENCHMARK(BM_Runtime_AcquireRelease_AllHit<false>)->Name("BM_Runtime_AcquireRelease_AllHit");
BENCHMARK(BM_Runtime_AcquireRelease_AllHit<true>)->Name("BM_Runtime_AcquireRelease_AllHit_RecordEvent");
BENCHMARK(BM_Runtime_AcquireRelease_AllHit<false, true>)->Name("BM_Runtime_AcquireRelease_AllHit_Prefetcher");
BENCHMARK(BM_Runtime_AcquireRelease_AllHit<false, true, runtime, false>)
    ->Name("BM_Runtime_AcquireRelease_AllHit_PrefetcherNoStallGuard");
BENCHMARK(BM_Runtime_AcquireRelease_AllHit<false, true, duel_runtime>)
    ->Name("BM_Runtime_AcquireRelease_AllHit_PrefetcherDuel");

void BM_Runtime_AcquireRelease_AllHit_Tiered(benchmark::State& state) {
  const auto g = mixtral_routing();
  expage::host_vmm vmm({.granularity = 4_KiB});
  expage::host_stream copy("copy"), compute("compute"), prefetch("prefetch");
  std::vector<std::byte> hi_bytes, lo_bytes;
  expage::tiered_source<expage::host_stream> sources{.hi = zero_source(g, hi_bytes),
                                                     .lo = {.format = expage::precision::int4, .load = {}}};
  lo_bytes.assign(g.tensor_bytes(expage::expert_tensor::gate_up, expage::precision::int4), std::byte{2});
  sources.lo.load = [&g, &lo_bytes](expage::expert_id, expage::expert_tensor t, std::span<std::byte> page,
                                    expage::host_stream& s) {
    const std::size_t n = g.tensor_bytes(t, expage::precision::int4);
    s.copy(page.data(), lo_bytes.data(), n);
    return n;
  };
  static expage::budget_tracker budget(1_GiB);
  runtime rt(g, budget.root(), vmm, copy, compute, sources, {.capacity = 128, .lo_capacity = 256}, &prefetch);
  const std::uint32_t all[] = {0, 1, 2, 3, 4, 5, 6, 7};
  for (std::uint32_t l = 0; l < g.layers(); ++l) rt.acquire(l, all).release();  // every expert lo
  std::vector<expage::residency_target> hi;                                     // experts 0-3 of every layer promoted
  for (std::uint32_t l = 0; l < g.layers(); ++l) {
    for (std::uint32_t e = 0; e < 4; ++e) hi.push_back({{l, e}, expage::residency_state::resident_hi});
  }
  rt.set_targets(hi);
  while (rt.statistics().total.switches < hi.size()) {
    compute.synchronize();
    copy.synchronize();
    prefetch.synchronize();
    rt.poll();
  }
  const auto groups = top2_groups();
  expage::completion_flag kernel_done;
  kernel_done.set();
  std::size_t i = 0;
  for (auto _ : state) {
    auto lease = rt.acquire(static_cast<std::uint32_t>(i % 32), groups[i & 4095]);
    ++i;
    lease.release(kernel_done);
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["hi_coverage"] = rt.statistics().hi_coverage();
}
BENCHMARK(BM_Runtime_AcquireRelease_AllHit_Tiered);

expage::moe_geometry model(std::int64_t which) {
  return which == 0 ? expage::moe_geometry::mixtral_8x7b() : expage::moe_geometry::qwen3_30b_a3b();
}

// One expert's bytes of 2 MiB host_vmm blocks mapped once and touched, the baselines'
// destination: a fresh memfd block is backed on first touch, a one-off the runtime's slots have
// paid before its timed loop too (run_misses()).
struct mapped_pages {
  expage::host_vmm vmm{{.granularity = 2_MiB}};
  std::size_t mapped;
  std::byte* base;
  std::vector<expage::host_vmm::physical_block> blocks;

  explicit mapped_pages(std::size_t bytes) : mapped((bytes + 2_MiB - 1) / 2_MiB * 2_MiB), base(vmm.reserve(mapped)) {
    for (std::size_t off = 0; off < mapped; off += 2_MiB) {
      blocks.push_back(vmm.create());
      vmm.map(blocks.back(), base + off);
    }
    std::memset(base, 0, mapped);  // first touch outside the timed loop
  }
  mapped_pages(const mapped_pages&) = delete;
  mapped_pages& operator=(const mapped_pages&) = delete;
  ~mapped_pages() {
    vmm.unmap(base, mapped);
    for (const auto b : blocks) vmm.release(b);
    vmm.free(base);
  }
};

void BM_Baseline_CopyIntoMappedPages(benchmark::State& state) {
  const auto g = model(state.range(0));
  const std::size_t bytes = g.expert_bytes(expage::precision::bf16);
  mapped_pages pages(bytes);
  std::vector<std::byte> source(bytes, std::byte{1});
  for (auto _ : state) {
    std::memcpy(pages.base, source.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
  state.SetLabel(g.name());
}
BENCHMARK(BM_Baseline_CopyIntoMappedPages)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

// The same copy into as many destinations as BM_Runtime_Miss has slots (top-k experts' pages),
// in turn: the runtime's copy always lands in the least recently used slot, which at Qwen3's
// 9 MiB is no longer in the last-level cache, while BM_Baseline_CopyIntoMappedPages rewrites one
// cache-warm destination. The copy itself, with the runtime's destination pattern.
// One destination of whole 2 MiB granules per slot of BM_Runtime_Miss (top-k), handed out in turn.
struct rotating_pages {
  std::size_t stride;
  std::size_t slots;
  mapped_pages pages;
  std::size_t slot = 0;

  rotating_pages(std::size_t bytes, std::size_t slots_)
      : stride((bytes + 2_MiB - 1) / 2_MiB * 2_MiB), slots(slots_), pages(stride * slots_) {}
  std::byte* next() noexcept {
    std::byte* const page = pages.base + slot * stride;
    slot = (slot + 1) % slots;
    return page;
  }
};

void BM_Baseline_CopyIntoRotatingPages(benchmark::State& state) {
  const auto g = model(state.range(0));
  const std::size_t bytes = g.expert_bytes(expage::precision::bf16);
  rotating_pages pages(bytes, g.top_k());
  std::vector<std::byte> source(bytes, std::byte{1});
  for (auto _ : state) {
    std::memcpy(pages.next(), source.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
  state.SetLabel(g.name() + ", " + std::to_string(g.top_k()) + " destinations");
}
BENCHMARK(BM_Baseline_CopyIntoRotatingPages)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

// The copy engine the copy-engine benchmarks use: one worker, which with the waiting thread that
// helps it makes two copying threads, one per vCPU here; 2 MiB chunks, non-temporal stores.
expage::host_copy_engine_options copy_engine_options() { return {.threads = 1, .chunk_bytes = 2_MiB}; }

// What the baselines of the runtime's two-copy miss share: the model's expert (its bytes, and the
// gate_up tensor's that come first), top-k rotating destinations, and zero_source()'s bytes (one
// expert's: gate_up, then down from its own bytes).
struct two_copy_case {
  expage::moe_geometry g;
  std::size_t bytes;
  std::size_t gate_up;
  rotating_pages pages;
  std::vector<std::byte> source;

  explicit two_copy_case(std::int64_t which)
      : g(model(which)),
        bytes(g.expert_bytes(expage::precision::bf16)),
        gate_up(g.tensor_bytes(expage::expert_tensor::gate_up, expage::precision::bf16)),
        pages(bytes, g.top_k()),
        source(bytes, std::byte{1}) {}
  void finish(benchmark::State& state) const {
    state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
    state.SetLabel(g.name() + ", " + std::to_string(g.top_k()) + " destinations");
  }
};

// The same copy as two memcpy calls (gate_up, down) on a host_stream's thread, waited for with
// synchronize(): the runtime's miss without the runtime (its loads run on the copy stream's
// thread), to tell the runtime's own cost from the cost of copying on another thread.
void BM_Baseline_StreamCopyIntoMappedPages(benchmark::State& state) {
  const auto g = model(state.range(0));
  const std::size_t bytes = g.expert_bytes(expage::precision::bf16);
  const std::size_t gate_up = g.tensor_bytes(expage::expert_tensor::gate_up, expage::precision::bf16);
  mapped_pages pages(bytes);
  std::vector<std::byte> source(bytes, std::byte{1});
  expage::host_stream copy("copy");
  for (auto _ : state) {
    copy.copy(pages.base, source.data(), gate_up);
    copy.copy(pages.base + gate_up, source.data() + gate_up, bytes - gate_up);
    copy.synchronize();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
  state.SetLabel(g.name());
}
BENCHMARK(BM_Baseline_StreamCopyIntoMappedPages)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

// The runtime's miss without the runtime, fences included: the two copies on a copy stream into
// the rotating destinations, an event recorded after them, the compute stream waiting on it, and
// the caller synchronizing the compute stream. What is left between this and the runtime's miss
// with the same loader is the runtime's own work; what lies between this and the copy alone is
// the host streams' (thread hand-offs between the machine's cores). Second argument, the loader:
// 0 host_stream::copy (as BM_Runtime_Miss), 1 the copy engine in stream order (as
// BM_Runtime_Miss_CopyEngine), 2 none: the hand-offs and fence alone, with no byte copied.
void BM_Baseline_StreamsFenceIntoRotatingPages(benchmark::State& state) {
  two_copy_case c(state.range(0));
  expage::host_stream copy("copy"), compute("compute");  // outlive the engine (see BM_Runtime_Miss_CopyEngine)
  expage::host_copy_engine engine(copy_engine_options());
  expage::host_event loaded;
  const std::int64_t loader = state.range(1);
  for (auto _ : state) {
    std::byte* const page = c.pages.next();
    if (loader == 0) {
      copy.copy(page, c.source.data(), c.gate_up);
      copy.copy(page + c.gate_up, c.source.data() + c.gate_up, c.bytes - c.gate_up);
    } else if (loader == 1) {
      engine.copy(page, c.source.data(), c.gate_up, copy);
      engine.copy(page + c.gate_up, c.source.data() + c.gate_up, c.bytes - c.gate_up, copy);
    }
    copy.record(loaded);
    compute.wait(loaded);
    compute.synchronize();
  }
  if (loader != 2) c.finish(state);  // nothing copied: no rate (a rate of 0 would be divided by)
  state.SetLabel(c.g.name() + (loader == 0 ? ", host_stream::copy" : loader == 1 ? ", copy engine" : ", no copy"));
}
BENCHMARK(BM_Baseline_StreamsFenceIntoRotatingPages)
    ->ArgsProduct({{0, 1}, {0, 1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// What one hand-off between host threads costs when the woken thread sleeps: a round trip (two
// wake-ups) through std::atomic wait/notify with a partner thread that has gone to sleep, the
// caller busy meanwhile (untimed) so that its own core stays awake, as a caller enqueuing work
// is. The unit of the streams' fixed cost per miss; run it pinned to one core (taskset -c 0) to
// see what the same round trip costs without crossing cores.
void BM_Baseline_WakeRoundTrip(benchmark::State& state) {
  std::atomic<std::uint64_t> turn{0};  // odd: the partner's turn; even: the caller's
  std::thread partner([&] {
    for (std::uint64_t seen = 0;;) {
      while ((seen = turn.load(std::memory_order_acquire)) % 2 == 0) turn.wait(seen, std::memory_order_acquire);
      if (seen == std::numeric_limits<std::uint64_t>::max()) return;
      turn.fetch_add(1, std::memory_order_acq_rel);
      turn.notify_one();
    }
  });
  for (auto _ : state) {
    state.PauseTiming();
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    while (std::chrono::steady_clock::now() < until) {  // the partner goes to sleep meanwhile
    }
    state.ResumeTiming();
    std::uint64_t mine = turn.fetch_add(1, std::memory_order_acq_rel) + 1;
    turn.notify_one();
    while (turn.load(std::memory_order_acquire) == mine) turn.wait(mine, std::memory_order_acquire);
  }
  turn.store(std::numeric_limits<std::uint64_t>::max(), std::memory_order_release);
  turn.notify_one();
  partner.join();
}
BENCHMARK(BM_Baseline_WakeRoundTrip)->Unit(benchmark::kMicrosecond)->UseRealTime();

// One demand miss per iteration, each evicting another expert: a runtime over top-k slots of
// @p g's experts (every slot full first), leases of one expert of layer 0 in turn, each waited for
// through the compute stream's fence. Both miss benchmarks run this with their loader.
void run_misses(benchmark::State& state, const expage::moe_geometry& g, expage::host_stream& copy,
                const expage::expert_source<expage::host_stream>& source, expage::runtime_views views) {
  expage::host_vmm vmm({.granularity = 2_MiB});
  expage::host_stream compute("compute");
  const std::size_t per_expert =
      (g.tensor_bytes(expage::expert_tensor::gate_up, expage::precision::bf16) + 2_MiB - 1) / 2_MiB * 2_MiB +
      (g.tensor_bytes(expage::expert_tensor::down, expage::precision::bf16) + 2_MiB - 1) / 2_MiB * 2_MiB;
  expage::budget_tracker budget(g.top_k() * per_expert);
  runtime rt(g, budget.root(), vmm, copy, compute, source, {.views = views});
  for (std::uint32_t e = 0; e < g.top_k(); ++e) {  // every slot full: each acquire below evicts
    const std::uint32_t one[] = {e};
    rt.acquire(1, one).release();
  }
  std::uint32_t e = 0;
  const auto miss = [&] {
    const std::uint32_t one[] = {e};
    e = (e + 1) % g.experts_per_layer();
    auto lease = rt.acquire(0, one);
    lease.release();
    compute.synchronize();  // the load is complete once the compute stream has passed its fence
  };
  // One round of misses before the timed loop: the prefill's loads complete and every slot's
  // pages are touched and remapped once, so no one-off cost lands in the first timed iterations
  // (at Mixtral size the first took 540 ms against 36 ms after, with 50–80 iterations in all).
  for (std::uint32_t i = 0; i < g.experts_per_layer(); ++i) miss();
  for (auto _ : state) miss();
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(g.expert_bytes(expage::precision::bf16)));
}

void BM_Runtime_Miss(benchmark::State& state) {
  const auto g = model(state.range(0));
  expage::host_stream copy("copy");
  std::vector<std::byte> bytes;
  // Argument 1: 0 keeps every view (a miss maps the victim's blocks at a new stable page); 1 keeps
  // the records alone, in slot mappings that live as long as the slot (no mapping per miss).
  run_misses(
      state, g, copy, zero_source(g, bytes),
      state.range(1) == 0 ? expage::runtime_views{} : expage::runtime_views{.stable_tensors = false, .slots = false});
  state.SetLabel(g.name() + (state.range(1) == 0 ? ", every view" : ", records alone"));
}
BENCHMARK(BM_Runtime_Miss)
    ->Args({0, 0})
    ->Args({1, 0})
    ->Args({0, 1})
    ->Args({1, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// BM_Baseline_CopyIntoRotatingPages with the host copy engine: the two tensors as one batch,
// copied by the worker and the caller's thread.
void BM_Baseline_CopyEngineIntoRotatingPages(benchmark::State& state) {
  two_copy_case c(state.range(0));
  expage::host_copy_engine engine(copy_engine_options());
  for (auto _ : state) {
    std::byte* const page = c.pages.next();
    const expage::copy_region regions[] = {{page, c.source.data(), c.gate_up},
                                           {page + c.gate_up, c.source.data() + c.gate_up, c.bytes - c.gate_up}};
    engine.copy(regions);  // the caller copies beside the worker, as the copy stream's thread does below
  }
  c.finish(state);
}
BENCHMARK(BM_Baseline_CopyEngineIntoRotatingPages)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Runtime_Miss_CopyEngine(benchmark::State& state) {
  const auto g = model(state.range(0));
  expage::host_stream copy("copy");  // outlives the engine, whose destructor waits for the copies enqueued on it
  expage::host_copy_engine engine(copy_engine_options());
  std::vector<std::byte> bytes;
  run_misses(state, g, copy, zero_source(g, bytes, &engine),
             expage::runtime_views{.stable_tensors = false, .slots = false});
  state.SetLabel(g.name() + ", records alone");
}
BENCHMARK(BM_Runtime_Miss_CopyEngine)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
