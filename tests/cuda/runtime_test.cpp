// CUDA runtime and driver discovery. These run everywhere: without a device
// they check that expage degrades to a clear "no device" instead of failing.
#include "expage/cuda/runtime.hpp"
#include "expage/cuda/driver.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace expage::cuda {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
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
  try {  // the errors every call gives without a driver or a device say so first
    check(cudaErrorInsufficientDriver, "cudaSetDevice");
    FAIL();
  } catch (const cuda_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("cudaSetDevice failed: no device: cudaErrorInsufficientDriver"));
  }
}

TEST(CudaDriver, EntryPointsResolveExactlyWhenADeviceIsPresent) {
  if (!device_available()) {
    EXPECT_EQ(driver(), nullptr);
    try {
      (void)require_driver();
      FAIL() << "require_driver() succeeded without a driver";
    } catch (const cuda_error& e) {
      EXPECT_THAT(e.what(), StartsWith("no device: CUDA driver unavailable"));
      EXPECT_THAT(e.what(), Not(HasSubstr("query result")));  // never written when the query fails
    }
    GTEST_SKIP() << "no CUDA device: " << device_status();
  }
  const driver_api& d = require_driver();
  const scoped_device on(0);  // as every caller in the library: device 0's primary context current
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
  // A code the driver does not know (or no driver at all): still a cuda_error with its code, never
  // a formatting error from the null name the driver leaves.
  try {
    check(static_cast<CUresult>(1000), "cuMemMap");  // unassigned (CUDA_ERROR_UNKNOWN is 999)
    FAIL();
  } catch (const cuda_error& e) {
    EXPECT_EQ(e.code(), 1000);
    EXPECT_THAT(e.what(), HasSubstr("cuMemMap failed: unknown CUresult"));
  }
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
