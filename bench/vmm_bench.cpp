// host_vmm remap beside the raw system calls it is made of, in the same run.
//
//   BM_HostVmm_Remap2MiB  vs  BM_Baseline_MmapFixedMunmap, BM_Baseline_MmapFixedPlaceholder
//
// One iteration swaps the memory behind one fixed 2 MiB granule: unmap, then map
// a block there again. The baselines do the same with raw calls on a memfd:
// mmap(MAP_FIXED | MAP_SHARED) then munmap (which leaves a hole), or then an
// anonymous PROT_NONE mmap back (what host_vmm does, without its bookkeeping).
// Goal (issue 3): host_vmm ≤ 1.2× the raw calls. Pages are never touched:
// the loop times the mapping work, not page faults.
#include "expage/core/units.hpp"
#include "expage/vmm/host_vmm.hpp"

#include <benchmark/benchmark.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>

namespace {

using namespace expage::literals;

constexpr std::size_t granule = 2_MiB;

void BM_HostVmm_Remap2MiB(benchmark::State& state) {
  expage::host_vmm vm({.granularity = granule});
  std::byte* base = vm.reserve(4 * granule);
  std::byte* x = base + granule;
  const auto block = vm.create();
  vm.map(block, x);
  for (auto _ : state) {
    vm.unmap(x, granule);
    vm.map(block, x);
    benchmark::DoNotOptimize(x);
  }
  vm.unmap(x, granule);
  vm.release(block);
  vm.free(base);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_HostVmm_Remap2MiB);

struct raw_setup {
  int fd = ::memfd_create("expage.bench", MFD_CLOEXEC);
  void* base = nullptr;
  raw_setup() {
    if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(granule)) != 0) std::abort();
    base = ::mmap(nullptr, 4 * granule, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) std::abort();
  }
  ~raw_setup() {
    ::munmap(base, 4 * granule);
    ::close(fd);
  }
  [[nodiscard]] void* at() const { return static_cast<std::byte*>(base) + granule; }
};

void BM_Baseline_MmapFixedMunmap(benchmark::State& state) {
  const raw_setup raw;
  void* x = raw.at();
  for (auto _ : state) {
    void* p = ::mmap(x, granule, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, raw.fd, 0);
    benchmark::DoNotOptimize(p);
    ::munmap(x, granule);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Baseline_MmapFixedMunmap);

void BM_Baseline_MmapFixedPlaceholder(benchmark::State& state) {
  const raw_setup raw;
  void* x = raw.at();
  for (auto _ : state) {
    void* p = ::mmap(x, granule, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, raw.fd, 0);
    benchmark::DoNotOptimize(p);
    ::mmap(x, granule, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Baseline_MmapFixedPlaceholder);

}  // namespace

BENCHMARK_MAIN();
