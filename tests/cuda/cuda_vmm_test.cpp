// The virtual_memory contract on cuda_vmm (skipped without a device), plus checks
// that run without one. Device data is written and read by the pattern kernels.
#include "common/virtual_memory_contract.hpp"
#include "cuda/device_pattern.hpp"

#include "expage/core/units.hpp"
#include "expage/cuda/cuda_vmm.hpp"
#include "expage/cuda/driver.hpp"
#include "expage/cuda/pattern_kernels.hpp"
#include "expage/cuda/runtime.hpp"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <exception>
#include <memory>
#include <thread>

namespace expage::testing {

template <>
struct vmm_traits<cuda::cuda_vmm> {
  // No cache: ReleaseReturnsMemory checks that release gives the memory back.
  static std::unique_ptr<cuda::cuda_vmm> make() {
    return std::make_unique<cuda::cuda_vmm>(cuda::cuda_vmm::options{.device = 0, .max_cached_blocks = 0});
  }
  static std::string unusable() { return no_device_reason(); }
  static void fill(std::byte* p, std::size_t bytes, std::uint64_t seed) { fill_device(p, bytes, seed); }
  static std::size_t mismatches(const std::byte* p, std::size_t bytes, std::uint64_t seed) {
    return device_mismatches(p, bytes, seed);
  }
};

using cuda_vmm_backends = ::testing::Types<cuda::cuda_vmm>;
INSTANTIATE_TYPED_TEST_SUITE_P(cuda, virtual_memory_contract, cuda_vmm_backends);

TEST(CudaVmm, ValidatesOptionsBeforeTouchingTheDriver) {
  EXPECT_THROW(cuda::cuda_vmm({.device = -1}), invalid_argument);
  EXPECT_THROW(cuda::cuda_vmm({.granularity = 3 * MiB}), invalid_argument);
  EXPECT_THROW(cuda::cuda_vmm({.initial_blocks = std::size_t{1} << 30}), invalid_argument);
}

TEST(CudaVmm, ConstructionWithoutADriverIsACudaErrorNotACrash) {
  if (cuda::device_available()) GTEST_SKIP() << "a device is present";
  EXPECT_THROW(cuda::cuda_vmm(), cuda_error);
}

TEST(CudaVmm, CreatesBlocksAheadOfTimeAndReusesThem) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device: " << cuda::device_status();
  cuda::cuda_vmm vm({.initial_blocks = 4});
  EXPECT_EQ(vm.cached_blocks(), 4U);
  EXPECT_EQ(vm.physical_bytes(), 4 * vm.granularity());
  const auto a = vm.create();
  EXPECT_EQ(vm.cached_blocks(), 3U);
  vm.release(a);
  EXPECT_EQ(vm.cached_blocks(), 4U);
  EXPECT_EQ(vm.state(a), block_state::free);
  vm.trim();
  EXPECT_EQ(vm.physical_bytes(), 0U);
}

// The runtime makes a context current on any thread it is used from; the driver's cuMem* calls
// need one already current. Every call here comes from a thread that never used the runtime.
TEST(CudaVmm, EveryCallWorksFromAThreadThatNeverUsedTheRuntime) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device: " << cuda::device_status();
  auto vm = std::make_unique<cuda::cuda_vmm>(cuda::cuda_vmm::options{.device = 0, .initial_blocks = 1});
  const std::size_t g = vm->granularity();
  const auto on_fresh_thread = [](auto body) {
    std::exception_ptr error;
    std::thread([&] {
      try {
        body();
      } catch (...) {
        error = std::current_exception();
      }
    }).join();
    if (error) std::rethrow_exception(error);
  };
  on_fresh_thread([&] {
    CUcontext context = nullptr;
    ASSERT_EQ(cuda::require_driver().ctx_get_current(&context), CUDA_SUCCESS);
    EXPECT_EQ(context, nullptr) << "the premise: a new thread starts without a current context";
    std::byte* base = vm->reserve(2 * g);
    const auto a = vm->create();
    const auto b = vm->create();
    vm->map(a, base, access_mode::read_write);
    vm->map(b, base + g, access_mode::none);
    vm->set_access(base + g, g, access_mode::read_write);
    fill_device(base, 2 * g, 41);
    EXPECT_EQ(device_mismatches(base, 2 * g, 41), 0U);
    vm->unmap(base, 2 * g);
    vm->release(a);
    vm->release(b);
    vm->free(base);
  });
  EXPECT_EQ(vm->blocks(), 0U);
  std::byte* kept = vm->reserve(g);
  vm->map(vm->create(), kept, access_mode::read_write);
  // Destroyed (unmap, release, free) on yet another fresh thread.
  on_fresh_thread([&] { vm.reset(); });
  EXPECT_EQ(vm, nullptr);
}

}  // namespace expage::testing
