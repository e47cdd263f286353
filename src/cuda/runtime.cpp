#include "expage/cuda/runtime.hpp"

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
    throw cuda_error(static_cast<int>(status),
                     fmt::format("{} failed: {} ({})", what, cudaGetErrorName(status), cudaGetErrorString(status)));
  }
}

scoped_device::scoped_device(int device) {
  check(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) {
    check(cudaSetDevice(device), "cudaSetDevice");
    changed_ = true;
  }
}

scoped_device::~scoped_device() {
  if (changed_) {
    (void)cudaSetDevice(previous_);
  }
}

}  // namespace expage::cuda
