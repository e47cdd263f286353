// The layer pipeline's per-layer cost on the host backend, beside the raw
// system calls that remapping the same pages needs at the very least.
//
//   BM_LayerPipeline_Step/E   one forward(i) + materialize(i + 1) of a window-2 pipeline
//                             over 8 layers × E experts (2E pages per layer): budget
//                             leases, map + one access grant per page, event records and
//                             waits on three host_streams, the WAR recycle of layer i − 1.
//   BM_Baseline_RawRemap/E    the same 2E pages remapped by raw mmap(MAP_FIXED|MAP_SHARED)
//                             plus a PROT_NONE placeholder mmap back, nothing else.
//
// Loads are no-ops (a loader that enqueues nothing), so the figures are the
// protocol's bookkeeping and mapping, not memcpy bandwidth. The compute is empty.
#include "expage/core/units.hpp"
#include "expage/memory/host_memory.hpp"
#include "expage/stream/host_stream.hpp"
#include "expage/vmm/host_vmm.hpp"
#include "expage/vmm/layer_pipeline.hpp"

#include <benchmark/benchmark.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <vector>

namespace {

using namespace expage::literals;

constexpr std::uint32_t layers = 8;

expage::moe_geometry geometry(std::uint32_t experts) {
  return expage::moe_geometry(expage::moe_geometry::config{.name = "bench",
                                                           .layers = layers,
                                                           .experts_per_layer = experts,
                                                           .top_k = 2,
                                                           .hidden_size = 32,
                                                           // gate_up 4 KiB, down 2 KiB: one granule
                                                           // per tensor page, as the baseline maps
                                                           .intermediate_size = 32});
}

void BM_LayerPipeline_Step(benchmark::State& state) {
  const auto experts = static_cast<std::uint32_t>(state.range(0));
  const expage::moe_geometry g = geometry(experts);
  expage::host_vmm vm;  // page-size granules: one per tensor page here
  expage::budget_tracker budget(1_GiB);
  expage::host_memory host({.block_size = 64_KiB, .alignment = 64_KiB});
  expage::tensor_storage<expage::host_stream> storage(g, expage::precision::bf16, host,
                                                      {.loader = [](auto, auto, expage::host_stream&) {}});
  expage::host_stream compute("compute"), load_gate_up("load.gate_up"), load_down("load.down");
  expage::layer_pipeline pipe(vm, g, expage::precision::bf16, budget.root(), storage, compute, load_gate_up, load_down,
                              {.window = 2});
  pipe.materialize(0);
  std::uint32_t i = 0;
  for (auto _ : state) {
    pipe.forward(i, [](expage::host_stream&) {});
    i = (i + 1) % layers;
    pipe.materialize(i);
  }
  pipe.drain();
  state.SetItemsProcessed(state.iterations());
  state.counters["pages_per_layer"] = static_cast<double>(expage::expert_tensor_count * experts);
  state.counters["time_per_page"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * static_cast<double>(expage::expert_tensor_count * experts),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["war_fences"] = static_cast<double>(pipe.statistics().war_fences);
}
BENCHMARK(BM_LayerPipeline_Step)->Arg(8)->Arg(64);

void BM_Baseline_RawRemap(benchmark::State& state) {
  const auto pages = static_cast<std::size_t>(2 * state.range(0));
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const int fd = ::memfd_create("expage.bench", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(pages * page)) != 0) std::abort();
  auto* base = static_cast<std::byte*>(
      ::mmap(nullptr, pages * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  if (base == MAP_FAILED) std::abort();
  for (auto _ : state) {
    for (std::size_t p = 0; p < pages; ++p) {
      void* at = base + p * page;
      void* m = ::mmap(at, page, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, static_cast<off_t>(p * page));
      benchmark::DoNotOptimize(m);
      ::mmap(at, page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    }
  }
  ::munmap(base, pages * page);
  ::close(fd);
  state.SetItemsProcessed(state.iterations());
  state.counters["time_per_page"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * static_cast<double>(pages),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_Baseline_RawRemap)->Arg(8)->Arg(64);

}  // namespace

BENCHMARK_MAIN();
