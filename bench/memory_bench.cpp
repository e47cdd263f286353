// Budget tracker and block pool, each beside its baseline in the same run.
//
//   BM_Budget_TryReserveRelease/<depth>  vs  BM_Baseline_AtomicFetchAddPair, BM_Baseline_MutexCounter
//   BM_BlockPool_AcquireRelease/<bytes>  vs  BM_Baseline_MallocFree/<bytes>
//
// Goals (docs/performance.md): try_reserve+release on the root ≤ 2× the
// atomic pair uncontended; pool acquire/release ≥ 10× faster than malloc/free
// of the same size for expert-sized requests.
#include "expage/core/moe_geometry.hpp"
#include "expage/core/units.hpp"
#include "expage/memory/block_pool.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/memory/host_memory.hpp"

#include <benchmark/benchmark.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>

namespace {

using namespace expage::literals;

// --- budget --------------------------------------------------------------------

// Accounts chained `depth` deep under the root; reservations go to the deepest.
struct budget_chain {
  expage::budget_tracker tracker{64_GiB};
  expage::budget_account* leaf = &tracker.root();
  explicit budget_chain(std::int64_t depth) {
    for (std::int64_t i = 0; i < depth; ++i) {
      leaf = &tracker.add_account("level" + std::to_string(i), 64_GiB, *leaf);
    }
  }
};

void BM_Budget_TryReserveRelease(benchmark::State& state) {
  static std::unique_ptr<budget_chain> shared;
  if (state.thread_index() == 0) shared = std::make_unique<budget_chain>(state.range(0));
  // Google Benchmark starts every thread's loop only after thread 0's setup.
  for (auto _ : state) {
    expage::reservation r = shared->leaf->try_reserve(2_MiB);
    benchmark::DoNotOptimize(r);
  }
  state.SetItemsProcessed(state.iterations());
  // Averaged over the threads (a plain counter is summed: 2 threads reported 2 levels for 1).
  state.counters["levels"] =
      benchmark::Counter(static_cast<double>(state.range(0) + 1), benchmark::Counter::kAvgThreads);
}
BENCHMARK(BM_Budget_TryReserveRelease)->Arg(0)->Arg(2)->ThreadRange(1, 2)->UseRealTime();

void BM_Baseline_AtomicFetchAddPair(benchmark::State& state) {
  static std::atomic<std::int64_t> used{0};
  constexpr std::int64_t block = std::int64_t{2} << 20;
  for (auto _ : state) {
    benchmark::DoNotOptimize(used.fetch_add(block, std::memory_order_acquire));
    used.fetch_sub(block, std::memory_order_release);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Baseline_AtomicFetchAddPair)->ThreadRange(1, 2)->UseRealTime();

void BM_Baseline_MutexCounter(benchmark::State& state) {
  static std::mutex m;
  static std::int64_t used = 0;
  constexpr std::int64_t cap = std::int64_t{64} << 30;
  constexpr std::int64_t block = std::int64_t{2} << 20;
  for (auto _ : state) {
    bool ok = false;
    {
      const std::lock_guard lock(m);
      if (used + block <= cap) {
        used += block;
        ok = true;
      }
    }
    benchmark::DoNotOptimize(ok);
    const std::lock_guard lock(m);
    used -= block;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Baseline_MutexCounter)->ThreadRange(1, 2)->UseRealTime();

// --- pool ------------------------------------------------------------------------

// Request sizes: one 2 MiB block, then one expert tensor of real models
// (OLMoE down bf16 = 4 MiB, Qwen3-30B gate_up bf16 = 6 MiB, Mixtral down
// bf16 = 112 MiB). glibc serves the small ones from its heap once its dynamic
// mmap threshold has adapted, and maps/unmaps anything ≥ 32 MiB every time.
std::size_t request_bytes(std::int64_t which) {
  using expage::expert_tensor;
  using expage::precision;
  switch (which) {
    case 0: return 2_MiB;
    case 1: return expage::moe_geometry::olmoe_1b_7b().tensor_bytes(expert_tensor::down, precision::bf16);
    case 2: return expage::moe_geometry::qwen3_30b_a3b().tensor_bytes(expert_tensor::gate_up, precision::bf16);
    default: return expage::moe_geometry::mixtral_8x7b().tensor_bytes(expert_tensor::down, precision::bf16);
  }
}

void BM_BlockPool_AcquireRelease(benchmark::State& state) {
  const std::size_t bytes = request_bytes(state.range(0));
  expage::budget_tracker budget(64_GiB);
  // Blocks are reserved address space only (never touched): a pool's steady
  // state recycles blocks, so faulting them in would time the page tables.
  expage::block_pool pool(expage::host_memory({.block_size = 2_MiB}), budget.root(),
                          {.name = "bench", .max_blocks = 64, .growth_blocks = 64, .initial_blocks = 64});
  for (auto _ : state) {
    auto span = pool.acquire(bytes);
    benchmark::DoNotOptimize(span.front());
  }
  state.SetLabel(fmt::format("{}", expage::byte_size{bytes}));
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_BlockPool_AcquireRelease)->DenseRange(0, 3);

void BM_Baseline_MallocFree(benchmark::State& state) {
  const std::size_t bytes = request_bytes(state.range(0));
  for (auto _ : state) {
    void* p = std::malloc(bytes);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
  state.SetLabel(fmt::format("{}", expage::byte_size{bytes}));
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Baseline_MallocFree)->DenseRange(0, 3);

}  // namespace

BENCHMARK_MAIN();
