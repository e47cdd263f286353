// The physical_memory contract on the CUDA backends (skipped without a device),
// plus backend-specific checks.
#include "common/physical_memory_contract.hpp"
#include "cuda/device_pattern.hpp"

#include "expage/cuda/device_memory.hpp"
#include "expage/cuda/pattern_kernels.hpp"
#include "expage/cuda/pinned_host_memory.hpp"
#include "expage/cuda/runtime.hpp"

#include <cuda_runtime_api.h>
#include <gmock/gmock.h>

namespace expage::testing {

using ::testing::HasSubstr;

template <>
struct memory_traits<cuda::pinned_host_memory> : host_touchable_traits<cuda::pinned_host_memory> {
  static cuda::pinned_host_memory make() { return cuda::pinned_host_memory({.block_size = 256 * KiB}); }
  static std::string unusable() { return no_device_reason(); }
};

// Device memory is filled and checked by the pattern kernels.
template <>
struct memory_traits<cuda::device_memory> {
  static cuda::device_memory make() { return cuda::device_memory({.device = 0, .block_size = 256 * KiB}); }
  static std::string unusable() { return no_device_reason(); }
  static void fill(std::byte* p, std::size_t bytes, std::uint64_t seed) { fill_device(p, bytes, seed); }
  static std::size_t mismatches(const std::byte* p, std::size_t bytes, std::uint64_t seed) {
    return device_mismatches(p, bytes, seed);
  }
};

using cuda_backends = ::testing::Types<cuda::pinned_host_memory, cuda::device_memory>;
INSTANTIATE_TYPED_TEST_SUITE_P(cuda, physical_memory_contract, cuda_backends);

TEST(CudaMemory, ValidatesOptionsWithoutADevice) {
  EXPECT_THROW(cuda::device_memory({.device = -1}), invalid_argument);
  EXPECT_THROW(cuda::device_memory({.block_size = 100}), invalid_argument);
  EXPECT_THROW(cuda::pinned_host_memory({.block_size = 1000}), invalid_argument);
  // A multiple that is too large is named with the range (it said "must be a positive multiple").
  try {
    cuda::pinned_host_memory m({.block_size = std::size_t{1} << 63});
    FAIL() << "a 2^63-byte block accepted";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("block_size 9223372036854775808 out of range: a multiple of 4096 in [4096, "));
  }
  try {
    cuda::device_memory m({.block_size = std::size_t{1} << 63});
    FAIL() << "a 2^63-byte block accepted";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("block_size 9223372036854775808 out of range: a multiple of 256 in [256, "));
  }
}

TEST(CudaMemory, AllocationWithoutADriverIsACudaErrorNotACrash) {
  if (cuda::device_available()) GTEST_SKIP() << "a device is present";
  cuda::device_memory m;
  EXPECT_THROW((void)m.allocate(1), cuda_error);
  cuda::pinned_host_memory pinned;
  EXPECT_THROW((void)pinned.allocate(1), cuda_error);
}

TEST(CudaMemory, DeviceExhaustionIsOutOfMemory) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  cuda::device_memory m({.block_size = 1 * TiB});
  EXPECT_THROW((void)m.allocate(64), out_of_memory);
}

}  // namespace expage::testing
