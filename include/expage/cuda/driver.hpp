/// @file
/// @brief The CUDA driver API entry points expage uses, resolved at run time.
///
/// expage never links libcuda: every driver function is fetched through
/// `cudaGetDriverEntryPointByVersion`, so a binary that uses them still starts
/// on a machine without a driver and reports "no device" instead of failing
/// to load.
#pragma once

#include "expage/core/error.hpp"

#include <cuda.h>

namespace expage::cuda {

/// @brief Function pointers to the driver's virtual-memory-management API (and
/// the error helpers), at the ABI of CUDA 12.0.
///
/// @code
/// if (const expage::cuda::driver_api* drv = expage::cuda::driver()) {
///   size_t granularity = 0;
///   expage::cuda::check(drv->mem_get_allocation_granularity(&granularity, &prop,
///                        CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity");
/// }
/// @endcode
/// @threadsafety thread-safe (immutable once resolved).
struct driver_api {
  CUresult (*init)(unsigned int);                        ///< cuInit
  CUresult (*get_error_name)(CUresult, const char**);    ///< cuGetErrorName
  CUresult (*get_error_string)(CUresult, const char**);  ///< cuGetErrorString
  CUresult (*ctx_get_current)(CUcontext*);               ///< cuCtxGetCurrent
  CUresult (*mem_address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                                  unsigned long long);  ///< cuMemAddressReserve
  CUresult (*mem_address_free)(CUdeviceptr, size_t);    ///< cuMemAddressFree
  CUresult (*mem_create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                         unsigned long long);                                                          ///< cuMemCreate
  CUresult (*mem_release)(CUmemGenericAllocationHandle);                                               ///< cuMemRelease
  CUresult (*mem_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);  ///< cuMemMap
  CUresult (*mem_unmap)(CUdeviceptr, size_t);                                                          ///< cuMemUnmap
  CUresult (*mem_set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);  ///< cuMemSetAccess
  CUresult (*mem_get_allocation_granularity)(size_t*, const CUmemAllocationProp*,
                                             CUmemAllocationGranularity_flags);  ///< cuMemGetAllocationGranularity
};

/// The resolved entry points, or nullptr when no driver (or a driver older
/// than CUDA 12.0) is present. Resolved once, on first call.
[[nodiscard]] const driver_api* driver() noexcept;

/// The resolved entry points.
/// @throws expage::cuda_error saying why the driver is unavailable.
[[nodiscard]] const driver_api& require_driver();

/// Throws cuda_error when @p result is not CUDA_SUCCESS, naming @p what and the driver's error name.
/// @throws expage::cuda_error
void check(CUresult result, const char* what);

}  // namespace expage::cuda
