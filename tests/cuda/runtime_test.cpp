// CUDA runtime and driver discovery. These run everywhere: without a device
// they check that expage degrades to a clear "no device" instead of failing.
#include "expage/cuda/runtime.hpp"
#include "expage/cuda/driver.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace expage::cuda {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(CudaRuntime, DiscoveryNeverThrows) {
  const int n = device_count();
  EXPECT_GE(n, 0);
  EXPECT_EQ(device_available(), n > 0);
  const std::string status = device_status();
  if (n == 0) {
    EXPECT_THAT(status, StartsWith("no device"));
  } else {
    EXPECT_THAT(status, HasSubstr("device"));
  }
}

TEST(CudaRuntime, CheckThrowsCudaErrorWithNameAndCall) {
  EXPECT_NO_THROW(check(cudaSuccess, "nothing"));
  try {
    check(cudaErrorInvalidValue, "cudaMemcpy(dst, src)");
    FAIL();
  } catch (const cuda_error& e) {
    EXPECT_EQ(e.code(), static_cast<int>(cudaErrorInvalidValue));
    EXPECT_THAT(e.what(), HasSubstr("cudaMemcpy(dst, src) failed: cudaErrorInvalidValue"));
  }
}

TEST(CudaDriver, EntryPointsResolveExactlyWhenADeviceIsPresent) {
  if (!device_available()) {
    EXPECT_EQ(driver(), nullptr);
    try {
      (void)require_driver();
      FAIL() << "require_driver() succeeded without a driver";
    } catch (const cuda_error& e) {
      EXPECT_THAT(e.what(), HasSubstr("CUDA driver unavailable"));
    }
    GTEST_SKIP() << "no CUDA device: " << device_status();
  }
  const driver_api& d = require_driver();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  std::size_t granularity = 0;
  check(d.mem_get_allocation_granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity");
  EXPECT_GT(granularity, 0U);
  EXPECT_EQ(granularity & (granularity - 1), 0U);
}

TEST(CudaDriver, CheckNamesTheDriverError) {
  if (!device_available()) GTEST_SKIP() << "no CUDA device: " << device_status();
  try {
    check(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate");
    FAIL();
  } catch (const cuda_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"));
  }
}

}  // namespace
}  // namespace expage::cuda
