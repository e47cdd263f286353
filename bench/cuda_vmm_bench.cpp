// cuda_vmm per 2 MiB granule on the GPU, beside cudaMalloc/cudaFree of the same
// size measured in the same run, and for reference the kvcached figures quoted
// in issue 3 (map 1.5 µs, set access 36 µs, unmap 26 µs per granule).
//
//   BM_CudaVmm_Map          cuMemMap of one created block (access none)
//   BM_CudaVmm_SetAccess    cuMemSetAccess on one mapped granule
//   BM_CudaVmm_SetAccessRun cuMemSetAccess once over a 16-granule run, per granule
//                           (what address_space does for a 16-granule page)
//   BM_CudaVmm_Unmap        cuMemUnmap of one granule
//   BM_CudaVmm_Create       cuMemCreate + cuMemRelease (no block cache)
//   BM_Baseline_CudaMallocFree
//
// Each iteration times only its own call (manual time); the set-up calls around
// it are not counted. Without a device every benchmark reports an error and the
// program still exits 0, so the CI smoke run passes on machines without a GPU.
#include "expage/core/units.hpp"
#include "expage/cuda/cuda_vmm.hpp"
#include "expage/cuda/runtime.hpp"

#include <benchmark/benchmark.h>

#include <cuda_runtime_api.h>

#include <chrono>
#include <vector>

namespace {

using namespace expage::literals;
using clock_type = std::chrono::steady_clock;

constexpr std::size_t run = 16;  // granules per iteration

bool skip_without_device(benchmark::State& state) {
  if (expage::cuda::device_available()) return false;
  state.SkipWithError(expage::cuda::device_status().c_str());
  return true;
}

// A reservation of `run` granules and `run` created blocks, kept across iterations.
struct granules {
  expage::cuda::cuda_vmm vm{{.device = 0, .initial_blocks = run}};
  std::size_t g = vm.granularity();
  std::byte* base = vm.reserve(run * g);
  std::vector<expage::cuda::cuda_vmm::physical_block> blocks;
  granules() {
    for (std::size_t i = 0; i < run; ++i) blocks.push_back(vm.create());
  }
  ~granules() {
    for (const auto b : blocks) vm.release(b);
    vm.free(base);
  }
  void map_all(expage::access_mode a) {
    for (std::size_t i = 0; i < run; ++i) vm.map(blocks[i], base + i * g, a);
  }
};

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

void per_granule(benchmark::State& state) {
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(run));
  state.counters["time_per_granule"] = benchmark::Counter(static_cast<double>(state.iterations()) * run,
                                                          benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void BM_CudaVmm_Map(benchmark::State& state) {
  if (skip_without_device(state)) return;
  granules s;
  for (auto _ : state) {
    const auto t0 = clock_type::now();
    s.map_all(expage::access_mode::none);
    state.SetIterationTime(seconds_since(t0));
    s.vm.unmap(s.base, run * s.g);
  }
  per_granule(state);
}
BENCHMARK(BM_CudaVmm_Map)->UseManualTime();

void BM_CudaVmm_SetAccess(benchmark::State& state) {
  if (skip_without_device(state)) return;
  granules s;
  for (auto _ : state) {
    s.map_all(expage::access_mode::none);
    const auto t0 = clock_type::now();
    for (std::size_t i = 0; i < run; ++i) s.vm.set_access(s.base + i * s.g, s.g, expage::access_mode::read_write);
    state.SetIterationTime(seconds_since(t0));
    s.vm.unmap(s.base, run * s.g);
  }
  per_granule(state);
}
BENCHMARK(BM_CudaVmm_SetAccess)->UseManualTime();

void BM_CudaVmm_SetAccessRun(benchmark::State& state) {
  if (skip_without_device(state)) return;
  granules s;
  for (auto _ : state) {
    s.map_all(expage::access_mode::none);
    const auto t0 = clock_type::now();
    s.vm.set_access(s.base, run * s.g, expage::access_mode::read_write);
    state.SetIterationTime(seconds_since(t0));
    s.vm.unmap(s.base, run * s.g);
  }
  per_granule(state);
}
BENCHMARK(BM_CudaVmm_SetAccessRun)->UseManualTime();

void BM_CudaVmm_Unmap(benchmark::State& state) {
  if (skip_without_device(state)) return;
  granules s;
  for (auto _ : state) {
    s.map_all(expage::access_mode::read_write);
    const auto t0 = clock_type::now();
    for (std::size_t i = 0; i < run; ++i) s.vm.unmap(s.base + i * s.g, s.g);
    state.SetIterationTime(seconds_since(t0));
  }
  per_granule(state);
}
BENCHMARK(BM_CudaVmm_Unmap)->UseManualTime();

void BM_CudaVmm_Create(benchmark::State& state) {
  if (skip_without_device(state)) return;
  expage::cuda::cuda_vmm vm({.device = 0, .max_cached_blocks = 0});
  for (auto _ : state) {
    const auto t0 = clock_type::now();
    const auto b = vm.create();
    vm.release(b);
    state.SetIterationTime(seconds_since(t0));
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_CudaVmm_Create)->UseManualTime();

void BM_Baseline_CudaMallocFree(benchmark::State& state) {
  if (skip_without_device(state)) return;
  for (auto _ : state) {
    void* p = nullptr;
    const auto t0 = clock_type::now();
    EXPAGE_CUDA_CHECK(cudaMalloc(&p, 2_MiB));
    EXPAGE_CUDA_CHECK(cudaFree(p));
    state.SetIterationTime(seconds_since(t0));
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Baseline_CudaMallocFree)->UseManualTime();

}  // namespace

BENCHMARK_MAIN();
