// Versioned expert handles, each beside its baseline in the same run.
//
//   BM_Handle_Resolve, BM_HandleTable_ResolveById  vs  BM_Baseline_AtomicPointerLoad,
//                                                      BM_Baseline_AtomicSharedPtrLoad, BM_Baseline_MutexPointer
//   BM_Handle_WindowOpenClose                      vs  BM_Baseline_MutexLockUnlock
//   BM_Handle_Publish/<bytes>  (begin, prepare, publish, reclaim the old version; transitions per second)
//                                                  vs  BM_Baseline_SharedPtrPublish/<bytes>
//
// Goal (docs/residency.md): a resolve costs ≤ 1.2× a raw atomic pointer load.
#include "expage/core/moe_geometry.hpp"
#include "expage/core/units.hpp"
#include "expage/memory/block_pool.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/memory/host_memory.hpp"
#include "expage/residency/handle_table.hpp"

#include <benchmark/benchmark.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

namespace {

using namespace expage::literals;
using rs = expage::residency_state;

expage::moe_geometry bench_geometry() {
  return expage::moe_geometry({.name = "bench",
                               .layers = 4,
                               .experts_per_layer = 16,
                               .top_k = 2,
                               .hidden_size = 2048,
                               .intermediate_size = 768});
}

// A table whose experts all hold one small version, on 4 KiB host blocks.
struct resident_table {
  expage::budget_tracker budget{1_GiB};
  expage::block_pool<expage::host_memory> pool{expage::host_memory({.block_size = 4_KiB}),
                                               budget.root(),
                                               {.name = "bench", .max_blocks = 4096, .growth_blocks = 64}};
  expage::handle_table table{bench_geometry()};

  resident_table() {
    for (std::uint64_t i = 0; i < table.geometry().expert_count(); ++i) {
      publish(table.geometry().expert_at(i), rs::promoting);
    }
  }
  void publish(expage::expert_id id, rs to) {
    auto t = table.begin(id, to);
    auto span = pool.acquire(pool.block_size());
    expage::version_record r;
    r.data = {span.front(), span.front() + 2048};
    r.bytes = 4096;
    t.prepare(r, expage::version_storage(std::move(span)));
    t.publish();
  }
};

// --- resolve -----------------------------------------------------------------------

void BM_Handle_Resolve(benchmark::State& state) {
  // One table for every run and thread: set-up code before the loop is not synchronized across
  // threads, so a table replaced by thread 0 could be destroyed under another thread's window.
  static resident_table shared;  // initialized once, thread-safely
  const expage::expert_handle h = shared.table.handle({.layer = 1, .expert = 3});
  auto w = shared.table.open_window();
  for (auto _ : state) {
    const expage::version_record* v = h.resolve();
    benchmark::DoNotOptimize(v);
  }
  w.close();
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Handle_Resolve)->ThreadRange(1, 2)->UseRealTime();

void BM_HandleTable_ResolveById(benchmark::State& state) {
  static resident_table shared;  // one for every run and thread (see BM_Handle_Resolve)
  auto w = shared.table.open_window();
  expage::expert_id id{.layer = 1, .expert = 3};
  benchmark::DoNotOptimize(id);
  for (auto _ : state) {
    const expage::version_record* v = shared.table.resolve(id);
    benchmark::DoNotOptimize(v);
  }
  w.close();
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_HandleTable_ResolveById)->ThreadRange(1, 2)->UseRealTime();

// 64 resolves over 64 handles against 64 acquire loads over a heap array of 64 pointers, the same
// loop shape: a single resolve in a loop measures the loop's code generation as much as the load
// (the baseline's loop unrolled, the resolve's did not: 2× at one cycle against two).
constexpr std::size_t batch = 64;

void BM_Handle_Resolve64(benchmark::State& state) {
  static resident_table shared;  // one for every run and thread (see BM_Handle_Resolve)
  std::vector<expage::expert_handle> handles;
  for (std::size_t i = 0; i < batch; ++i) handles.push_back(shared.table.handle(shared.table.geometry().expert_at(i)));
  auto w = shared.table.open_window();
  for (auto _ : state) {
    for (const expage::expert_handle& h : handles) {
      const expage::version_record* v = h.resolve();
      benchmark::DoNotOptimize(v);
    }
  }
  w.close();
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(batch));
}
BENCHMARK(BM_Handle_Resolve64)->ThreadRange(1, 2)->UseRealTime();

struct payload {
  std::byte bytes[64];
};

