// Filling and checking device memory with the pattern kernels, for the GPU
// contract suites (physical memory, virtual memory).
#pragma once

#include "expage/cuda/pattern_kernels.hpp"
#include "expage/cuda/runtime.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace expage::testing {

/// Why a CUDA suite cannot run here ("" when a device is present).
inline std::string no_device_reason() {
  return cuda::device_available() ? std::string() : "no CUDA device: " + cuda::device_status();
}

/// Writes the pattern seeded by @p seed over @p bytes of device memory and waits.
inline void fill_device(std::byte* p, std::size_t bytes, std::uint64_t seed) {
  cuda::fill_pattern_async(reinterpret_cast<std::uint64_t*>(p), bytes / 8, seed, 0, nullptr);
  EXPAGE_CUDA_CHECK(cudaStreamSynchronize(nullptr));
}

/// Counts the 8-byte words of @p bytes of device memory that differ from the pattern.
inline std::size_t device_mismatches(const std::byte* p, std::size_t bytes, std::uint64_t seed) {
  void* raw = nullptr;
  EXPAGE_CUDA_CHECK(cudaMalloc(&raw, sizeof(unsigned long long)));
  auto* counter = static_cast<unsigned long long*>(raw);
  EXPAGE_CUDA_CHECK(cudaMemset(counter, 0, sizeof *counter));
  cuda::count_pattern_mismatches_async(reinterpret_cast<const std::uint64_t*>(p), bytes / 8, seed, 0, counter, nullptr);
  unsigned long long host = 0;
  EXPAGE_CUDA_CHECK(cudaMemcpy(&host, counter, sizeof host, cudaMemcpyDeviceToHost));
  EXPAGE_CUDA_CHECK(cudaFree(counter));
  return static_cast<std::size_t>(host);
}

}  // namespace expage::testing
