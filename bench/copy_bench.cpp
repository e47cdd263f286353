// The host copy engine beside one thread's memcpy of the same bytes, in the same run.
//
//   BM_Baseline_Memcpy                     memcpy of 256 MiB, one thread
//   BM_HostCopyEngine_Copy/T/C             engine.copy() of the same 256 MiB with T workers and
//                                          C-byte chunks; the caller copies beside them (T + 1 threads)
//   BM_HostCopyEngine_CopyAsync/T          copy_async(), 2 MiB chunks, then the caller waits on the
//                                          completion without helping (T threads copy)
//   BM_HostCopyEngine_StreamCopy/T         the same bytes as 48 expert tensors of Qwen3-30B-A3B's size
//                                          (gate_up ≈ 7.1 MiB, down ≈ 3.6 MiB), each enqueued on a
//                                          host_stream (the loader form), one event record and host
//                                          wait per iteration; the stream's thread helps (T + 1)
//
// Sources and destinations are allocated once and faulted in before timing
// (pages of a mapped expert pool are resident). Counters: bytes_per_second,
// and per_thread_vs_memcpy = (engine rate / copying threads) / (memcpy rate
// measured once at start-up on the same buffers). Goal: ≥ 0.9 with one copying
// thread and, on a machine with a free core per copying thread, with more.
#include "expage/core/units.hpp"
#include "expage/memory/host_memory.hpp"
#include "expage/stream/host_copy_engine.hpp"
#include "expage/stream/host_stream.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

namespace {

using namespace expage::literals;

constexpr std::size_t total_bytes = 256_MiB;

// Source and destination of total_bytes each, populated at allocation.
struct buffers {
  expage::host_memory memory{{.block_size = 2_MiB, .alignment = 2_MiB, .huge_pages = false, .populate = true}};
  std::byte* src = memory.allocate(total_bytes / 2_MiB);
  std::byte* dst = memory.allocate(total_bytes / 2_MiB);
  double memcpy_rate = 0;  // bytes per second, best of three, measured once
  buffers() {
    std::memset(src, 0x5A, total_bytes);
    std::memset(dst, 0, total_bytes);
    for (int i = 0; i < 3; ++i) {
      const auto start = std::chrono::steady_clock::now();
      std::memcpy(dst, src, total_bytes);
      benchmark::ClobberMemory();
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      memcpy_rate = std::max(memcpy_rate, static_cast<double>(total_bytes) / took.count());
    }
  }
  buffers(const buffers&) = delete;
  buffers& operator=(const buffers&) = delete;
  ~buffers() {
    memory.deallocate(dst, total_bytes / 2_MiB);
    memory.deallocate(src, total_bytes / 2_MiB);
  }
};

buffers& shared_buffers() {
  static buffers b;
  return b;
}

void report(benchmark::State& state, double threads, std::size_t bytes = total_bytes) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(bytes));
  state.counters["threads"] = threads;
  state.counters["memcpy_GBps"] = shared_buffers().memcpy_rate / 1e9;
  // Filled in from the measured time: rate per thread over the memcpy rate.
  state.counters["per_thread_vs_memcpy"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * static_cast<double>(bytes) / threads / shared_buffers().memcpy_rate,
      benchmark::Counter::kIsRate);
}

void BM_Baseline_Memcpy(benchmark::State& state) {
  buffers& b = shared_buffers();
  for (auto _ : state) {
    std::memcpy(b.dst, b.src, total_bytes);
    benchmark::ClobberMemory();
  }
  report(state, 1);
}
BENCHMARK(BM_Baseline_Memcpy)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_HostCopyEngine_Copy(benchmark::State& state) {
  buffers& b = shared_buffers();
  const auto threads = static_cast<std::size_t>(state.range(0));
  expage::host_copy_engine engine({.threads = threads, .chunk_bytes = static_cast<std::size_t>(state.range(1))});
  for (auto _ : state) {
    engine.copy(b.dst, b.src, total_bytes);
    benchmark::ClobberMemory();
  }
  report(state, static_cast<double>(threads + 1));
}
BENCHMARK(BM_HostCopyEngine_Copy)
    ->Args({1, 2_MiB})
    ->Args({2, 2_MiB})
    ->Args({1, 256_KiB})
    ->Args({2, 256_KiB})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_HostCopyEngine_CopyAsync(benchmark::State& state) {
  buffers& b = shared_buffers();
  const auto threads = static_cast<std::size_t>(state.range(0));
  expage::host_copy_engine engine({.threads = threads, .chunk_bytes = 2_MiB});
  for (auto _ : state) {
    engine.copy_async(b.dst, b.src, total_bytes).synchronize();
    benchmark::ClobberMemory();
  }
  report(state, static_cast<double>(threads));
}
BENCHMARK(BM_HostCopyEngine_CopyAsync)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_HostCopyEngine_StreamCopy(benchmark::State& state) {
  buffers& b = shared_buffers();
  const auto threads = static_cast<std::size_t>(state.range(0));
  expage::host_copy_engine engine({.threads = threads, .chunk_bytes = 2_MiB});
  expage::host_stream stream("load");
  // gate_up and down are 2:1 in size, about Qwen3-30B-A3B's (its bf16 tensors are 6 and 3 MiB; these,
  // 24 pairs filling the 256 MiB, are 7.11 and 3.55 MiB).
  constexpr std::size_t pairs = 24;
  constexpr std::size_t pair_bytes = total_bytes / pairs / 4096 * 4096;
  constexpr std::size_t gate_up = pair_bytes / 3 * 2 / 4096 * 4096;
  std::vector<expage::copy_region> tensors;
  for (std::size_t p = 0; p < pairs; ++p) {
    const std::size_t at = p * pair_bytes;
    tensors.push_back({b.dst + at, b.src + at, gate_up});
    tensors.push_back({b.dst + at + gate_up, b.src + at + gate_up, pair_bytes - gate_up});
  }
  expage::host_event loaded;
  for (auto _ : state) {
    for (const auto& t : tensors) engine.copy(t.dst, t.src, t.bytes, stream);  // one loader call per tensor
    stream.record(loaded);
    loaded.synchronize();
  }
  stream.synchronize();
  report(state, static_cast<double>(threads + 1), pairs * pair_bytes);
  state.counters["tensors"] = static_cast<double>(tensors.size());
}
BENCHMARK(BM_HostCopyEngine_StreamCopy)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