void BM_Baseline_AtomicPointerLoad(benchmark::State& state) {
  static payload p;
  static std::atomic<const payload*> active{&p};
  for (auto _ : state) {
    const payload* v = active.load(std::memory_order_acquire);
    benchmark::DoNotOptimize(v);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Baseline_AtomicPointerLoad)->ThreadRange(1, 2)->UseRealTime();

void BM_Baseline_AtomicPointerLoad64(benchmark::State& state) {
  static payload p[batch];
  static const auto active = [] {  // a heap array, as the handle table's slots are
    auto a = std::make_unique<std::atomic<const payload*>[]>(batch);
    for (std::size_t i = 0; i < batch; ++i) a[i].store(&p[i]);
    return a;
  }();
  for (auto _ : state) {
    for (std::size_t i = 0; i < batch; ++i) {
      const payload* v = active[i].load(std::memory_order_acquire);
      benchmark::DoNotOptimize(v);
    }
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(batch));
}
BENCHMARK(BM_Baseline_AtomicPointerLoad64)->ThreadRange(1, 2)->UseRealTime();

void BM_Baseline_AtomicSharedPtrLoad(benchmark::State& state) {
  static std::atomic<std::shared_ptr<const payload>> active{std::make_shared<const payload>()};
  for (auto _ : state) {
    std::shared_ptr<const payload> v = active.load(std::memory_order_acquire);
    benchmark::DoNotOptimize(v);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Baseline_AtomicSharedPtrLoad)->ThreadRange(1, 2)->UseRealTime();

void BM_Baseline_MutexPointer(benchmark::State& state) {
  static payload p;
  static std::mutex m;
  static const payload* active = &p;
  for (auto _ : state) {
    const payload* v = nullptr;
    {
      const std::lock_guard lock(m);
      v = active;
    }
    benchmark::DoNotOptimize(v);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Baseline_MutexPointer)->ThreadRange(1, 2)->UseRealTime();

// --- windows -------------------------------------------------------------------------

void BM_Handle_WindowOpenClose(benchmark::State& state) {
  static resident_table shared;  // one for every run and thread (see BM_Handle_Resolve)
  for (auto _ : state) {
    auto w = shared.table.open_window();
    benchmark::DoNotOptimize(w);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Handle_WindowOpenClose)->ThreadRange(1, 2)->UseRealTime();

void BM_Baseline_MutexLockUnlock(benchmark::State& state) {
  static std::mutex m;
  for (auto _ : state) {
    const std::lock_guard lock(m);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Baseline_MutexLockUnlock)->ThreadRange(1, 2)->UseRealTime();

// --- publish -------------------------------------------------------------------------

// A full transition: begin, acquire blocks (budget included), copy the
// payload, prepare, publish, and reclaim the version it replaces (no window
// is open, so publish()'s collect frees it at once). Alternates promote and
// demote on one expert. Arg: version bytes (64, or a Qwen3-30B-A3B int4
// expert copied from host memory).
void BM_Handle_Publish(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  expage::budget_tracker budget(4_GiB);
  const std::size_t block = bytes <= 4_KiB ? 4_KiB : 2_MiB;
  expage::block_pool<expage::host_memory> pool(expage::host_memory({.block_size = block}), budget.root(),
                                               {.name = "bench", .max_blocks = 64, .initial_blocks = 8});
  expage::handle_table table(bench_geometry());
  const expage::expert_id id{.layer = 2, .expert = 5};
  std::vector<std::byte> source(bytes, std::byte{0x5a});
  const auto transition_to = [&](rs to) {
    auto t = table.begin(id, to);
    auto span = pool.acquire(bytes);
    std::size_t copied = 0;
    for (std::byte* b : span) {  // block by block: a span is not contiguous
      const std::size_t n = std::min(block, bytes - copied);
      std::memcpy(b, source.data() + copied, n);
      copied += n;
    }
    expage::version_record r;
    r.data = {span.front(), span.front() + std::min(block, bytes) / 2};
    r.bytes = bytes;
    t.prepare(r, expage::version_storage(std::move(span)));
    t.publish();
  };
  transition_to(rs::demoting);
  bool hi = false;
  for (auto _ : state) {
    transition_to(hi ? rs::demoting : rs::promoting);
    hi = !hi;
  }
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(state.iterations() * state.range(0));
  state.counters["reclaimed"] = static_cast<double>(table.statistics().reclaimed);
}
BENCHMARK(BM_Handle_Publish)
    ->Arg(64)
    ->Arg(static_cast<std::int64_t>(bench_geometry().expert_bytes(expage::precision::int4)));

// Baseline: replacing a shared_ptr'd payload of the same size (allocation,
// copy, atomic store, free of the old one when its count drops).
void BM_Baseline_SharedPtrPublish(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  std::vector<std::byte> source(bytes, std::byte{0x5a});
  std::atomic<std::shared_ptr<const std::vector<std::byte>>> active{
      std::make_shared<const std::vector<std::byte>>(source)};
  for (auto _ : state) {
    active.store(std::make_shared<const std::vector<std::byte>>(source), std::memory_order_release);
  }
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_Baseline_SharedPtrPublish)
    ->Arg(64)
    ->Arg(static_cast<std::int64_t>(bench_geometry().expert_bytes(expage::precision::int4)));

}  // namespace

BENCHMARK_MAIN();
