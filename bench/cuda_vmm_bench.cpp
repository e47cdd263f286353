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
//   BM_DeviceMirror_Publish        device_mirror::update of one record, then a synchronize of the
//                                  compute stream: a publish until kernels on that stream see it
//   BM_DeviceMirror_Enqueue        update() alone (the host side of a publish; the stream is
//                                  synchronized every 64 publishes, outside the timed region)
//   BM_Baseline_RecordCopy         cudaMemcpyAsync of one record from pinned memory + synchronize
//
// Each iteration times only its own call (manual time); the set-up calls around
// it are not counted. Without a device every benchmark reports an error and the
// program still exits 0, so the CI smoke run passes on machines without a GPU.
#include "expage/core/units.hpp"
#include "expage/cuda/cuda_stream.hpp"
#include "expage/cuda/cuda_vmm.hpp"
#include "expage/cuda/device_mirror.hpp"
#include "expage/cuda/pinned_host_memory.hpp"
#include "expage/cuda/runtime.hpp"

#include <benchmark/benchmark.h>

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstring>
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

constexpr std::size_t mirror_experts = 8 * 32;  // Mixtral-8x7B: 32 layers of 8 experts

expage::version_record some_record(std::size_t i) {
  expage::version_record r;
  r.bytes = i + 1;
  r.number = i + 1;
  return r;
}

void BM_DeviceMirror_Publish(benchmark::State& state) {
  if (skip_without_device(state)) return;
  expage::cuda::cuda_stream compute;
  expage::cuda::device_mirror mirror(mirror_experts, compute.native());
  std::size_t i = 0;
  for (auto _ : state) {
    const auto t0 = clock_type::now();
    mirror.update(i % mirror_experts, some_record(i));
    compute.synchronize();
    state.SetIterationTime(seconds_since(t0));
    ++i;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_DeviceMirror_Publish)->UseManualTime();

void BM_DeviceMirror_Enqueue(benchmark::State& state) {
  if (skip_without_device(state)) return;
  expage::cuda::cuda_stream compute;
  expage::cuda::device_mirror mirror(mirror_experts, compute.native());
  std::size_t i = 0;
  for (auto _ : state) {
    const auto t0 = clock_type::now();
    mirror.update(i % mirror_experts, some_record(i));
    state.SetIterationTime(seconds_since(t0));
    if (++i % 64 == 0) compute.synchronize();
  }
  compute.synchronize();
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_DeviceMirror_Enqueue)->UseManualTime();

void BM_Baseline_RecordCopy(benchmark::State& state) {
  if (skip_without_device(state)) return;
  expage::cuda::cuda_stream compute;
  expage::cuda::pinned_host_memory pinned({.block_size = 4096, .portable = false, .write_combined = false});
  std::byte* host = pinned.allocate(1);
  void* device = nullptr;
  EXPAGE_CUDA_CHECK(cudaMalloc(&device, sizeof(expage::version_record) * mirror_experts));
  std::size_t i = 0;
  for (auto _ : state) {
    const auto t0 = clock_type::now();
    const expage::version_record r = some_record(i);
    std::memcpy(host, &r, sizeof r);
    EXPAGE_CUDA_CHECK(cudaMemcpyAsync(static_cast<expage::version_record*>(device) + i % mirror_experts, host, sizeof r,
                                      cudaMemcpyHostToDevice, compute.native()));
    compute.synchronize();
    state.SetIterationTime(seconds_since(t0));
    ++i;
  }
  (void)cudaFree(device);
  pinned.deallocate(host, 1);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Baseline_RecordCopy)->UseManualTime();

}  // namespace

BENCHMARK_MAIN();
