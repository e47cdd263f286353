#include "expage/cuda/runtime.hpp"

#include "expage/cuda/driver.hpp"

#include <fmt/format.h>

#include <string>

namespace expage::cuda {

int device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky, but leave no error behind for the caller
    return 0;
  }
  return count;
}

std::string device_status() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    return fmt::format("no device: {} ({})", cudaGetErrorName(status), cudaGetErrorString(status));
  }
  if (count == 0) {
    return "no device: the driver reports 0 devices";
  }
  std::string names;
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, d) == cudaSuccess) {
      names += fmt::format("{}{} (sm_{}{}, {:.1f} GiB)", d == 0 ? "" : ", ", prop.name, prop.major, prop.minor,
                           static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
    }
  }
  return fmt::format("{} device{}: {}", count, count == 1 ? "" : "s", names);
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    // Without a driver or a device every call fails the same way: say so first, as device_status() does.
    const bool no_device = status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver ||
                           status == cudaErrorStubLibrary || status == cudaErrorDevicesUnavailable;
    throw cuda_error(static_cast<int>(status), fmt::format("{} failed: {}{} ({})", what, no_device ? "no device: " : "",
                                                           cudaGetErrorName(status), cudaGetErrorString(status)));
  }
}

namespace {

// True when the calling thread has a current context. Without the driver's entry points (no
// driver, or one older than CUDA 12.0) it cannot tell, and answers false: the caller then calls
// cudaSetDevice, which is always correct, only slower.
bool context_current() noexcept {
  const driver_api* drv = driver();
  CUcontext context = nullptr;
  return drv != nullptr && drv->ctx_get_current(&context) == CUDA_SUCCESS && context != nullptr;
}

}  // namespace

cudaError_t scoped_device::enter(int device) noexcept {
  if (const cudaError_t rc = cudaGetDevice(&previous_); rc != cudaSuccess) return rc;
  const bool had_context = context_current();
  if (previous_ == device && had_context) return cudaSuccess;
  if (const cudaError_t rc = cudaSetDevice(device); rc != cudaSuccess) return rc;
  // Restoring a device on a thread that had no context would create that device's context.
  changed_ = had_context && previous_ != device;
  return cudaSuccess;
}

scoped_device::scoped_device(int device) {
  check(enter(device), "cudaSetDevice (scoped_device)");
  ok_ = true;
}

scoped_device::scoped_device(int device, std::nothrow_t /*unused*/) noexcept {
  ok_ = enter(device) == cudaSuccess;
  if (!ok_) (void)cudaGetLastError();
}

scoped_device::~scoped_device() {
  if (changed_) {
    (void)cudaSetDevice(previous_);
  }
}

}  // namespace expage::cuda
