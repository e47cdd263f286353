// cuda::copy_engine beside the raw pinned host-to-device peak measured in the same run.
//
//   BM_Baseline_H2D/pinned:1         one cudaMemcpyAsync of 256 MiB from pinned memory, one stream
//   BM_CudaCopyEngine_Pinned/M       the same bytes, chunked (4 MiB) over M streams, direct
//   BM_CudaCopyEngine_Pageable/M/T/S the same bytes from pageable memory through a ring of S × 4 MiB
//                                    pinned slots over M streams, T host threads filling each slot
//   BM_Baseline_H2D/pinned:0         the same from pageable memory (the runtime stages it)
//   BM_Baseline_HostStaging/threads:T  T host threads copying the pageable bytes into pinned memory,
//                                    no device: the most any staging ring with T threads can reach
//                                    (host memory bandwidth), reported beside the goal
//
// Each iteration waits for its copy (stream synchronize on the caller stream).
// Counter vs_pinned_peak = rate / (the pinned peak, best of three, measured once
// at start-up). Goals: ≥ 0.9 from pinned memory, ≥ 0.7 from pageable memory through the
// ring (tools/dev/gpu_summary.py judges them). Without a device every
// benchmark reports an error and the program exits 0.
#include "expage/core/units.hpp"
#include "expage/cuda/copy_engine.hpp"
#include "expage/cuda/cuda_stream.hpp"
#include "expage/cuda/pinned_host_memory.hpp"
#include "expage/cuda/runtime.hpp"

#include <benchmark/benchmark.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

namespace {

using namespace expage::literals;

constexpr std::size_t total_bytes = 256_MiB;

bool skip_without_device(benchmark::State& state) {
  if (expage::cuda::device_available()) return false;
  state.SkipWithError(expage::cuda::device_status().c_str());
  return true;
}

// Pinned and pageable sources, a device destination, and the pinned peak.
struct buffers {
  expage::cuda::pinned_host_memory pinned_memory{
      {.block_size = total_bytes, .portable = true, .write_combined = false}};
  std::byte* pinned = pinned_memory.allocate(1);
  std::vector<std::byte> pageable = std::vector<std::byte>(total_bytes, std::byte{0x5A});
  void* device = nullptr;
  double pinned_peak = 0;  // bytes per second
  buffers() {
    std::memset(pinned, 0x5A, total_bytes);
    EXPAGE_CUDA_CHECK(cudaMalloc(&device, total_bytes));
    expage::cuda::cuda_stream stream;
    for (int i = 0; i < 3; ++i) {
      const auto start = std::chrono::steady_clock::now();
      EXPAGE_CUDA_CHECK(cudaMemcpyAsync(device, pinned, total_bytes, cudaMemcpyHostToDevice, stream.native()));
      stream.synchronize();
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      pinned_peak = std::max(pinned_peak, static_cast<double>(total_bytes) / took.count());
    }
  }
  buffers(const buffers&) = delete;
  buffers& operator=(const buffers&) = delete;
  ~buffers() {
    (void)cudaFree(device);
    pinned_memory.deallocate(pinned, 1);
  }
};

buffers& shared_buffers() {
  static buffers b;
  return b;
}

void report(benchmark::State& state) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(total_bytes));
  state.counters["pinned_peak_GBps"] = shared_buffers().pinned_peak / 1e9;
  state.counters["vs_pinned_peak"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * static_cast<double>(total_bytes) / shared_buffers().pinned_peak,
      benchmark::Counter::kIsRate);
}

// Arg 1: from the pinned buffer (the peak); 0: from the pageable one (the runtime stages it).
void BM_Baseline_H2D(benchmark::State& state) {
  if (skip_without_device(state)) return;
  buffers& b = shared_buffers();
  const void* src = state.range(0) == 1 ? static_cast<const void*>(b.pinned) : b.pageable.data();
  expage::cuda::cuda_stream stream;
  for (auto _ : state) {
    EXPAGE_CUDA_CHECK(cudaMemcpyAsync(b.device, src, total_bytes, cudaMemcpyHostToDevice, stream.native()));
    stream.synchronize();
  }
  report(state);
}
BENCHMARK(BM_Baseline_H2D)->ArgName("pinned")->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_CudaCopyEngine_Pinned(benchmark::State& state) {
  if (skip_without_device(state)) return;
  buffers& b = shared_buffers();
  expage::cuda::copy_engine engine({.streams = static_cast<std::size_t>(state.range(0)), .chunk_bytes = 4_MiB});
  expage::cuda::cuda_stream stream;
  for (auto _ : state) {
    engine.copy(b.device, b.pinned, total_bytes, stream);
    stream.synchronize();
  }
  report(state);
}
BENCHMARK(BM_CudaCopyEngine_Pinned)->Arg(1)->Arg(2)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_CudaCopyEngine_Pageable(benchmark::State& state) {
  if (skip_without_device(state)) return;
  buffers& b = shared_buffers();
  expage::cuda::copy_engine engine({.streams = static_cast<std::size_t>(state.range(0)),
                                    .staging_slots = static_cast<std::size_t>(state.range(2)),
                                    .chunk_bytes = 4_MiB,
                                    .staging_threads = static_cast<std::size_t>(state.range(1))});
  expage::cuda::cuda_stream stream;
  for (auto _ : state) {
    engine.copy(b.device, b.pageable.data(), total_bytes, stream);
    stream.synchronize();
  }
  report(state);
  state.counters["slot_fences"] = static_cast<double>(engine.statistics().slot_fences);
}
BENCHMARK(BM_CudaCopyEngine_Pageable)
    ->Args({2, 1, 8})
    ->Args({2, 4, 8})
    ->Args({4, 8, 8})
    ->Args({4, 8, 16})
    ->Args({4, 12, 24})
    ->Args({4, 16, 32})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The host side alone: T threads each memcpy a contiguous T-th of the pageable buffer into the
// pinned one. A staging ring moves every byte this way once before its DMA, so with T threads it
// cannot beat this rate (it also shares the memory bus with the DMA reads of the pinned slots).
void BM_Baseline_HostStaging(benchmark::State& state) {
  if (skip_without_device(state)) return;  // pinned memory needs the driver
  buffers& b = shared_buffers();
  const auto threads = static_cast<std::size_t>(state.range(0));
  const std::size_t share = total_bytes / threads;
  const auto copy_share = [&b, share](std::size_t t) {
    std::memcpy(b.pinned + t * share, b.pageable.data() + t * share, share);
  };
  // Threads started once, as the ring's are, and released together each iteration: starting and
  // joining T threads per iteration would be timed too (0.4–1.2 ms for 16 on a 2-vCPU VM).
  std::barrier start(static_cast<std::ptrdiff_t>(threads));
  std::barrier done(static_cast<std::ptrdiff_t>(threads));
  std::atomic<bool> stop{false};
  std::vector<std::jthread> workers;
  workers.reserve(threads - 1);
  for (std::size_t t = 1; t < threads; ++t) {
    workers.emplace_back([&, t] {
      for (;;) {
        start.arrive_and_wait();
        if (stop.load(std::memory_order_relaxed)) return;
        copy_share(t);
        done.arrive_and_wait();
      }
    });
  }
  for (auto _ : state) {
    start.arrive_and_wait();
    copy_share(0);  // the benchmark's thread copies the first share
    done.arrive_and_wait();
  }
  stop.store(true, std::memory_order_relaxed);  // read after the barrier below, which orders it
  start.arrive_and_wait();
  workers.clear();
  report(state);
}
BENCHMARK(BM_Baseline_HostStaging)
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(4)
    ->Arg(8)
    ->Arg(16)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
