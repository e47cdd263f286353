#include "expage/core/pattern.hpp"
#include "expage/cuda/pattern_kernels.hpp"
#include "expage/cuda/runtime.hpp"

#include <algorithm>

namespace expage::cuda {
namespace {

constexpr unsigned threads_per_block = 256;

unsigned grid_for(std::size_t words) {
  const std::size_t blocks = (words + threads_per_block - 1) / threads_per_block;
  return static_cast<unsigned>(std::min<std::size_t>(std::max<std::size_t>(blocks, 1), 65535));
}

__global__ void fill_kernel(std::uint64_t* p, std::size_t words, std::uint64_t seed, std::uint64_t first) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t i = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < words; i += stride) {
    p[i] = pattern_word(seed, first + i);
  }
}

__global__ void check_kernel(const std::uint64_t* p, std::size_t words, std::uint64_t seed, std::uint64_t first,
                             unsigned long long* mismatches) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  unsigned long long bad = 0;
  for (std::size_t i = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < words; i += stride) {
    bad += p[i] != pattern_word(seed, first + i) ? 1 : 0;
  }
  if (bad != 0) {
    atomicAdd(mismatches, bad);
  }
}

}  // namespace

void fill_pattern_async(std::uint64_t* device_words, std::size_t words, std::uint64_t seed, std::uint64_t first,
                        cudaStream_t stream) {
  if (words == 0) return;
  fill_kernel<<<grid_for(words), threads_per_block, 0, stream>>>(device_words, words, seed, first);
  check(cudaGetLastError(), "fill_kernel launch");
}

void count_pattern_mismatches_async(const std::uint64_t* device_words, std::size_t words, std::uint64_t seed,
                                    std::uint64_t first, unsigned long long* device_mismatches, cudaStream_t stream) {
  if (words == 0) return;
  check_kernel<<<grid_for(words), threads_per_block, 0, stream>>>(device_words, words, seed, first, device_mismatches);
  check(cudaGetLastError(), "check_kernel launch");
}

}  // namespace expage::cuda
