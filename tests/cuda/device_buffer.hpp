// Device memory for one GPU test, poisoned on request so a kernel that skips a value is caught.
#pragma once

#include "expage/cuda/runtime.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

namespace expage::testing {

/// Tag: allocate and poison.
struct poisoned_t {};
inline constexpr poisoned_t poisoned{};

class device_buffer {
 public:
  explicit device_buffer(std::size_t bytes) : bytes_(bytes) {
    EXPAGE_CUDA_CHECK(cudaMalloc(&p_, bytes == 0 ? 1 : bytes));
  }
  /// A buffer of @p bytes filled with 0xA5.
  device_buffer(std::size_t bytes, poisoned_t) : device_buffer(bytes) { poison(); }
  /// A buffer holding a copy of @p host.
  template <class T>
  explicit device_buffer(const std::vector<T>& host) : device_buffer(host.size() * sizeof(T)) {
    upload(host.data());
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { (void)cudaFree(p_); }
  template <class T>
  [[nodiscard]] T* as() const noexcept {
    return static_cast<T*>(p_);
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  /// Copies @p host in and waits until the bytes are on the device. A cudaMemcpy from pageable
  /// memory may return once they are staged, before its DMA lands, and a cudaMemset returns at
  /// once; a kernel on a non-blocking stream is not ordered after either. Waiting for the default
  /// stream they ran on makes both visible to any later launch, whichever stream it is on.
  void upload(const void* host) {
    EXPAGE_CUDA_CHECK(cudaMemcpy(p_, host, bytes_, cudaMemcpyHostToDevice));
    EXPAGE_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  }
  void download(void* host) const { EXPAGE_CUDA_CHECK(cudaMemcpy(host, p_, bytes_, cudaMemcpyDeviceToHost)); }
  /// The whole buffer as bytes_ / sizeof(T) values.
  template <class T>
  [[nodiscard]] std::vector<T> to_host() const {
    std::vector<T> out(bytes_ / sizeof(T));
    EXPAGE_CUDA_CHECK(cudaMemcpy(out.data(), p_, out.size() * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }
  /// Fills the buffer with 0xA5 and waits for it (as upload()).
  void poison() {
    EXPAGE_CUDA_CHECK(cudaMemset(p_, 0xA5, bytes_));
    EXPAGE_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  }

 private:
  void* p_ = nullptr;
  std::size_t bytes_;
};

}  // namespace expage::testing
