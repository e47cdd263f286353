/// @file
/// @brief CUDA runtime helpers: device discovery that never fails, and error checking.
///
/// Part of expage::cuda. The runtime is linked statically, so programs start
/// on machines without a CUDA driver; device_count() then reports 0 and
/// device_status() says why.
#pragma once

#include "expage/core/error.hpp"

#include <cuda_runtime_api.h>

#include <new>
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

/// @brief Makes a device, and its primary context, current on this host thread for a scope.
///
/// The runtime API creates a context on first use from any thread, but the driver API (every
/// `cuMem*` call of cuda_vmm) needs one already current: on a thread that never touched the
/// runtime, `cudaGetDevice` still reports device 0 while no context is current, and driver calls
/// fail with `CUDA_ERROR_INVALID_CONTEXT`. So the constructor calls `cudaSetDevice` (which, since
/// CUDA 12, initializes the primary context and makes it current) whenever the device differs *or*
/// the thread has no current context. The destructor restores the previous device only when the
/// thread had a context of another device before; a thread that had none keeps @p device's.
///
/// @code
/// std::thread([&] {
///   const expage::cuda::scoped_device on(0);  // a fresh thread: makes device 0's context current
///   vm.map(block, address);                   // cuMemMap now finds it
/// }).join();
/// @endcode
/// @threadsafety single-owner (the current device is per host thread).
class scoped_device {
 public:
  /// Makes @p device and its primary context current. @throws expage::cuda_error
  explicit scoped_device(int device);
  /// The same for release paths that cannot throw: errors are swallowed and reported by ok().
  scoped_device(int device, std::nothrow_t /*unused*/) noexcept;
  scoped_device(const scoped_device&) = delete;
  scoped_device& operator=(const scoped_device&) = delete;
  /// Restores the device that was current before (see the class comment).
  ~scoped_device();

  /// True when @p device's context is current (always, after the throwing constructor).
  [[nodiscard]] bool ok() const noexcept { return ok_; }

 private:
  [[nodiscard]] cudaError_t enter(int device) noexcept;

  int previous_ = 0;
  bool changed_ = false;
  bool ok_ = false;
};

}  // namespace expage::cuda

/// Checks a CUDA runtime call, throwing expage::cuda_error with the call's text on failure.
#define EXPAGE_CUDA_CHECK(call) ::expage::cuda::check((call), #call)
