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
  void upload(const void* host) { EXPAGE_CUDA_CHECK(cudaMemcpy(p_, host, bytes_, cudaMemcpyHostToDevice)); }
  void download(void* host) const { EXPAGE_CUDA_CHECK(cudaMemcpy(host, p_, bytes_, cudaMemcpyDeviceToHost)); }
  /// The whole buffer as bytes_ / sizeof(T) values.
  template <class T>
  [[nodiscard]] std::vector<T> to_host() const {
    std::vector<T> out(bytes_ / sizeof(T));
    EXPAGE_CUDA_CHECK(cudaMemcpy(out.data(), p_, out.size() * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }
  void poison() { EXPAGE_CUDA_CHECK(cudaMemset(p_, 0xA5, bytes_)); }

 private:
  void* p_ = nullptr;
  std::size_t bytes_;
};

}  // namespace expage::testing
