/// @file
/// @brief CUDA runtime helpers: device discovery that never fails, and error checking.
///
/// Part of expage::cuda. The runtime is linked statically, so programs start
/// on machines without a CUDA driver; device_count() then reports 0 and
/// device_status() says why.
#pragma once

#include "expage/core/error.hpp"

#include <cuda_runtime_api.h>

#include <string>

namespace expage::cuda {

/// Number of usable CUDA devices; 0 when there is no driver or no device.
[[nodiscard]] int device_count() noexcept;

/// True when at least one CUDA device is usable.
[[nodiscard]] inline bool device_available() noexcept { return device_count() > 0; }

/// A one-line description: "2 devices (NVIDIA H200, ...)" or
/// "no device: cudaErrorInsufficientDriver (CUDA driver version is insufficient for CUDA runtime version)".
[[nodiscard]] std::string device_status();

/// Throws cuda_error when @p status is not cudaSuccess, naming @p what, the
/// error's name and its description. Clears the sticky-free last error.
/// @throws expage::cuda_error
void check(cudaError_t status, const char* what);

/// @brief Makes a device current for a scope and restores the previous one.
/// @threadsafety single-owner (the current device is per host thread).
class scoped_device {
 public:
  /// Makes @p device current. @throws expage::cuda_error
  explicit scoped_device(int device);
  scoped_device(const scoped_device&) = delete;
  scoped_device& operator=(const scoped_device&) = delete;
  /// Restores the device that was current before.
  ~scoped_device();

 private:
  int previous_ = 0;
  bool changed_ = false;
};

}  // namespace expage::cuda

/// Checks a CUDA runtime call, throwing expage::cuda_error with the call's text on failure.
#define EXPAGE_CUDA_CHECK(call) ::expage::cuda::check((call), #call)
